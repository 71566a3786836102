"""HTTP load against any OpenAI-compatible server: open-loop Poisson arrivals at given request
rates, chats that share system prompts and come back for follow-up turns, streamed.

    python benchmarks/serve.py                               # starts `python -m engine.serve` itself
    python benchmarks/serve.py --rates 0.5,1,2 --duration-s 60
    python benchmarks/serve.py --base-url http://127.0.0.1:8080/v1 --api-key KEY   # llama-server, vLLM, ...

Open loop: arrivals follow the clock (exponential gaps at the rate), not the replies, so a server
slower than the rate shows it in growing latencies instead of a slower client. Each arrival is a
new chat (one of a few shared system prompts and a question) or, half the time, the next turn of
a chat whose last turn has finished (its history plus the reply). Reports per rate: requests
completed and failed, request throughput, output tokens/s, time to first token and inter-token
latency p50/p99, and the share of prompt tokens the server says it served from its cache.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import cpu_model  # noqa: E402

SYSTEM_PROMPTS = (
    "You are a helpful assistant. Answer clearly and concisely, and say so when you are unsure.",
    "You are a patient teacher. Explain ideas step by step with one short example each time.",
    "You are a travel guide who knows many cities. Suggest places, times to visit, and what to eat.",
    "You are a careful code reviewer. Point out bugs first, then style, and keep comments short.",
)
TOPICS = ("lighthouses", "paged attention", "sourdough bread", "the Roman empire", "hash tables", "tides",
          "jazz harmony", "solar panels", "Lisbon", "binary search", "volcanoes", "chess openings")
ASKS = ("Tell me about {}.", "What should a beginner know about {}?", "Give me three facts about {}.",
        "Explain {} to a ten-year-old.", "What is surprising about {}?")
FOLLOW_UPS = ("Can you say more?", "Give me an example.", "Why is that?", "Summarise that in one sentence.")


@dataclass
class Result:
    ok: bool
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


class Chats:
    """The conversations: new ones, and finished ones waiting for their next turn."""

    def __init__(self, rng: random.Random, max_turns: int) -> None:
        self.rng = rng
        self.max_turns = max_turns
        self.ready: list[list[dict]] = []

    def next_messages(self) -> list[dict]:
        if self.ready and self.rng.random() < 0.5:
            history = self.ready.pop(self.rng.randrange(len(self.ready)))
            return history + [{"role": "user", "content": self.rng.choice(FOLLOW_UPS)}]
        question = self.rng.choice(ASKS).format(self.rng.choice(TOPICS))
        return [{"role": "system", "content": self.rng.choice(SYSTEM_PROMPTS)}, {"role": "user", "content": question}]

    def finished(self, messages: list[dict], reply: str) -> None:
        if sum(m["role"] == "user" for m in messages) < self.max_turns:
            self.ready.append(messages + [{"role": "assistant", "content": reply}])


async def one_request(http: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int,
                      chats: Chats) -> Result:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.7, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    result, last, text = Result(ok=False), None, []
    try:
        async with http.stream("POST", "chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.cached_tokens = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if last is None:
                            result.ttft_s = now - started
                        else:
                            result.gaps_s.append(now - last)
                        last = now
                        text.append(piece)
        result.ok = result.ttft_s is not None
        if result.ok:
            chats.finished(messages, "".join(text))
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = type(error).__name__
    return result


async def run_rate(base_url: str, api_key: str | None, model: str, rate: float, duration_s: float, max_tokens: int,
                   seed: int) -> dict:
    rng = random.Random(seed)
    chats = Chats(rng, max_turns=4)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", headers=headers, timeout=600, limits=limits) as http:
        tasks = []
        started = time.perf_counter()
        next_at = 0.0
        while next_at < duration_s:
            delay = started + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(http, model, chats.next_messages(), max_tokens, chats)))
            next_at += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
    done = [r for r in results if r.ok]
    gaps = [g for r in done for g in r.gaps_s]
    prompt = sum(r.prompt_tokens for r in done)
    return {"rate": rate, "sent": len(results), "completed": len(done), "failed": len(results) - len(done),
            "errors": sorted({r.error for r in results if r.error}), "wall_s": round(wall, 1),
            "req_per_s": round(len(done) / wall, 3), "output_tok_s": round(sum(r.output_tokens for r in done) / wall, 1),
            "ttft_p50_s": pct([r.ttft_s for r in done], 0.5), "ttft_p99_s": pct([r.ttft_s for r in done], 0.99),
            "itl_p50_ms": ms(pct(gaps, 0.5)), "itl_p99_ms": ms(pct(gaps, 0.99)),
            "cached_share": round(sum(r.cached_tokens for r in done) / prompt, 3) if prompt else None}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def start_engine_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "engine.serve", "--port", str(port)]
    if args.model:
        command += ["--model", args.model]
    if args.num_gpu_blocks:
        command += ["--num-gpu-blocks", str(args.num_gpu_blocks)]
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"engine.serve exited: {server.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server, f"http://127.0.0.1:{port}/v1"
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            raise RuntimeError("engine.serve did not come up in 300 s")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="an OpenAI-compatible /v1 URL (default: start engine.serve)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--model", default=None, help="engine.serve's --model when it is started here")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="engine.serve's pool when started here")
    parser.add_argument("--rates", default="0.5,1,2", help="request rates to run, per second, comma-separated")
    parser.add_argument("--duration-s", type=float, default=60.0, help="arrivals per rate last this long")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    server = None
    base_url = args.base_url
    if base_url is None:
        server, base_url = start_engine_server(args)
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=30).json()["data"][0]["id"]
        rows = [asyncio.run(run_rate(base_url, args.api_key, model, float(rate), args.duration_s, args.max_tokens,
                                     args.seed)) for rate in args.rates.split(",")]
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)

    print(f"{model} at {base_url} — {cpu_model()}, {args.duration_s:.0f} s of arrivals per rate, "
          f"{args.max_tokens} new tokens at most")
    print(f"{'rate/s':>7} {'sent':>5} {'done':>5} {'fail':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'cached':>7}")
    for r in rows:
        def s(x):
            return "-" if x is None else f"{x:.2f}s"

        def m(x):
            return "-" if x is None else f"{x:.0f}ms"
        cached = "-" if r["cached_share"] is None else f"{100 * r['cached_share']:.0f}%"
        print(f"{r['rate']:>7} {r['sent']:>5} {r['completed']:>5} {r['failed']:>5} {r['req_per_s']:>7} "
              f"{r['output_tok_s']:>10} {s(r['ttft_p50_s']):>9} {s(r['ttft_p99_s']):>9} {m(r['itl_p50_ms']):>8} "
              f"{m(r['itl_p99_ms']):>8} {cached:>7}")
    print(json.dumps({"model": model, "base_url": base_url, "cpu": cpu_model(), "duration_s": args.duration_s,
                      "max_tokens": args.max_tokens, "rates": rows}))


if __name__ == "__main__":
    main()
