"""Where a served engine's time went, from its step log: run the server with
PAGEDCHAT_STEP_LOG=FILE (the engine core writes a JSON line per step: start, milliseconds, how it
ran, decodes and prompt tokens, the process's CPU time, page faults and context switches), put load on it, then

    .venv/bin/python benchmarks/step_log.py FILE [--since-s 0]

Prints, per kind of step (how it ran: the compiled lone, flat or batch graph, eagerly; "+prompt"
for steps with prompt tokens), how many there were, their time p50/p99/max and share of the wall
time, and for steps the step-cost model predicted (those with prompt tokens) the p50 and p99 of
actual over predicted time; the gaps between steps (the core's own time outside them: taking
requests, sending outputs); the idle share; and the slowest steps with what the process did
meanwhile (CPU time of all its threads over the wall time, page faults, its threads' involuntary
context switches): a step whose compute threads wait for one that another process preempted
shows about one core's CPU time and many preemptions, a step that had more to do shows two
cores' and few. Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def read(path: str) -> list[dict]:
    with open(path) as file:
        return [json.loads(line) for line in file if line.strip()]


def kinds_of(steps: list[dict]) -> dict[str, dict]:
    """Per kind of step (how it ran; "+prompt" with prompt tokens): count, mean rows and prompt
    tokens, time p50/p99/max, share of the wall time, and the step-cost model's actual/predicted."""
    wall = steps[-1]["t"] + steps[-1]["ms"] / 1000 - steps[0]["t"]
    kinds: dict[str, list[dict]] = defaultdict(list)
    for step in steps:
        kinds[f"{step['path']}+prompt" if step["prefill"] else step["path"]].append(step)
    rows = {}
    for kind, group in sorted(kinds.items()):
        times = [s["ms"] for s in group]
        row = {"steps": len(group), "rows_mean": round(statistics.mean(s["rows"] for s in group), 1),
               "prompt_mean": round(statistics.mean(s["prefill"] for s in group), 1),
               "p50_ms": round(pct(times, 0.5), 2), "p99_ms": round(pct(times, 0.99), 2), "max_ms": round(max(times), 2),
               "share": round(sum(times) / 1000 / wall, 3)}
        # How far the step-cost model was off, where it predicted (a prediction of 0: no fit yet)
        errors = [s["ms"] / s["predicted_ms"] for s in group if s.get("predicted_ms")]
        row["actual_over_predicted"] = ({"p50": round(pct(errors, 0.5), 3), "p99": round(pct(errors, 0.99), 3),
                                         "steps": len(errors)} if errors else None)
        rows[kind] = row
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--since-s", type=float, default=0.0, help="skip the log's first seconds (warm-up)")
    parser.add_argument("--slowest", type=int, default=8, help="list this many of the slowest steps")
    args = parser.parse_args()
    steps = read(args.log)
    start = steps[0]["t"] + args.since_s
    steps = [s for s in steps if s["t"] >= start]
    wall = steps[-1]["t"] + steps[-1]["ms"] / 1000 - steps[0]["t"]
    gaps = [1000 * (b["t"] - a["t"]) - a["ms"] for a, b in zip(steps, steps[1:])]
    busy_gaps = [g for g in gaps if g < 5.0]  # longer ones: the engine had nothing to do
    rows = kinds_of(steps)
    print(f"{len(steps)} steps over {wall:.1f} s")
    print(f"{'kind':>14} {'steps':>6} {'rows':>6} {'prompt':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'share':>6} "
          f"{'act/pred p50':>12} {'p99':>6}")
    for kind, row in rows.items():
        error = row["actual_over_predicted"]
        error = f"{error['p50']:>12} {error['p99']:>6}" if error else f"{'-':>12} {'-':>6}"
        print(f"{kind:>14} {row['steps']:>6} {row['rows_mean']:>6} {row['prompt_mean']:>7} {row['p50_ms']:>8} "
              f"{row['p99_ms']:>8} {row['max_ms']:>8} {100 * row['share']:>5.1f}% {error}")
    between = {"mean_ms": round(statistics.mean(busy_gaps), 3) if busy_gaps else None,
               "p99_ms": round(pct(busy_gaps, 0.99), 3) if busy_gaps else None,
               "share": round(sum(busy_gaps) / 1000 / wall, 3)}
    idle = round(sum(g for g in gaps if g >= 5.0) / 1000 / wall, 3)
    print(f"between steps while busy: mean {between['mean_ms']} ms, p99 {between['p99_ms']} ms, "
          f"{100 * between['share']:.1f}% of the time; idle {100 * idle:.1f}%")
    slowest = [{"t_s": round(s["t"] - steps[0]["t"], 3), "ms": s["ms"], "path": s["path"], "rows": s["rows"],
                "prefill": s["prefill"], "cores": round(s["cpu_ms"] / s["ms"], 2) if s["ms"] else None,
                "faults": s.get("faults"), "preempted": s.get("preempted")}
               for s in sorted(steps, key=lambda s: -s["ms"])[:args.slowest] if "cpu_ms" in s]
    if slowest:
        print(f"slowest steps: {'at s':>8} {'ms':>7} {'kind':>6} {'rows':>5} {'prompt':>7} {'cores':>6} {'faults':>7} "
              f"{'preempted':>9}")
        for s in slowest:
            print(f"{'':>14} {s['t_s']:>8} {s['ms']:>7} {s['path']:>6} {s['rows']:>5} {s['prefill']:>7} {s['cores']:>6} "
                  f"{s['faults']:>7} {s['preempted']:>9}")
    print(json.dumps({"steps": len(steps), "wall_s": round(wall, 1), "kinds": rows, "between": between, "idle": idle,
                      "slowest": slowest}))


if __name__ == "__main__":
    main()
