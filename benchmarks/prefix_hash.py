"""What the prefix cache's block hash costs: xxh3 (the default) against sha256
(`--prefix-caching-hash-algo sha256`, engine/core/block_hash.py).

Two measures, for each hash:
- the hash alone: a chain of `--blocks` blocks of 16 random token ids hashed through
  `extend_block_hashes` (the engine's own path), best of `--rounds`, in microseconds a block;
- its share of a prefill: the engine (prefix caching on, compiled steps off) prefills a prompt of
  `--prompt-tokens` random token ids, a new one each round so nothing hits, and the hashing of that
  prompt's full blocks (from the first measure) is set against the prefill's median time.

    .venv/bin/python benchmarks/prefix_hash.py [--blocks 20000] [--prompt-tokens 512] [--rounds 3] [--model M]
        [--num-gpu-blocks N] [--num-cpu-blocks N]   # the engines' KV pools (default: the engine's, ~1 GiB each)

Prints a table, then one JSON line of the figures (with the CPU model).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the repository root: benchmarks/kernels.py is not `kernels`

from benchmarks.machine import cpu_model  # noqa: E402
from engine.core.block_hash import HASH_ALGOS, extend_block_hashes  # noqa: E402

BLOCK_SIZE = 16


def hash_us_per_block(algo: str, tokens: list[int], rounds: int) -> float:
    blocks = len(tokens) // BLOCK_SIZE
    best = float("inf")
    for _ in range(rounds):
        chain: list[int] = []
        start = time.perf_counter()
        extend_block_hashes(chain, tokens, BLOCK_SIZE, blocks, algo=algo)
        best = min(best, time.perf_counter() - start)
    return best / blocks * 1e6


def prefill_ms(llm, prompt_tokens: int, rounds: int, rng: random.Random) -> float:
    from engine import SamplingParams

    vocab = llm.tokenizer.vocab_size
    times = []
    for _ in range(rounds + 1):  # the first round warms up, untimed
        prompt = [rng.randrange(10, vocab) for _ in range(prompt_tokens)]
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="folder or hub id (default: $MODEL, else the embedded model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="device KV pool (default: the engine's)")
    parser.add_argument("--num-cpu-blocks", type=int, default=None, help="host swap pool (default: the engine's)")
    args = parser.parse_args()
    if args.num_gpu_blocks is not None and args.num_gpu_blocks * BLOCK_SIZE <= args.prompt_tokens:
        parser.error(f"--num-gpu-blocks {args.num_gpu_blocks} cannot hold a {args.prompt_tokens}-token prompt")
    rng = random.Random(0)
    tokens = [rng.randrange(0, 49_152) for _ in range(args.blocks * BLOCK_SIZE)]
    per_block = {algo: hash_us_per_block(algo, tokens, args.rounds) for algo in HASH_ALGOS}

    from engine import LLM

    prompt_blocks = args.prompt_tokens // BLOCK_SIZE
    prefill, model, dtype = {}, None, None
    for algo in HASH_ALGOS:
        llm = LLM(args.model, dtype=args.dtype, compile_decode=False, enable_prefix_caching=True,
                  prefix_caching_hash_algo=algo, block_size=BLOCK_SIZE, num_gpu_blocks=args.num_gpu_blocks,
                  num_cpu_blocks=args.num_cpu_blocks)
        model, dtype = llm.engine.model_name, str(llm.engine.dtype).removeprefix("torch.")
        prefill[algo] = prefill_ms(llm, args.prompt_tokens, args.rounds, rng)
        del llm

    cpu = cpu_model()
    print(f"{cpu}; {args.blocks:,} blocks of {BLOCK_SIZE} tokens, best of {args.rounds}; "
          f"prefill: {model} in {dtype}, {args.prompt_tokens:,}-token prompts, median of {args.rounds}\n")
    print(f"{'hash':<8} {'us/block':>9} {'blocks/s':>11} {'vs xxh3':>8} {'prompt hash ms':>15} {'prefill ms':>11} "
          f"{'share':>8}")
    share = {}
    for algo in HASH_ALGOS:
        hash_ms = per_block[algo] * prompt_blocks / 1e3
        share[algo] = hash_ms / prefill[algo]
        print(f"{algo:<8} {per_block[algo]:9.2f} {1e6 / per_block[algo]:11,.0f} "
              f"{per_block[algo] / per_block['xxh3']:7.2f}x {hash_ms:15.3f} {prefill[algo]:11.1f} {share[algo]:8.4%}")
    print(json.dumps({"cpu": cpu, "blocks": args.blocks, "block_size": BLOCK_SIZE,
                      "us_per_block": {a: round(v, 3) for a, v in per_block.items()},
                      "sha256_vs_xxh3": round(per_block["sha256"] / per_block["xxh3"], 2),
                      "prompt_tokens": args.prompt_tokens, "model": model, "dtype": dtype,
                      "prefill_ms": {a: round(v, 1) for a, v in prefill.items()},
                      "hash_share_of_prefill": {a: round(v, 6) for a, v in share.items()}}))


if __name__ == "__main__":
    main()
