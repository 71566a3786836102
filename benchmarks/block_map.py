"""What an open panel costs the engine: the engine thread's share of one block map (copying
the blocks that changed since the last one, and the block tables) against a step of decoding,
and against walking the whole pool on the engine thread (how the map was built before).

    .venv/bin/python benchmarks/block_map.py [--requests 128] [--steps 50] [--pools 10000,170000]

Pools of 10k and 170k device blocks (SmolLM2 fp32 on a 24 GB machine holds ~170k), decoding
steadily; the panel asks for a map once a second. Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from scheduler_overhead import build  # noqa: E402
from simulation import expected_block_map  # noqa: E402  (the whole-pool walk, kept as the tests' oracle)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(num_blocks: int, requests: int, steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    lens = [rng.randint(256, 768) for _ in range(requests)]  # ~4k blocks in use: fits both pools
    scheduler, runner = build(requests, lens, num_blocks, caching=True, mode="auto", seed=seed)
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        out = scheduler.schedule()
        scheduler.update(out, runner.execute(out))
    scheduler.block_map_state()  # the first map copies every block once

    def step():
        out = scheduler.schedule()
        scheduler.update(out, runner.execute(out))

    step_ms = ms(step, steps)
    # Between two maps a panel sees about one second of steps; one step of changes is the least.
    engine_ms = []
    for _ in range(steps):
        step()
        t0 = time.perf_counter()
        state = scheduler.block_map_state()
        engine_ms.append((time.perf_counter() - t0) * 1e3)
    build_ms = ms(state.build, 3)
    walk_ms = ms(lambda: expected_block_map(scheduler), 3)
    return {"device_blocks": num_blocks, "running": len(scheduler.running), "step_ms": step_ms,
            "engine_ms": statistics.median(engine_ms), "reader_build_ms": build_ms, "whole_walk_ms": walk_ms}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pools", default="10000,170000", help="device pool sizes in blocks, comma-separated")
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; {args.requests} requests decoding, a block map after every step\n")
    print(f"{'device blocks':>13} {'step ms':>8} {'map on engine ms':>17} {'% of a 1 s panel tick':>22} "
          f"{'build on reader ms':>19} {'whole-pool walk ms':>19} {'saved':>7}")
    rows = []
    for blocks in [int(b) for b in args.pools.split(",")]:
        r = measure(blocks, args.requests, args.steps, args.seed)
        rows.append(r)
        print(f"{blocks:>13,} {r['step_ms']:8.3f} {r['engine_ms']:17.3f} {r['engine_ms'] / 10:21.3f}% "
              f"{r['reader_build_ms']:19.1f} {r['whole_walk_ms']:19.1f} {r['whole_walk_ms'] / r['engine_ms']:6.0f}x")
    print(json.dumps({"cpu": cpu_model(), "requests": args.requests,
                      "pools": {r["device_blocks"]: {"engine_ms": round(r["engine_ms"], 4), "step_ms": round(r["step_ms"], 4),
                                                     "whole_walk_ms": round(r["whole_walk_ms"], 2)} for r in rows}}))


if __name__ == "__main__":
    main()
