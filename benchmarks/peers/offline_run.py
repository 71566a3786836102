"""The measurement every offline peer script makes, in one place: all chats at once, then the
first chat alone, output tokens per second of each, and the report (a line, then the JSON line
compare.py reads). Standard library only: the vLLM venv imports it too.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable


def parse_args(doc: str, options: Callable[[argparse.ArgumentParser], None] | None = None,
               ) -> tuple[argparse.Namespace, dict]:
    """The command line every offline script takes, and the workload file it names; `options`
    adds a script's own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output-tokens", type=int, default=128)
    if options is not None:
        options(parser)
    args = parser.parse_args()
    with open(args.workload) as file:
        return args, json.load(file)


def measure_and_report(system: str, label: str, dtype: str, cpu: str, startup_s: float,
                       generate: Callable[[list[list[int]]], list[list[int]]], prompts: list[list[int]],
                       output_tokens: int, extra: dict | None = None) -> None:
    """`generate(prompts)` returns each prompt's generated token ids (greedy, EOS ignored);
    `extra`: more keys for the JSON line."""
    def timed(batch: list[list[int]]) -> float:
        start = time.perf_counter()
        outputs = generate(batch)
        seconds = time.perf_counter() - start
        tokens = sum(len(ids) for ids in outputs)
        assert tokens == len(batch) * output_tokens, f"{tokens} tokens generated, expected {len(batch) * output_tokens}"
        return tokens / seconds

    many = timed(prompts)
    single = timed([prompts[0]])
    print(f"{label}, {cpu}, {dtype}: start-up to first token {startup_s:.1f} s; "
          f"{len(prompts)} chats {many:.1f} tok/s; one chat {single:.1f} tok/s")
    print(json.dumps({"system": system, "dtype": dtype, "cpu": cpu, "startup_s": round(startup_s, 1),
                      "tok_s": round(many, 2), "single_tok_s": round(single, 2), "chats": len(prompts),
                      **(extra or {})}))
