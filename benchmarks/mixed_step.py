"""A step of prompt chunks beside decodes, each way the engine can run it, timed in one process.

A busy chat server's steps carry a few prompt chunks (new chats past their cached system prompt,
follow-up turns past their cached history) beside many decodes. This benchmark lays out such
steps in the paged cache the way the load of benchmarks/serve.py makes them (four shared system
prompts of ~150 tokens, each chat's own history after them), then times each step, round after
round, through both paths that can take it: the eager forward (`ModelRunner._forward_eager`) and
the compiled flat step (`CompiledSteps.run_flat`). Each side's logits are checked against the
eager forward's first. The compiled packages are built first where this machine has none (minutes).

    .venv/bin/python benchmarks/mixed_step.py [--dtype float32] [--rounds 10]

Prints a table (median ms per step, each path against eager) and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the repository root

from benchmarks.machine import cpu_model  # noqa: E402

# (decodes, chunks as (past tokens, new tokens)): a quiet server to a busy one
SHAPES = [(4, []), (8, []), (16, []), (32, []), (64, []), (8, [(150, 25)]), (16, [(150, 25)]), (32, [(150, 25)]),
          (32, [(300, 40)]), (32, [(150, 25), (260, 30)]), (24, [(150, 128)]), (0, [(150, 25)]),
          (0, [(150, 25), (150, 20), (310, 35)])]
SYSTEM_TOKENS = 150
BLOCK = 16


class Layout:
    """Hands out blocks: four system prompts' blocks shared, every sequence's own after them."""

    def __init__(self, num_blocks: int) -> None:
        self.next = 0
        self.num_blocks = num_blocks
        self.systems = [self.take(SYSTEM_TOKENS // BLOCK) for _ in range(4)]

    def take(self, count: int) -> list[int]:
        if self.next + count > self.num_blocks:
            raise SystemExit("the cache is too small for these shapes")
        blocks = list(range(self.next, self.next + count))
        self.next += count
        return blocks

    def table(self, system: int, length: int) -> list[int]:
        shared = self.systems[system]
        return shared + self.take(-(-length // BLOCK) - len(shared))


def sequences_of(shape, layout: Layout, rng: random.Random, vocab: int):
    from engine.worker.flat_batch import FlatSequence

    decodes, chunks = shape
    out = []
    for i in range(decodes):
        past = SYSTEM_TOKENS + rng.randrange(20, 250)
        out.append(FlatSequence([rng.randrange(vocab)], past, layout.table(i % 4, past + 1), True))
    for i, (past, new) in enumerate(chunks):
        out.append(FlatSequence([rng.randrange(vocab) for _ in range(new)], past, layout.table(i % 4, past + new),
                                True))
    return out


def eager(runner, sequences, native: bool = False):
    bs = runner.block_size
    input_ids, positions, slots, cu_q, k_lens, tables = [], [], [], [0], [], []
    for s in sequences:
        end = s.start + len(s.tokens)
        input_ids += s.tokens
        positions += range(s.start, end)
        slots += [s.table[p // bs] * bs + p % bs for p in range(s.start, end)]
        cu_q.append(cu_q[-1] + len(s.tokens))
        k_lens.append(end)
        tables.append(s.table)
    runner._last_plan = None
    keep = runner.model.row_attention
    if not native:
        runner.model.row_attention = None
    try:
        return runner._forward_eager(input_ids, positions, slots, cu_q, k_lens, tables, list(range(len(sequences))))
    finally:
        runner.model.row_attention = keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3, help="steps per side per round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flat-package", default=None,
                        help="also time this flat package beside the engine's own, as \"other\" (a variant of "
                             "compiled/flat_step.py, or an older build; one built without weights gets the engine's)")
    args = parser.parse_args()

    import torch

    from engine import LLM

    llm = LLM(args.model, dtype=args.dtype, num_gpu_blocks=4096, num_cpu_blocks=16, compile_decode=True)
    core = llm.engine.core
    runner, compiled = core.runner, core.compiled
    if compiled is None or not compiled.wait():
        raise SystemExit(f"no compiled steps: {compiled.error if compiled else 'compile_decode is off here'}")
    other = None
    if args.flat_package:
        from engine.worker.compiled.steps import CompiledSteps
        from engine.worker.compiled.flat_step import FlatStep

        package = torch._inductor.aoti_load_package(args.flat_package)
        constants = FlatStep(core.model).constants()
        if set(package.get_constant_fqns()) == set(constants):  # built without weights: the engine's
            package.load_constants(constants, check_full_update=True, user_managed=True)
        other = CompiledSteps(args.model, core.model.dtype, core.model, ("flat",))
        other.install("flat", package)
    torch.manual_seed(args.seed)
    runner.kv_cache.normal_()
    rng = random.Random(args.seed)
    layout = Layout(runner.kv_cache.shape[0])
    vocab = core.model.shape.vocab_size
    cases = [(shape, sequences_of(shape, layout, rng, vocab)) for shape in SHAPES]

    def sides(sequences):
        paths = {"eager": lambda: eager(runner, sequences),
                 "flat": lambda: compiled.run_flat(sequences, runner.kv_cache, runner.block_size)[0]}
        if other is not None:
            paths["other"] = lambda: other.run_flat(sequences, runner.kv_cache, runner.block_size)[0]
        if runner.uses_row_attention([len(s.tokens) for s in sequences]):
            paths["eager-native"] = lambda: eager(runner, sequences, native=True)
        return paths

    rows = []
    with torch.inference_mode():
        for shape, sequences in cases:
            paths = sides(sequences)
            reference = paths["eager"]().clone()
            diffs = {name: float((run() - reference).abs().max()) for name, run in paths.items()}
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, run in paths.items():
                    run()
                    start = time.perf_counter()
                    for _ in range(args.repeat):
                        run()
                    times[name].append(1000 * (time.perf_counter() - start) / args.repeat)
            medians = {name: statistics.median(values) for name, values in times.items()}
            q_lens = [len(s.tokens) for s in sequences]
            cu_q = [0]
            for n in q_lens:
                cu_q.append(cu_q[-1] + n)
            takes = "flat" if runner._flat_fits([s.table for s in sequences], cu_q, [s.start + n for s, n in zip(sequences, q_lens)]) \
                and not runner._rows_outrun_flat([], cu_q) else "eager-native" if "eager-native" in paths else "eager"
            rows.append({"decodes": shape[0], "chunks": shape[1], "rows": sum(q_lens), "engine_takes": takes,
                         "ms": {k: round(v, 2) for k, v in medians.items()},
                         "vs_eager": {k: round(v / medians["eager"], 3) for k, v in medians.items()},
                         "max_abs_diff": diffs})
    print(f"{cpu_model()}, {args.dtype}, {args.rounds} rounds of {args.repeat} steps a side, medians")
    print(f"{'decodes':>7} {'chunks (past, new)':<32} {'rows':>5} {'eager ms':>9} {'native ms':>10} {'flat ms':>8} "
          f"{'native/eager':>12} {'flat/eager':>10} {'engine takes':>13}"
          + (f" {'other ms':>8} {'other/flat':>10}" if other is not None else ""))
    for row in rows:
        ms, ratio = row["ms"], row["vs_eager"]
        native = f"{ms['eager-native']:.1f}" if "eager-native" in ms else "-"
        native_ratio = f"{ratio['eager-native']:.3f}" if "eager-native" in ratio else "-"
        print(f"{row['decodes']:>7} {str(row['chunks']):<32} {row['rows']:>5} {ms['eager']:>9.1f} {native:>10} "
              f"{ms['flat']:>8.1f} {native_ratio:>12} {ratio['flat']:>10.3f} {row['engine_takes']:>13}"
              + (f" {ms['other']:>8.1f} {ms['other'] / ms['flat']:>10.3f}" if "other" in ms else ""))
    print(json.dumps({"cpu": cpu_model(), "dtype": args.dtype, "model": core.model_name, "rounds": args.rounds,
                      "steps": rows}))


if __name__ == "__main__":
    main()
