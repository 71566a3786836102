"""One engine step of many chats on a GPU, against the time the device needs to read the weights once.

A decode step of N chats reads every weight once (the embedding only in the rows it gathers, the
tied output head whole), so the weights' bytes over the device's copy bandwidth is the least a step
can take; a step near it is device-bound, a step far above it waits on the host. This benchmark
starts N chats on one shared system prompt, lets every prompt through, then times, in one process:
- decode steps of all N as the engine runs them (`LLMEngine.step`, wall time), the device time of
  each step's forward (CUDA events), and where the host's time goes (the scheduler, building the
  batch, sampling, the output processor);
- the same decode steps run eagerly (no CUDA graphs), with the fused layer ops and with torch's ops;
- steps that carry a new chat's prompt chunk (25 or 128 tokens past the cached system prompt)
  beside the N decodes, flattened into one batch, replayed from a graph and run eagerly.
`--kernels K` prints the K kernels with the most device time over eager decode steps (torch's
profiler) and `--profile K` the K functions with the most own host time (cProfile): what a change
should go after.

    python3 benchmarks/gpu_step.py --model random-llama-1b --tokenizer .gpu/tokenizer [--chats 32] [--kernels 20]
    .venv/bin/python benchmarks/gpu_step.py --device cpu --model random-llama-tiny --no-compile   # anywhere: a smoke run

`--model`: random-llama-1b (hidden 2,048, 16 layers, 1.07B parameters, as benchmarks/throughput.py
builds it), random-llama-tiny, or a local folder. On a CPU the device figures are absent and the
wall times mean little. Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the repository root, not benchmarks/

import torch  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402
from benchmarks.measure import device_name, now  # noqa: E402
from benchmarks.random_llama import RANDOM_MODELS, build_random_llama  # noqa: E402
from benchmarks.throughput import QUESTIONS, SYSTEM_PROMPT, chat_prompt  # noqa: E402
from engine.worker.loading.model_loader import load_tokenizer  # noqa: E402

CHUNKS = (25, 128)  # a new chat's own tokens past the cached system prompt, in a mixed step


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy (best of `repeats`)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = now(device)
        b.copy_(a)
        best = min(best, now(device) - t0)
    del a, b
    return 2 * nbytes / best


def weight_bytes(folder: str) -> int:
    """The checkpoint's tensor bytes (safetensors files: a tied embedding is stored once)."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


class StepParts:
    """Wall time of each named part of a step, summed over the steps it is on, and the device
    time of each step's forward (CUDA events around the runner's model call)."""

    def __init__(self, engine, device: torch.device) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.device = device
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.on = False
        core, runner = engine.core, engine.core.runner
        self._wrap(core, "step", "engine core step (engine.serve's core loop; no text)")
        self._wrap(core.scheduler, "schedule", "scheduler.schedule")
        self._wrap(core.scheduler, "update", "scheduler.update")
        self._wrap(runner, "execute", "runner.execute")
        self._wrap(runner, "_sample", "runner._sample (waits for the device)")
        self._wrap(engine.outputs, "process", "output processor")
        if runner.graphs is not None:
            self._wrap(runner.graphs, "run", "graphs.run (inputs copied, replay queued)", events=True)
            self._wrap(runner.graphs, "run_flat", "graphs.run_flat (inputs copied, replay queued)", events=True)
        self._wrap(runner, "_forward_eager", "eager forward queued", events=True)

    def _wrap(self, owner, name: str, label: str, events: bool = False) -> None:
        function = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if not self.on:
                return function(*args, **kwargs)
            start = end = None
            if events and self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.totals[label] += time.perf_counter() - t0
                if end is not None:
                    end.record()
                    self.events.append((start, end))
        setattr(owner, name, wrapper)

    def device_seconds(self) -> list[float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1000 for s, e in self.events]

    def reset(self) -> None:
        self.totals.clear()
        self.events.clear()


