"""One chat's decode rate on a GGUF file kept quantized (quantization="native") against our own
dense decode of the same model (a transformers folder, bf16 and fp32), the prompt already in the
prefix cache, so the figure is decode alone. Compiled decode steps off for every case (a natively
served model has none; building them for a 1B model takes many minutes).

    .venv/bin/python benchmarks/gguf_decode.py FILE.gguf FOLDER [--tokens 33]

`benchmarks/peers/gguf_models.py` makes the random 1B's Q4_K_M file and its folder. Prints a
table, then one JSON line.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

if not __package__:  # run as a script: the repository root first (benchmarks/kernels.py shadows kernels)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.machine import cpu_model  # noqa: E402

PROMPT = list(range(1000, 1235))  # the peers' workload's prompt length


def decode_rate(model: str, tokens: int, rounds: int = 2, **options) -> float:
    from engine import LLM, SamplingParams

    llm = LLM(model, compile_decode=False, num_gpu_blocks=64, num_cpu_blocks=8, **options)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))  # the prompt into the prefix cache
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    best = 0.0
    for _ in range(rounds):
        started = time.perf_counter()
        llm.generate([PROMPT], params)
        best = max(best, tokens / (time.perf_counter() - started))
    del llm
    gc.collect()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("folder")
    parser.add_argument("--tokens", type=int, default=33)
    args = parser.parse_args()
    rates = {"native": decode_rate(args.file, args.tokens, quantization="native"),
             "dense bfloat16": decode_rate(args.folder, args.tokens, dtype="bfloat16"),
             "dense float32": decode_rate(args.folder, args.tokens, dtype="float32")}
    cpu = cpu_model()
    print(f"One chat's decode, {args.tokens} tokens, prompt cached, best of 2, on {cpu}")
    print("| weights | tok/s | native / this |")
    print("|---|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.2f} | {rates['native'] / rate:.2f}x |")
    print(json.dumps({"benchmark": "gguf_decode", "cpu": cpu, "file": Path(args.file).name, "tokens": args.tokens,
                      "tok_s": {k: round(v, 2) for k, v in rates.items()},
                      "native_over_dense_bf16": round(rates["native"] / rates["dense bfloat16"], 2)}))


if __name__ == "__main__":
    main()
