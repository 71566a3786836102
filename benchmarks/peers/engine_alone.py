"""The engine offline on one chat, as `make bench-serve` compares its served figures with: the
trace's first chat (benchmarks/serve.py's, its sampling: temperature 0.7, EOS ignored), run to
`--tokens` new tokens by `LLMEngine.step()` directly, with the compiled decode steps ready. Reports
tokens per second after the first token (as a streaming client measures it) and the median step
time of its decode steps, the medians of `--rounds` rounds; one JSON line at the end.

    .venv/bin/python benchmarks/peers/engine_alone.py [--dtype float32] [--tokens 300] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[0] = str(ROOT)  # the repository root (benchmarks/kernels.py shadows kernels)

import kernels  # noqa: E402,F401  (first: benchmarks/serve.py puts benchmarks/ ahead on the path)
from benchmarks.machine import cpu_model  # noqa: E402
from benchmarks.serve import TEMPERATURE, Chats  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from engine import LLMEngine, SamplingParams

    engine = LLMEngine(args.model, dtype=args.dtype)
    messages = Chats(random.Random(args.seed)).next_chat().messages
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=args.tokens, ignore_eos=True)

    def one_round(tokens: int) -> tuple[float, float]:
        engine.add_request(f"alone-{time.monotonic_ns()}", messages, params)
        first_at, steps = None, []
        while engine.has_unfinished():
            started = time.perf_counter()
            deltas = engine.step()
            now = time.perf_counter()
            if first_at is None and any(d.token_ids for d in deltas):
                first_at = now
            elif first_at is not None:
                steps.append(now - started)
        return (tokens - 1) / (now - first_at), statistics.median(steps)

    one_round(8)  # the first step starts the compiled steps' loading
    compiled = engine.compiled
    if compiled is not None and not compiled.wait():
        print(f"no compiled decode step: {compiled.error}", file=sys.stderr)
    rounds = [one_round(args.tokens) for _ in range(args.rounds)]
    tok_s = statistics.median(r[0] for r in rounds)
    step_ms = 1000 * statistics.median(r[1] for r in rounds)
    print(f"engine offline, one chat of {args.tokens} tokens, {cpu_model()}, {engine.dtype}: {tok_s:.1f} tok/s, "
          f"decode step {step_ms:.2f} ms (rounds: {', '.join(f'{r[0]:.1f}' for r in rounds)})")
    print(json.dumps({"system": "engine_offline", "cpu": cpu_model(), "dtype": str(engine.dtype).removeprefix("torch."),
                      "tokens": args.tokens, "tok_s": round(tok_s, 1), "step_ms": round(step_ms, 2),
                      "rounds_tok_s": [round(r[0], 1) for r in rounds],
                      "compiled": bool(compiled is not None and compiled.ready)}))


if __name__ == "__main__":
    main()
