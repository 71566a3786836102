"""The engine client the app uses: the step loop on a background thread, many callers at once.

Only the loop thread touches the engine, its tokenizer included. Callers talk to it through one
thread-safe inbox (add, abort, snapshot requests) and read their request's deltas from a queue
of its own.
`submit()` validates and queues at once (a bad prompt raises in the caller) and returns an
iterator; a caller that stops iterating aborts its request, so its blocks return at once.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
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


class EngineClient:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, queue.SimpleQueue] = {}
        self._open: dict[str, int] = {}  # request id -> samples not yet finished
        self._ids = itertools.count()
        self._stats = engine.stats()
        self._info = engine.info()
        self._submitted: dict[str, float] = {}  # request id -> when the loop took it (no token yet)
        self._first_tokens: deque[FirstToken] = deque(maxlen=RECENT_FIRST_TOKENS)
        self._recent: tuple[FirstToken, ...] = ()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- caller side --------------------------------------------------------------------
    def submit(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[Delta]:
        """Queue a prompt (text, token ids, or chat messages rendered with the chat template) and
        return an iterator over its deltas, ending after every sample's final delta."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        stream: queue.SimpleQueue = queue.SimpleQueue()
        future: Future = Future()
        if self.closed:
            raise RuntimeError("the engine client is closed")
        self._inbox.put(("add", request_id, prompt, params, stream, future))
        while True:  # an empty or too long prompt, or a duplicate id, raises here
            try:
                future.result(timeout=1.0)
                break
            except FutureTimeout:
                if not self._thread.is_alive():  # closed after our check: nobody will answer
                    raise RuntimeError("the engine client is closed") from None
        return self._iterate(request_id, stream)

    def _iterate(self, request_id: str, stream: queue.SimpleQueue) -> Iterator[Delta]:
        finished = False
        try:
            while (item := stream.get()) is not _DONE:
                yield item
            finished = True
        finally:
            if not finished:  # the caller stopped reading (or disconnected): free its blocks now
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

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
        future: Future = Future()
        self._inbox.put(("block_map", future))
        return future.result(timeout)

    @property
    def closed(self) -> bool:
        return self._stopping.is_set()

    def close(self) -> None:
        self._stopping.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=30)

    # ---- loop thread --------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            # Block for work only when the engine is idle; otherwise take what has arrived and step.
            block = not self.engine.has_unfinished()
            try:
                message = self._inbox.get(block=block)
                self._handle(message)
                while True:
                    self._handle(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():  # an abort may have emptied it: no step will say so
                self._stats = self.engine.scheduler.current_stats()
                continue
            try:
                self._route(self.engine.step())
            except Exception:  # a bug must not hang every caller: end their streams instead
                log.exception("engine step failed; ending every open request")
                for request_id in list(self._streams):
                    self.engine.abort_request(request_id)
                    self._finish_stream(request_id, "error")
            self._stats = self.engine.stats()
        for request_id in list(self._streams):
            self._finish_stream(request_id, "abort")

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt, params, stream, future = message
            try:
                if request_id in self._streams:
                    raise ValueError(f"a request with id {request_id!r} is already running")
                # The tokenizer is used on this thread only: fast tokenizers are not safe to share.
                if prompt and isinstance(prompt, list) and isinstance(prompt[0], dict):
                    prompt = self.engine.apply_chat_template(prompt)
                self.engine.add_request(request_id, prompt, params)
            except Exception as error:
                future.set_exception(error)
                return
            self._streams[request_id] = stream
            self._open[request_id] = params.n
            self._submitted[request_id] = time.monotonic()
            future.set_result(None)
        elif kind == "abort":
            request_id = message[1]
            if request_id in self._streams:
                self.engine.abort_request(request_id)
                self._finish_stream(request_id, "abort")
        elif kind == "block_map":
            message[1].set_result(self.engine.block_map())

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
            if delta.finish_reason is not None:
                self._open[delta.request_id] -= 1
                if self._open[delta.request_id] == 0:
                    del self._streams[delta.request_id], self._open[delta.request_id]
                    self._submitted.pop(delta.request_id, None)
                    stream.put(_DONE)
        if first_token:  # readers get an immutable copy; the deque itself stays on this thread
            self._recent = tuple(self._first_tokens)

    def _finish_stream(self, request_id: str, reason: str) -> None:
        stream = self._streams.pop(request_id)
        self._open.pop(request_id, None)
        self._submitted.pop(request_id, None)
        stream.put(Delta(request_id, 0, "", (), finish_reason=reason))
        stream.put(_DONE)
