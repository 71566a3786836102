"""What constrained decoding costs a serving engine: 32 concurrent streamed chats, each a short
prompt asking for a JSON object, with 0, 16 and 32 of them constrained by a JSON schema
(`response_format: json_schema`) and the rest free (the same prompts, no response_format).

    .venv/bin/python benchmarks/structured.py --start ours,vllm          # starts each server in turn
    .venv/bin/python benchmarks/structured.py --base-url http://127.0.0.1:8000/v1 --label ours \\
        --base-url http://127.0.0.1:8100/v1 --label vllm                 # servers already running
    .venv/bin/python benchmarks/structured.py --start vllm --rounds 1 --chats 8   # a quick look

Every reply is told to be exactly `--max-tokens` (64) long where the server takes it
(`max_tokens = min_tokens`, `ignore_eos`: ours and vLLM do), so the mixes do the same work. A
constrained reply may still end early, when its JSON is complete and the grammar allows nothing
else: output tokens are counted per request from the server's `usage`, and every tok/s is made
from those counts.

One round sends the mixes one after another, each as 32 requests at once (index i constrained
when the mix's share of the first i+1 requests reaches a new whole one: 16 of 32 are the odd
ones); `--rounds` repeats that, and a mix's figures pool its rounds. Before the rounds each
schema is asked for once, short, so that compiling a grammar is not in the figures (a server
caches compiled grammars: what is measured is constrained serving, not compilation). Four
schemas rotate over a mix's constrained chats.

Per target and mix: requests done and failed; output tok/s of all requests (tokens over the
rounds' wall time, from sending to the last reply's end), and the constrained and the free
requests' shares of it (their tokens over the same wall time: the two add up to the total);
ITL p50/p99 (gaps between streamed chunks that carried text) of the free requests and of the
constrained ones; how the requests finished (stop / length), per kind; and how many
constrained replies parse and validate against their schema (a server that ignores
`response_format` shows it here; but a reply forced to 64 tokens is mostly cut before its JSON
closes, so that count means something with `--eos-ends` or a larger `--max-tokens`). The
client is benchmarks/serve.py's minimal asyncio HTTP client (its CPU cost is small and the
same for every server).

Goals, printed as met / not met (or not run, when a figure is missing):
- ours all-constrained output tok/s >= 0.9x ours all-free;
- ours free requests' ITL p99 in the half-constrained mix <= 1.1x the all-free mix's;
- ours constrained tok/s >= vLLM's on the same requests (the all-constrained mix).

`--start ours,vllm`: `python -m engine.serve` and vLLM CPU (benchmarks/peers/vllm_cpu.sh serve,
its own venv; it compiles for 1-2 min at start) one after the other on free loopback ports, both
in the dtype our engine's `auto` picks on this CPU (`--dtype` to choose), ours after its compiled
decode steps are ready; each is stopped (its whole process group) before the next starts. Their
logs go to benchmarks/peers/.build/serve-logs/structured-<name>.log. Prints a table with the CPU
model, the goals, then one JSON line with every figure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(1, str(ROOT))

import serve  # noqa: E402  (benchmarks/serve.py: the HTTP client, percentiles, free ports)
from machine import cpu_model  # noqa: E402
from schema_check import assert_readable, judge  # noqa: E402

TEMPERATURE = 0.7
STARTABLE = ("ours", "vllm")

TOPICS = ("lighthouses", "paged attention", "sourdough bread", "the Roman empire", "hash tables", "tides",
          "jazz harmony", "solar panels", "Lisbon", "binary search", "volcanoes", "chess openings",
          "honeybees", "the printing press", "black holes", "origami")
ASKS = ("Describe {} as a JSON object.", "Give me the key facts about {} as JSON.")

STRING = {"type": "string"}
SCHEMAS: dict[str, dict] = {
    "summary": {"type": "object", "additionalProperties": False, "required": ["title", "summary", "facts"],
                "properties": {"title": STRING, "summary": STRING,
                               "facts": {"type": "array", "items": STRING, "maxItems": 5}}},
    "card": {"type": "object", "additionalProperties": False, "required": ["name", "category", "rating", "pros"],
             "properties": {"name": STRING, "category": {"type": "string", "enum": ["science", "history", "food",
                                                                                   "music", "places", "other"]},
                            "rating": {"type": "number"}, "pros": {"type": "array", "items": STRING, "maxItems": 4}}},
    "quiz": {"type": "object", "additionalProperties": False, "required": ["question", "answer", "difficulty"],
             "properties": {"question": STRING, "answer": STRING, "difficulty": {"type": "integer"},
                            "hint": STRING}},
    "entry": {"type": "object", "additionalProperties": False, "required": ["topic", "details"],
              "properties": {"topic": STRING, "is_popular": {"type": "boolean"},
                             "details": {"type": "object", "additionalProperties": False,
                                         "required": ["origin", "description"],
                                         "properties": {"origin": STRING, "description": STRING}}}},
}
for _schema in SCHEMAS.values():
    assert_readable(_schema)


@dataclass
class Ask:
    """One chat of the batch: its prompt and, when constrained, its schema's name."""
    prompt: str
    schema: str | None = None

    @property
    def constrained(self) -> bool:
        return self.schema is not None


