"""Online-serving load: open-loop Poisson arrivals at given request rates, chats that share system
prompts and come back for follow-up turns, every reply streamed and read as a user's client
reads it. Two protocols, one trace:

- `openai` (default): any OpenAI-compatible server's streamed /v1/chat/completions
  (engine.serve, the app's /v1, vLLM, llama-server);
- `gradio`: the chat page's own `send` event through Gradio's queue, the raw protocol a browser
  speaks (POST `gradio_api/queue/join`, then the session's server-sent events from
  `gradio_api/queue/data`), so the page's cost over the API is a number.

    python benchmarks/serve.py                               # starts `python -m engine.serve` itself
    python benchmarks/serve.py --rates 0.5,1,2 --duration-s 60
    python benchmarks/serve.py --base-url http://127.0.0.1:8080/v1 --api-key KEY   # llama-server, vLLM, ...
    python benchmarks/serve.py --protocol gradio --page-url http://127.0.0.1:7860/  # a running app
    python benchmarks/serve.py --protocol gradio              # starts `python app.py` itself
    python benchmarks/serve.py --one-chat-tokens 300          # also one chat alone, first

The trace. Arrivals follow the clock (exponential gaps at the rate, seeded), not the replies, so a
server slower than the rate shows it in growing latencies instead of a slower client. Each
arrival is a new chat (one of the chat page's preset system prompts, `ui.presets.PRESETS`, and a
question) or, half the time, the next turn of a chat whose last turn has finished (up to 4
turns); temperature 0.7, every reply exactly 64 new tokens where the API takes `ignore_eos` and
`min_tokens` (`--eos-ends` lets EOS end a reply, as it always may on the page). On the page a new chat is a new anonymous user
(per-user limits never bite) on the preset by name, so its prompt is shared in the prefix cache
as the API's is; a follow-up passes the conversation id its first turn returned. (A browser also
fires the page's small follow-on events after each turn: the chat list, the buttons, the context
meter. They are not sent here: the figures are the reply's path alone.)

The client. It shares the CPU with the server, so it is a minimal asyncio HTTP/1.1 client (one
connection per request, chunked or sized or close-delimited bodies, SSE `data:` lines split by
hand) and the same for every server; each content-bearing chunk is timestamped when it is read.
Its own CPU seconds per rate are reported (`client_cpu_s`), so its share is a number.

What is measured, per request: TTFT (to the first chunk with reply text; on the page, the first
update whose last assistant message has text) and the gaps between chunks that added text (on
the page, between updates that added text: the page may carry several tokens in one update,
which is what its user sees). A request is *good* when its TTFT <= --ttft-slo-s (1 s) and the
p99 of its own gaps <= --itl-slo-ms (200 ms). Per rate: sent, completed, failed, completed/s,
output tok/s, TTFT p50/p99, ITL p50/p99 over every gap of every request, goodput (good requests
per second of wall time, from the first arrival until the last reply ended), good share (good /
sent), the client's CPU seconds, and the share of prompt tokens the server served from its
cache where it says so. Output tokens come from the usage the server returns (`usage`); the
page returns none, so its replies are re-tokenized after the rate with the app's /tokenize
(`retokenized`: the text's tokens, EOS not counted), or counted as chunks where that is not
served (`chunks`). The JSON line at the end carries everything.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(1, str(ROOT))

from machine import cpu_model  # noqa: E402
from ui.presets import PRESETS  # noqa: E402  (plain data: no Gradio import)

# The chat page's preset prompts: shared by every user on the page, and the API sees the same text.
PRESET_OF = {text: name for name, text in PRESETS.items() if text}
SYSTEM_PROMPTS = tuple(PRESET_OF)
TOPICS = ("lighthouses", "paged attention", "sourdough bread", "the Roman empire", "hash tables", "tides",
          "jazz harmony", "solar panels", "Lisbon", "binary search", "volcanoes", "chess openings")
ASKS = ("Tell me about {}.", "What should a beginner know about {}?", "Give me three facts about {}.",
        "Explain {} to a ten-year-old.", "What is surprising about {}?")
FOLLOW_UPS = ("Can you say more?", "Give me an example.", "Why is that?", "Summarise that in one sentence.")
TEMPERATURE = 0.7
MAX_TURNS = 4

# What the page's chatbot holds after a reply's text (ui/render.py): a footer with its numbers and
# its Markdown source, base64; and how the page shows an error instead of a reply.
PAGE_FOOTER = '\n\n<div class="pc-meta">'
PAGE_SOURCE = re.compile(r'data-source="([A-Za-z0-9+/=]*)"')
PAGE_CACHED = re.compile(r"(\d+) of (\d+) prompt tokens cached")
PAGE_ERROR = "⚠️ **Error:**"
# The page's `send` inputs, in ui/chat.py's order: user id, conversation id, message, preset,
# custom prompt, temperature, top_p, max new tokens.
SEND_INPUTS = 8


# ---- the trace --------------------------------------------------------------------------------

@dataclass
class Chat:
    """One conversation of the trace: its OpenAI messages so far (ending with the user's turn
    being asked), and on the page its user and conversation id."""
    messages: list[dict]
    user_id: str
    conversation_id: int | None = None

    @property
    def system_prompt(self) -> str:
        return self.messages[0]["content"]

    @property
    def question(self) -> str:
        return self.messages[-1]["content"]


class Chats:
    """The conversations: new ones, and finished ones waiting for their next turn."""

    def __init__(self, rng: random.Random, max_turns: int = MAX_TURNS) -> None:
        self.rng = rng
        self.max_turns = max_turns
        self.ready: list[Chat] = []

    def next_chat(self) -> Chat:
        if self.ready and self.rng.random() < 0.5:
            chat = self.ready.pop(self.rng.randrange(len(self.ready)))
            chat.messages.append({"role": "user", "content": self.rng.choice(FOLLOW_UPS)})
            return chat
        question = self.rng.choice(ASKS).format(self.rng.choice(TOPICS))
        return Chat([{"role": "system", "content": self.rng.choice(SYSTEM_PROMPTS)},
                     {"role": "user", "content": question}], user_id=f"anon:{uuid.uuid4().hex}")

    def finished(self, chat: Chat, reply: str) -> None:
        if sum(m["role"] == "user" for m in chat.messages) < self.max_turns:
            chat.messages.append({"role": "assistant", "content": reply})
            self.ready.append(chat)


@dataclass
class Result:
    ok: bool = False
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    chunks: int = 0  # chunks (updates, on the page) that added reply text
    output_tokens: int | None = None  # from the server's usage, where it gives one
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    text: str = ""
    error: str | None = None
    first_at: float | None = None
    last_at: float | None = None
    turn: int = 1  # the chat's turn this request asked (2 and on: a follow-up)

    def saw_text(self, now: float, started: float) -> None:
        if self.first_at is None:
            self.ttft_s = now - started
            self.first_at = now
        else:
            self.gaps_s.append(now - self.last_at)
        self.last_at = now
        self.chunks += 1

    def good(self, ttft_slo_s: float, itl_slo_s: float) -> bool:
        if not self.ok or self.ttft_s is None or self.ttft_s > ttft_slo_s:
            return False
        itl_p99 = pct(self.gaps_s, 0.99)
        return itl_p99 is None or itl_p99 <= itl_slo_s


# ---- a minimal HTTP/1.1 client ------------------------------------------------------------------

class HTTPError(Exception):
    pass


class Response:
    """One request's response on its own connection: status, headers, then the body read as it
    comes (chunked transfer coding, a Content-Length, or until the server closes)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int,
                 headers: dict[str, str]) -> None:
        self.reader, self.writer, self.status, self.headers = reader, writer, status, headers

    async def pieces(self) -> AsyncIterator[bytes]:
        reader = self.reader
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                line = await reader.readline()
                if not line:
                    raise HTTPError("connection closed mid-body")
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                piece = await reader.readexactly(size)
                await reader.readexactly(2)  # the chunk's CRLF
                yield piece
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                piece = await reader.read(min(left, 1 << 16))
                if not piece:
                    raise HTTPError("connection closed mid-body")
                left -= len(piece)
                yield piece
        else:
            while piece := await reader.read(1 << 16):
                yield piece

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.pieces()])

    async def events(self) -> AsyncIterator[tuple[float, str]]:
        """Server-sent events' data, each with the time its last byte was read."""
        pending, data = b"", []
        async for piece in self.pieces():
            now = time.perf_counter()
            pending += piece
            *lines, pending = pending.split(b"\n")
            for line in lines:
                line = line.rstrip(b"\r")
                if not line:
                    if data:
                        yield now, "\n".join(data)
                        data = []
                elif line.startswith(b"data:"):
                    value = line[5:]
                    data.append((value[1:] if value.startswith(b" ") else value).decode())
        if data:
            yield time.perf_counter(), "\n".join(data)

    def close(self) -> None:
        self.writer.close()


