"""Turns a request's stream of generated token ids into text deltas for streaming.

Byte-level BPE spreads one emoji or CJK character over several tokens, and decoding a token on
its own gives the replacement character "\\ufffd". So, like vLLM's and HF TextStreamer's
incremental decoding, each new token is decoded inside a small window of recent tokens and
only the text that can no longer change is released: a trailing "\\ufffd" (an incomplete
character) waits for the tokens that complete it. The window is cut back to a few tokens of
context whenever it grows, so the cost per token does not depend on the output length.

Stop strings follow vLLM: the text is cut just before the first stop string (just after it with
`include_stop`), nothing more is emitted after it, and text that could still be the start of a
stop string is held back until it is known not to be one (or until `flush()` at the end of the
request). A token added with `check_stop=False` (before the request's `min_tokens`) releases its
text unchecked.
"""
from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"
# Tokens kept as context when the window is cut back. Every non-special token carries at least
# one byte, and an incomplete UTF-8 character has at most three, so four tokens always hold the
# start of a pending character (and give SentencePiece decoders the token before a leading space).
CONTEXT_TOKENS = 4
MAX_WINDOW_TOKENS = 2 * CONTEXT_TOKENS


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop)
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.stopped = False
        self.stop_string: str | None = None
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self._chunks: list[str] = []  # released deltas, joined lazily by `text`
        self._held = ""               # decoded text that may be the start of a stop string
        self._window: list[int] = []  # recent token ids; the decoding context
        self._emitted = 0             # characters of decode(window) already passed on
        self._reset_window(self._prompt_context(prompt_token_ids))

    @property
    def text(self) -> str:
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_id: int, check_stop: bool = True) -> str:
        """Append one generated token; return the new text it makes final ("" if none yet)."""
        if self.stopped:
            return ""
        if self.skip_special_tokens and token_id in self._special_ids:
            return ""  # a full decode drops it too; keeping it out keeps every window token >= 1 byte
        self._window.append(token_id)
        new_text = self._take_final_text(self._decode(self._window))
        if len(self._window) >= MAX_WINDOW_TOKENS:
            self._reset_window(self._window[-CONTEXT_TOKENS:])
        return self._release(new_text, final=False, check_stop=check_stop)

    def flush(self) -> str:
        """At the end of the request: return any text still held back, "" if none."""
        if self.stopped:
            return ""
        decoded = self._decode(self._window)
        new_text = decoded[self._emitted:]  # an incomplete character at the very end stays "\ufffd"
        self._emitted = len(decoded)
        return self._release(new_text, final=True)

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt's last tokens, ending on a whole character so output text starts clean."""
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        while context and self._decode(context).endswith(REPLACEMENT):
            context.pop()
        return context

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _take_final_text(self, decoded: str) -> str:
        """The part of the window's text not yet emitted that later tokens cannot change."""
        final = _without_pending_char(decoded)
        new_text = final[self._emitted:]
        self._emitted = max(self._emitted, len(final))
        return new_text

    def _reset_window(self, token_ids: list[int]) -> None:
        """Restart from these tokens, all of whose final text counts as already emitted.

        UTF-8 resynchronises at the first byte that is not a continuation byte, so the new
        window's text ends exactly like the old one's: every character but a pending one.
        """
        self._window = token_ids
        self._emitted = len(_without_pending_char(self._decode(token_ids)))

    def _release(self, new_text: str, final: bool, check_stop: bool = True) -> str:
        """Pass `new_text` through the stop-string check; return what the user may see now."""
        pending = self._held + new_text
        self._held = ""
        match = self._find_stop(pending) if check_stop else None
        if match is not None:
            index, self.stop_string = match
            end = index + len(self.stop_string) if self.include_stop else index
            pending, self.stopped = pending[:end], True
        elif not check_stop:
            pass  # before min_tokens: no stop string counts yet, so nothing is held back either
        elif not final:
            keep = self._stop_prefix_length(pending)
            pending, self._held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        if pending:
            self._chunks.append(pending)
        return pending

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The earliest stop string in `text` (the first listed on a tie), with its index."""
        found = [(text.find(stop), order, stop) for order, stop in enumerate(self.stop_strings)]
        found = [hit for hit in found if hit[0] >= 0]
        if not found:
            return None
        index, _, stop = min(found)
        return index, stop

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest end of `text` that some stop string starts with."""
        longest = max((len(stop) for stop in self.stop_strings), default=1)
        for length in range(min(len(text), longest - 1), 0, -1):
            if any(stop.startswith(text[-length:]) for stop in self.stop_strings):
                return length
        return 0


def _without_pending_char(decoded: str) -> str:
    # A trailing "\ufffd" may be a character whose remaining bytes are still to come.
    return decoded[:-1] if decoded.endswith(REPLACEMENT) else decoded
