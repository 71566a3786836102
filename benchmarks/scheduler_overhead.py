"""Scheduler overhead: wall time of one `schedule()` + `update()` with 256 running requests of
1-2k tokens each, the model replaced by pre-sampled tokens. Goal: under 1 ms per step.

    .venv/bin/python benchmarks/scheduler_overhead.py [--steps 300] [--requests 256]

Prints a table, then one JSON line of the figures.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from engine import Request, SamplingParams, Scheduler, SchedulerConfig
from engine.devtools.simulated_runner import SimulatedRunner

GOAL_MS = 1.0


def build(num_requests: int, prompt_lens: list[int], num_device_blocks: int, caching: bool, mode: str,
          seed: int) -> tuple[Scheduler, SimulatedRunner]:
    config = SchedulerConfig(num_device_blocks=num_device_blocks, num_host_blocks=num_device_blocks, block_size=16,
                             max_num_seqs=num_requests, max_num_batched_tokens=8192,
                             enable_prefix_caching=caching, preemption_mode=mode)
    scheduler = Scheduler(config)
    rng = random.Random(seed)
    for i, length in enumerate(prompt_lens):
        prompt = [rng.randrange(1, 32000) for _ in range(length)]
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=100_000, ignore_eos=True)))
    return scheduler, SimulatedRunner(config, verify=False)


def measure(scheduler: Scheduler, runner: SimulatedRunner, steps: int) -> dict:
    # Prefill everything first (untimed), so the timed steps are the steady state of decoding.
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        out = scheduler.schedule()
        scheduler.update(out, runner.execute(out))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        sampled = runner.execute(out)  # the "model": untimed
        t2 = time.perf_counter()
        scheduler.update(out, sampled)
        t3 = time.perf_counter()
        times.append(((t1 - t0) + (t3 - t2)) * 1e3)
    times.sort()
    stats = scheduler.last_stats
    return {"ms_mean": statistics.fmean(times), "ms_p50": times[len(times) // 2],
            "ms_p99": times[int(len(times) * 0.99) - 1], "running": stats.num_running,
            "preemptions": stats.num_preemptions_swap + stats.num_preemptions_recompute}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    lens = [rng.randint(1024, 2048) for _ in range(args.requests)]
    roomy = sum(-(-(n + args.steps + 128) // 16) for n in lens)  # + tokens decoded during prefill
    tight = sum(-(-(n + 96) // 16) for n in lens)  # fills up partway through the timed steps
    cases = [
        ("decode, prefix caching on", dict(num_device_blocks=roomy, caching=True, mode="auto")),
        ("decode, prefix caching off", dict(num_device_blocks=roomy, caching=False, mode="auto")),
        ("decode under memory pressure (swap)", dict(num_device_blocks=tight, caching=True, mode="swap")),
    ]
    rows = {}
    print(f"{args.requests} running requests, prompts 1024-2048 tokens, {args.steps} timed steps each\n")
    print(f"{'case':<38} {'mean ms':>8} {'p50 ms':>8} {'p99 ms':>8} {'running':>8} {'preempt':>8} {'vs goal':>8}")
    for name, kwargs in cases:
        scheduler, runner = build(args.requests, lens, seed=args.seed, **kwargs)
        r = measure(scheduler, runner, args.steps)
        rows[name] = r
        print(f"{name:<38} {r['ms_mean']:8.3f} {r['ms_p50']:8.3f} {r['ms_p99']:8.3f} {r['running']:8d} "
              f"{r['preemptions']:8d} {r['ms_mean'] / GOAL_MS:7.2f}x")
    head = rows[cases[0][0]]
    print(json.dumps({"ms_per_step": round(head["ms_mean"], 4), "ms_p99": round(head["ms_p99"], 4),
                      "ms_per_step_no_caching": round(rows[cases[1][0]]["ms_mean"], 4),
                      "ms_per_step_memory_pressure": round(rows[cases[2][0]]["ms_mean"], 4),
                      "requests": args.requests, "goal_ms": GOAL_MS}))


if __name__ == "__main__":
    main()