async def request(url: str, method: str = "GET", body: dict | None = None,
                  headers: dict[str, str] | None = None) -> Response:
    """Send one request on a new connection (closed after the response) and read its head."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    payload = json.dumps(body).encode() if body is not None else b""
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close", "Accept: */*"]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
    head += [f"{name}: {value}" for name, value in (headers or {}).items()]
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        status_line = await reader.readline()
        if not status_line:
            raise HTTPError("connection closed before a status line")
        status = int(status_line.split(b" ", 2)[1])
        fields: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            fields[name.strip().lower()] = value.strip()
    except BaseException:
        writer.close()
        raise
    return Response(reader, writer, status, fields)


def get_json(url: str, body: dict | None = None, headers: dict[str, str] | None = None, timeout: float = 30) -> dict:
    """A plain blocking request, for what is not timed (models, config, metrics, tokenize)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        return json.loads(response.read())


# ---- the systems' protocols --------------------------------------------------------------------

@dataclass
class Target:
    """Where the trace goes: an OpenAI-compatible /v1 URL, or a chat page's URL (`protocol`)."""
    protocol: str  # "openai" or "gradio"
    url: str  # the /v1 base (openai) or the page (gradio), with a trailing slash
    api_key: str | None = None
    model: str | None = None  # openai: the id /v1/models names
    fn_index: int | None = None  # gradio: the `send` event's id in the page's queue

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/") + "/"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def prepare(self) -> Target:
        """Ask the server what the requests need: the model id, or the `send` event's id."""
        if self.protocol == "openai":
            self.model = get_json(self.url + "models", headers=self.headers)["data"][0]["id"]
        else:
            config = get_json(self.url + "config")
            send = next(d for d in config["dependencies"] if d.get("api_name") == "send")
            if len(send["inputs"]) != SEND_INPUTS:
                raise RuntimeError(f"the page's send event takes {len(send['inputs'])} inputs, not {SEND_INPUTS}: "
                                   "benchmarks/serve.py's page_request must follow ui/chat.py")
            self.fn_index = send["id"]
        return self

    def ask(self, chat: Chat, max_tokens: int, ignore_eos: bool = False,
            timeout_s: float = 600) -> Coroutine[None, None, Result]:
        if self.protocol == "openai":
            return api_request(self, chat, max_tokens, ignore_eos, timeout_s)
        return page_request(self, chat, max_tokens, timeout_s)

    def count_tokens(self, results: list[Result]) -> str:
        """Fill in output tokens where the server gave no usage; says where the counts came from."""
        missing = [r for r in results if r.ok and r.output_tokens is None]
        if not missing:
            return "usage"
        tokenize = self.url + "tokenize" if self.protocol == "gradio" else self.url.removesuffix("v1/") + "tokenize"
        try:
            for r in missing:
                r.output_tokens = get_json(tokenize, {"prompt": r.text}, self.headers)["count"]
            source = "retokenized"
        except (OSError, ValueError, KeyError):
            for r in missing:
                r.output_tokens = r.chunks
            source = "chunks"
        return source if len(missing) == sum(r.ok for r in results) else f"usage+{source}"


