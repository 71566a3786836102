"""One reply streaming from the engine: the text so far, and its numbers once it ends."""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from engine import SamplingParams, Usage, decode_rate
from ui import presets
from ui.backends.backend import ChatBackend, Deltas


class ReplyStream:
    """Iterating (`async for`) yields this object again after each delta, its text grown; the
    waits hold no thread. `aclose()` aborts the engine request so its blocks free at once; so does
    cancelling the task that iterates.

    Created by `start_reply`, which submits at once: a prompt the engine refuses (too long for
    the KV cache, empty) raises ValueError there, before anything is shown or stored.
    `backend`: the remote backend that writes it (None: the in-process engine)."""

    def __init__(self, deltas: Deltas, backend: str | None = None) -> None:
        self._deltas = deltas
        self.backend = backend
        self.text = ""
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.usage: Usage | None = None
        self._started = time.perf_counter()
        self._first_token_at: float | None = None
        self.left_out = 0  # the oldest messages left out of its prompt to fit (set by its caller)
        self.request_id = ""  # the engine's name for it (set by start_reply)

    async def __aiter__(self) -> AsyncIterator[ReplyStream]:
        async for delta in self._deltas:
            if (delta.token_ids or delta.text) and self._first_token_at is None:
                self._first_token_at = time.perf_counter()
            self.text += delta.text
            # A remote server streams text, not token ids: about one token per chunk.
            self.num_tokens += len(delta.token_ids) or bool(delta.text)
            if delta.finish_reason is not None:
                self.finish_reason, self.usage, self.error = delta.finish_reason, delta.usage, delta.error
            yield self

    async def aclose(self) -> None:
        await self._deltas.aclose()  # ends the request at its backend, iterated or not

    def metrics(self) -> dict:
        """The Store's message metrics: the engine's usage when it finished the reply, our own
        clock when it was cut short (an aborted request carries no usage)."""
        if self.usage is not None:
            usage = self.usage
            per_s = usage.decode_tokens_per_s
            return {"prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
                    "completion_tokens": usage.completion_tokens, "ttft_s": usage.ttft_s,
                    "tokens_per_s": per_s, "finish_reason": self.finish_reason, "backend": self.backend,
                    "left_out": self.left_out or None}
        ttft = per_s = None
        if self._first_token_at is not None:
            ttft = self._first_token_at - self._started
            per_s = decode_rate(self.num_tokens, time.perf_counter() - self._first_token_at)
        return {"completion_tokens": self.num_tokens, "ttft_s": ttft, "tokens_per_s": per_s,
                "finish_reason": self.finish_reason, "backend": self.backend, "left_out": self.left_out or None}


async def paced(reply: ReplyStream, interval_s: float) -> AsyncIterator[ReplyStream]:
    """The reply's states as it grows, at most one per `interval_s`: deltas that come sooner are
    merged into the state that comes when the interval has passed, not with the next delta (which
    may be a slow step away). The first state and the last (the reply ended) come at once. Closing
    this (or cancelling its reader) ends the wait for the next delta, which aborts the request."""
    loop = asyncio.get_running_loop()
    deltas = aiter(reply)
    pending: asyncio.Future | None = None
    next_at = 0.0
    waiting = False  # text arrived that no state has shown yet
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(deltas))
            timeout = max(next_at - loop.time(), 0.0) if waiting else None
            done, _ = await asyncio.wait({pending}, timeout=timeout)
            if done:
                arrived, pending = pending, None
                try:
                    arrived.result()
                except StopAsyncIteration:
                    return
                waiting = True
                if reply.finish_reason is None and loop.time() < next_at:
                    continue  # shown once the interval has passed
            waiting = False
            next_at = loop.time() + interval_s
            yield reply
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await deltas.aclose()


async def start_reply(backend: ChatBackend, messages: list[dict], params: SamplingParams,
                      conversation_id: int | None = None, user: str | None = None,
                      previous: str | None = None) -> ReplyStream:
    """Submit a conversation. The request id starts with the conversation (`chat12/…`, or
    `chat-new-…` before the first reply creates it): the live panel tints blocks by it.
    With `user`, the prefix cache keeps everything after a preset system prompt to that user:
    another user sending the same text hits only the preset's blocks. `previous`: the backend
    that wrote the conversation's last reply (the router keeps a conversation where its blocks are)."""
    conversation = f"chat{int(conversation_id)}" if conversation_id is not None else f"chat-new-{uuid.uuid4().hex[:6]}"
    request_id = f"{conversation}/{uuid.uuid4().hex[:8]}"
    reply = await backend.start(messages, params, request_id=request_id, user=user,
                                num_shared_messages=presets.num_shared_messages(messages), previous=previous)
    stream = ReplyStream(reply.deltas, reply.backend)
    stream.request_id = request_id
    return stream