def prompts(chats: int) -> list[str]:
    return [ASKS[i // len(TOPICS) % len(ASKS)].format(TOPICS[i % len(TOPICS)]) for i in range(chats)]


def constrained_indices(chats: int, constrained: int) -> list[int]:
    """Which of `chats` requests carry a schema, spread evenly (16 of 32: the odd ones)."""
    return [i for i in range(chats) if (i + 1) * constrained // chats > i * constrained // chats]


def batch(chats: int, constrained: int) -> list[Ask]:
    """The mix's requests: the same prompts every mix, a schema on `constrained` of them."""
    rank = {i: k for k, i in enumerate(constrained_indices(chats, constrained))}  # the schemas rotate over these
    names = list(SCHEMAS)
    return [Ask(p, names[rank[i] % len(names)] if i in rank else None) for i, p in enumerate(prompts(chats))]


def request_body(model: str, ask: Ask, max_tokens: int, exact: bool) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": ask.prompt}], "max_tokens": max_tokens,
            "temperature": TEMPERATURE, "stream": True, "stream_options": {"include_usage": True}}
    if exact:  # the same length for every reply, as serve.py asks (vLLM and ours take both)
        body["min_tokens"] = max_tokens
        body["ignore_eos"] = True
    if ask.constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": ask.schema, "schema": SCHEMAS[ask.schema], "strict": True}}
    return body


# ---- one request, one mix -------------------------------------------------------------------------

@dataclass
class Reply:
    """One streamed reply as the client read it."""
    constrained: bool
    ok: bool = False
    error: str | None = None
    tokens: int | None = None  # from usage
    chunks: int = 0  # chunks that carried text
    gaps_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    valid: bool | None = None  # constrained: the text parses and validates against its schema
    text: str = ""


async def stream_one(url: str, headers: dict[str, str], model: str, ask: Ask, max_tokens: int, exact: bool,
                     timeout_s: float) -> Reply:
    reply, pieces, last = Reply(ask.constrained), [], None
    response = None
    try:
        async with asyncio.timeout(timeout_s):
            response = await serve.request(url + "chat/completions", "POST",
                                           request_body(model, ask, max_tokens, exact), headers)
            if response.status != 200:
                reply.error = f"HTTP {response.status}: {(await response.read())[:160].decode(errors='replace')}"
                return reply
            async for now, data in response.events():
                if data.strip() == "[DONE]":
                    continue
                chunk = json.loads(data)
                if chunk.get("error"):
                    reply.error = str(chunk["error"])[:160]
                if usage := chunk.get("usage"):
                    reply.tokens = usage.get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
                    if piece := (choice.get("delta") or {}).get("content"):
                        if last is not None:
                            reply.gaps_s.append(now - last)
                        last = now
                        reply.chunks += 1
                        pieces.append(piece)
        reply.text = "".join(pieces)
        if ask.constrained:
            reply.valid = judge(reply.text, SCHEMAS[ask.schema])[0]
        if reply.error is None and not reply.chunks:
            reply.error = "no reply text"
        reply.ok = reply.error is None
    except (OSError, serve.HTTPError, ValueError, asyncio.IncompleteReadError, TimeoutError) as error:
        reply.error = f"{type(error).__name__}: {str(error)[:100]}"
    finally:
        if response is not None:
            response.close()
    return reply


async def run_batch(target: serve.Target, asks: list[Ask], max_tokens: int, exact: bool,
                    timeout_s: float) -> tuple[list[Reply], float]:
    """Every request at once; the replies and the wall time until the last one ended."""
    started = time.perf_counter()
    replies = await asyncio.gather(*(stream_one(target.url, target.headers, target.model, ask, max_tokens, exact,
                                                timeout_s) for ask in asks))
    return list(replies), time.perf_counter() - started


def warm_schemas(target: serve.Target, timeout_s: float) -> list[str]:
    """Each schema once and one free request, short and one at a time: grammars compiled and
    cached before anything is timed. Returns the errors (a server may refuse response_format)."""
    errors = []
    for ask in [Ask(prompts(1)[0])] + [Ask(prompts(1)[0], name) for name in SCHEMAS]:
        reply = asyncio.run(stream_one(target.url, target.headers, target.model, ask, 8, False, timeout_s))
        if not reply.ok:
            errors.append(f"{ask.schema or 'free'}: {reply.error}")
    return errors


# ---- figures ---------------------------------------------------------------------------------------

def finishes(replies: list[Reply]) -> dict[str, int]:
    return dict(sorted(Counter(r.finish_reason or "none" for r in replies if r.ok).items()))


def mix_figures(constrained: int, rounds: list[tuple[list[Reply], float]]) -> dict:
    """One mix's figures, its rounds pooled: tokens over summed wall time, percentiles over all gaps."""
    replies = [r for done, _ in rounds for r in done]
    wall = sum(w for _, w in rounds)
    ok = [r for r in replies if r.ok]

    def tokens(kind: list[Reply]) -> int:
        return sum(r.tokens if r.tokens is not None else r.chunks for r in kind)

    kinds = {"constrained": [r for r in ok if r.constrained], "free": [r for r in ok if not r.constrained]}
    figures = {"constrained": constrained, "requests": len(replies), "done": len(ok), "failed": len(replies) - len(ok),
               "errors": sorted({r.error for r in replies if r.error})[:3], "wall_s": round(wall, 2),
               "tokens": tokens(ok), "tok_s": round(tokens(ok) / wall, 1) if wall else None,
               "tokens_from": "usage" if all(r.tokens is not None for r in ok) else "usage+chunks"}
    for kind, done in kinds.items():
        gaps = [g for r in done for g in r.gaps_s]
        figures[f"{kind}_tok_s"] = round(tokens(done) / wall, 1) if wall and done else None
        figures[f"{kind}_tokens_per_reply"] = round(tokens(done) / len(done), 1) if done else None
        figures[f"itl_{kind}_p50_ms"] = serve.ms(serve.pct(gaps, 0.5))
        figures[f"itl_{kind}_p99_ms"] = serve.ms(serve.pct(gaps, 0.99))
        figures[f"finish_{kind}"] = finishes(done)
    figures["constrained_valid"] = sum(bool(r.valid) for r in kinds["constrained"])
    return figures


def goals(targets: dict[str, dict], chats: int) -> dict[str, dict]:
    """The three goals from the targets labelled `ours` and `vllm`: met True/False, or None when
    a figure they need is missing."""
    def mix(label: str, constrained: int) -> dict:
        return (targets.get(label) or {}).get("mixes", {}).get(str(constrained)) or {}

    def goal(ours: float | None, bound: float | None, factor: float, at_most: bool) -> dict:
        if ours is None or bound is None:
            return {"met": None, "ours": ours, "bound": bound}
        met = ours <= factor * bound if at_most else ours >= factor * bound
        return {"met": met, "ours": ours, "bound": round(factor * bound, 2)}

    half = chats // 2
    return {
        f"ours {chats}-constrained tok/s >= 0.9x ours {chats}-free":
            goal(mix("ours", chats).get("tok_s"), mix("ours", 0).get("tok_s"), 0.9, at_most=False),
        f"ours free ITL p99 in {half}+{chats - half} <= 1.1x all-free":
            goal(mix("ours", half).get("itl_free_p99_ms"), mix("ours", 0).get("itl_free_p99_ms"), 1.1, at_most=True),
        "ours constrained tok/s >= vLLM's":
            goal(mix("ours", chats).get("constrained_tok_s"), mix("vllm", chats).get("constrained_tok_s"), 1.0,
                 at_most=False),
    }


HEADER = (f"{'target':<8} {'constr':>6} {'done':>5} {'fail':>4} {'tok/s':>7} {'c tok/s':>8} {'f tok/s':>8} "
          f"{'ITL free p50/p99':>17} {'ITL constr p50/p99':>19} {'c tok/reply':>11} {'finish constr':>18} "
          f"{'finish free':>16} {'valid':>7}")


def table_row(label: str, f: dict) -> str:
    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:g}"

    def itl(kind: str) -> str:
        return f"{num(f[f'itl_{kind}_p50_ms'])}/{num(f[f'itl_{kind}_p99_ms'])}ms"

    def fin(kind: str) -> str:
        return " ".join(f"{k} {v}" for k, v in f[f"finish_{kind}"].items()) or "-"
    constrained_done = sum(f["finish_constrained"].values())
    valid = f"{f['constrained_valid']}/{constrained_done}" if constrained_done else "-"
    return (f"{label:<8} {f['constrained']:>6} {f['done']:>5} {f['failed']:>4} {num(f['tok_s']):>7} "
            f"{num(f['constrained_tok_s']):>8} {num(f['free_tok_s']):>8} {itl('free'):>17} {itl('constrained'):>19} "
            f"{num(f['constrained_tokens_per_reply']):>11} {fin('constrained'):>18} {fin('free'):>16} {valid:>7}")


def report(targets: dict[str, dict], settings: dict) -> str:
    """The readable part: settings and CPU, a row per target and mix, missing targets, goals."""
    exact = (f"exactly {settings['max_tokens']} new tokens where the server takes min_tokens/ignore_eos"
             if settings["exact"] else f"at most {settings['max_tokens']} new tokens")
    lines = [f"structured output under load — {settings['chats']} concurrent streamed chats, {exact}, "
             f"{settings['rounds']} round(s), temperature {TEMPERATURE} — {settings['cpu']}"
             + (f", dtype {settings['dtype']}" if settings.get("dtype") else ""), HEADER]
    for label, target in targets.items():
        if "missing" in target:
            lines.append(f"{label:<8} not run: {target['missing']}")
            continue
        for f in target["mixes"].values():
            lines.append(table_row(label, f))
    lines.append("(c/f tok/s: the constrained / free requests' tokens over the same wall time; valid: "
                 "constrained replies that parse and validate against their schema)")
    for name, g in goals(targets, settings["chats"]).items():
        verdict = {True: "met", False: "NOT met", None: "not run"}[g["met"]]
        lines.append(f"goal: {name}: {verdict} (ours {g['ours']}, bound {g['bound']})")
    return "\n".join(lines)


def summary(targets: dict[str, dict], settings: dict) -> dict:
    return {**settings, "temperature": TEMPERATURE, "targets": targets, "goals": goals(targets, settings["chats"])}


# ---- targets ---------------------------------------------------------------------------------------

def measure(target: serve.Target, mixes: list[int], chats: int, rounds: int, max_tokens: int, exact: bool,
            timeout_s: float) -> dict:
    """Warm each schema, then `rounds` rounds of every mix; the target's figures."""
    warm_errors = warm_schemas(target, timeout_s)
    if warm_errors:
        print(f"  warm-up errors: {warm_errors}", file=sys.stderr, flush=True)
    done: dict[int, list[tuple[list[Reply], float]]] = {m: [] for m in mixes}
    for r in range(rounds):
        for m in mixes:
            replies, wall = asyncio.run(run_batch(target, batch(chats, m), max_tokens, exact, timeout_s))
            done[m].append((replies, wall))
            print(f"  round {r + 1} mix {m}/{chats}: {sum(x.ok for x in replies)} done in {wall:.1f} s",
                  file=sys.stderr, flush=True)
    return {"url": target.url, "model": target.model, "warm_errors": warm_errors,
            "mixes": {str(m): mix_figures(m, done[m]) for m in mixes}}


def started_server(name: str, port: int, dtype: str, model: str | None):
    """A serve_compare.Server for `ours` or `vllm` on `port` (imported here: only --start needs it)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    import serve_compare
    root = f"http://127.0.0.1:{port}/"
    if name == "ours":
        command = [sys.executable, "-m", "engine.serve", "--port", str(port), "--dtype", dtype]
        return serve_compare.Server(name, command + (["--model", model] if model else []), "openai", root,
                                    compiled=True)
    return serve_compare.Server(name, ["bash", str(ROOT / "benchmarks" / "peers" / "vllm_cpu.sh"), "serve", str(port)],
                                "openai", root, env={"DTYPE": dtype}, startup_timeout_s=900)


def run_started(name: str, args: argparse.Namespace, mixes: list[int], dtype: str) -> dict:
    """Start the server, measure it, stop its whole process group; {"missing": why} if it never came up."""
    import serve_compare
    server = started_server(name, serve.free_port(), dtype, args.model)
    print(f"== {name}: {' '.join(server.command)}", file=sys.stderr, flush=True)
    running = serve_compare.Running(server, serve_compare.BUILD / "serve-logs" / f"structured-{name}.log")
    try:
        target = serve_compare.start(running, {}, args)
        return measure(target, mixes, args.chats, args.rounds, args.max_tokens, not args.eos_ends, args.request_timeout_s)
    except serve_compare.Missing as missing:
        return {"missing": str(missing)[:400]}
    finally:
        running.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", action="append", default=[], help="an OpenAI-compatible /v1 URL (repeatable)")
    parser.add_argument("--label", action="append", default=[],
                        help="the name of each --base-url, in order (ours, vllm: the goals use these)")
    parser.add_argument("--start", default=None, help="servers to start here, in turn: ours,vllm")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="the model of a server started here (default: the engine's)")
    parser.add_argument("--dtype", default=None, help="servers started here (default: what our auto picks here)")
    parser.add_argument("--chats", type=int, default=32, help="concurrent requests per mix")
    parser.add_argument("--mixes", default=None, help="constrained counts, comma-separated (default: 0,half,all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--eos-ends", action="store_true", help="let EOS end a reply (default: exactly --max-tokens)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--compiled-wait-s", type=float, default=900.0,
                        help="ours, started here: wait this long at most for its compiled decode steps")
    args = parser.parse_args()
    if not args.base_url and not args.start:
        parser.error("give --base-url (and --label) or --start ours,vllm")
    if len(args.label) > len(args.base_url):
        parser.error("more --label than --base-url")
    started = [s for s in (args.start or "").split(",") if s]
    if unknown := set(started) - set(STARTABLE):
        parser.error(f"--start takes {','.join(STARTABLE)}, not {','.join(sorted(unknown))}")
    mixes = sorted({int(m) for m in args.mixes.split(",")} if args.mixes else {0, args.chats // 2, args.chats})
    if any(not 0 <= m <= args.chats for m in mixes):
        parser.error(f"every mix must be between 0 and --chats ({args.chats})")
    serve.raise_open_files_limit()

    dtype = None
    if started:
        sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
        import serve_compare
        dtype = args.dtype or serve_compare.auto_dtype()
    targets: dict[str, dict] = {}
    for i, url in enumerate(args.base_url):
        label = args.label[i] if i < len(args.label) else f"server{i + 1}"
        print(f"== {label}: {url}", file=sys.stderr, flush=True)
        try:
            target = serve.Target("openai", url, args.api_key).prepare()
        except (OSError, ValueError, KeyError, IndexError) as error:
            targets[label] = {"missing": f"{url}: {type(error).__name__}: {error}"[:400]}
            continue
        targets[label] = measure(target, mixes, args.chats, args.rounds, args.max_tokens, not args.eos_ends,
                                 args.request_timeout_s)
    for name in started:
        targets[name] = run_started(name, args, mixes, dtype)

    settings = {"cpu": cpu_model(), "chats": args.chats, "mixes": mixes, "rounds": args.rounds,
                "max_tokens": args.max_tokens, "exact": not args.eos_ends, "dtype": dtype}
    print(report(targets, settings))
    print(json.dumps(summary(targets, settings)))


if __name__ == "__main__":
    main()
