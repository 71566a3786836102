"""Memory of an engine serving a dense model (a transformers folder, or the embedded default):
the serving process's RSS growth from `import engine` to a loaded engine with its compiled steps
loaded and one reply done, against the bytes of its weights in the dtype it runs.

Each case runs in a fresh process: RSS is sampled every 20 ms on a thread from just after `import
engine`; the engine is built with small KV pools (64 + 16 blocks, so the pools are a few MB and
are subtracted anyway), its compiled steps are loaded before any request as a server's engine
core loads them (built beforehand by processes of their own, not counted), one 32-token reply is
generated, and `malloc_trim` returns the allocator's free pages. Reported, less the pools: the
peak growth and the resident growth after the reply, each over the weights' bytes, and where the
resident memory is (anonymous, or file pages mapped: the safetensors file, a compiled package);
then the same less the runtime (the same measure of an engine on a 2-layer, 64-wide random Llama
with its compiled steps: Python, torch, the compiler's runtime, the engine's libraries).

    .venv/bin/python benchmarks/dense_memory.py [--model FOLDER] [--dtype float32,bfloat16] [--no-compile]

Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

if not __package__:  # run as a script: the repository root first (benchmarks/kernels.py shadows kernels)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.fresh_process import run_fresh  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402

MiB = 2 ** 20
SAMPLE_S = 0.02


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _mapped() -> dict[str, int]:
    """Resident bytes by what they map: anonymous memory, or a file's name."""
    by: dict[str, int] = {}
    name = "anonymous"
    with open(f"/proc/{os.getpid()}/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=6)
            if "-" in first[0] and len(first) >= 5 and ":" in first[3]:  # a mapping's header line
                path = first[5].strip() if len(first) > 5 else ""
                name = Path(path).name if path.startswith("/") else "anonymous"
            elif line.startswith("Rss:"):
                by[name] = by.get(name, 0) + int(line.split()[1]) * 1024
    return by


def measure_case(model: str | None, dtype: str, compile_decode: bool) -> dict:
    """In this process: RSS from here (engine imported) to an engine with its compiled steps
    loaded and one reply done."""
    import ctypes
    import threading

    import engine  # noqa: F401 - the baseline includes the engine's own imports

    baseline = _rss()
    peak = [baseline]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(SAMPLE_S):
            peak[0] = max(peak[0], _rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    from engine import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, num_gpu_blocks=64, num_cpu_blocks=16, compile_decode=compile_decode)
    core = llm.engine.core
    compiled = None
    if core.compiled is not None:
        core.load_compiled_steps_if_built()  # as a server's core does before its first request
        compiled = core.compiled.ready and core.compiled.flat_ready
        if not compiled:
            raise RuntimeError(f"the compiled steps did not load: {core.compiled.error}")
    loaded = _rss()
    llm.generate([list(range(1000, 1040))], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    stop.set()
    sampler.join()
    resident = _rss()
    peak[0] = max(peak[0], resident)
    runner = llm.engine.runner
    pools = runner.kv_cache.nbytes + runner.host_cache.nbytes
    weights = sum(t.numel() * t.element_size() for t in _parameters(core.model))
    top = sorted(_mapped().items(), key=lambda item: -item[1])[:6]
    return {"dtype": str(core.dtype).removeprefix("torch."), "parameters": core.model.num_parameters,
            "weights_bytes": core.model.num_parameters * core.dtype.itemsize, "tensor_bytes": weights,
            "pools": pools, "baseline_rss": baseline, "peak_growth": peak[0] - baseline - pools,
            "loaded_growth": loaded - baseline - pools, "resident_growth": resident - baseline - pools,
            "compiled": compiled, "compiled_state": core.config.compiled_steps,
            "mapped_top": {name: size for name, size in top}}


def _parameters(model) -> list:
    """The distinct tensors the decoder holds (a tensor reached twice counts once)."""
    import torch

    seen, tensors = set(), []
    stack = [model]
    visited = set()
    while stack:
        obj = stack.pop()
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            key = (obj.untyped_storage().data_ptr() if not obj.is_mkldnn else id(obj))
            if key not in seen:
                seen.add(key)
                tensors.append(obj)
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("engine."):
            stack.extend(vars(obj).values())
    return tensors


def run_case(model: str | None, dtype: str, compile_decode: bool) -> dict:
    if compile_decode:  # built beforehand, by processes of their own (what a build costs is not counted)
        for kind in ("lone", "flat"):
            subprocess.run([sys.executable, "-m", "engine.worker.compiled", "--kind", kind, "--dtype", dtype,
                            *(["--model", model] if model else [])], check=True, capture_output=True, timeout=7200)
    return run_fresh("benchmarks.dense_memory", "measure_case", model, dtype, compile_decode, what=f"{model} ({dtype})")


def runtime_model() -> Path:
    """The 2-layer random Llama, made once and kept (its compiled packages are keyed by its files)."""
    from benchmarks.random_llama import build_random_llama
    from engine.worker.cache_folders import cache_dir

    folder = cache_dir() / "bench-models" / "random-llama-tiny"
    if not (folder / "config.json").exists():
        import torch

        from engine.worker.loading.model_loader import load_tokenizer
        build_random_llama("random-llama-tiny", load_tokenizer(None), torch.float32, str(folder))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder or hub id (default: the embedded one)")
    parser.add_argument("--dtype", default="float32,bfloat16", help="dtypes to run, comma-separated")
    parser.add_argument("--no-compile", action="store_true", help="without the compiled steps")
    args = parser.parse_args()
    cpu = cpu_model()
    cases = {dtype: run_case(args.model, dtype, not args.no_compile) for dtype in args.dtype.split(",")}
    # The runtime: the same engine on a 2-layer, 64-wide random Llama (weights of a few MB), its
    # compiled steps too: Python, torch, the compiler's runtime, the engine and its libraries.
    tiny = runtime_model()
    runtime = {dtype: run_case(str(tiny), dtype, not args.no_compile) for dtype in cases}
    for dtype, case in cases.items():
        case["runtime"] = runtime[dtype]["resident_growth"]
        case["resident_less_runtime"] = case["resident_growth"] - case["runtime"]
        case["peak_less_runtime"] = case["peak_growth"] - case["runtime"]
    print(f"Memory of an engine on {args.model or 'the embedded model'}, 64 + 16 KV blocks, on {cpu}")
    print("| dtype | weights | peak growth | after load | after a reply | runtime | peak / resident less runtime "
          "| largest mappings |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, case in cases.items():
        w = case["weights_bytes"]
        mapped = ", ".join(f"{name} {size / MiB:.0f}" for name, size in case["mapped_top"].items())
        print(f"| {dtype} | {w / MiB:.0f} MiB | {case['peak_growth'] / MiB:.0f} MiB ({case['peak_growth'] / w:.2f}x) "
              f"| {case['loaded_growth'] / MiB:.0f} MiB | {case['resident_growth'] / MiB:.0f} MiB "
              f"({case['resident_growth'] / w:.2f}x) | {case['runtime'] / MiB:.0f} MiB "
              f"| {case['peak_less_runtime'] / w:.2f}x / {case['resident_less_runtime'] / w:.2f}x | {mapped} |")
    print(f"pools ({next(iter(cases.values()))['pools'] / MiB:.0f} MiB) subtracted everywhere; compiled steps: "
          f"{next(iter(cases.values()))['compiled_state']}")
    print(json.dumps({"benchmark": "dense_memory", "cpu": cpu, "model": args.model, "cases": cases}))


if __name__ == "__main__":
    main()