def decode_steps(engine, steps: int) -> list[float]:
    """Wall seconds of `steps` engine steps (the chats decoding, nothing else running)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random-llama-1b")
    parser.add_argument("--tokenizer", default=None, help="a saved tokenizer folder (default SmolLM2's, embedded)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--chats", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps")
    parser.add_argument("--mixed-rounds", type=int, default=8, help="timed mixed steps per chunk length")
    parser.add_argument("--profile", type=int, default=0, help="print the K functions with most own time")
    parser.add_argument("--kernels", type=int, default=0,
                        help="CUDA: print the K kernels with most device time over 10 eager decode steps")
    parser.add_argument("--no-compile", action="store_true", help="CPU: no compiled steps (the smoke run)")
    args = parser.parse_args(argv)
    if args.chats < 1 or args.steps < 1 or args.mixed_rounds < 1:
        parser.error("--chats, --steps and --mixed-rounds must be at least 1")
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    with tempfile.TemporaryDirectory(prefix="pagedchat-gpu-step-") as scratch:
        folder = args.model
        if args.model in RANDOM_MODELS:
            folder = scratch
            build_random_llama(args.model, load_tokenizer(args.tokenizer), getattr(torch, dtype), folder, device.type)
        run(args, folder, device, dtype)


def run(args, folder: str, device: torch.device, dtype: str) -> None:
    from engine import SamplingParams
    from engine.runtime.llm_engine import LLMEngine

    options = dict(max_num_seqs=max(64, args.chats + 1), max_num_batched_tokens=2048)
    if device.type == "cuda":
        options["gpu_memory_utilization"] = 0.5
    else:
        options.update(num_gpu_blocks=64 * (args.chats + 2), num_cpu_blocks=16)
    if args.no_compile:
        options["compile_decode"] = False
    engine = LLMEngine(folder, device=device.type, dtype=dtype, **options)
    if engine.compiled is not None:
        engine.compiled.wait()
    tokenizer = engine.tokenizer
    questions = [QUESTIONS[i % len(QUESTIONS)] + (f" ({i})" if i >= len(QUESTIONS) else "") for i in range(args.chats)]
    prompts = [chat_prompt(tokenizer, SYSTEM_PROMPT, q) for q in questions]
    long_reply = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    total_steps = args.steps * (2 if args.profile else 1) + 8 + 2 * len(CHUNKS) * args.mixed_rounds + 16
    if max(len(p) for p in prompts) + total_steps >= engine.config.scheduler.max_model_len:
        raise SystemExit(f"the prompts and {total_steps} steps outrun max_model_len {engine.config.scheduler.max_model_len}")
    for i, prompt in enumerate(prompts):
        engine.add_request(f"chat-{i}", prompt, long_reply)
    scheduler = engine.core.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    for _ in range(8):  # warm: every chat decoding, the batch's graph replayed
        engine.step()

    parts = StepParts(engine, device)
    parts.on = True
    walls = decode_steps(engine, args.steps)
    path = engine.core.runner.last_path
    forward = parts.device_seconds()
    host = dict(parts.totals)
    parts.reset()

    profile_text = ""
    if args.profile:
        parts.on = False
        profiler = cProfile.Profile()
        profiler.enable()
        decode_steps(engine, args.steps)
        profiler.disable()
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(args.profile)
        profile_text = stream.getvalue()
        parts.on = True

    kernel_text = ""
    if args.kernels and device.type == "cuda":
        # The same decode steps without the graphs, under torch's profiler: each kernel's device time
        # (a replayed graph's kernels are the same ones, launched without the host's gaps).
        parts.on = False
        runner = engine.core.runner
        graphs, runner.graphs = runner.graphs, None
        for _ in range(3):
            engine.step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            decode_steps(engine, 10)
        runner.graphs = graphs
        kernel_text = profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.kernels,
                                                    max_name_column_width=70)
        parts.on = True

    runner, model = engine.core.runner, engine.core.model
    # Same run, A/B: the decode steps run eagerly (no graphs), with the fused layer ops and with torch's.
    eager: dict[str, dict] = {}
    graphs, runner.graphs = runner.graphs, None
    for label, fused in (("fused layer ops", True), ("torch's ops", False)):
        model.fuse_layer_ops = fused
        parts.on = False
        decode_steps(engine, 3)
        parts.on = True
        parts.reset()
        times = decode_steps(engine, 20)
        device_times = parts.device_seconds()
        eager[label] = {"ms_p50": round(1000 * statistics.median(times), 3),
                        "device_ms_p50": round(1000 * statistics.median(device_times), 3) if device_times else None}
    model.fuse_layer_ops = True
    runner.graphs = graphs

    mixed: dict[str, dict] = {}
    for n, chunk in enumerate(CHUNKS):
        for label, hide_graphs in (("graphs", False), ("eager", True)):
            if hide_graphs:
                runner.graphs = None
            times, paths, device_times = [], set(), []
            for r in range(args.mixed_rounds + 1):
                own = [(7 * r + 13 * n + k) % 20_000 + 100 for k in range(chunk)]  # past the cached system prompt
                rid = f"new-{label}-{chunk}-{r}"
                engine.add_request(rid, prompts[0][:-len(own)] + own if len(prompts[0]) > chunk else own,
                                   SamplingParams(temperature=0, max_tokens=1))
                parts.reset()
                t0 = time.perf_counter()
                engine.step()
                seconds = time.perf_counter() - t0
                if r:  # the first round compiles what is new
                    times.append(seconds)
                    device_times += parts.device_seconds()
                    paths.add(runner.last_path)
                engine.abort_request(rid)
                engine.step()  # back to the decodes alone
            runner.graphs = graphs
            mixed[f"{chunk} {label}"] = {
                "chunk": chunk, "ms_p50": round(1000 * statistics.median(times), 3), "paths": sorted(paths),
                "device_ms_p50": round(1000 * statistics.median(device_times), 3) if device_times else None}

    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    weights = weight_bytes(folder)
    read_ms = 1000 * weights / bandwidth if bandwidth else None
    step_ms = 1000 * statistics.median(walls)
    core_ms = 1000 * host.get("engine core step (engine.serve's core loop; no text)", 0) / args.steps
    forward_ms = 1000 * statistics.median(forward) if forward else None
    where = device_name(device) + (f" (host: {cpu_model()})" if device.type == "cuda" else "")
    print(f"{args.chats} chats decoding, {args.model} in {dtype} on {where}; {args.steps} steps, path {path!r}")
    print(f"{'what':<48} {'ms':>9}")
    print(f"{'decode step, wall (p50)':<48} {step_ms:>9.3f}")
    print(f"{'decode step, wall (p90)':<48} {1000 * sorted(walls)[int(0.9 * len(walls))]:>9.3f}")
    if forward_ms is not None:
        print(f"{'  its forward on the device (p50, events)':<48} {forward_ms:>9.3f}")
    for label, total in sorted(host.items(), key=lambda kv: -kv[1]):
        print(f"{'  ' + label + ' (mean)':<48} {1000 * total / args.steps:>9.3f}")
    if read_ms is not None:
        print(f"{'the weights read once (' + f'{weights / 1e9:.2f} GB at {bandwidth / 1e9:,.0f} GB/s copy)':<48} "
              f"{read_ms:>9.3f}")
        print(f"{'  as a share of the decode step':<48} {read_ms / step_ms:>9.1%}")
        if core_ms:
            print(f"{'  as a share of the engine core step':<48} {read_ms / core_ms:>9.1%}")
    for label, m in eager.items():
        print(f"{'decode step, eager, ' + label + ' (p50)':<48} {m['ms_p50']:>9.3f}"
              + (f"   forward {m['device_ms_p50']:.3f}" if m["device_ms_p50"] is not None else ""))
    for label, m in mixed.items():
        text = f"{args.chats} decodes + a {m['chunk']}-token chunk, wall (p50)"
        print(f"{text:<48} {m['ms_p50']:>9.3f}   path {','.join(m['paths'])}"
              + (f", forward {m['device_ms_p50']:.3f}" if m["device_ms_p50"] is not None else ""))
    if kernel_text:
        print(f"\nDevice time by kernel over 10 decode steps run eagerly (torch.profiler):\n{kernel_text}")
    if profile_text:
        print(f"\nOwn time over {args.steps} decode steps (cProfile; its own cost inflates every figure):")
        print("\n".join(line for line in profile_text.splitlines() if line.strip())[:6000])
    figures = {"model": args.model, "dtype": dtype, "device": device.type, "device_name": device_name(device),
               "host_cpu": cpu_model(), "chats": args.chats, "steps": args.steps, "path": path,
               "step_ms_p50": round(step_ms, 3), "forward_ms_p50": round(forward_ms, 3) if forward_ms else None,
               "host_ms_mean": {k: round(1000 * v / args.steps, 3) for k, v in host.items()},
               "weight_bytes": weights, "copy_gb_s": round(bandwidth / 1e9, 1) if bandwidth else None,
               "weights_read_ms": round(read_ms, 3) if read_ms else None,
               "weights_read_share": round(read_ms / step_ms, 4) if read_ms else None,
               "core_step_ms_mean": round(core_ms, 3),
               "weights_read_share_of_core_step": round(read_ms / core_ms, 4) if read_ms and core_ms else None,
               "eager_decode": eager, "mixed": mixed,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
