"""The in-process engine client: the step loop on a background thread of this process, many
callers at once (the callers' side is engine/runtime/streaming_client.py; engine/runtime/process_client.py runs the
engine in a process of its own instead, behind the same interface).

Only the loop thread touches the engine; callers tokenize their prompts with a copy of its
tokenizer (engine/frontend/input_processor.py's CallerSideInputs). Callers talk to it through one
thread-safe inbox (add, abort, snapshot requests) and read their request's deltas from a stream
of its own.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before 3.11

from engine.core.block_map import BlockMap
from engine.core.sampling_params import SamplingParams
from engine.core.stats import SchedulerStats
from engine.frontend.input_processor import CallerSideInputs
from engine.runtime.llm_engine import LLMEngine
from engine.outputs import EngineInfo
from engine.runtime.streaming_client import (LIVENESS_CHECK_S, EngineBusyError, EngineDeadError, Stream,
                                    StreamingClient)

log = logging.getLogger(__name__)
__all__ = ["EngineBusyError", "EngineClient", "EngineDeadError"]


class EngineClient(StreamingClient):
    def __init__(self, engine: LLMEngine, max_waiting: int = 256) -> None:
        """`max_waiting`: requests that may wait for the engine at once; beyond it `submit`
        raises EngineBusyError at once instead of queueing without bound."""
        super().__init__(max_waiting)
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stats = engine.stats()
        self._info = engine.info()
        self._inputs = CallerSideInputs(engine.tokenizer)
        self._stopping = threading.Event()
        self._death: str | None = None  # why the loop stopped, if a fault stopped it
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        """The engine's tokenizer: copy it before use off the loop thread (fast tokenizers are not thread-safe)."""
        return self.engine.tokenizer

    # ---- caller side --------------------------------------------------------------------
    def _add(self, stream: Stream, prompt, params: SamplingParams, options: dict) -> None:
        if self.closed:
            raise EngineDeadError(self._dead_reason())
        processed = self._inputs.prepare(prompt, params, options, self._info)
        self._ask(("add", processed, params, options, stream, Future()))

    async def _add_async(self, stream: Stream, prompt, params: SamplingParams, options: dict) -> None:
        if self.closed:
            raise EngineDeadError(self._dead_reason())
        processed = await self._inputs.aprepare(prompt, params, options, self._info)
        await self._ask_async(("add", processed, params, options, stream, Future()))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def _close_stream(self, stream: Stream) -> None:
        self._inbox.put(("close", stream))  # the loop checks it is still that stream's request

    _drop = _close_stream  # a queue put takes no lock a finalizer could find held

    def stats(self) -> SchedulerStats:
        return self._stats

    def info(self) -> EngineInfo:
        return self._info

    def compiled_pending(self) -> bool:
        return self.engine.compiled_pending()

    def block_map(self, timeout: float = 10.0) -> BlockMap:
        """Every block's state, taken by the loop thread between two steps."""
        # The loop thread only copies what changed; the BlockInfos are built here, off it.
        return self._ask(("block_map", Future()), timeout).build()

    @property
    def closed(self) -> bool:
        """True once the loop is not running: closed, or stopped by a fault."""
        return self._stopping.is_set() or not self._thread.is_alive()

    def _why_dead(self) -> str | None:
        return None if self._thread.is_alive() else self._dead_reason()

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
        self._inputs.close()
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
            self._finish_all_streams(reason, None if self._death is None else self._dead_reason())
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

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        finally:
            self._finish_stream(request_id, "abort")

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
            _, processed, params, options, stream, future = message
            request_id = stream.request_id
            try:
                if request_id in self._streams:
                    raise ValueError(f"a request with id {request_id!r} is already running")
                waiting = len(self.engine.scheduler.waiting)
                if waiting >= self.max_waiting:
                    raise EngineBusyError(f"the engine is busy: {waiting} requests are waiting "
                                          f"(limit {self.max_waiting}); try again in a moment")
                self.engine.add_processed(request_id, processed, params, cache_salt=options["cache_salt"])
            except Exception as error:
                future.set_exception(error)
                return
            self._register(stream, params)
            future.set_result(None)
        elif kind == "abort":
            if message[1] in self._streams:
                self._abort(message[1])
        elif kind == "close":
            stream = message[1]
            if self._streams.get(stream.request_id) is stream:
                self._abort(stream.request_id)
        elif kind == "block_map":
            future = message[1]
            try:
                future.set_result(self.engine.block_map_state())
            except Exception as error:  # the caller gets the error; the engine goes on
                future.set_exception(error)
