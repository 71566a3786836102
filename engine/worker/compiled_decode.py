"""The engine's steps as AOTInductor-compiled graphs, built once per machine and cached: a lone
chat's decode step, and any other step of a chat server (decodes and prompt chunks together).

What a single user waits for on a CPU is one sequence's decode step, and eager torch spends a
third of it between the weight matmuls: ~900 small ops a step for a 30-layer model, each a few
microseconds of dispatch. `DecodeStep` (engine/worker/models/decode_step.py) compiled ahead of
time by AOTInductor runs the whole step as one C++ call: the small ops fused into loops, the
weight matmuls as loops over weights laid out for one row times them (`MatVec`), no library call
left. SmolLM2-135M on a 2-core AMD EPYC, the same captured step in one process: bf16 ~6 ms
(0.83-0.87 of the step with torch's matrix-vector kernel), fp32 0.76-0.92 of the step with
inductor's row-by-row loops. Every other step, a batch of decodes (the steady state of a busy
server) with or without prompt chunks beside it (each arrival's new turn), runs `FlatStep`
(engine/worker/models/flat_step.py) the same way, every new token a row of the same matmuls,
reading past K/V from the paged cache (benchmarks/mixed_step.py times it against the eager forward).

A package depends on the model's weights, the dtype, torch, the CPU's vector instructions
and this code, so it is keyed by all of them and kept under `cache_dir()/compiled`
($PAGEDCHAT_COMPILED_DIR when set). A missing one is built by a subprocess at a low priority (`python -m engine.worker.compiled_decode`,
once, in minutes: SmolLM2-135M's lone package takes ~1 min on a 2-core Zen 5 and its flat one
several, longer in fp32 on a slower CPU), then loaded by a thread (~2 s, releasing the GIL):
the engine starts as fast as without it and decodes eagerly until the graph is ready.
Built or loaded, each package holds another copy of the weights.

Loading a package runs its native code, so only a package this user's own build recorded, in a
folder nobody else can write to, is loaded (engine/worker/package_trust.py); any other is built
afresh, and in a folder others can write to nothing is built or loaded. A build runs in a process
group of its own, with a scratch folder its engine chose beside the packages: a timeout or the
engine's exit ends the whole group (the compiler's workers too) and removes what it left, and a
build whose engine was killed ends itself; the next engine removes what that one left.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.worker.cache_folders import packages_folder
from engine.worker.flat_batch import FlatSequence, flat_batch
from engine.worker.loading.model_files import resolve_model
from engine.worker.loading.model_loader import load_checkpoint
from engine.worker.models.flat_step import FlatStep
from engine.worker.models.llama import LlamaModel
from engine.worker.package_trust import digest_path, digest_problem, folder_problem, install
from engine.worker.parent_watch import end_with_parent

log = logging.getLogger(__name__)

CAPACITY_STEP = 64    # the K/V buffer grows by this many tokens; attention runs over all of it, masked
MAX_CONTEXT = 4096    # longer contexts decode eagerly (the buffer of SmolLM2 at 4,096 tokens is 190 MB in fp32)
# One package's build that takes longer is stopped (SmolLM2's lone and flat packages together
# take ~2.5 min on a 2-core Zen 5, 7-11 min in fp32 on a busy 2-core Zen 1 EPYC).
BUILD_TIMEOUT_S = 30 * 60
DTYPES = (torch.float32, torch.bfloat16)
KINDS = ("lone", "flat")  # one sequence's decode step (`DecodeStep`), any mix of decodes and prompt chunks (`FlatStep`)
BATCH_BLOCK_SIZE = 16  # the flat graph reads caches of this block size (the engine's default)
MAX_BATCH = 256       # steps of more sequences run eagerly
# What a package's graph is traced from: a change to any of these files rebuilds the packages.
_LAYERS = tuple(f"engine/worker/models/layers/{name}.py"
                for name in ("activation", "attention", "rms_norm", "rotary", "shape"))
_SOURCES = {"lone": ("engine/worker/compiled_decode.py", "engine/worker/models/decode_step.py",
                     "engine/worker/models/weights.py", "engine/worker/models/layers/matvec.py", *_LAYERS),
            "flat": ("engine/worker/compiled_decode.py", "engine/worker/models/flat_step.py",
                     "engine/worker/models/weights.py", "engine/worker/models/layers/linear.py", *_LAYERS)}
_PREFIX = {"lone": "decode", "flat": "flat-step"}


def enabled_by_default() -> bool:
    """$PAGEDCHAT_COMPILE=0 turns the compiled decode step off (the test suite does, but for its
    own tests of it)."""
    return os.environ.get("PAGEDCHAT_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


def supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the compiled step cannot run here, or None when it may (whether a package can be
    built is found out in the background: importing inductor alone takes a second)."""
    if device.type != "cpu":
        return f"it is built for CPUs (the engine runs on {device.type})"
    if dtype not in DTYPES:
        return f"it is built for float32 and bfloat16, not {dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    return None


