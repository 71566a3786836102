"""What every engine client shares, wherever its engine runs (a thread of this process:
engine/runtime/thread_client.py; a process of its own: engine/runtime/process_client.py): callers submit and read their
request's deltas from a stream of its own, many at once, and the side that runs the engine routes
each step's deltas to those streams, to the listeners (metrics) and to the record of recent times
to first token.

`submit()` validates and queues at once (a bad prompt raises in the caller) and returns a
DeltaStream; a caller that closes or drops it aborts its request, so its blocks return at once
(engine/frontend/delta_stream.py). `asubmit()` is the same for a coroutine: its reader waits on
its event loop, holding no thread, so a web server can stream thousands of replies and cancel one
the moment its client leaves.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from engine.core.block_map import BlockMap
from engine.core.sampling_params import SamplingParams
from engine.core.stats import SchedulerStats
from engine.frontend.delta_stream import DONE, AsyncDeltaStream, DeltaStream
from engine.outputs import Delta, EngineInfo, FirstToken

log = logging.getLogger(__name__)
RECENT_FIRST_TOKENS = 256
LIVENESS_CHECK_S = 1.0  # how often a waiting caller checks that the engine is still running


class EngineBusyError(RuntimeError):
    """The engine's waiting queue is full: try again in a moment (nothing was queued)."""


class EngineDeadError(RuntimeError):
    """The engine is not running (closed, stopped by a fault, or restarting): nothing submitted will run."""


