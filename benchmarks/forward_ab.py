"""Is a change to the forward pass faster? A/B inside one process, on one captured decode step.

Separate runs cannot tell a few percent apart on a shared machine: the 2-core EPYC this project
is measured on runs the same engine at ~750 or ~900 tok/s from one minute to the next, and even
flips inside one process. Here both sides share the process and the minute. The chats of
`step_profile.py` are run once to capture the model's inputs at one decode step in the middle of
the reply (`--step`); then that one forward is timed again and again, the base and each variant
in turn, round after round, and each side's median is compared.

A variant is a Python file defining `VARIANTS(model, inputs) -> {name: apply}` (`inputs`: the
captured forward's arguments), where `apply()` changes the code (assigns a module's function, a
layer's weight, the model's whole `forward`, ...) and returns a callable that undoes it. Each variant's logits are checked
against the base's (largest difference, same greedy tokens) before anything is timed. The files are imported before
the model loads: one without VARIANTS is refused at once.

    .venv/bin/python benchmarks/forward_ab.py --dtype bfloat16 --chats 32 --variant /tmp/my_change.py
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the repository root (see step_profile.py)

from benchmarks.machine import cpu_model  # noqa: E402


def import_variants(path: str):
    """The file's VARIANTS function, read before any model loads: a wrong file is refused at once."""
    if not Path(path).is_file():
        raise SystemExit(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "VARIANTS", None)):
        raise SystemExit(f"{path}: defines no VARIANTS(model, inputs)")
    return module.VARIANTS


def load_variants(path: str, make, model, inputs: tuple) -> dict:
    variants = make(model, inputs)
    if not variants or not all(callable(apply) for apply in variants.values()):
        raise SystemExit(f"{path}: VARIANTS(model, inputs) must return a non-empty dict of name -> apply()")
    return variants


def capture_step(llm, chats, tokens: int, step: int):
    """Generate the chats' replies, keeping the forward's arguments at decode step `step`. The
    blocks they name keep their K/V after the requests end: nothing else runs to reuse them."""
    from engine import SamplingParams

    model = llm.engine.runner.model
    forward, calls, captured = model.forward, [0], []

    def spy(*args):
        calls[0] += 1
        if calls[0] == step:
            captured.append(args)
        return forward(*args)

    model.forward = spy
    try:
        llm.chat(chats, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    finally:
        model.forward = forward
    if not captured:
        raise SystemExit(f"the replies took fewer than {step} steps")
    return captured[0]


def under(apply, work):
    """`work()` with a variant applied, undone afterwards."""
    undo = apply()
    try:
        return work()
    finally:
        if undo is not None:
            undo()


def timed_forwards(forward, inputs, repeat: int) -> float:
    """Median ms of `repeat` forwards (after one untimed forward)."""
    forward(*inputs)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        forward(*inputs)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--chats", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128, help="reply length while capturing")
    parser.add_argument("--step", type=int, default=70, help="which forward of the replies to capture")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=3, help="forwards per side per round")
    parser.add_argument("--variant", action="append", default=[], help="a file defining VARIANTS(model, inputs)")
    args = parser.parse_args()
    makers = [(path, import_variants(path)) for path in args.variant]

    import torch

    from engine import LLM
    from ui.panel.load_generator import LOAD_SYSTEM_PROMPT, QUESTIONS

    # The eager forward is what is measured: a lone chat's steps must not bypass it (engine/worker/compiled/).
    llm = LLM(args.model, dtype=args.dtype, num_gpu_blocks=1024, num_cpu_blocks=16, compile_decode=False)
    model = llm.engine.runner.model
    chats = [[{"role": "system", "content": LOAD_SYSTEM_PROMPT[:1200]},
              {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(args.chats)]
    inputs = capture_step(llm, chats, args.tokens, args.step)

    sides = {"base": lambda: None}
    for path, make in makers:
        for name, apply in load_variants(path, make, model, inputs).items():
            if name in sides:
                raise SystemExit(f"two variants are called {name!r}")
            sides[name] = apply
    def forward(*args):  # looked up each call: a variant may replace the whole forward
        return model.forward(*args)

    base_logits = forward(*inputs).clone()
    checks = {}
    for name, apply in sides.items():
        logits = under(apply, lambda: forward(*inputs))
        checks[name] = {"max_abs_diff": float((logits - base_logits).abs().max()),
                        "same_greedy": bool(torch.equal(logits.argmax(-1), base_logits.argmax(-1)))}

    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, apply in sides.items():
            times[name].append(under(apply, lambda: timed_forwards(forward, inputs, args.repeat)))

    # Every undo ran: the base gives the logits it gave at the start.
    base_unchanged = bool(torch.equal(forward(*inputs), base_logits))
    base = statistics.median(times["base"])
    print(f"{cpu_model()}, {args.dtype}, {args.chats} chat(s), decode step {args.step} "
          f"({inputs[0].shape[0]} tokens), {args.rounds} rounds of {args.repeat} forwards a side")
    print(f"{'side':<20} {'median ms':>10} {'vs base':>8} {'faster in':>10} {'max |diff|':>11} {'greedy':>7}")
    summary = {"cpu": cpu_model(), "dtype": args.dtype, "chats": args.chats, "step": args.step,
               "base_unchanged": base_unchanged, "sides": {}}
    for name, values in times.items():
        median = statistics.median(values)
        wins = sum(value < reference for value, reference in zip(values, times["base"]))
        print(f"{name:<20} {median:>10.2f} {median / base:>8.3f} {f'{wins}/{args.rounds}':>10} "
              f"{checks[name]['max_abs_diff']:>11.3g} {'same' if checks[name]['same_greedy'] else 'DIFF':>7}")
        summary["sides"][name] = {"median_ms": round(median, 3), "vs_base": round(median / base, 4),
                                  "rounds_faster": wins, "ms": [round(v, 3) for v in values], **checks[name]}
    if not base_unchanged:
        print("the base's logits changed after the variants ran: an undo left something behind")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
