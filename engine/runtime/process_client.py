"""An engine client whose engine core runs in a process of its own (engine/runtime/core_process.py),
behind the same interface as the in-process EngineClient: submit and asubmit, abort, stats,
info, block_map, listeners. This is how `python -m engine.serve` and the app serve.

Why a process: on a small CPU the step loop and the server share the cores, and in one process
they share the GIL too; every per-token bit of Python in the server (detokenizing, SSE frames,
Gradio updates) then delays the next step. Here the core only schedules and steps (vLLM v1's
EngineCore busy loop); this side tokenizes prompts (InputProcessor, on the caller's thread, or
for `asubmit` on a thread of its own, never the event loop's), turns each step's token ids into
text (OutputProcessor, on a reader thread) and routes the deltas to the callers' streams. The
weights load once, in the core.

If the core process dies, every open stream ends at once with an error saying so, `closed` is
True (the API's /health answers 503) and a new core starts; when it is ready the client serves
again (`restarts` counts them).
"""
from __future__ import annotations

import copy
import itertools
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from pathlib import Path

from engine.core.block_map import BlockMap
from engine.core.sampling_params import SamplingParams
from engine.core.stats import SchedulerStats
from engine.frontend.input_processor import CallerSideInputs, ProcessedPrompt
from engine.frontend.output_processor import OutputProcessor
from engine.outputs import EngineInfo
from engine.runtime.streaming_client import LIVENESS_CHECK_S, EngineBusyError, EngineDeadError, Stream, StreamingClient

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 900.0  # loading weights (the first run converts the embedded model: ~15 s)
SHUTDOWN_TIMEOUT_S = 30.0
ROOT = Path(__file__).resolve().parents[1]


class EngineStartError(RuntimeError):
    """The engine core process could not start; says why (its own error, or how it exited)."""