async def api_request(target: Target, chat: Chat, max_tokens: int, ignore_eos: bool, timeout_s: float) -> Result:
    body = {"model": target.model, "messages": chat.messages, "max_tokens": max_tokens, "temperature": TEMPERATURE,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:  # exactly max_tokens: vLLM and ours take both; llama-server reads ignore_eos
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    result, text = Result(), []
    started = time.perf_counter()
    response = None
    try:
        async with asyncio.timeout(timeout_s):
            response = await request(target.url + "chat/completions", "POST", body, target.headers)
            if response.status != 200:
                result.error = f"HTTP {response.status}"
                return result
            async for now, data in response.events():
                if data.strip() == "[DONE]":
                    continue
                chunk = json.loads(data)
                if usage := chunk.get("usage"):
                    result.output_tokens = usage.get("completion_tokens")
                    result.prompt_tokens = usage.get("prompt_tokens") or 0
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    if cached is not None:
                        result.cached_tokens = cached
                if result.cached_tokens is None and (timings := chunk.get("timings")) and "cache_n" in timings:
                    result.cached_tokens = timings["cache_n"]  # llama-server's own report
                if chunk.get("error"):
                    result.error = str(chunk["error"])[:200]
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        result.saw_text(now, started)
                        text.append(piece)
        result.text = "".join(text)
        if result.ttft_s is None and result.error is None:
            result.error = "no reply text"
        result.ok = result.error is None
    except (OSError, HTTPError, ValueError, asyncio.IncompleteReadError, TimeoutError) as error:
        result.error = type(error).__name__
    finally:
        if response is not None:
            response.close()
    return result


def apply_diff(value, edits: list):
    """Gradio's streamed output diffs (`[[action, path, value], ...]`: replace, append, add,
    delete), applied in place to what the first update sent whole."""
    for action, path, new in edits:
        if not path:
            value = value + new if action == "append" else new
            continue
        target = value
        for key in path[:-1]:
            target = target[key]
        key = path[-1]
        if action == "replace":
            target[key] = new
        elif action == "append":
            target[key] += new
        elif action == "add":
            if isinstance(target, list):
                target.insert(int(key), new)
            else:
                target[key] = new
        elif action == "delete":
            del target[key]
        else:
            raise ValueError(f"unknown diff action {action!r}")
    return value


def last_reply(chatbot) -> str:
    """The chatbot's last assistant message as shown (its footer dropped), "" when the last
    message is not the assistant's."""
    if not chatbot or not isinstance(chatbot[-1], dict) or chatbot[-1].get("role") != "assistant":
        return ""
    content = chatbot[-1].get("content")
    if isinstance(content, list):  # Gradio 6: [{"type": "text", "text": ...}, ...]
        content = "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


async def page_request(target: Target, chat: Chat, max_tokens: int, timeout_s: float) -> Result:
    session = uuid.uuid4().hex[:11]
    data = [chat.user_id, chat.conversation_id, chat.question, PRESET_OF.get(chat.system_prompt, "Custom"),
            "" if chat.system_prompt in PRESET_OF else chat.system_prompt, TEMPERATURE, 1.0, max_tokens]
    result, outputs, shown = Result(), None, ""
    started = time.perf_counter()
    stream = None
    try:
        async with asyncio.timeout(timeout_s):
            joined = await request(target.url + "gradio_api/queue/join", "POST",
                                   {"data": data, "fn_index": target.fn_index, "session_hash": session,
                                    "event_data": None, "trigger_id": None})
            answer = await joined.read()
            joined.close()
            if joined.status != 200:
                result.error = f"HTTP {joined.status}: {answer[:200].decode(errors='replace')}"
                return result
            stream = await request(f"{target.url}gradio_api/queue/data?session_hash={session}")
            if stream.status != 200:
                result.error = f"HTTP {stream.status} on queue/data"
                return result
            async for now, payload in stream.events():
                message = json.loads(payload)
                kind = message.get("msg")
                if kind == "process_generating":
                    update = message["output"]["data"]
                    if outputs is None:
                        outputs = list(update)
                    else:
                        outputs = [apply_diff(old, edits) for old, edits in zip(outputs, update)]
                elif kind == "process_completed":
                    if not message.get("success", True):
                        result.error = str((message.get("output") or {}).get("error"))[:200]
                        break
                    outputs = message["output"]["data"]
                elif kind in ("unexpected_error", "close_stream", "server_stopped"):
                    result.error = f"{kind}: {str(message.get('message'))[:200]}"
                    break
                else:
                    continue
                reply = last_reply(outputs[0])
                text = reply.split(PAGE_FOOTER, 1)[0]
                if text != shown and text:
                    shown = text
                    result.saw_text(now, started)
                if outputs[1] is not None:
                    chat.conversation_id = int(outputs[1])
                if kind == "process_completed":
                    if reply.startswith(PAGE_ERROR):
                        result.error = reply[:200]
                    elif source := PAGE_SOURCE.search(reply):
                        result.text = base64.b64decode(source.group(1)).decode()
                    else:
                        result.text = text
                    if cached := PAGE_CACHED.search(reply):
                        result.cached_tokens, result.prompt_tokens = int(cached.group(1)), int(cached.group(2))
                    if result.ttft_s is None and result.error is None:
                        result.error = "no reply text"
                    result.ok = result.error is None
                    break
            else:
                result.error = result.error or "the event stream ended before process_completed"
    except (OSError, HTTPError, ValueError, KeyError, IndexError, TypeError, asyncio.IncompleteReadError,
            TimeoutError) as error:
        result.error = f"{type(error).__name__}: {str(error)[:100]}"
    finally:
        if stream is not None:
            stream.close()
    return result


# ---- runs --------------------------------------------------------------------------------------

async def one_turn(target: Target, chat: Chat, max_tokens: int, chats: Chats, timeout_s: float,
                   exact: bool = False) -> Result:
    result = await target.ask(chat, max_tokens, ignore_eos=exact, timeout_s=timeout_s)
    result.turn = sum(m["role"] == "user" for m in chat.messages)
    if result.ok:
        chats.finished(chat, result.text)
    return result


async def arrivals(target: Target, rate: float, duration_s: float, max_tokens: int, seed: int,
                   timeout_s: float, exact: bool, min_requests: int = 0) -> tuple[list[Result], float]:
    rng = random.Random(seed)
    chats = Chats(rng)
    tasks = []
    started = time.perf_counter()
    next_at = 0.0
    while next_at < duration_s or len(tasks) < min_requests:
        delay = started + next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one_turn(target, chats.next_chat(), max_tokens, chats, timeout_s, exact)))
        next_at += rng.expovariate(rate)
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - started