def _check_compiler() -> None:
    from torch._inductor import config
    compiler = config.cpp.cxx[1] if isinstance(config.cpp.cxx, tuple) else config.cpp.cxx
    if shutil.which(compiler or "g++") is None:
        raise RuntimeError(f"no C++ compiler ({compiler or 'g++'}) on PATH to build it with")


def package_path(model: str | None, dtype: torch.dtype, kind: str = "lone") -> Path:
    """Where the `kind` package for `model` in `dtype` on this machine lives."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    root = Path(__file__).resolve().parents[2]
    folder = Path(resolve_model(model))
    name = folder.name
    identity = {"model": str(folder), "dtype": str(dtype), "torch": torch.__version__, "isa": str(pick_vec_isa()),
                "max_context": MAX_CONTEXT,
                "kind": kind, "code": [hashlib.sha256((root / name).read_bytes()).hexdigest() for name in _SOURCES[kind]]}
    if not folder.is_dir():  # a hub id: the revision the engine loaded is the cached snapshot's
        with contextlib.suppress(Exception):
            from huggingface_hub import try_to_load_from_cache
            config = try_to_load_from_cache(str(identity["model"]), "config.json")
            if isinstance(config, str):
                folder = Path(config).parent  # .../snapshots/<commit>
    if folder.is_dir():
        identity["snapshot"] = str(folder)
        identity["config"] = (folder / "config.json").read_text()
        identity["weights"] = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                     for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    return packages_folder() / f"{_PREFIX[kind]}-{name}-{str(dtype).removeprefix('torch.')}-{key}.pt2"


def staging_path(out: Path, pid: int) -> Path:
    """Where build process `pid` writes the package `out` before installing it."""
    return out.with_name(f"{out.stem}.{pid}.tmp.pt2")


def build(model: str | None, dtype: torch.dtype, out: Path, kind: str = "lone") -> Path:
    """Export and compile the `kind` step for `model` in `dtype` into the package `out` (written
    whole, its sha256 recorded beside it, then renamed into place: a reader never sees half a
    package)."""
    checkpoint = load_checkpoint(model, dtype)
    program = _export_flat(checkpoint, dtype) if kind == "flat" else _export_lone(checkpoint, dtype)
    del checkpoint
    # Reassociation and fused multiply-adds let the C++ compiler split a loop's running sum over
    # several registers (infinities and NaNs keep their meaning).
    configs = {"cpp.enable_unsafe_math_opt_flag": True, "cpp.enable_floating_point_contract_flag": "fast"}
    if kind == "lone":
        # A lone row's weights are frozen constants the compiler folds into the graph, in loops over
        # blocks laid out for them (`MatVec` in engine/worker/models/layers/matvec.py). An input
        # read by two loops (the q and k/v projections' normalized input, the rotated query) is
        # computed once into a buffer, not in each of them (`realize_reads_threshold`): a
        # normalized input recomputed for every block of weights made the bf16 step ~1.1x slower.
        configs.update({"freezing": True, "cpp.weight_prepack": False, "realize_reads_threshold": 1})
    else:
        # The flat step multiplies by the engine's own weights (FlatStep.constants), handed over
        # when the package is loaded: nothing is folded, and the package holds no weights.
        configs.update({"freezing": False, "aot_inductor.package_constants_in_so": False})
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(out, os.getpid())
    with torch.no_grad():
        torch._inductor.aoti_compile_and_package(program, package_path=str(staging), inductor_configs=configs)
    install(staging, out)
    # Older builds for this model, dtype and kind (other code, another torch) are never loaded
    # again; a package written elsewhere (--out) leaves its folder alone.
    if out.parent.resolve() == packages_folder().resolve():
        family = out.name.rsplit("-", 1)[0]
        for stale in out.parent.glob(f"{family}-*.pt2"):
            if stale != out and ".tmp." not in stale.name:
                stale.unlink(missing_ok=True)
                digest_path(stale).unlink(missing_ok=True)
    return out


def _export_lone(checkpoint, dtype: torch.dtype):
    from torch.export import Dim

    from engine.worker.models.decode_step import DecodeStep

    step = DecodeStep(checkpoint, dtype).eval()
    layers, kv_heads, dim = len(step.layers), step.shape.num_kv_heads, step.shape.head_dim
    example = (torch.zeros(1, dtype=torch.int64), torch.ones(1, dim, dtype=dtype), torch.zeros(1, dim, dtype=dtype),
               torch.zeros(layers, 2, kv_heads, 2 * CAPACITY_STEP, dim, dtype=dtype), torch.tensor(1))
    capacity = Dim("capacity", min=2, max=MAX_CONTEXT + CAPACITY_STEP)
    with torch.no_grad():
        return torch.export.export(step, example, dynamic_shapes=(None, None, None, {3: capacity}, None))


def _export_flat(checkpoint, dtype: torch.dtype):
    from torch.export import Dim

    step = FlatStep(LlamaModel(checkpoint, dtype, torch.device("cpu"))).eval()
    layers, kv_heads, dim, bs = len(step.layers), step.shape.num_kv_heads, step.shape.head_dim, BATCH_BLOCK_SIZE
    # any sizes, each its own: every one is dynamic
    decodes, prompt_tokens, chunks, width, decode_blocks, prompt_blocks, shared, sampled = 3, 7, 2, 5, 4, 6, 2, 4
    i64 = torch.int64
    example = (torch.zeros(decodes, dtype=i64), torch.zeros(prompt_tokens, dtype=i64),
               torch.zeros(decodes, 2, dim, dtype=dtype), torch.zeros(prompt_tokens, 2, dim, dtype=dtype),
               torch.zeros(64, layers, 2, kv_heads, bs, dim, dtype=dtype),
               torch.zeros(shared, dtype=i64), torch.zeros(shared * bs),
               torch.zeros(decodes, decode_blocks, dtype=i64), torch.zeros(decodes, decode_blocks * bs),
               torch.zeros(chunks, prompt_blocks, dtype=i64), torch.zeros(chunks, prompt_blocks * bs),
               torch.zeros(chunks, width, dtype=i64), torch.zeros(chunks, width, width),
               torch.zeros(prompt_tokens, dtype=i64), torch.zeros(sampled, dtype=i64))
    d, t = Dim("decodes", min=1, max=MAX_BATCH), Dim("prompt_tokens", min=1, max=MAX_CONTEXT)
    p, q = Dim("chunks", min=1, max=MAX_BATCH), Dim("width", min=1, max=MAX_CONTEXT)
    od, op = Dim("decode_blocks", min=1, max=MAX_CONTEXT), Dim("prompt_blocks", min=1, max=MAX_CONTEXT)
    s, r, blocks = Dim("shared", min=1, max=MAX_CONTEXT), Dim("sampled", min=1, max=2 * MAX_BATCH), Dim("blocks", min=2)
    dynamic = ({0: d}, {0: t}, {0: d}, {0: t}, {0: blocks}, {0: s}, {0: s * bs}, {0: d, 1: od}, {0: d, 1: od * bs},
               {0: p, 1: op}, {0: p, 1: op * bs}, {0: p, 1: q}, {0: p, 1: q, 2: q}, {0: t}, {0: r})
    with torch.no_grad():
        return torch.export.export(step, example, dynamic_shapes=dynamic)


@dataclass(eq=False)
class _Build:
    """A build subprocess, the leader of its own process group, and what it may leave behind."""
    process: subprocess.Popen
    scratch: Path  # inductor's cache for this build (hundreds of MB), chosen by the engine
    staging: Path  # the half-written package

    def end(self) -> None:
        """Kill the whole group (the compiler's workers with the build) and remove what it left."""
        if self.process.returncode is None:  # not reaped yet: the group's id is still its own
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        self.clean()

    def clean(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.staging.unlink(missing_ok=True)


_builds: set[_Build] = set()  # running now, ended when this process exits
_builds_lock = threading.Lock()  # held while a build starts: none starts once exiting is set
_exiting = threading.Event()


@atexit.register
def _end_builds() -> None:
    """A build outliving its engine (a one-off script, a server shut down) would compile on, orphaned."""
    with _builds_lock:
        _exiting.set()
        running = list(_builds)
    for build in running:
        build.end()


# What a build leaves in the packages folder while it runs: the scratch folder its engine made
# (named for the engine's pid) and its half-written package and digest (named for its own).
_LEFTOVER = re.compile(r"^\.scratch-(\d+)-|\.(\d+)\.tmp(\.pt2)?$")


def _sweep_leftovers(folder: Path) -> None:
    """Remove what builds left whose processes are gone (an engine killed before it could)."""
    for entry in folder.iterdir():
        match = _LEFTOVER.search(entry.name)
        if match and not _alive(int(match.group(1) or match.group(2))):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that pid
        return True
    return True


def _end_group() -> None:
    """Kill this build's process group (the compiler's workers are in it), when it has one."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpgrp(), signal.SIGKILL)


class CompiledDecode:
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
        self.paths: dict[str, Path] = {}  # by kind, found in the background (inductor's ISA check compiles a probe)
        self.error: str | None = None  # why a step is unavailable (the other may still be ready)
        self._runs: dict[str, object] = {}  # by kind, once loaded
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

    def start(self) -> CompiledDecode:
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
        except Exception:  # noqa: BLE001 - no compiler for the ISA probe: the background path says so
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
        folder = packages_folder()
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            problem = folder_problem(folder)
        except OSError as error:
            problem = f"{folder} cannot be used: {error}"
        if problem is not None:
            self.error = f"compiled packages refused: {problem}"
            log.warning("not loading or building compiled decode steps, decoding eagerly: %s", problem)
            return
        _sweep_leftovers(folder)
        # The lone step first: a single user, the common case on a quiet server, waits on it.
        for kind in self.kinds:
            try:
                path = self.paths[kind] = package_path(self.model, self.dtype, kind)
                problem = digest_problem(path) if path.exists() else None
                if problem is not None:
                    log.warning("refusing the compiled %s decode step %s: %s; building it afresh", kind, path.name,
                                problem)
                if problem is not None or not path.exists():
                    _check_compiler()
                    self._build_in_subprocess(path, kind)
                    problem = digest_problem(path)
                    if problem is not None:
                        raise RuntimeError(f"the package built was refused: {problem}")
                self.install(kind, self._load(path, kind))
                log.info("compiled %s decode step ready (%s)", kind, path.name)
            except Exception as error:  # the eager path goes on serving
                self.error = f"{kind} step: {type(error).__name__}: {error}"
                log.warning("compiled %s decode step unavailable, decoding eagerly: %s", kind, self.error)

    def _load(self, path: Path, kind: str):
        run = torch._inductor.aoti_load_package(str(path))
        if kind == "flat":  # the engine's weights themselves, not a copy: they outlive the package
            run.load_constants(FlatStep(self.decoder).constants(), check_full_update=True, user_managed=True)
        return run

    def _build_in_subprocess(self, path: Path, kind: str) -> None:
        log.info("building the compiled %s decode step (once per machine): %s", kind, path.name)
        root = Path(__file__).resolve().parents[2]
        with _builds_lock:
            if _exiting.is_set():
                raise RuntimeError("not building: this process is exiting")
            scratch = Path(tempfile.mkdtemp(prefix=f".scratch-{os.getpid()}-", dir=path.parent))
            command = [sys.executable, "-m", "engine.worker.compiled_decode", "--background", "--dtype",
                       str(self.dtype).removeprefix("torch."), "--kind", kind, "--out", str(path),
                       "--scratch", str(scratch), "--parent", str(os.getpid())]
            if self.model:
                command += ["--model", self.model]
            try:
                process = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(root)}, cwd=root,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                           start_new_session=True)
            except BaseException:
                shutil.rmtree(scratch, ignore_errors=True)
                raise
            build = _Build(process, scratch, staging_path(path, process.pid))
            _builds.add(build)
        try:
            _, stderr = process.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the build took over {BUILD_TIMEOUT_S} s and was stopped") from None
        finally:
            build.end()
            with _builds_lock:
                _builds.discard(build)
        if process.returncode != 0:
            raise RuntimeError(f"the build exited with {process.returncode}: {stderr.strip()[-2000:]}")

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
        """One step of any mix of prompt chunks and decodes (models/flat_step.py). Returns fp32
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


def lower_priority() -> None:
    """A build beside a serving engine takes what CPU the engine leaves. Its nice value alone
    does not do that where the kernel groups processes by session (autogroups: Debian's and
    Ubuntu's default): a build in a session of its own is scheduled as a group beside the engine's,
    whatever its nice value, and took a whole core from the engine's two. So the group's nice
    value is raised too."""
    os.nice(10)
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text("19")


def main() -> None:
    parser = argparse.ArgumentParser(description="Build a compiled step (a lone chat's decode, or the flat step) for a model and dtype.")
    parser.add_argument("--model", default=None, help="folder or hub id (default: $MODEL, else the embedded model)")
    parser.add_argument("--dtype", choices=[str(d).removeprefix("torch.") for d in DTYPES], default="float32")
    parser.add_argument("--kind", choices=KINDS, default="lone", help="a lone chat's decode step, or the flat step")
    parser.add_argument("--out", default=None, help="package path (default: this machine's cache entry)")
    parser.add_argument("--background", action="store_true", help="at a low priority (beside a serving engine)")
    parser.add_argument("--scratch", default=None,
                        help="folder for the compiler's own cache, which the caller removes (default: a temporary one)")
    parser.add_argument("--parent", type=int, default=None, help="end when this process (the engine) is gone")
    args = parser.parse_args()
    if args.parent is not None:
        end_with_parent(args.parent, _end_group)  # a killed engine can end nothing: its build ends itself
    if args.background:
        lower_priority()
    dtype = getattr(torch, args.dtype)
    out = Path(args.out) if args.out else package_path(args.model, dtype, args.kind)
    if not args.out:
        out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = folder_problem(out.parent)
        if problem is not None:
            sys.exit(f"not building into {out.parent}, which the engine would refuse to load from: {problem}")
        if out.exists() and digest_problem(out) is None:
            print(f"already built: {out}")
            return
    with contextlib.ExitStack() as stack:
        # inductor's own cache of the build (hundreds of MB) goes with the scratch folder
        scratch = args.scratch or stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedchat-inductor-"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = scratch
        print(f"built: {build(args.model, dtype, out, args.kind)}")


if __name__ == "__main__":
    main()
