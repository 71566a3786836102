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
from collections.abc import Iterator
from concurrent.futures import Future

from engine.llm_engine import LLMEngine
from engine.outputs import Delta
from engine.sampling_params import SamplingParams
from engine.stats import BlockMap, SchedulerStats

log = logging.getLogger(__name__)
_DONE = object()


class EngineClient:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, queue.SimpleQueue] = {}
        self._open: dict[str, int] = {}  # request id -> samples not yet finished
        self._ids = itertools.count()
        self._stats = engine.stats()
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
        self._inbox.put(("add", request_id, prompt, params, stream, future))
        future.result()  # an empty or too long prompt, or a duplicate id, raises here
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

    def block_map(self, timeout: float = 10.0) -> BlockMap:
        """Every block's state, taken by the loop thread between two steps."""
        future: Future = Future()
        self._inbox.put(("block_map", future))
        return future.result(timeout)

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
            future.set_result(None)
        elif kind == "abort":
            request_id = message[1]
            if request_id in self._streams:
                self.engine.abort_request(request_id)
                self._finish_stream(request_id, "abort")
        elif kind == "block_map":
            message[1].set_result(self.engine.block_map())

    def _route(self, deltas: list[Delta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            stream.put(delta)
            if delta.finish_reason is not None:
                self._open[delta.request_id] -= 1
                if self._open[delta.request_id] == 0:
                    del self._streams[delta.request_id], self._open[delta.request_id]
                    stream.put(_DONE)

    def _finish_stream(self, request_id: str, reason: str) -> None:
        stream = self._streams.pop(request_id)
        self._open.pop(request_id, None)
        stream.put(Delta(request_id, 0, "", (), finish_reason=reason))
        stream.put(_DONE)
