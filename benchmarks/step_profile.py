"""Where one chat's decode step goes: wall time per generated token in each part of the engine.

One chat (a ~300-token system prompt and a question, the chat template applied), greedy, EOS
ignored, on the embedded SmolLM2-135M-Instruct by default. Each part is timed by wrapping it:
`LLMEngine.step`, the scheduler's `schedule` and `update`, the model's `forward`, every weight
matmul (`Linear.__call__`, `QuantizedLinear.__call__`), `kernels.paged_attention`, `kernels.store_kv`, RMSNorm, rotary, and
sampling. Parts nest (the forward holds the matmuls), so they do not add up to the step.

    .venv/bin/python benchmarks/step_profile.py [--dtype float32|bfloat16] [--tokens 128] [--chats 1] [--ops 25]

`--ops N` then runs the same chats once more under torch.profiler over ten decode steps in the
middle of the reply, and prints the N ops with the most self time per step, by input shape: which
matmul, gather or small op a change should go after.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import time
from pathlib import Path

# Import from the repository root, not this folder: benchmarks/kernels.py would shadow the package
# `kernels` that the engine imports.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from benchmarks.machine import cpu_model  # noqa: E402


def timed(totals: dict[str, float], key: str, function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--chats", type=int, default=1)
    parser.add_argument("--quantization", default="auto", choices=("auto", "native", "dequantize"),
                        help="for a GGUF file: its weights kept quantized (native) or not")
    parser.add_argument("--ops", type=int, default=0, help="print the top N aten ops of ten profiled steps")
    args = parser.parse_args()

    import kernels
    from engine import LLM, SamplingParams
    from engine.worker.models import llama
    from engine.worker.models.layers import linear, quantized_linear, rms_norm
    from ui.panel.load_generator import LOAD_SYSTEM_PROMPT, QUESTIONS

    # The eager forward is what is profiled: a lone chat's steps must not bypass it (engine/worker/compiled/).
    llm = LLM(args.model, dtype=args.dtype, num_gpu_blocks=1024, num_cpu_blocks=16, compile_decode=False,
              quantization=args.quantization)
    engine = llm.engine
    totals: dict[str, float] = collections.defaultdict(float)
    engine.step = timed(totals, "step", engine.step)
    engine.scheduler.schedule = timed(totals, "schedule", engine.scheduler.schedule)
    engine.scheduler.update = timed(totals, "update", engine.scheduler.update)
    engine.runner.model.forward = timed(totals, "forward", engine.runner.model.forward)
    engine.runner._sample = timed(totals, "sampling", engine.runner._sample)
    kernels.paged_attention = timed(totals, "attention", kernels.paged_attention)
    kernels.store_kv = timed(totals, "store K/V", kernels.store_kv)
    rms_norm.RMSNorm.__call__ = timed(totals, "RMSNorm", rms_norm.RMSNorm.__call__)
    llama.rotate = timed(totals, "rotary", llama.rotate)
    linear.Linear.__call__ = timed(totals, "weight matmuls", linear.Linear.__call__)
    quantized_linear.QuantizedLinear.__call__ = timed(totals, "weight matmuls",
                                                      quantized_linear.QuantizedLinear.__call__)

    chats = [[{"role": "system", "content": LOAD_SYSTEM_PROMPT[:1200]},
              {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(args.chats)]
    llm.chat(chats, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    totals.clear()
    start = time.perf_counter()
    llm.chat(chats, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
    elapsed = time.perf_counter() - start
    steps = args.tokens  # one token per chat per step (after the prompt's)

    print(f"{cpu_model()}, {args.dtype}, {args.chats} chat(s), {args.tokens} tokens each: "
          f"{args.chats * args.tokens / elapsed:.1f} tok/s, {1000 * elapsed / steps:.1f} ms per step")
    print(f"{'part':<16} {'ms per step':>12}")
    for key, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"{key:<16} {1000 * seconds / steps:>12.2f}")
    summary = {"cpu": cpu_model(), "dtype": args.dtype, "chats": args.chats, "tokens": args.tokens,
               "tok_s": round(args.chats * args.tokens / elapsed, 2),
               "ms_per_step": {key: round(1000 * value / steps, 2) for key, value in totals.items()}}
    if args.ops:
        print_top_ops(llm, chats, args.tokens, args.ops)
    print(json.dumps(summary))


def print_top_ops(llm, chats, tokens: int, top: int, steps: int = 10) -> None:
    """Ten decode steps from the middle of a reply under torch.profiler: self CPU time per step
    of the `top` costliest ops, by input shape."""
    import torch
    from engine import SamplingParams

    engine, count = llm.engine, [0]
    first = max(2, tokens // 2 - steps // 2)
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
    step = engine.step

    def profiled_step():
        count[0] += 1
        if count[0] == first:
            profiler.start()
        try:
            return step()
        finally:
            if count[0] == first + steps - 1:
                profiler.stop()

    engine.step = profiled_step
    try:
        llm.chat(chats, SamplingParams(temperature=0, max_tokens=max(tokens, first + steps), ignore_eos=True))
    finally:
        engine.step = step
    rows = sorted(profiler.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)[:top]
    print(f"\n{'op':<34} {'us per step':>11} {'calls':>6}  input shapes")
    for event in rows:
        print(f"{event.key[:34]:<34} {event.self_cpu_time_total / steps:>11.0f} {event.count // steps:>6}  "
              f"{str(event.input_shapes)[:90]}")


if __name__ == "__main__":
    main()