class Stream:
    """One request's deltas, from the side that runs the engine to its reader: a thread that
    blocks on `get`, or a coroutine awaiting `aget` on `loop`, woken through that loop (waiting
    holds no thread). Both check every LIVENESS_CHECK_S that the engine is alive: the engine
    side ends every open stream as it stops, but a reader must never wait on one that could not."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.request_id = request_id
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._loop = loop
        self._arrived = asyncio.Event() if loop is not None else None
        self._waiting = False  # a coroutine is parked on `_arrived` (only then is a wake-up needed)

    def put(self, item: object) -> None:
        self._items.put(item)
        if self._loop is not None and self._waiting:
            try:
                self._loop.call_soon_threadsafe(self._arrived.set)
            except RuntimeError:  # the reader's event loop has closed: no one is left to read
                pass

    def get(self, why_dead: Callable[[], str | None]) -> object:
        """The next item (a Delta, or DONE after the last)."""
        while True:
            try:
                return self._items.get(timeout=LIVENESS_CHECK_S)
            except queue.Empty:
                self._end_if_dead(why_dead)

    def get_nowait(self) -> object | None:
        """The next item if one is there, else None (never waits)."""
        try:
            return self._items.get_nowait()
        except queue.Empty:
            return None

    async def aget(self, why_dead: Callable[[], str | None]) -> object:
        """`get` for a coroutine."""
        while True:
            try:
                return self._items.get_nowait()
            except queue.Empty:
                pass
            # `_waiting` is set before the queue is checked again, so a `put` after that check
            # sees it and wakes us; one before it is found by the check.
            self._arrived.clear()
            self._waiting = True
            try:
                if self._items.empty():
                    try:
                        await asyncio.wait_for(self._arrived.wait(), LIVENESS_CHECK_S)
                    except TimeoutError:
                        self._end_if_dead(why_dead)
            finally:
                self._waiting = False

    def _end_if_dead(self, why_dead: Callable[[], str | None]) -> None:
        reason = why_dead()
        if reason is not None:
            self._items.put(Delta(self.request_id, 0, "", (), finish_reason="error", error=reason))
            self._items.put(DONE)


class StreamingClient:
    """The callers' side of an engine client and the routing of deltas to them. Subclasses say
    how a request reaches the engine (`_add`, `_add_async`, `abort`) and report its state."""

    def __init__(self, max_waiting: int = 256) -> None:
        """`max_waiting`: requests that may wait for the engine at once; beyond it `submit`
        raises EngineBusyError at once instead of queueing without bound."""
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        self.max_waiting = max_waiting
        self._streams: dict[str, Stream] = {}
        self._open: dict[str, set[int]] = {}  # request id -> indices of its samples not yet finished
        self._ids = itertools.count()
        self._submitted: dict[str, float] = {}  # request id -> when the engine took it (no token yet)
        self._first_tokens: deque[FirstToken] = deque(maxlen=RECENT_FIRST_TOKENS)
        self._recent: tuple[FirstToken, ...] = ()
        self._listeners: list[Callable[[Delta, float], None]] = []
        # Guards the streams' bookkeeping where callers and the routing side run on different threads.
        self._lock = threading.RLock()

    # ---- what a subclass provides -------------------------------------------------------
    def _add(self, stream: Stream, prompt, params: SamplingParams, options: dict) -> None:
        """Queue the request with the engine, registered under `stream` (raises if refused)."""
        raise NotImplementedError

    async def _add_async(self, stream: Stream, prompt, params: SamplingParams, options: dict) -> None:
        self._add(stream, prompt, params, options)

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _close_stream(self, stream: Stream) -> None:
        """Abort `stream`'s request if it still runs: its caller closed it. By the stream, not its
        id alone: a caller may reuse the id of a request that has finished."""
        with self._lock:
            if self._streams.get(stream.request_id) is stream:
                self.abort(stream.request_id)

    def _drop(self, stream: Stream) -> None:
        """`_close_stream` for the finalizer of a stream dropped unclosed: it runs on any thread at
        any moment (inside this client's locked code too), so it must take no lock: queue it."""
        raise NotImplementedError

    def stats(self) -> SchedulerStats:
        """The latest step's stats (an immutable snapshot; never blocks)."""
        raise NotImplementedError

    def info(self) -> EngineInfo:
        raise NotImplementedError

    def block_map(self, timeout: float = 10.0) -> BlockMap:
        """Every block's state, taken between two steps."""
        raise NotImplementedError

    def compiled_pending(self) -> bool:
        """Whether a compiled decode step is still being built or loaded in the background."""
        return False

    @property
    def closed(self) -> bool:
        """True while the engine is not running: closed, stopped by a fault, or restarting."""
        raise NotImplementedError

    def _dead_reason(self) -> str:
        raise NotImplementedError

    def closed_reason(self) -> str | None:
        """Why the engine is not running (None while it runs): what a status page shows."""
        return self._dead_reason() if self.closed else None

    def close(self) -> None:
        raise NotImplementedError

    # ---- caller side --------------------------------------------------------------------
    def submit(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None,
               request_id: str | None = None, *, cache_salt: str | None = None,
               num_shared_messages: int = 0) -> DeltaStream:
        """Queue a prompt (text, token ids, or chat messages rendered with the chat template) and
        return a stream of its deltas, ending after every sample's final delta. `cache_salt`
        (the user) keeps its prefix-cache blocks to that user, apart from the first
        `num_shared_messages` messages (see LLMEngine.add_request)."""
        stream = Stream(request_id or f"req-{next(self._ids)}")
        options = {"cache_salt": cache_salt, "num_shared_messages": num_shared_messages}
        self._add(stream, prompt, params or SamplingParams(), options)  # a bad prompt raises here
        return DeltaStream(self, stream)

    async def asubmit(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None,
                      request_id: str | None = None, *, cache_salt: str | None = None,
                      num_shared_messages: int = 0) -> AsyncDeltaStream:
        """`submit` for a coroutine: the deltas come as an async iterator whose waits hold no
        thread. Cancelling the caller (here, or while it iterates) aborts the request."""
        stream = Stream(request_id or f"req-{next(self._ids)}", asyncio.get_running_loop())
        options = {"cache_salt": cache_salt, "num_shared_messages": num_shared_messages}
        try:
            await self._add_async(stream, prompt, params or SamplingParams(), options)
        except asyncio.CancelledError:  # the engine may take the request after we stop waiting
            self.abort(stream.request_id)
            raise
        return AsyncDeltaStream(self, stream)

    def _why_dead(self) -> str | None:
        return self._dead_reason() if self.closed else None

    def add_listener(self, listener: Callable[[Delta, float], None]) -> None:
        """Call `listener(delta, time.monotonic())` for every delta of every request, as the delta
        is routed (metrics count tokens and latencies this way). It must be quick; an exception
        it raises is logged and ignored."""
        self._listeners.append(listener)

    def recent_first_tokens(self) -> tuple[FirstToken, ...]:
        """Time to first token of the latest requests, oldest first (a snapshot; never blocks)."""
        return self._recent

    # ---- the routing side ---------------------------------------------------------------
    def _register(self, stream: Stream, params: SamplingParams) -> None:
        with self._lock:
            if stream.request_id in self._streams:
                raise ValueError(f"a request with id {stream.request_id!r} is already running")
            self._streams[stream.request_id] = stream
            self._open[stream.request_id] = set(range(params.n))
            self._submitted[stream.request_id] = time.monotonic()

    def _route(self, deltas: list[Delta]) -> None:
        first_token = False
        with self._lock:
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if stream is None:
                    continue
                if delta.token_ids and delta.request_id in self._submitted:
                    ttft = time.monotonic() - self._submitted.pop(delta.request_id)
                    self._first_tokens.append(FirstToken(delta.request_id, time.time(), ttft))
                    first_token = True
                stream.put(delta)
                self._tell_listeners(delta)
                if delta.finish_reason is not None:
                    self._open[delta.request_id].discard(delta.index)
                    if not self._open[delta.request_id]:
                        del self._streams[delta.request_id], self._open[delta.request_id]
                        self._submitted.pop(delta.request_id, None)
                        stream.put(DONE)
            if first_token:  # readers get an immutable copy; the deque itself stays with the router
                self._recent = tuple(self._first_tokens)

    def _finish_stream(self, request_id: str, reason: str, error: str | None = None) -> None:
        """End a request's stream with one final delta per sample still open."""
        with self._lock:
            stream = self._streams.pop(request_id)
            open_samples = self._open.pop(request_id, None) or {0}
            self._submitted.pop(request_id, None)
            for index in sorted(open_samples):
                delta = Delta(request_id, index, "", (), finish_reason=reason, error=error)
                stream.put(delta)
                self._tell_listeners(delta)
            stream.put(DONE)

    def _finish_all_streams(self, reason: str, error: str | None = None) -> None:
        with self._lock:
            for request_id in list(self._streams):
                self._finish_stream(request_id, reason, error)

    def _tell_listeners(self, delta: Delta) -> None:
        if not self._listeners:
            return
        now = time.monotonic()
        for listener in self._listeners:
            try:
                listener(delta, now)
            except Exception:  # a metrics bug must not fail a request
                log.exception("engine client listener failed")

