"""Does one user's heavy request stall another user's stream? Through a real `python -m
engine.serve` (started here on a free loopback port, or `--base-url`): one chat streams a long
reply while another request does its heavy work — a large body (7.5 MB of text by default) sent
to /tokenize, or (`--probe grammar`) a chat constrained by a JSON schema whose grammar takes a
second or more to compile; the stream's largest gap between chunks meanwhile is set beside its
gaps before it.

    .venv/bin/python benchmarks/stream_stall.py [--probe tokenize|grammar] [--megabytes 7.5] [--rounds 3]

Prints, per round, the probe's seconds (and the tokenize's token count) and the stream's largest
gap during it (goal: under 1 s) against its p99 gap before it, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve  # noqa: E402  (benchmarks/serve.py: free_port, wait_healthy, warm)
from machine import cpu_model  # noqa: E402
from peers.serve_compare import wait_compiled as compiled_wait  # noqa: E402

TEXT = "Paged attention keeps every sequence's keys in fixed-size blocks, so memory is never wasted. "


class Stream:
    """One streamed chat reply, read on a thread of its own; the arrival time of each chunk."""

    def __init__(self, url: str, tokens: int) -> None:
        self.arrivals: list[float] = []
        self.done = threading.Event()
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": tokens,
                "ignore_eos": True, "temperature": 0.0, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data:"):
                        self.arrivals.append(time.monotonic())
        finally:
            self.done.set()

    def gaps(self, start: float, end: float) -> list[tuple[float, float]]:
        """Every wait for a chunk within [start, end], counting from `start` to the first chunk
        and from the last chunk before `end` to the first one after it: (seconds, when it began
        counted from `start`)."""
        inside = [t for t in self.arrivals if start < t < end]
        after = next((t for t in self.arrivals if t >= end), None)
        times = [start] + inside + ([after] if after is not None else [])
        return [(b - a, a - start) for a, b in zip(times, times[1:])]


def slow_schema(fields: int) -> dict:
    """A JSON schema whose grammar compiles slowly: `fields` required strings, each with a pattern
    (~0.9 s for 60 of them at SmolLM2's 49,152-token vocabulary on a 2-core Intel Xeon). Each round
    names its fields anew, so no compiled grammar is reused."""
    tag = f"{time.monotonic_ns() % 10**6}"
    names = [f"field_{tag}_{i}" for i in range(fields)]
    return {"type": "object", "properties": {n: {"type": "string", "pattern": "[a-z]{3,9}-[0-9]{2,4}"} for n in names},
            "required": names, "additionalProperties": False}


def tokenize_probe(url: str, text: str) -> dict:
    body = json.dumps({"prompt": text}).encode()  # before the clock starts: this process reads the stream too
    start = time.monotonic()
    answer = httpx.post(f"{url}/tokenize", content=body, headers={"content-type": "application/json"}, timeout=600)
    end = time.monotonic()
    answer.raise_for_status()
    return {"start": start, "end": end, "tokens": answer.json()["count"]}


def grammar_probe(url: str, fields: int) -> dict:
    """A constrained chat asked for one token: its time is the grammar's compile and one step."""
    body = json.dumps({"messages": [{"role": "user", "content": "A record, please."}], "max_tokens": 1,
                       "temperature": 0.0, "response_format": {"type": "json_schema", "json_schema": {
                           "name": "record", "schema": slow_schema(fields)}}}).encode()
    start = time.monotonic()
    answer = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                        timeout=600)
    end = time.monotonic()
    answer.raise_for_status()
    return {"start": start, "end": end, "tokens": answer.json()["usage"]["completion_tokens"]}


def one_round(url: str, probe, tokens: int) -> dict:
    stream = Stream(url, tokens)
    deadline = time.monotonic() + 300
    while len(stream.arrivals) < 20:
        if stream.done.is_set() or time.monotonic() > deadline:
            raise SystemExit("the stream did not start")
        time.sleep(0.01)
    before_from = stream.arrivals[-1]
    time.sleep(1.0)
    before = [gap for gap, _ in stream.gaps(before_from, stream.arrivals[-1])]
    done = probe(url)
    start, end = done["start"], done["end"]
    while not stream.done.is_set() and not any(t >= end for t in stream.arrivals):
        time.sleep(0.01)
    during = stream.gaps(start, end)
    stream.thread.join(timeout=600)
    largest, at = max(during)
    return {"probe_s": round(end - start, 2), "tokens": done["tokens"], "largest_gap_s": round(largest, 3),
            "largest_gap_at_s": round(at, 2), "gap_p99_before_s": round(serve.pct(before, 0.99), 3),
            "chunks_during": len(during) - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="a running server (default: start engine.serve here)")
    parser.add_argument("--probe", choices=("tokenize", "grammar"), default="tokenize")
    parser.add_argument("--megabytes", type=float, default=7.5, help="the /tokenize body's size")
    parser.add_argument("--fields", type=int, default=120, help="the slow schema's fields (--probe grammar)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stream-tokens", type=int, default=2000, help="the streamed reply's length")
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()
    text = (TEXT * int(args.megabytes * 1e6 / len(TEXT) + 1))[:int(args.megabytes * 1e6)]
    server = None
    url = args.base_url
    if url is None:
        port = serve.free_port()
        command = [sys.executable, "-m", "engine.serve", "--port", str(port)]
        if args.dtype:
            command += ["--dtype", args.dtype]
        server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        serve.wait_healthy(server, f"{url}/health", 300, "engine.serve")
        target = serve.Target("openai", f"{url}/v1").prepare()
        serve.warm(target, 2)  # its first step starts the compiled steps' load: wait until they serve
        waited, ready = compiled_wait(url + "/", 900)
        if not ready:
            print(f"compiled steps still pending after {waited:.0f} s; going on", flush=True)
    try:
        if args.probe == "tokenize":
            probe, what = (lambda base: tokenize_probe(base, text)), f"/tokenize of {args.megabytes:g} MB"
        else:
            probe, what = (lambda base: grammar_probe(base, args.fields)), f"a {args.fields}-field schema's grammar"
        rounds = [one_round(url.rstrip("/"), probe, args.stream_tokens) for _ in range(args.rounds)]
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    print(f"{cpu_model()}; {what} while one chat streams ({url})")
    print(f"{'round':>5} {'probe s':>11} {'tokens':>9} {'largest gap s':>14} {'at s':>6} {'p99 gap before s':>17} "
          f"{'chunks':>7}")
    for i, r in enumerate(rounds, 1):
        print(f"{i:>5} {r['probe_s']:>11} {r['tokens']:>9} {r['largest_gap_s']:>14} {r['largest_gap_at_s']:>6} "
              f"{r['gap_p99_before_s']:>17} {r['chunks_during']:>7}")
    worst = max(r["largest_gap_s"] for r in rounds)
    print(f"largest gap of any round: {worst} s (goal < 1 s)")
    print(json.dumps({"cpu": cpu_model(), "probe": args.probe, "megabytes": args.megabytes, "fields": args.fields,
                      "rounds": rounds, "largest_gap_s": worst,
                      "median_probe_s": statistics.median(r["probe_s"] for r in rounds)}))


if __name__ == "__main__":
    main()
