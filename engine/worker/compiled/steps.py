"""The engine's steps as AOTInductor-compiled graphs, built once per machine and cached: a lone
chat's decode step, and any other step of a chat server (decodes and prompt chunks together).

What a single user waits for on a CPU is one sequence's decode step, and eager torch spends much
of it between the weight matmuls: hundreds of small ops a step, each microseconds of dispatch.
`LoneStep` (engine/worker/compiled/lone_step.py) compiled ahead of time runs the whole step as
one C++ call: the small ops fused into loops, each weight matmul one call into packed_rows.c over
the engine's own packed weight (or, where oneDNN lays it out otherwise, a loop over a copy laid
out for one row, `MatVec`, made when the package loads). Every other step,
a batch of decodes with or without prompt chunks beside it (each arrival's new turn), runs
`FlatStep` (engine/worker/compiled/flat_step.py) the same way, every new token a row of the same
matmuls, reading past K/V from the paged cache and multiplying by the engine's own weights. Both
packages are built without weights and handed them when they load: they hold none.

A missing package is built by a supervised process at a low priority (builds.py), once, in
minutes; a thread loads it, and the engine decodes eagerly until it is ready. Loading a package
runs its native code, so only a package this user's own build recorded, in a folder nobody else
can write to, is loaded (engine/worker/package_trust.py); any other is built afresh, and in a
folder others can write to nothing is built or loaded.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

from engine.worker import cpu_binding
from engine.worker.cache_folders import packages_folder
from engine.worker.compiled.builds import build_in_subprocess, sweep_leftovers
from engine.worker.compiled.package_key import package_path, retired_packages
from engine.worker.compiled.shapes import CAPACITY_STEP, DTYPES, KINDS
from engine.worker.flat_batch import FlatSequence, flat_batch
from engine.worker.host_allocator import release_freed_memory
from engine.worker.compiled.flat_step import FlatStep
from engine.worker.compiled.loaded_package import LoadedPackage
from engine.worker.compiled.lone_step import LoneStep
from engine.worker.models.layers.packed_rows import load_library
from engine.worker.models.llama import LlamaModel
from engine.worker.package_trust import digest_path, digest_problem, folder_problem

log = logging.getLogger(__name__)


def enabled_by_default() -> bool:
    """$PAGEDCHAT_COMPILE=0 turns the compiled steps off (the test suite does, but for its
    own tests of it)."""
    return os.environ.get("PAGEDCHAT_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


def supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the compiled step cannot run here, or None when it may (whether a package can be
    built is found out in the background, by building it)."""
    if device.type != "cpu":
        return f"it is built for CPUs (the engine runs on {device.type})"
    if dtype not in DTYPES:
        return f"it is built for float32 and bfloat16, not {dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    return None


def _check_compiler() -> None:
    # The compiler inductor builds with: $CXX, else its platform's default (torch._inductor.config.cpp.cxx).
    compiler = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler}) on PATH to build it with")


