"""Resident memory of an engine serving a GGUF file: kept quantized (native) against dequantized
to float32, beside the runtime alone, after a short decode (so every part has been touched). No
compiled decode steps in any case (a natively served model has none).

Each case runs in a fresh process that builds `LLM` with the same KV pools and generates a few
tokens, then reports its RSS (and peak RSS). The runtime is an engine on a 2-layer, 64-wide
random Llama (benchmarks/random_llama.py's random-llama-tiny): Python, torch, transformers, the
engine and its libraries, with weights of a few megabytes. The check the issue asks of the
native case: RSS <= the GGUF's size x 1.2 + the KV pools + the runtime. The pools are what the
engine allocated (its device and host caches' bytes; zero pages count in RSS only once touched).

    .venv/bin/python benchmarks/gguf_memory.py FILE.gguf [--blocks 256] [--host-blocks 16]

Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

if not __package__:  # run as a script: the repository root first (benchmarks/kernels.py shadows kernels)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.fresh_process import run_fresh  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402

MiB = 2 ** 20
BUDGET_FACTOR = 1.2  # the file, plus a fifth for what the engine keeps beside its quantized groups


def _status() -> dict[str, int]:
    fields = {}
    for line in open(f"/proc/{os.getpid()}/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def measure_case(model: str, quantization: str | None, blocks: int, host_blocks: int) -> dict:
    """In this process: the engine on `model`, a short greedy decode, then its memory."""
    from engine import LLM, SamplingParams

    options = {"quantization": quantization} if quantization else {}
    # No compiled decode steps: the native case never builds them (they would hold dense weights),
    # and for a 1B model in float32 the build alone takes many minutes and gigabytes.
    llm = LLM(model, num_gpu_blocks=blocks, num_cpu_blocks=host_blocks, compile_decode=False, **options)
    llm.generate([list(range(1000, 1064))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    runner = llm.engine.runner
    pools = runner.kv_cache.nbytes + runner.host_cache.nbytes
    core = llm.engine.core
    return {**_status(), "pools": pools, "weights_info": core.weights_info, "dtype": str(core.dtype)}


def run_case(model: str, quantization: str | None, blocks: int, host_blocks: int) -> dict:
    return run_fresh("benchmarks.gguf_memory", "measure_case", model, quantization, blocks, host_blocks,
                     timeout_s=1800, what=f"{model} ({quantization})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--blocks", type=int, default=256, help="device KV pool, in blocks of 16 tokens")
    parser.add_argument("--host-blocks", type=int, default=16)
    args = parser.parse_args()
    from benchmarks.random_llama import build_random_llama
    from engine.worker.loading.gguf_file import inspect_gguf
    from engine.worker.loading.model_loader import load_tokenizer

    info = inspect_gguf(args.file)
    with tempfile.TemporaryDirectory() as folder:
        import torch
        build_random_llama("random-llama-tiny", load_tokenizer(None), torch.float32, folder)
        runtime = run_case(folder, None, args.blocks, args.host_blocks)
    native = run_case(args.file, "native", args.blocks, args.host_blocks)
    dense = run_case(args.file, "dequantize", args.blocks, args.host_blocks)
    runtime_bytes = runtime["VmRSS"] - runtime["pools"]
    budget = info.size_bytes * BUDGET_FACTOR + native["pools"] + runtime_bytes
    cpu = cpu_model()
    print(f"Memory of an engine on {Path(args.file).name} ({info.file_type}, {info.size_bytes / MiB:.0f} MiB), "
          f"{args.blocks} + {args.host_blocks} KV blocks, on {cpu}")
    print("| case | RSS | peak RSS | KV pools | RSS less pools and runtime |")
    print("|---|---|---|---|---|")
    for name, case in (("runtime (tiny random Llama)", runtime), ("native (quantized)", native),
                       ("dequantized (float32)", dense)):
        rest = case["VmRSS"] - case["pools"] - (runtime_bytes if case is not runtime else 0)
        print(f"| {name} | {case['VmRSS'] / MiB:.0f} MiB | {case['VmHWM'] / MiB:.0f} MiB | {case['pools'] / MiB:.0f} MiB "
              f"| {rest / MiB:.0f} MiB |")
    print(f"budget: GGUF x {BUDGET_FACTOR} + pools + runtime = {budget / MiB:.0f} MiB; native RSS {native['VmRSS'] / MiB:.0f} MiB: "
          f"{'within' if native['VmRSS'] <= budget else 'OVER'}")
    print(json.dumps({"benchmark": "gguf_memory", "cpu": cpu, "file": Path(args.file).name, "type": info.file_type,
                      "gguf_bytes": info.size_bytes, "runtime_rss": runtime_bytes, "native": native, "dequantized": dense,
                      "budget": int(budget), "within_budget": native["VmRSS"] <= budget}))


if __name__ == "__main__":
    main()
