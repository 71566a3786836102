"""The engine client the app uses: the step loop on a background thread, many callers at once.

Only the loop thread touches the engine, its tokenizer included. Callers talk to it through one
thread-safe inbox (add, abort, snapshot requests) and read their request's deltas from a queue
of its own.
`submit()` validates and queues at once (a bad prompt raises in the caller) and returns an
iterator; a caller that stops iterating aborts its request, so its blocks return at once.
`asubmit()` is the same for a coroutine: its reader waits on its event loop, holding no thread,
so a web server can stream thousands of replies and cancel one the moment its client leaves.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before 3.11

from engine.core.block_map import BlockMap
from engine.core.sampling_params import SamplingParams
from engine.core.stats import SchedulerStats
from engine.llm_engine import LLMEngine
from engine.outputs import Delta, EngineInfo, FirstToken

log = logging.getLogger(__name__)
_DONE = object()
RECENT_FIRST_TOKENS = 256
LIVENESS_CHECK_S = 1.0  # how often a waiting caller checks that the loop thread is still alive


class EngineBusyError(RuntimeError):
    """The engine's waiting queue is full: try again in a moment (nothing was queued)."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running (closed, or stopped by a fault): nothing submitted will run."""


class _Stream:
    """One request's deltas, from the loop thread to its reader: a thread that blocks on `get`, or
    a coroutine awaiting `aget` on `loop`, woken through that loop (waiting holds no thread).
    Both check every LIVENESS_CHECK_S that the loop is alive: the loop ends every open stream as
    it stops, but a reader must never wait on a loop that could not."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.request_id = request_id
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._loop = loop
        self._arrived = asyncio.Event() if loop is not None else None

    def put(self, item: object) -> None:
        self._items.put(item)
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._arrived.set)
            except RuntimeError:  # the reader's event loop has closed: no one is left to read
                pass

    def get(self, why_dead: Callable[[], str | None]) -> object:
        """The next item (a Delta, or _DONE after the last)."""
        while True:
            try:
                return self._items.get(timeout=LIVENESS_CHECK_S)
            except queue.Empty:
                self._end_if_dead(why_dead)

    async def aget(self, why_dead: Callable[[], str | None]) -> object:
        """`get` for a coroutine."""
        while True:
            try:
                return self._items.get_nowait()
            except queue.Empty:
                pass
            # No await between the check and the clear: `put`'s wake-up runs on this loop, so it
            # cannot land in between and be lost.
            self._arrived.clear()
            if self._items.empty():
                try:
                    await asyncio.wait_for(self._arrived.wait(), LIVENESS_CHECK_S)
                except TimeoutError:
                    self._end_if_dead(why_dead)

    def _end_if_dead(self, why_dead: Callable[[], str | None]) -> None:
        reason = why_dead()
        if reason is not None:
            self._items.put(Delta(self.request_id, 0, "", (), finish_reason="error", error=reason))
            self._items.put(_DONE)


class EngineClient:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256) -> None:
        """`max_waiting`: requests that may wait for the engine at once; beyond it `submit`
        raises EngineBusyError at once instead of queueing without bound."""
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._open: dict[str, set[int]] = {}  # request id -> indices of its samples not yet finished
        self._ids = itertools.count()
        self._stats = engine.stats()
        self._info = engine.info()
        self._submitted: dict[str, float] = {}  # request id -> when the loop took it (no token yet)
        self._first_tokens: deque[FirstToken] = deque(maxlen=RECENT_FIRST_TOKENS)
        self._recent: tuple[FirstToken, ...] = ()
        self._listeners: list[Callable[[Delta, float], None]] = []
        self._stopping = threading.Event()
        self._death: str | None = None  # why the loop stopped, if a fault stopped it
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- caller side --------------------------------------------------------------------
    def submit(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None,
               request_id: str | None = None, *, cache_salt: str | None = None,
               num_shared_messages: int = 0) -> Iterator[Delta]:
        """Queue a prompt (text, token ids, or chat messages rendered with the chat template) and
        return an iterator over its deltas, ending after every sample's final delta. `cache_salt`
        (the user) keeps its prefix-cache blocks to that user, apart from the first
        `num_shared_messages` messages (see LLMEngine.add_request)."""
        stream = _Stream(request_id or f"req-{next(self._ids)}")
        self._ask(self._add_message(prompt, params, cache_salt, num_shared_messages, stream))  # a bad prompt raises here
        return self._iterate(stream)

    async def asubmit(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None,
                      request_id: str | None = None, *, cache_salt: str | None = None,
                      num_shared_messages: int = 0) -> AsyncIterator[Delta]:
        """`submit` for a coroutine: the deltas come as an async iterator whose waits hold no
        thread. Cancelling the caller (here, or while it iterates) aborts the request."""
        stream = _Stream(request_id or f"req-{next(self._ids)}", asyncio.get_running_loop())
        try:
            await self._ask_async(self._add_message(prompt, params, cache_salt, num_shared_messages, stream))
        except asyncio.CancelledError:  # the loop may take the request after we stop waiting
            self.abort(stream.request_id)
            raise
        return self._aiterate(stream)

    @staticmethod
    def _add_message(prompt, params: SamplingParams | None, cache_salt: str | None, num_shared_messages: int,
                     stream: _Stream) -> tuple:
        options = {"cache_salt": cache_salt, "num_shared_messages": num_shared_messages}
        return ("add", stream.request_id, prompt, params or SamplingParams(), options, stream, Future())

    def _iterate(self, stream: _Stream) -> Iterator[Delta]:
        finished = False
        try:
            while (item := stream.get(self._why_dead)) is not _DONE:
                yield item
            finished = True
        finally:
            if not finished:  # the caller stopped reading (or disconnected): free its blocks now
                self.abort(stream.request_id)

    async def _aiterate(self, stream: _Stream) -> AsyncIterator[Delta]:
        finished = False
        try:
            while (item := await stream.aget(self._why_dead)) is not _DONE:
                yield item
            finished = True
        finally:
            if not finished:  # closed or cancelled mid-reply (a client gone): free its blocks now
                self.abort(stream.request_id)

    def _why_dead(self) -> str | None:
        return None if self._thread.is_alive() else self._dead_reason()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def add_listener(self, listener: Callable[[Delta, float], None]) -> None:
        """Call `listener(delta, time.monotonic())` for every delta of every request, on the loop
        thread as the delta is routed (metrics count tokens and latencies this way). It must be
        quick; an exception it raises is logged and ignored."""
        self._listeners.append(listener)

    def stats(self) -> SchedulerStats:
        """The latest step's stats (an immutable snapshot; never blocks)."""
        return self._stats

    def info(self) -> EngineInfo:
        return self._info

    def recent_first_tokens(self) -> tuple[FirstToken, ...]:
        """Time to first token of the latest requests, oldest first (a snapshot; never blocks)."""
        return self._recent

    def block_map(self, timeout: float = 10.0) -> BlockMap:
        """Every block's state, taken by the loop thread between two steps."""
        # The loop thread only copies what changed; the BlockInfos are built here, off it.
        return self._ask(("block_map", Future()), timeout).build()

    @property
    def closed(self) -> bool:
        """True once the loop is not running: closed, or stopped by a fault."""
        return self._stopping.is_set() or not self._thread.is_alive()

    def _dead_reason(self) -> str:
        if self._death is not None:
            return f"the engine loop stopped after a fault ({self._death})"
        return "the engine client is closed"

    def _ask(self, message: tuple, timeout: float | None = None):
        """Send the loop a message whose last item is a Future, and wait for its answer, checking
        that the loop is alive while waiting (it may stop after our check and never answer)."""
        future: Future = message[-1]
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.closed:
            raise EngineDeadError(self._dead_reason())
        self._inbox.put(message)
        while True:
            wait = LIVENESS_CHECK_S if deadline is None else min(LIVENESS_CHECK_S, deadline - time.monotonic())
            try:
                return future.result(timeout=max(wait, 0.0))
            except FutureTimeout:
                if self.closed and not future.done():
                    raise EngineDeadError(self._dead_reason()) from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    async def _ask_async(self, message: tuple) -> object:
        """`_ask` for a coroutine: awaits the loop's answer without holding a thread."""
        future: Future = message[-1]
        if self.closed:
            raise EngineDeadError(self._dead_reason())
        self._inbox.put(message)
        answer = asyncio.wrap_future(future)
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(answer), LIVENESS_CHECK_S)
            except TimeoutError:
                if self.closed and not future.done():
                    raise EngineDeadError(self._dead_reason()) from None

    def close(self) -> None:
        self._stopping.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=30)

    # ---- loop thread --------------------------------------------------------------------
    def _loop(self) -> None:
        """Supervises the steps: a failing forward fails only its own requests (LLMEngine.step), a
        failing step otherwise fails the requests open then, and if the loop itself stops, every
        open stream and every waiting caller is answered with the reason before the thread ends."""
        try:
            self._run()
        except BaseException as error:
            self._death = f"{type(error).__name__}: {error}"
            log.exception("the engine loop stopped")
        finally:
            self._stopping.set()
            reason = "abort" if self._death is None else "error"
            for request_id in list(self._streams):
                self._finish_stream(request_id, reason, None if self._death is None else self._dead_reason())
            self._answer_leftovers()

    def _run(self) -> None:
        while not self._stopping.is_set():
            # Block for work only when the engine is idle; otherwise take what has arrived and step.
            block = not self.engine.has_unfinished()
            try:
                self._handle_safely(self._inbox.get(block=block))
                while True:
                    self._handle_safely(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():  # an abort may have emptied it: no step will say so
                self._stats = self.engine.scheduler.current_stats()
                continue
            try:
                self._route(self.engine.step())
            except Exception as error:  # a bug outside the forward: fail what is open, keep serving
                log.exception("engine step failed; ending every open request")
                self._fail_open_requests(f"{type(error).__name__}: {error}")
            self._stats = self.engine.stats()

    def _fail_open_requests(self, reason: str) -> None:
        for request_id in list(self._streams):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the state that failed the step may fail this too; end the stream anyway
                log.exception("could not abort %s", request_id)
            self._finish_stream(request_id, "error", reason)
        self.engine.scheduler.refresh_stats()

    def _answer_leftovers(self) -> None:
        """Callers whose messages the stopped loop never took get the reason, not a wait."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            future = message[-1]
            if isinstance(future, Future) and not future.done():
                future.set_exception(EngineDeadError(self._dead_reason()))

    def _handle_safely(self, message: tuple) -> None:
        try:
            self._handle(message)
        except Exception as error:  # one bad message must not stop the loop
            log.exception("engine client message %r failed", message[0])
            future = message[-1]
            if isinstance(future, Future) and not future.done():
                future.set_exception(error)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt, params, options, stream, future = message
            try:
                if request_id in self._streams:
                    raise ValueError(f"a request with id {request_id!r} is already running")
                waiting = len(self.engine.scheduler.waiting)
                if waiting >= self.max_waiting:
                    raise EngineBusyError(f"the engine is busy: {waiting} requests are waiting "
                                          f"(limit {self.max_waiting}); try again in a moment")
                # Tokenizing happens here, on this thread only: fast tokenizers are not safe to share.
                self.engine.add_request(request_id, prompt, params, **options)
            except Exception as error:
                future.set_exception(error)
                return
            self._streams[request_id] = stream
            self._open[request_id] = set(range(params.n))
            self._submitted[request_id] = time.monotonic()
            future.set_result(None)
        elif kind == "abort":
            request_id = message[1]
            if request_id in self._streams:
                try:
                    self.engine.abort_request(request_id)
                finally:
                    self._finish_stream(request_id, "abort")
        elif kind == "block_map":
            future = message[1]
            try:
                future.set_result(self.engine.block_map_state())
            except Exception as error:  # the caller gets the error; the engine goes on
                future.set_exception(error)

    def _route(self, deltas: list[Delta]) -> None:
        first_token = False
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
                    stream.put(_DONE)
        if first_token:  # readers get an immutable copy; the deque itself stays on this thread
            self._recent = tuple(self._first_tokens)

    def _finish_stream(self, request_id: str, reason: str, error: str | None = None) -> None:
        """End a request's stream with one final delta per sample still open."""
        stream = self._streams.pop(request_id)
        open_samples = self._open.pop(request_id, None) or {0}
        self._submitted.pop(request_id, None)
        for index in sorted(open_samples):
            delta = Delta(request_id, index, "", (), finish_reason=reason, error=error)
            stream.put(delta)
            self._tell_listeners(delta)
        stream.put(_DONE)

    def _tell_listeners(self, delta: Delta) -> None:
        if not self._listeners:
            return
        now = time.monotonic()
        for listener in self._listeners:
            try:
                listener(delta, now)
            except Exception:  # a metrics bug must not fail a request
                log.exception("engine client listener failed")
