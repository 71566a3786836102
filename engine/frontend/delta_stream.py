"""What `submit` and `asubmit` return: one request's deltas, and the caller's hold on the request.

A caller that lets go of its stream aborts the request, so its blocks return at once, however it
lets go: `close()` / `aclose()`, leaving its `with` block, an exception or a cancel while it
waits for a delta, or dropping it unread (a generator dropped before its first item runs no
cleanup at all, which is why this is an object with a finalizer, not a generator). A stream read
to its end has nothing left to abort.

The finalizer runs on whatever thread frees the stream, possibly in the middle of the client's
own locked code, so it only hands the request to the client's lock-free `_drop`; it is off at
interpreter exit, when the client may be half torn down.
"""
from __future__ import annotations

import weakref
from collections import deque
from typing import TYPE_CHECKING

from engine.outputs import Delta

if TYPE_CHECKING:
    from engine.runtime.streaming_client import Stream, StreamingClient

DONE = object()  # a request's stream ends with this, after every sample's final delta


class _Reader:
    """What the blocking and the async stream share: the deltas read ahead, and the request's end."""

    def __init__(self, client: StreamingClient, stream: Stream) -> None:
        self.request_id = stream.request_id
        self._client = client
        self._stream = stream
        self._ready: deque[Delta] = deque()
        self._ended = False  # DONE was read, or the caller closed the stream
        self._abort_if_dropped = weakref.finalize(self, client._drop, stream)
        self._abort_if_dropped.atexit = False

    def _take(self, item: object) -> None:
        """Queue `item` and every delta already waiting behind it (see `_coalesced`)."""
        if item is DONE:
            self._finished()
            return
        deltas, after = _coalesced(item, self._stream)
        self._ready.extend(deltas)
        if after is DONE:
            self._finished()

    def _finished(self) -> None:
        self._ended = True
        self._abort_if_dropped.detach()

    def _close(self) -> None:
        self._ready.clear()
        self._ended = True
        if self._abort_if_dropped.detach() is not None:  # still running (or its end not yet read)
            self._client._close_stream(self._stream)


class DeltaStream(_Reader):
    """A request's deltas for a blocking reader: iterate it; `close()` (or a `with` block) aborts
    the request if it is still running."""

    def __iter__(self) -> DeltaStream:
        return self

    def __next__(self) -> Delta:
        if not self._ready:
            if self._ended:
                raise StopIteration
            try:
                self._take(self._stream.get(self._client._why_dead))
            except BaseException:  # interrupted while waiting: the caller is gone
                self._close()
                raise
            if not self._ready:
                raise StopIteration
        return self._ready.popleft()

    def close(self) -> None:
        self._close()

    def __enter__(self) -> DeltaStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._close()


class AsyncDeltaStream(_Reader):
    """A request's deltas for a coroutine (`async for`); its waits hold no thread. `aclose()` (or
    an `async with` block, or cancelling the task that waits on it) aborts the request if it is
    still running."""

    def __aiter__(self) -> AsyncDeltaStream:
        return self

    async def __anext__(self) -> Delta:
        if not self._ready:
            if self._ended:
                raise StopAsyncIteration
            try:
                self._take(await self._stream.aget(self._client._why_dead))
            except BaseException:  # cancelled while waiting (a client gone): abort now
                self._close()
                raise
            if not self._ready:
                raise StopAsyncIteration
        return self._ready.popleft()

    async def aclose(self) -> None:
        self._close()

    def close(self) -> None:
        """`aclose()` for code that cannot await (closing never waits)."""
        self._close()

    async def __aenter__(self) -> AsyncDeltaStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._close()


def _coalesced(first: Delta, stream: Stream) -> tuple[list[Delta], object | None]:
    """`first` and every delta already waiting behind it, a sample's consecutive ones merged into
    one: a reader that fell behind (a busy server) catches up in one chunk, not one per token.
    Returns the deltas and the item that ended the run (DONE), or None if the queue ran dry."""
    merged = [first]
    while (item := stream.get_nowait()) is not None:
        if item is DONE:
            return merged, DONE
        last = merged[-1]
        if item.index == last.index and last.finish_reason is None:
            merged[-1] = _merge(last, item)
        else:
            merged.append(item)
    return merged, None


def _merge(a: Delta, b: Delta) -> Delta:
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or ()) + (b.logprobs or ())
    return Delta(a.request_id, a.index, a.text + b.text, a.token_ids + b.token_ids, finish_reason=b.finish_reason,
                 usage=b.usage, error=b.error, logprobs=logprobs)