MIN_REQUESTS = 20  # a rate is judged on at least this many requests: see run_rate


def run_rate(target: Target, rate: float, duration_s: float, max_tokens: int = 64, seed: int = 0,
             ttft_slo_s: float = 1.0, itl_slo_ms: float = 200.0, timeout_s: float = 600, exact: bool = True,
             min_requests: int = MIN_REQUESTS) -> dict:
    """The trace at `rate` requests/s for `duration_s` of arrivals, and on until `min_requests`
    have arrived, and its figures. `exact`: every reply `max_tokens` long where the API can be told
    so (not on the page). Why a least count: at a quarter of a request a second, 30 s hold about 8
    requests, and the 95% bar then means every one of them; a single stall of the shared machine
    decides the rate. With 20, one request may miss, as one in twenty may at any rate."""
    cpu, started = time.process_time(), time.perf_counter()
    results, wall = asyncio.run(arrivals(target, rate, duration_s, max_tokens, seed, timeout_s, exact, min_requests))
    cpu, ended = time.process_time() - cpu, time.perf_counter()
    tokens_from = target.count_tokens(results)  # after the window: not timed, not the client's share
    done = [r for r in results if r.ok]
    good = [r for r in done if r.good(ttft_slo_s, itl_slo_ms / 1000)]
    gaps = [g for r in done for g in r.gaps_s]
    with_cache = [r for r in done if r.cached_tokens is not None and r.prompt_tokens]
    prompt = sum(r.prompt_tokens for r in with_cache)
    return {"rate": rate, "exact": exact and target.protocol == "openai", "sent": len(results), "follow_ups": sum(r.turn > 1 for r in results),
            "completed": len(done), "failed": len(results) - len(done),
            "errors": sorted({r.error for r in results if r.error})[:5], "wall_s": round(wall, 1),
            # The window on the monotonic clock a server's step log also uses (benchmarks/step_log.py).
            "window": [round(started, 3), round(ended, 3)],
            "req_per_s": round(len(done) / wall, 3),
            "output_tok_s": round(sum(r.output_tokens or 0 for r in done) / wall, 1), "output_tokens_from": tokens_from,
            "ttft_p50_s": pct([r.ttft_s for r in done], 0.5), "ttft_p99_s": pct([r.ttft_s for r in done], 0.99),
            "itl_p50_ms": ms(pct(gaps, 0.5)), "itl_p99_ms": ms(pct(gaps, 0.99)),
            "good": len(good), "goodput_req_s": round(len(good) / wall, 3),
            # Why the others were not good (a request may miss both).
            "ttft_missed": sum(r.ttft_s > ttft_slo_s for r in done),
            "itl_missed": sum(bool(r.gaps_s) and pct(r.gaps_s, 0.99) > itl_slo_ms / 1000 for r in done),
            "good_share": round(len(good) / len(results), 3) if results else None,
            "client_cpu_s": round(cpu, 2), "client_cpu_share": round(cpu / wall, 3),
            "cached_share": round(sum(r.cached_tokens for r in with_cache) / prompt, 3) if prompt else None}


