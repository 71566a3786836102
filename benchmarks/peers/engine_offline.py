"""PagedChat's engine on the peers' workload file, measured as `vllm_offline.py` measures vLLM:
start-up to first token (from process start: imports, weights, first step), then all chats at
once, then one chat alone; greedy, EOS ignored, token ids as given.

    .venv/bin/python benchmarks/peers/engine_offline.py /tmp/workload.json [--dtype bfloat16]
"""
from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root (benchmarks/kernels.py shadows kernels)

from benchmarks.machine import cpu_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output-tokens", type=int, default=128)
    args = parser.parse_args()
    prompts = json.loads(Path(args.workload).read_text())["prompts"]

    from engine import LLM, SamplingParams

    llm = LLM(None, dtype=args.dtype)
    llm.generate([prompts[-1]], SamplingParams(temperature=0, max_tokens=1))
    startup = time.perf_counter() - STARTED
    greedy = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)

    def timed(batch: list[list[int]]) -> float:
        start = time.perf_counter()
        outputs = llm.generate(batch, greedy)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert tokens == len(batch) * args.output_tokens, f"{tokens} tokens generated"
        return tokens / seconds

    many = timed(prompts)
    single = timed([prompts[0]])
    print(f"PagedChat engine, {cpu_model()}, {args.dtype}: start-up to first token {startup:.1f} s; "
          f"{len(prompts)} chats {many:.1f} tok/s; one chat {single:.1f} tok/s")
    print(json.dumps({"system": "engine", "dtype": args.dtype, "cpu": cpu_model(), "startup_s": round(startup, 1),
                      "tok_s": round(many, 2), "single_tok_s": round(single, 2), "chats": len(prompts)}))


if __name__ == "__main__":
    main()
