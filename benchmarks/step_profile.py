"""Where one chat's decode step goes: wall time per generated token in each part of the engine.

One chat (a ~300-token system prompt and a question, the chat template applied), greedy, EOS
ignored, on the embedded SmolLM2-135M-Instruct by default. Each part is timed by wrapping it:
`LLMEngine.step`, the scheduler's `schedule` and `update`, the model's `forward`, every weight
matmul (`Linear.__call__`), `kernels.paged_attention`, `kernels.store_kv`, RMSNorm, rotary, and
sampling. Parts nest (the forward holds the matmuls), so they do not add up to the step.

    .venv/bin/python benchmarks/step_profile.py [--dtype float32|bfloat16] [--tokens 128] [--chats 1]
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
    args = parser.parse_args()

    import kernels
    from engine import LLM, SamplingParams
    from engine.worker.models import linear, llama, rms_norm
    from ui.panel.load_generator import LOAD_SYSTEM_PROMPT, QUESTIONS

    llm = LLM(args.model, dtype=args.dtype, num_gpu_blocks=1024, num_cpu_blocks=16)
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
    llama._rotate_ = timed(totals, "rotary", llama._rotate_)
    linear.Linear.__call__ = timed(totals, "weight matmuls", linear.Linear.__call__)

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
    print(json.dumps({"cpu": cpu_model(), "dtype": args.dtype, "chats": args.chats, "tokens": args.tokens,
                      "tok_s": round(args.chats * args.tokens / elapsed, 2),
                      "ms_per_step": {key: round(1000 * value / steps, 2) for key, value in totals.items()}}))


if __name__ == "__main__":
    main()