class CoreProcessClient(StreamingClient):
    def __init__(self, model: str | None = None, device: str | None = None, dtype: str | None = None, *,
                 max_waiting: int = 256, restart: bool = True, num_threads: int | None = None, **options) -> None:
        """`options`: the engine core's (see EngineCore). `num_threads`: torch's threads in the
        core (default: torch's, one per core). `restart`: start a new core when one dies."""
        self._begin(model, device, dtype, max_waiting, restart, num_threads, options)
        self._finish()

    @classmethod
    def starting(cls, model: str | None = None, device: str | None = None, dtype: str | None = None, *,
                 max_waiting: int = 256, restart: bool = True, num_threads: int | None = None,
                 **options) -> Callable[[], CoreProcessClient]:
        """Start the core process now and return what finishes the client (the tokenizer, then
        the wait for the core): the caller does its own slow start-up in between (the app
        imports Gradio, ~7 s of CPU) while the core loads the model on another CPU core."""
        client = cls.__new__(cls)
        client._begin(model, device, dtype, max_waiting, restart, num_threads, options)
        return client._finish

    def _begin(self, model, device, dtype, max_waiting: int, restart: bool, num_threads: int | None,
               options: dict) -> None:
        super().__init__(max_waiting)
        self._options = {"model": model, "device": device, "dtype": dtype, "num_threads": num_threads, **options}
        self._restart = restart
        # The core starts first: it imports torch and transformers and loads the weights on one
        # CPU core while this process imports them and loads the tokenizer on the other (one
        # after the other, an engine took ~20 s to start on the tiny test model on a 2-core EPYC).
        self._starting = self._spawn_core()

    def _finish(self) -> CoreProcessClient:
        from engine.worker.loading.model_loader import load_tokenizer

        starting, self._starting = self._starting, None
        try:
            self.tokenizer = load_tokenizer(self._options["model"])
        except BaseException:
            _stop(starting[0])
            starting[1].close()
            raise
        # Their own copies: prompts are tokenized on callers' threads, replies detokenized on the reader's.
        # The serving process holds no torch, nor the grammar library (0.7 s and ~45 MiB more with
        # torch ~2 s and ~200 MiB): the core checks constraints, failing a broken one at once.
        self._inputs = CallerSideInputs(self.tokenizer, check_constraints=False)
        self._outputs = OutputProcessor(copy.deepcopy(self.tokenizer))
        self._send_lock = threading.Lock()
        self._closing = False
        self._alive = threading.Event()
        self._death: str | None = None  # why the last core ended, while no new one serves
        self._asks: dict[int, Future] = {}
        self._dropped: queue.SimpleQueue[Stream] = queue.SimpleQueue()  # see `_drop`
        self._ask_ids = itertools.count()
        self.restarts = 0
        self._process: subprocess.Popen | None = None
        self._connection: Connection | None = None
        self._await_core(*starting)
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()
        return self

    # ---- the interface ------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return self._stats

    def info(self) -> EngineInfo:
        return self._info

    def compiled_pending(self) -> bool:
        return self._pending

    @property
    def closed(self) -> bool:
        return self._closing or not self._alive.is_set()

    @property
    def core_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def _dead_reason(self) -> str:
        if self._closing:
            return "the engine client is closed"
        if self._death is not None:
            return self._death
        return "the engine core is not running"

    def _add(self, stream: Stream, prompt, params: SamplingParams, options: dict) -> None:
        if self.closed:
            raise EngineDeadError(self._dead_reason())
        self._take(stream, self._inputs.prepare(prompt, params, options, self._info), params, options)

    async def _add_async(self, stream: Stream, prompt, params: SamplingParams, options: dict) -> None:
        if self.closed:
            raise EngineDeadError(self._dead_reason())
        self._take(stream, await self._inputs.aprepare(prompt, params, options, self._info), params, options)

    def _take(self, stream: Stream, processed: ProcessedPrompt, params: SamplingParams, options: dict) -> None:
        """Register the request and send it to the core."""
        if self.closed:
            raise EngineDeadError(self._dead_reason())
        request_id = stream.request_id
        with self._lock:  # registered and sent as one, so an abort cannot come between
            waiting = len(self._submitted)
            if waiting >= self.max_waiting:
                raise EngineBusyError(f"the engine is busy: {waiting} requests are waiting "
                                      f"(limit {self.max_waiting}); try again in a moment")
            self._register(stream, params)
            self._outputs.add_request(request_id, processed.token_ids, params)
            try:
                self._send(("add", request_id, processed.token_ids, params, options["cache_salt"],
                            processed.num_shared_prefix_tokens))
            except (OSError, ValueError):
                self._outputs.abort(request_id)
                self._streams.pop(request_id, None), self._open.pop(request_id, None)
                self._submitted.pop(request_id, None)
                raise EngineDeadError(self._dead_reason()) from None

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id not in self._streams:
                return  # finished already, or never taken
            self._outputs.abort(request_id)
            self._finish_stream(request_id, "abort")
            try:
                self._send(("abort", request_id))
            except (OSError, ValueError):  # the core is gone: nothing left to abort
                pass

    def _drop(self, stream: Stream) -> None:
        # Aborting takes the locks the reader holds while it routes (a finalizer may run there),
        # so the reader closes dropped streams before its next message; a running request sends
        # one every step.
        self._dropped.put(stream)

    def _close_dropped(self) -> None:
        while not self._dropped.empty():
            self._close_stream(self._dropped.get_nowait())

    def block_map(self, timeout: float = 10.0) -> BlockMap:
        """Every block's state, taken by the core between two steps (built here, off it)."""
        if self.closed:
            raise EngineDeadError(self._dead_reason())
        token, future = next(self._ask_ids), Future()
        self._asks[token] = future
        try:
            self._send(("block_map", token))
        except (OSError, ValueError):
            self._asks.pop(token, None)
            raise EngineDeadError(self._dead_reason()) from None
        deadline = time.monotonic() + timeout
        while True:
            try:
                answer = future.result(timeout=max(min(LIVENESS_CHECK_S, deadline - time.monotonic()), 0.0))
                break
            except FutureTimeout:
                if time.monotonic() >= deadline:
                    self._asks.pop(token, None)
                    raise
        if isinstance(answer, str):
            raise RuntimeError(f"the engine core could not take a block map: {answer}")
        return answer.build()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._alive.clear()
        try:
            self._send(("shutdown",))
        except (OSError, ValueError):
            pass
        self._stop_process(grace_s=10.0)
        self._inputs.close()
        self._finish_all_streams("abort")
        self._answer_asks(EngineDeadError(self._dead_reason()))
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=SHUTDOWN_TIMEOUT_S)

    # ---- the core process ---------------------------------------------------------------
    def _start_core(self) -> None:
        """Start a core process and wait until it has loaded the model (EngineStartError if it cannot)."""
        self._await_core(*self._spawn_core())

    def _spawn_core(self) -> tuple[subprocess.Popen, Connection]:
        """A core process, told what to load; it loads while the caller goes on."""
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "TOKENIZERS_PARALLELISM": "false"}
        process = subprocess.Popen([sys.executable, "-m", "engine.runtime.core_process", str(theirs.fileno())],
                                   pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        connection = Connection(ours.detach())
        try:
            connection.send(("init", self._options))
        except OSError:
            pass  # it died at once: _await_core says how it exited
        return process, connection

    def _await_core(self, process: subprocess.Popen, connection: Connection) -> None:
        """Wait until the core has loaded the model, then serve through it (EngineStartError if it cannot)."""
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not connection.poll(1.0):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise EOFError
            message = connection.recv()
        except (EOFError, OSError):
            connection.close()
            _stop(process)
            raise EngineStartError(f"the engine core process {_exit_words(process.poll())} while starting") from None
        if message[0] == "failed":
            connection.close()
            _stop(process)
            raise EngineStartError(f"the engine core could not start: {message[1]}")
        _, self._info, self._stats, self._pending = message
        self._process, self._connection = process, connection
        self._death = None
        self._alive.set()

    def _stop_process(self, grace_s: float = 0.0) -> None:
        if self._process is not None:
            _stop(self._process, grace_s)
        if self._connection is not None:
            self._connection.close()

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._connection.send(message)

    # ---- the reader thread --------------------------------------------------------------
    def _read(self) -> None:
        """Each step's outputs become deltas for the callers; a core that dies is replaced."""
        while not self._closing:
            try:
                while True:
                    self._on_message(self._connection.recv())
            except (EOFError, OSError, ValueError):  # the core is gone (or we closed its socket)
                if self._closing:
                    return
            except Exception:  # a bug on this side: the core's state is unknown now, start afresh
                log.exception("engine core client: reading the core's outputs failed")
                self._stop_process()
            if not self._core_died() or self._closing:
                return

    def _on_message(self, message: tuple) -> None:
        self._close_dropped()
        kind = message[0]
        if kind == "step":
            _, outputs, stats, pending = message
            with self._lock:
                deltas, stopped = self._outputs.process(outputs)
                self._stats, self._pending = stats, pending
                self._route(deltas)
                for sample_id in stopped:  # a stop string ended it: its blocks return now
                    self._send(("finish", sample_id))
        elif kind == "stats":
            _, self._stats, self._pending = message
        elif kind == "block_map":
            future = self._asks.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message[2])

    def _core_died(self) -> bool:
        """End every stream with the reason, then start a new core; False if none could start."""
        self._alive.clear()
        process = self._process
        try:
            code = process.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # its socket failed but it runs on: stop it
            _stop(process)
            code = process.poll()
        self._connection.close()
        reason = f"the engine core process {_exit_words(code)}"
        self._death = f"{reason}; a new one is starting" if self._restart else reason
        with self._lock:
            cut = len(self._streams)
            self._outputs.clear()
            self._finish_all_streams("error", f"{reason}, so this reply was cut short")
        self._answer_asks(EngineDeadError(reason))
        log.error("%s: %d open requests ended with an error", reason, cut)
        if not self._restart:
            return False
        try:
            self._start_core()
        except EngineStartError as error:
            self._death = f"{reason}, and a new one could not start ({error})"
            log.error("%s", self._death)
            return False
        self.restarts += 1
        log.warning("a new engine core process (pid %d) is serving", self._process.pid)
        return True

    def _answer_asks(self, error: Exception) -> None:
        asks, self._asks = self._asks, {}
        for future in asks.values():
            if not future.done():
                future.set_exception(error)


def _stop(process: subprocess.Popen, grace_s: float = 0.0) -> None:
    """End the process: let it finish for `grace_s`, then terminate it, then kill it."""
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _exit_words(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed ({name})"
    return f"exited with code {code}"
