"""One reply streaming from the engine: the text so far, and its numbers once it ends."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from engine import Delta, EngineClient, SamplingParams, Usage, decode_rate
from ui import presets


class ReplyStream:
    """Iterating (`async for`) yields this object again after each delta, its text grown; the
    waits hold no thread. `aclose()` aborts the engine request so its blocks free at once; so does
    cancelling the task that iterates.

    Created by `start_reply`, which submits at once: a prompt the engine refuses (too long for
    the KV cache, empty) raises ValueError there, before anything is shown or stored."""

    def __init__(self, deltas: AsyncIterator[Delta], abort: Callable[[], None] | None = None) -> None:
        self._deltas = deltas
        self._abort = abort
        self.text = ""
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.usage: Usage | None = None
        self._started = time.perf_counter()
        self._first_token_at: float | None = None

    async def __aiter__(self) -> AsyncIterator[ReplyStream]:
        async for delta in self._deltas:
            if delta.token_ids and self._first_token_at is None:
                self._first_token_at = time.perf_counter()
            self.text += delta.text
            self.num_tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                self.finish_reason, self.usage, self.error = delta.finish_reason, delta.usage, delta.error
            yield self

    async def aclose(self) -> None:
        await self._deltas.aclose()  # EngineClient aborts a request whose iterator closes early...
        if self.finish_reason is None and self._abort is not None:
            self._abort()  # ...but not one never iterated: closing an unstarted generator runs nothing

    def metrics(self) -> dict:
        """The Store's message metrics: the engine's usage when it finished the reply, our own
        clock when it was cut short (an aborted request carries no usage)."""
        if self.usage is not None:
            usage = self.usage
            per_s = usage.decode_tokens_per_s
            return {"prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
                    "completion_tokens": usage.completion_tokens, "ttft_s": usage.ttft_s,
                    "tokens_per_s": per_s, "finish_reason": self.finish_reason}
        ttft = per_s = None
        if self._first_token_at is not None:
            ttft = self._first_token_at - self._started
            per_s = decode_rate(self.num_tokens, time.perf_counter() - self._first_token_at)
        return {"completion_tokens": self.num_tokens, "ttft_s": ttft, "tokens_per_s": per_s,
                "finish_reason": self.finish_reason}


async def start_reply(client: EngineClient, messages: list[dict], params: SamplingParams,
                      conversation_id: int | None = None, user: str | None = None) -> ReplyStream:
    """Submit a conversation. The request id starts with the conversation (`chat12/…`, or
    `chat-new-…` before the first reply creates it): the live panel tints blocks by it.
    With `user`, the prefix cache keeps everything after a preset system prompt to that user:
    another user sending the same text hits only the preset's blocks."""
    conversation = f"chat{int(conversation_id)}" if conversation_id is not None else f"chat-new-{uuid.uuid4().hex[:6]}"
    request_id = f"{conversation}/{uuid.uuid4().hex[:8]}"
    deltas = await client.asubmit(messages, params, request_id=request_id, cache_salt=user,
                                  num_shared_messages=presets.num_shared_messages(messages))
    return ReplyStream(deltas, lambda: client.abort(request_id))
