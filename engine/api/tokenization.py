"""`/tokenize` and `/detokenize`, off the event loop. A body may hold 8 MiB of text, seconds of
tokenizing (and a few million token ids to write as JSON); on the loop that would stall every
reply it streams. Here the work runs on one thread of its own, with a tokenizer copy of its own:
a fast tokenizer is not thread-safe, and one thread uses it one request at a time (vLLM's
server does the same), so heavy requests wait for each other, never for the streams."""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

from fastapi.responses import Response

from engine.api.errors import bad_request
from engine.api.protocol import DetokenizeRequest, TokenizeRequest


class Tokenization:
    """The two endpoints over `tokenizer` (this object's alone from now on)."""

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-tokenizer")

    async def tokenize(self, body: TokenizeRequest) -> Response:
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either `prompt` or `messages`", "prompt")
        messages = None
        if body.messages is not None:
            try:
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            except ValueError as error:
                raise bad_request(str(error), "messages") from None
        return await self._off_loop(self._tokenize, body.prompt, messages, body.add_generation_prompt)

    async def detokenize(self, body: DetokenizeRequest) -> Response:
        return await self._off_loop(self._detokenize, body.tokens)

    async def _off_loop(self, work, *args) -> Response:
        content = await asyncio.get_running_loop().run_in_executor(self._thread, work, *args)
        return Response(content, media_type="application/json")

    # ---- on the tokenizer's thread ----------------------------------------------------------------
    def _tokenize(self, prompt: str | None, messages: list[dict] | None, add_generation_prompt: bool) -> bytes:
        if messages is not None:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                        tokenize=False)
        tokens = self.tokenizer(prompt, add_special_tokens=False).input_ids
        return _json({"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len})

    def _detokenize(self, tokens: list[int]) -> bytes:
        vocab = len(self.tokenizer)
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token ids must be in [0, {vocab}), got {bad}", "tokens")
        return _json({"prompt": self.tokenizer.decode(tokens)})


def _json(payload: dict) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
