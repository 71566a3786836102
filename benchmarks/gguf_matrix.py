"""Which of benchmarks/peers/gguf_models.py's matrix files the engine serves today, and how close its
native path stays to the file's own float32 dequantization.

One row per file: its size; its tensor types and how many tensors of each (gguf's GGUFReader: a
K-quant file of a model whose rows are not a multiple of 256 holds fallback types besides its
name's), and which of them the engine's reader does not read; whether the engine loads it by path and serves it with `quantization="native"` (a short
greedy generation), or the error it refuses the file with (naming the type it does not read);
and, where it serves it, benchmarks/gguf_quality.py's comparison: teacher-forced top-1 agreement
of the native model with the file dequantized to float32, and how many greedy replies are equal.

    .venv/bin/python benchmarks/gguf_matrix.py                       # every matrix file that exists
    .venv/bin/python benchmarks/gguf_matrix.py 'smollm2-135m-*' --prompts 2 --positions 32 --max-tokens 8

Names are gguf_models.py's (globs over the matrix, or paths). Prints a table with the CPU it ran
on, then one JSON line.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

if not __package__:  # run as a script: the repository root first (benchmarks/kernels.py shadows kernels)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.machine import cpu_model  # noqa: E402
from benchmarks.peers import gguf_models  # noqa: E402


def serve_check(path: Path, num_gpu_blocks: int, max_tokens: int) -> dict:
    """Load the file by path with native quantization and generate `max_tokens` greedy tokens:
    {"loads": True, "reply_tokens": n} or {"loads": False, "error": what the engine said}."""
    from engine import LLM, SamplingParams

    llm = None
    try:
        llm = LLM(model=str(path), dtype="float32", quantization="native", num_gpu_blocks=num_gpu_blocks,
                  compile_decode=False)
        out = llm.generate(["What is the capital of France?"],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return {"loads": True, "reply_tokens": len(out[0].outputs[0].token_ids)}
    except Exception as error:  # the row reports any refusal; the next file still runs
        return {"loads": False, "error": f"{type(error).__name__}: {error}"}
    finally:
        del llm
        gc.collect()


def row(name: str, path: Path, args) -> dict:
    from benchmarks import gguf_quality

    from engine.worker.loading.gguf_formats import SUPPORTED_TYPES

    types = gguf_models.tensor_types(path)
    entry = {"name": name, "file": path.name, "size_bytes": path.stat().st_size,
             "tensor_types": dict(types.most_common()),
             "types_not_read": [t for t in types if t not in {s.name for s in SUPPORTED_TYPES}],
             **serve_check(path, args.num_gpu_blocks, args.max_tokens)}
    if entry["loads"] and args.prompts > 0:
        quality = gguf_quality.measure(str(path), args.max_tokens, prompts=args.prompts, positions=args.positions,
                                       stepwise_too=args.stepwise)
        entry.update({key: quality[key] for key in ("type", "positions", "top1", "top1_clear", "clear_positions",
                                                     "top1_stepwise", "greedy_prompts", "greedy_equal",
                                                     "first_difference_at")})
        gc.collect()
    return entry


def selected(names: str | None, build: Path) -> list[tuple[str, Path]]:
    """(name, path) of each named file, or of every matrix file that exists when none is named."""
    if names is None:
        pairs = [(n, gguf_models.model_path(n, build)) for n in gguf_models.matrix_names()]
        return [(n, p) for n, p in pairs if p.is_file()]
    pairs = [(n, gguf_models.model_path(n, build)) for n in gguf_models.expand(names)]
    missing = [str(p) for _, p in pairs if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"no GGUF file at {', '.join(missing)} (benchmarks/peers/gguf_models.py makes them)")
    return pairs


def table(rows: list[dict]) -> list[str]:
    lines = ["| file | MB | tensor types (count) | types the engine does not read | native | top-1 agree (positions) "
             "| greedy equal |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        types = ", ".join(f"{t} {n}" for t, n in r["tensor_types"].items())
        if not r["loads"]:
            # the engine's message up to its list of supported types (the JSON line keeps it whole)
            served, top1, greedy = f"refused: {r['error'].split(' (supported')[0]}", "", ""
        else:
            served = "serves"
            top1 = f"{r['top1']:.1%} ({r['positions']})" if "top1" in r else ""
            greedy = f"{r['greedy_equal']} of {r['greedy_prompts']}" if "greedy_equal" in r else ""
        lines.append(f"| {r['file']} | {r['size_bytes'] / 1e6:,.0f} | {types} | {', '.join(r['types_not_read']) or '-'} "
                     f"| {served} | {top1} | {greedy} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="?", default=None,
                        help="comma list of gguf_models.py names, globs or paths (default: every matrix file there)")
    parser.add_argument("--build", type=Path, default=gguf_models.BUILD)
    parser.add_argument("--prompts", type=int, default=4, help="chat texts and greedy questions (0: load check only)")
    parser.add_argument("--positions", type=int, default=64, help="each chat text cut to this many tokens")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per reply")
    parser.add_argument("--stepwise", action="store_true", help="also the one-token-a-step pass (slow)")
    parser.add_argument("--num-gpu-blocks", type=int, default=64, help="KV blocks of the load check's engine")
    args = parser.parse_args()
    try:
        files = selected(args.names, args.build)
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    if not files:
        parser.error(f"no matrix file in {args.build}: benchmarks/peers/gguf_models.py --matrix makes them")
    started = time.perf_counter()
    rows = []
    for name, path in files:
        rows.append(row(name, path, args))
        print(f"{path.name}: {'serves' if rows[-1]['loads'] else 'refused'}", file=sys.stderr, flush=True)
    cpu = cpu_model()
    print(f"GGUF matrix: served natively, against its own float32 dequantization ({args.prompts} chat texts of "
          f"{args.positions} tokens, greedy {args.max_tokens} tokens), on {cpu}")
    print("\n".join(table(rows)))
    print(json.dumps({"benchmark": "gguf_matrix", "cpu": cpu, "seconds": round(time.perf_counter() - started, 1),
                      "prompts": args.prompts, "positions": args.positions, "max_tokens": args.max_tokens,
                      "results": rows}))


if __name__ == "__main__":
    main()