class CompiledSteps:
    """The compiled steps for one engine, built or loaded in the background. `decode` runs a lone
    sequence's steps, keeping that sequence's K/V of every layer in one buffer from step to step
    (the paged cache gets each new token too, for the steps to come); `run_flat` runs any other
    step on the paged cache."""

    def __init__(self, model: str | None, dtype: torch.dtype, decoder: LlamaModel,
                 kinds: tuple[str, ...] = KINDS) -> None:
        """`kinds`: the steps to build and load (an engine wants both; a benchmark of one step
        need not build the other)."""
        unknown = set(kinds) - set(KINDS)
        if unknown or not kinds:
            raise ValueError(f"kinds must be some of {KINDS}, not {kinds}")
        self.model, self.dtype, self.decoder, self.kinds = model, dtype, decoder, kinds
        self.paths: dict[str, Path] = {}  # by kind, found in the background
        self.error: str | None = None  # why a step is unavailable (the other may still be ready)
        self._runs: dict[str, object] = {}  # by kind, once loaded
        self._constants: dict[str, dict[str, torch.Tensor]] = {}  # by kind: the weights its package runs on
        self._buffer: torch.Tensor | None = None  # [layers, 2, kv_heads, capacity, head_dim]
        self._blocks: list[int] = []
        self._filled = 0
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        """The lone-chat step is loaded."""
        return "lone" in self._runs

    @property
    def flat_ready(self) -> bool:
        return "flat" in self._runs

    def install(self, kind: str, run) -> None:
        """Serve `kind` steps with `run`: what `_prepare` does with a loaded package (a test may
        give the torch module a package is compiled from)."""
        self._runs[kind] = run

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def settled(self) -> bool:
        """Started, and every step of `kinds` is loaded or known to be unavailable: nothing more
        will change."""
        return self._thread is not None and not self._thread.is_alive()

    def start(self) -> CompiledSteps:
        """Build (when missing) and load in the background. The engine calls this after its first
        step, so that loading (~2 s of copying weights) never delays a first token."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._prepare, name="compiled-decode", daemon=True)
            self._thread.start()
        return self

    def all_built(self) -> bool:
        """Every step of `kinds` has a package here whose build recorded its digest: loading is
        all that is left (seconds), no build (minutes)."""
        try:
            paths = [package_path(self.model, self.dtype, kind) for kind in self.kinds]
        except Exception:  # noqa: BLE001 - no key for the model (its files unreadable): the background path says so
            return False
        return all(path.exists() and digest_problem(path) is None for path in paths)

    def wait(self, timeout: float | None = None) -> bool:
        """Start if not started, then block until every step of `kinds` is ready (True) or one
        failed or `timeout` passed (False)."""
        self.start()._thread.join(timeout)
        return all(kind in self._runs for kind in self.kinds)

    def _prepare(self) -> None:
        with contextlib.suppress(OSError):  # this thread only: the serving thread keeps its priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        cpu_binding.release_this_thread()  # not a compute thread, nor are the builds it starts
        folder = packages_folder()
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            problem = folder_problem(folder)
        except OSError as error:
            problem = f"{folder} cannot be used: {error}"
        if problem is not None:
            self.error = f"compiled packages refused: {problem}"
            log.warning("not loading or building compiled steps, running eagerly: %s", problem)
            return
        sweep_leftovers(folder)
        for retired in retired_packages(folder):
            retired.unlink(missing_ok=True)
            digest_path(retired).unlink(missing_ok=True)
        # The lone step first: a single user, the common case on a quiet server, waits on it.
        for kind in self.kinds:
            try:
                path = self.paths[kind] = package_path(self.model, self.dtype, kind)
                problem = digest_problem(path) if path.exists() else None
                if problem is not None:
                    log.warning("refusing the compiled %s step %s: %s; building it afresh", kind, path.name,
                                problem)
                if problem is not None or not path.exists():
                    _check_compiler()
                    build_in_subprocess(self.model, self.dtype, kind, path)
                    problem = digest_problem(path)
                    if problem is not None:
                        raise RuntimeError(f"the package built was refused: {problem}")
                self.install(kind, self._load(path, kind))
                log.info("compiled %s step ready (%s)", kind, path.name)
            except Exception as error:  # the eager path goes on serving
                self.error = f"{kind} step: {type(error).__name__}: {error}"
                log.warning("compiled %s step unavailable, running eagerly: %s", kind, self.error)
        # What loading freed (any matrix unpacked for `MatVec`'s layout, the packages' own
        # loading) back to the kernel: the engine keeps freed memory otherwise (host_allocator.py).
        release_freed_memory()

    def _load(self, path: Path, kind: str) -> LoadedPackage:
        if kind == "lone":
            load_library()  # the C shim its products on packed weights call
        run = LoadedPackage(path)
        # The engine's weights themselves (the lone step's read in place, or laid out anew where
        # they cannot be): kept by this object as long as the package runs on them.
        step = FlatStep(self.decoder) if kind == "flat" else LoneStep(self.decoder)
        self._constants[kind] = step.constants()
        run.load_constants(self._constants[kind], check_full_update=True, user_managed=True)
        return run

    def forget(self) -> None:
        """Drop the kept K/V: another path wrote to the cache, blocks moved, or nothing is left to run."""
        self._buffer, self._blocks, self._filled = None, [], 0

    def decode(self, token: int, position: int, blocks: list[int], length: int, kv_cache: torch.Tensor,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of a sequence whose context, this token included, is `length` tokens
        in `blocks` of the paged cache. Returns fp32 logits `[1, vocab]` and their argmax `[1]`;
        stores the token's K/V in the cache's slot for position `length - 1`."""
        past = length - 1
        # The buffer goes on from the last call when it holds this context's first `past` tokens
        # from the same blocks: the caller forgets it whenever anything else may have written
        # those blocks (an eager step, a swap, a copy). It holds more than `past` only when the
        # same step runs again, as benchmarks/forward_ab.py replays one.
        if not (self._buffer is not None and self._filled >= past and self._blocks == blocks[:len(self._blocks)]):
            self._gather(blocks, past, kv_cache, block_size)
        elif length > self._buffer.shape[3]:
            grown = self._buffer.new_zeros((*self._buffer.shape[:3], self._capacity(length), self._buffer.shape[4]))
            grown[:, :, :, :past].copy_(self._buffer[:, :, :, :past])
            self._buffer = grown
        cos_sin = self.decoder.rotary.table[position]
        logits, new_kv, best = self._runs["lone"](torch.tensor([token]), cos_sin[0:1], cos_sin[1:2], self._buffer,
                                         torch.tensor(past))
        self._buffer[:, :, :, past].copy_(new_kv)
        kv_cache[blocks[past // block_size], :, :, :, past % block_size].copy_(new_kv)
        self._blocks, self._filled = list(blocks), max(self._filled, length)
        return logits, best

    def run_flat(self, sequences: list[FlatSequence], kv_cache: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of any mix of prompt chunks and decodes (compiled/flat_step.py). Returns fp32
        logits and their argmax for each sequence that samples, in the order given; stores every
        new token's K/V in the cache."""
        batch = flat_batch(sequences, block_size, self.decoder.rotary.table)
        logits, new_kv, best = self._runs["flat"](*batch.arguments(kv_cache))
        kv_cache[batch.blocks, :, :, :, batch.offsets] = new_kv[batch.stored_rows]
        return logits, best

    @staticmethod
    def _capacity(length: int) -> int:
        return -(-length // CAPACITY_STEP) * CAPACITY_STEP

    def _gather(self, blocks: list[int], past: int, kv_cache: torch.Tensor, block_size: int) -> None:
        used = -(-past // block_size)
        held = kv_cache[torch.tensor(blocks[:used], dtype=torch.int64)]  # [used, layers, 2, kv_heads, block, dim]
        layers, _, kv_heads, _, dim = held.shape[1:]
        # Zeros, not garbage, past the context: masked scores are -inf, but a NaN would still spread.
        self._buffer = kv_cache.new_zeros((layers, 2, kv_heads, self._capacity(past + 1), dim))
        self._buffer[:, :, :, :past].copy_(held.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, kv_heads, -1, dim)[
            :, :, :, :past])
        self._blocks, self._filled = blocks[:used], past