SUSTAINED = 0.95  # a rate is sustained when at least this share of its requests is good
REFINE = 1.25     # the climb narrows the highest sustained rate to within this factor of the first unsustained one


def sustained(row: dict) -> bool:
    return (row["good_share"] or 0) >= SUSTAINED


def climb(run: Callable[[float], dict], rates: list[float], refine: float = REFINE,
          past_limit: tuple[float, ...] = (), rechecks: int = 2) -> dict:
    """Rates in increasing order until the first one whose good share is under SUSTAINED; then
    rates between the highest sustained one and that one (the geometric mean of the two, again)
    until they are at most `refine` apart; then, past the limit, each multiple in `past_limit` of
    the highest sustained rate (how gently the system degrades). `run(rate)` gives a rate's row.

    A server's good share is not monotonic in the rate: one trace's burst can fail a rate that a
    higher one passes. When a rate past the limit is sustained, the limit found was such a dip,
    not the limit: the climb goes on from the highest sustained rate (at most `rechecks` times),
    so a noisy system's limit is not understated, and the rates past the limit are multiples of
    the limit it ends with. The unsustained rates below that limit are returned as `dips`.

    Returns every row in the order run, the highest sustained rate (None if not even the first),
    the first unsustained one above it (None if every rate was sustained), the past-the-limit rows
    and the dips."""
    rows: list[dict] = []
    by_rate: dict[float, dict] = {}

    def at(rate: float) -> dict:
        if rate not in by_rate:
            by_rate[rate] = run(rate)
            rows.append(by_rate[rate])
        return by_rate[rate]

    def rise(ladder) -> tuple[float | None, float | None]:
        good = None
        for rate in ladder:
            if not sustained(at(rate)):
                return good, rate
            good = rate
        return good, None

    good, bad = rise(rates)
    past: list[dict] = []
    for recheck in range(rechecks + 1):
        while good is not None and bad is not None and bad / good > refine * 1.0001:
            rate = round((good * bad) ** 0.5, 3)
            if sustained(at(rate)):
                good = rate
            else:
                bad = rate
        if good is None:
            break
        past = [{"multiple": multiple, **at(round(good * multiple, 3))} for multiple in past_limit]
        passed = [row["rate"] for row in past if sustained(row)]
        if not passed or recheck == rechecks:
            break
        # The limit was a dip: go on from the highest rate sustained past it.
        floor = max(passed)
        failed = [row["rate"] for row in past if row["rate"] > floor and not sustained(row)]
        if failed:
            good, bad = floor, min(failed)
        else:
            higher = [rate for rate in rates if rate > floor] or [round(floor * 2 ** k, 3) for k in range(1, 5)]
            good, bad = rise([floor] + higher)
    dips = sorted(row["rate"] for row in rows if good is not None and row["rate"] < good and not sustained(row))
    return {"rows": rows, "max_good_rate": good, "first_unsustained_rate": bad, "past_limit": past, "dips": dips}


