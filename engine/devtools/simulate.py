"""Watch the scheduler and the KV cache at work, no model needed: `python -m engine.devtools.simulate`.

Simulated users chat in two turns over a shared system prompt with a small device pool, so
prefix-cache hits, continuous batching and preemption all show up within a few hundred steps.
The "model" is the simulated runner, which also checks every block it reads.
"""
from __future__ import annotations

import argparse
import random
import time

from engine.core.config import PREEMPTION_MODES, SchedulerConfig
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.devtools.simulated_runner import SimulatedRunner, run_step

COLUMNS = ("step", "run", "wait", "swap", "dev used", "dev cached", "host used", "pre swap", "pre recomp",
           "out/in", "hit rate", "prefill", "decode")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=24)
    parser.add_argument("--system-tokens", type=int, default=200)
    parser.add_argument("--gpu-blocks", type=int, default=160)
    parser.add_argument("--cpu-blocks", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="auto")
    parser.add_argument("--every", type=int, default=20, help="print a row every N steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    config = SchedulerConfig(num_device_blocks=args.gpu_blocks, num_host_blocks=args.cpu_blocks,
                             block_size=args.block_size, max_num_batched_tokens=512,
                             preemption_mode=args.preemption_mode)
    scheduler = Scheduler(config)
    runner = SimulatedRunner(config)
    system = [rng.randrange(1, 32000) for _ in range(args.system_tokens)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    def question() -> list[int]:
        return [rng.randrange(1, 32000) for _ in range(rng.randint(8, 40))]

    for user in range(args.users):
        scheduler.add_request(Request(f"user{user}-turn1", system + question(), params))

    print(f"{args.users} simulated users, {args.system_tokens}-token shared system prompt, "
          f"{args.gpu_blocks} device blocks x {args.block_size} tokens, {args.cpu_blocks} host blocks, "
          f"preemption {args.preemption_mode}")
    print(" ".join(f"{c:>10}" for c in COLUMNS))
    started = time.perf_counter()
    tokens = 0
    while scheduler.has_unfinished():
        out, finished = run_step(scheduler, runner)
        tokens += out.num_batched_tokens
        for request in finished:
            if request.request_id.endswith("turn1"):  # the user replies: turn 2 extends turn 1
                user = request.request_id.split("-")[0]
                scheduler.add_request(Request(f"{user}-turn2", request.all_token_ids + question(), params))
        s = scheduler.last_stats
        if s.step % args.every == 0 or not scheduler.has_unfinished():
            row = (s.step, s.num_running, s.num_waiting, s.num_swapped,
                   f"{s.device_blocks_used}/{s.device_blocks_total}", s.device_blocks_cached,
                   f"{s.host_blocks_used}/{s.host_blocks_total}", s.num_preemptions_swap,
                   s.num_preemptions_recompute, f"{s.blocks_swapped_out}/{s.blocks_swapped_in}",
                   f"{s.prefix_cache_hit_rate:.0%}", s.num_prefill_tokens, s.num_decode_tokens)
            print(" ".join(f"{str(v):>10}" for v in row))
    elapsed = time.perf_counter() - started
    s = scheduler.last_stats
    print(f"\n{s.step} steps, {tokens} tokens scheduled in {elapsed:.2f} s; prefix cache served "
          f"{s.prefix_cache_hits} of {s.prefix_cache_queries} prompt tokens ({s.prefix_cache_hit_rate:.0%}); "
          f"preemptions: {s.num_preemptions_swap} by swap, {s.num_preemptions_recompute} by recompute; "
          f"every block read back checked.")


if __name__ == "__main__":
    main()