def one_chat(target: Target, max_tokens: int = 300, seed: int = 0, timeout_s: float = 600, rounds: int = 1) -> dict:
    """One chat alone (nothing else running): `max_tokens` new tokens (EOS ignored where the API
    takes `ignore_eos`; on the page EOS may end it earlier), and its speed as the client sees it:
    tokens after the first over the time after the first. With `rounds`, the same chat that many
    times one after another and the median round (the engine offline is a median of rounds too:
    one ~10-s round moves ±10% on a shared machine)."""
    done = []
    for _ in range(rounds):
        chat = Chats(random.Random(seed)).next_chat()
        result = asyncio.run(target.ask(chat, max_tokens, ignore_eos=True, timeout_s=timeout_s))
        if not result.ok:
            return {"ok": False, "error": result.error}
        tokens_from = target.count_tokens([result])
        span = (result.last_at or 0) - (result.first_at or 0)
        done.append({"ok": True, "tokens": result.output_tokens, "output_tokens_from": tokens_from,
                     "chunks": result.chunks, "eos_ignored": target.protocol == "openai",
                     "ttft_s": round(result.ttft_s, 3),
                     "tok_s": round((result.output_tokens - 1) / span, 1) if span > 0 else None,
                     "itl_p50_ms": ms(pct(result.gaps_s, 0.5)), "itl_p99_ms": ms(pct(result.gaps_s, 0.99))})
    ranked = sorted(done, key=lambda r: r["tok_s"] or 0)
    return {**ranked[len(ranked) // 2], "rounds_tok_s": [r["tok_s"] for r in done]}


def warm(target: Target, requests: int = 3, max_tokens: int = 16) -> None:
    """A few requests one after another, so first-use costs are not in the figures."""
    chats = Chats(random.Random(12345))
    for _ in range(requests):
        result = asyncio.run(one_turn(target, chats.next_chat(), max_tokens, chats, 300, target.protocol == "openai"))
        if not result.ok:
            raise RuntimeError(f"a warm-up request failed: {result.error}")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


# ---- servers started here ----------------------------------------------------------------------

def raise_open_files_limit() -> None:
    """Every open request holds a connection: let a slow server's backlog have as many as it needs."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(server: subprocess.Popen, url: str, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"{what} exited ({server.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer {url} in {timeout_s:.0f} s")
        time.sleep(0.5)


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, Target, tempfile.TemporaryDirectory]:
    """`python -m engine.serve` (openai) or `python app.py` (gradio) on a free loopback port."""
    port = free_port()
    scratch = tempfile.TemporaryDirectory(prefix="pagedchat-serve-")
    if args.protocol == "openai":
        command = [sys.executable, "-m", "engine.serve", "--port", str(port)]
    else:
        command = [sys.executable, "app.py", "--port", str(port), "--db", str(Path(scratch.name) / "chats.db")]
    for flag, value in (("--model", args.model), ("--num-gpu-blocks", args.num_gpu_blocks), ("--dtype", args.dtype)):
        if value:
            command += [flag, str(value)]
    log = open(Path(scratch.name) / "server.log", "wb")
    server = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}/health", 300, " ".join(command[1:3]))
    except RuntimeError as error:
        server.kill()
        server.wait()
        raise RuntimeError(f"{error}: {(Path(scratch.name) / 'server.log').read_text()[-2000:]}") from None
    url = f"http://127.0.0.1:{port}/v1" if args.protocol == "openai" else f"http://127.0.0.1:{port}/"
    return server, Target(args.protocol, url, args.api_key), scratch


# ---- the report --------------------------------------------------------------------------------

HEADER = (f"{'rate/s':>7} {'sent':>5} {'done':>5} {'fail':>5} {'done/s':>7} {'out tok/s':>10} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'good/s':>7} {'good':>5} {'cli CPU':>8} {'cached':>7}")


def table_row(r: dict) -> str:
    def s(x):
        return "-" if x is None else f"{x:.2f}s"

    def m(x):
        return "-" if x is None else f"{x:.0f}ms"
    cached = "-" if r["cached_share"] is None else f"{100 * r['cached_share']:.0f}%"
    good = "-" if r["good_share"] is None else f"{100 * r['good_share']:.0f}%"
    return (f"{r['rate']:>7} {r['sent']:>5} {r['completed']:>5} {r['failed']:>5} {r['req_per_s']:>7.2f} "
            f"{r['output_tok_s']:>10} {s(r['ttft_p50_s']):>9} {s(r['ttft_p99_s']):>9} {m(r['itl_p50_ms']):>8} "
            f"{m(r['itl_p99_ms']):>8} {r['goodput_req_s']:>7.2f} {good:>5} {r['client_cpu_s']:>7.1f}s {cached:>7}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", choices=("openai", "gradio"), default="openai")
    parser.add_argument("--base-url", default=None, help="an OpenAI-compatible /v1 URL (default: start engine.serve)")
    parser.add_argument("--page-url", default=None, help="the chat page's URL, for --protocol gradio "
                                                         "(default: start app.py)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--model", default=None, help="the model of a server started here")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="the pool of a server started here")
    parser.add_argument("--dtype", default=None, help="the dtype of a server started here (default: its auto)")
    parser.add_argument("--rates", default="0.5,1,2", help="request rates to run, per second, comma-separated")
    parser.add_argument("--climb", action="store_true",
                        help="--rates rise until one is not sustained, then narrow to within 1.25x")
    parser.add_argument("--duration-s", type=float, default=30.0, help="arrivals per rate last this long")
    parser.add_argument("--min-requests", type=int, default=MIN_REQUESTS,
                        help="and on until this many requests have arrived")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--eos-ends", action="store_true",
                        help="let EOS end a reply (default: exactly --max-tokens where the API takes ignore_eos)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-slo-s", type=float, default=1.0, help="a good request's TTFT at most (s)")
    parser.add_argument("--itl-slo-ms", type=float, default=200.0, help="a good request's own ITL p99 at most (ms)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="a request still open then fails")
    parser.add_argument("--warm", type=int, default=0, help="requests sent one by one before the first rate")
    parser.add_argument("--one-chat-tokens", type=int, default=0,
                        help="first, one chat alone of this many new tokens (0: none)")
    parser.add_argument("--one-chat-rounds", type=int, default=1, help="that chat this many times: the median")
    args = parser.parse_args()
    raise_open_files_limit()

    server = scratch = None
    given = args.base_url if args.protocol == "openai" else args.page_url
    if given:
        target = Target(args.protocol, given, args.api_key)
    else:
        server, target, scratch = start_server(args)
    try:
        target.prepare()
        if args.warm:
            warm(target, args.warm)
        alone = one_chat(target, args.one_chat_tokens, args.seed, rounds=args.one_chat_rounds) if args.one_chat_tokens else None
        def run(rate: float) -> dict:
            row = run_rate(target, rate, args.duration_s, args.max_tokens, args.seed, args.ttft_slo_s,
                           args.itl_slo_ms, args.request_timeout_s, not args.eos_ends, args.min_requests)
            print(table_row(row), flush=True)
            return row

        rates = sorted(float(rate) for rate in args.rates.split(","))
        climbed = climb(run, rates) if args.climb else None
        rows = climbed["rows"] if climbed else [run(rate) for rate in rates]
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            scratch.cleanup()

    what = target.model if args.protocol == "openai" else "the chat page"
    length = "at most" if args.eos_ends or args.protocol == "gradio" else "exactly"
    print(f"{what} at {target.url} ({args.protocol}) — {cpu_model()}, {args.duration_s:g} s of arrivals per rate "
          f"(at least {args.min_requests} requests), "
          f"{length} {args.max_tokens} new tokens; good: TTFT <= {args.ttft_slo_s:g} s and own ITL p99 <= "
          f"{args.itl_slo_ms:g} ms")
    if alone is not None:
        print(f"one chat alone: {alone}")
    print(HEADER)
    for r in sorted(rows, key=lambda r: r["rate"]):
        print(table_row(r))
    if climbed:
        dips = f"; unsustained below it: {', '.join(f'{r:g}/s' for r in climbed['dips'])}" if climbed["dips"] else ""
        print(f"highest sustained rate: {climbed['max_good_rate']}; first unsustained: "
              f"{climbed['first_unsustained_rate']}{dips}")
    sources = sorted({r["output_tokens_from"] for r in rows})
    print(f"output tokens from: {', '.join(sources)}")
    print(json.dumps({"model": target.model, "protocol": args.protocol, "url": target.url,
                      "base_url": target.url if args.protocol == "openai" else None, "cpu": cpu_model(),
                      "duration_s": args.duration_s, "min_requests": args.min_requests, "max_tokens": args.max_tokens, "seed": args.seed,
                      "ttft_slo_s": args.ttft_slo_s, "itl_slo_ms": args.itl_slo_ms, "exact": not args.eos_ends,
                      "one_chat": alone, "rates": rows,
                      "max_good_rate": climbed["max_good_rate"] if climbed else None,
                      "first_unsustained_rate": climbed["first_unsustained_rate"] if climbed else None,
                      "dips": climbed["dips"] if climbed else []}))


if __name__ == "__main__":
    main()
