"""Soak test: many real users chatting for minutes against a small KV pool, as on a busy Space.

The app runs in a child process (the store and the Gradio server, with the engine core in a
process of its own, as `python app.py` runs them), so the users' clients do not share its
interpreter. Each user is one gradio_client session in a thread, chatting in multi-turn loops;
some turns leave mid-reply by closing the connection (a closed tab), some send bad input.
Meanwhile a prober loads the page and Gradio's config every half second. At the end it reports:

- replies finished, errors (by kind), turns that hung (no answer within --hang-s),
- replies lost: finished in the browser but not in the database,
- blocks left in use once every user has stopped (0 means nothing leaked), and preemptions,
- TTFT p50/p99 as the user sees it, and the page-load and config-fetch p99 during the run.

    python benchmarks/soak.py --users 64 --minutes 10 --gpu-blocks 256  # BENCHMARKS.md's figures (48: its small pool)
    python benchmarks/soak.py --users 4 --minutes 0.3 --model <folder>   # the suite's short run
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import gradio_http  # noqa: E402
from machine import cpu_model  # noqa: E402

PRESETS = ("Helpful assistant", "Teacher", "None")
QUESTIONS = ("How do lighthouses work?", "Tell me a short story about a cat.", "What is paged attention?",
             "Give me three tips for learning to cook.", "Why is the sky blue?", "Explain a hash table.",
             "What should I see in Lisbon?", "Write a haiku about the sea.")
TURNS_PER_CHAT = 4
ERROR_MARK = "⚠️ **Error:**"
BUSY_MARK = "The server is busy with other chats"


# ---- the app, in a child process ---------------------------------------------------------------
def serve(args: argparse.Namespace) -> None:
    """The child: the app on a loopback port; prints READY, then answers `stats` lines on stdin
    with the engine's stats as JSON, until `quit`."""
    from engine import CoreProcessClient

    # As `python app.py` serves: the engine core in a process of its own, loading the model while
    # this one imports the UI.
    finish_engine = CoreProcessClient.starting(args.model, num_gpu_blocks=args.gpu_blocks,
                                               num_cpu_blocks=args.cpu_blocks, max_waiting=args.max_waiting)
    import uvicorn

    from storage import Store
    from ui import backends
    from ui.panel.feed import PanelFeed
    from ui.panel.load_generator import LoadGenerator
    from ui.server import build_app, build_server
    from ui.sessions import Sessions

    client = finish_engine()
    feed, load, sessions = PanelFeed(client), LoadGenerator(client), Sessions()
    backend = backends.in_process(client, block_map_cache=feed.block_map_cache)  # as app.py does
    demo = build_app(backend, Store(args.db), feed, load, host="127.0.0.1", sessions=sessions)
    server = uvicorn.Server(uvicorn.Config(build_server(demo, client, sessions, "127.0.0.1"), host="127.0.0.1",
                                           port=args.port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "stats":
            print(json.dumps(dataclasses.asdict(client.stats())), flush=True)
        elif line.strip() == "quit":
            break
    server.should_exit = True
    feed.close()
    backend.close()
    client.close()


class ChildApp:
    """The app in a child process, on a free loopback port; its engine's stats on request."""

    def __init__(self, args: argparse.Namespace, db: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        command = [sys.executable, __file__, "--serve", "--port", str(self.port), "--db", str(db),
                   "--gpu-blocks", str(args.gpu_blocks), "--cpu-blocks", str(args.cpu_blocks),
                   "--max-waiting", str(args.max_waiting)]
        if args.model:
            command += ["--model", args.model]
        self._log = open(log, "w")
        self.process = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._log, text=True)
        line = self.process.stdout.readline()  # the model loads first: this may take a minute
        if line.strip() != "READY":
            self.close()
            raise RuntimeError(f"the app did not start (see {log}): {line!r}")

    def stats(self) -> dict:
        self.process.stdin.write("stats\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.flush()
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
        self._log.close()


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the users -------------------------------------------------------------------------------------
@dataclasses.dataclass
class Tally:
    """What the users saw; one lock guards it all (updates are rare next to waiting)."""
    finished: int = 0
    left_mid_reply: int = 0
    bad_input_refused: int = 0
    refused_busy: int = 0  # "the server is busy": the bounded queue answering at once, as designed
    hung: int = 0
    errors: Counter = dataclasses.field(default_factory=Counter)
    ttft_s: list = dataclasses.field(default_factory=list)
    replies: Counter = dataclasses.field(default_factory=Counter)  # (user, conversation id) -> finished replies
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def shown(message: dict) -> str:
    content = message.get("content", "")
    return content if isinstance(content, str) else " ".join(part.get("text", "") for part in content)


def reply_started(outputs: list) -> bool:
    chat = outputs[-1][0] if outputs and outputs[-1] else None
    return bool(chat) and chat[-1].get("role") == "assistant" and shown(chat[-1]) not in ("", "…")


def chat_turn(session, url: str, user: str, conversation: int | None, rng: random.Random,
              args: argparse.Namespace, tally: Tally) -> int | None:
    """One Send through gradio_client; the conversation to go on in (None for a new one)."""
    from gradio_client.exceptions import AppError

    started = time.monotonic()
    job = session.submit(user, conversation, rng.choice(QUESTIONS), rng.choice(PRESETS), "", 0.7, 0.9,
                         args.max_tokens, api_name="/send")
    ttft = None
    while not job.done():
        if ttft is None and reply_started(job.outputs()):
            ttft = time.monotonic() - started
        if time.monotonic() - started > args.hang_s:
            job.cancel()
            with tally.lock:
                tally.hung += 1
            return None
        time.sleep(0.05)
    try:
        chat, conversation_id, _box = job.result(timeout=args.hang_s)
    except AppError as error:
        with tally.lock:
            tally.errors[f"app error: {error}"] += 1
        return None
    except Exception as error:  # a transport error: what a broken reply in a browser would be
        with tally.lock:
            tally.errors[type(error).__name__] += 1
        return None
    last = shown(chat[-1]) if chat else ""
    with tally.lock:
        if BUSY_MARK in last:
            tally.refused_busy += 1
            return conversation_id
        if ERROR_MARK in last:
            tally.errors[last.split(ERROR_MARK, 1)[1].strip()[:60]] += 1
            return conversation_id
        tally.finished += 1
        tally.replies[(user, conversation_id)] += 1
        if ttft is not None:
            tally.ttft_s.append(ttft)
    return conversation_id


def leave_mid_reply(url: str, fn: int, user: str, rng: random.Random, args: argparse.Namespace,
                    tally: Tally) -> None:
    """A new chat whose browser closes as soon as the reply starts."""
    event = gradio_http.submit(url, fn, [user, None, rng.choice(QUESTIONS), rng.choice(PRESETS), "", 0.7, 0.9,
                                        args.max_tokens], timeout=args.hang_s)
    views = 0  # the first view is the user's message; the ones after it carry the reply
    try:
        for message in event.messages():
            views += message.get("msg") == "process_generating"
            if views >= 3 or message.get("msg") == "process_completed":
                break
    except httpx.HTTPError as error:
        with tally.lock:
            tally.errors[f"leaving: {type(error).__name__}"] += 1
        return
    finally:
        event.leave()
    if views >= 3:  # else it ended first (refused as busy, or a very short reply): nothing to leave
        with tally.lock:
            tally.left_mid_reply += 1


def bad_input(session, user: str, rng: random.Random, tally: Tally) -> None:
    """A mistake the app must refuse with a message (and store nothing for)."""
    from gradio_client.exceptions import AppError

    attempts = [(user, None, "   ", "None", "", 0.7, 0.9, 32),                 # an empty message
                (user, rng.randrange(10**6, 10**9), "Hi", "None", "", 0.7, 0.9, 32),  # not their chat
                (user, None, "Hi", "None", "", 0.7, 0.9, 10**9)]               # absurd max tokens
    try:
        session.predict(*rng.choice(attempts), api_name="/send")
    except AppError as error:
        with tally.lock:
            if str(error).strip() and str(error) != "Error":
                tally.bad_input_refused += 1
            else:
                tally.errors["bad input without a message"] += 1
        return
    except Exception as error:
        with tally.lock:
            tally.errors[f"bad input: {type(error).__name__}"] += 1
        return
    with tally.lock:
        tally.errors["bad input accepted"] += 1


def user_loop(index: int, url: str, fn: int, deadline: float, args: argparse.Namespace, tally: Tally) -> None:
    from gradio_client import Client

    rng = random.Random(index)
    user = f"anon:{uuid.uuid4().hex}"
    while True:  # opening the app; a person whose page does not load reloads it
        try:
            session = Client(url, verbose=False)
            break
        except Exception as error:
            with tally.lock:
                tally.errors[f"opening the app: {type(error).__name__}"] += 1
            if time.monotonic() > deadline:
                return
            time.sleep(1.0)
    conversation, turns = None, 0
    try:
        while time.monotonic() < deadline:
            roll = rng.random()
            try:
                if roll < args.bad_share:
                    bad_input(session, user, rng, tally)
                elif roll < args.bad_share + args.leave_share:
                    leave_mid_reply(url, fn, user, rng, args, tally)
                else:
                    conversation = chat_turn(session, url, user, conversation, rng, args, tally)
                    turns = turns + 1 if conversation is not None else 0
                    if turns >= TURNS_PER_CHAT:
                        conversation, turns = None, 0
            except Exception as error:  # counted, and the user goes on as a person would
                with tally.lock:
                    tally.errors[f"client: {type(error).__name__}"] += 1
                conversation, turns = None, 0
            time.sleep(rng.uniform(0.0, args.think_s))
    finally:
        session.close()


# ---- the prober -------------------------------------------------------------------------------------
def probe(url: str, stop: threading.Event, timings: dict[str, list[float]]) -> None:
    """A fresh page load and Gradio's config fetch, every half second."""
    with httpx.Client(timeout=60) as http:
        while not stop.is_set():
            for name, path in (("page", ""), ("config", "config")):
                started = time.monotonic()
                try:
                    http.get(url + path).raise_for_status()
                    timings[name].append(time.monotonic() - started)
                except httpx.HTTPError:
                    timings[name].append(float("inf"))
            stop.wait(0.5)


# ---- the run ---------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def lost_replies(db: Path, replies: Counter) -> int:
    """Replies a browser saw finish that the database does not hold."""
    with sqlite3.connect(db) as conn:
        lost = 0
        for (user, conversation_id), finished in replies.items():
            stored = conn.execute("select count(*) from messages join conversations on conversations.id = "
                                  "messages.conversation_id where conversations.id = ? and conversations.user_id = ? "
                                  "and messages.role = 'assistant' and messages.finish_reason in ('stop', 'length')",
                                  (conversation_id, user)).fetchone()[0]
            lost += max(0, finished - stored)
        integrity = conn.execute("pragma integrity_check").fetchone()[0]
    if integrity != "ok":
        raise RuntimeError(f"the database fails its integrity check: {integrity}")
    return lost


def wait_idle(app: ChildApp, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = app.stats()
        busy = stats["num_running"] + stats["num_waiting"] + stats["num_swapped"]
        if (busy == 0 and stats["device_blocks_used"] == 0 and stats["host_blocks_used"] == 0) \
                or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def run(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="pagedchat-soak-"))
    db, log = workdir / "soak.db", workdir / "app.log"
    app = ChildApp(args, db, log)
    try:
        fn = gradio_http.fn_index(app.url, "send")
        tally, timings, stop = Tally(), {"page": [], "config": []}, threading.Event()
        prober = threading.Thread(target=probe, args=(app.url, stop, timings), daemon=True)
        prober.start()
        started = time.monotonic()
        deadline = started + 60 * args.minutes
        users = [threading.Thread(target=user_loop, args=(i, app.url, fn, deadline, args, tally), daemon=True)
                 for i in range(args.users)]
        for user in users:  # people arrive over the ramp-up, not in one instant
            user.start()
            time.sleep(args.ramp_s / args.users)
        for user in users:  # a turn started just before the deadline may run its full length
            user.join(timeout=max(0.0, deadline - time.monotonic()) + 2 * args.hang_s)
        still_running = sum(user.is_alive() for user in users)
        stop.set()
        prober.join(timeout=60)
        wall = time.monotonic() - started
        stats = wait_idle(app, timeout=10.0)
    finally:
        app.close()
    return {
        "users": args.users, "minutes": args.minutes, "gpu_blocks": args.gpu_blocks, "cpu_blocks": args.cpu_blocks,
        "max_tokens": args.max_tokens, "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "cpu": cpu_model(), "wall_s": round(wall, 1),
        "replies_finished": tally.finished, "left_mid_reply": tally.left_mid_reply,
        "bad_input_refused": tally.bad_input_refused, "refused_busy": tally.refused_busy,
        "max_waiting": args.max_waiting, "errors": sum(tally.errors.values()),
        "error_kinds": dict(tally.errors.most_common(8)), "hung": tally.hung + still_running,
        "replies_lost": lost_replies(db, tally.replies),
        "blocks_left": stats["device_blocks_used"] + stats["host_blocks_used"],
        "requests_left": stats["num_running"] + stats["num_waiting"] + stats["num_swapped"],
        "preemptions_swap": stats["num_preemptions_swap"], "preemptions_recompute": stats["num_preemptions_recompute"],
        "blocks_swapped_out": stats["total_blocks_swapped_out"],
        "ttft_p50_s": percentile(tally.ttft_s, 0.5), "ttft_p99_s": percentile(tally.ttft_s, 0.99),
        "page_load_p99_s": percentile(timings["page"], 0.99), "page_load_max_s": max(timings["page"], default=None),
        "config_p99_s": percentile(timings["config"], 0.99), "page_loads": len(timings["page"]),
    }


def print_table(figures: dict) -> None:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    rows = [("users × minutes", f"{figures['users']} × {figures['minutes']}"),
            ("device / host blocks", f"{figures['gpu_blocks']} / {figures['cpu_blocks']}"),
            ("replies finished", figures["replies_finished"]),
            ("left mid-reply (tab closed)", figures["left_mid_reply"]),
            ("bad input refused with a message", figures["bad_input_refused"]),
            (f"refused as busy (queue bound {figures['max_waiting']})", figures["refused_busy"]),
            ("errors", f"{figures['errors']} {figures['error_kinds'] or ''}"),
            ("hung", figures["hung"]), ("replies lost", figures["replies_lost"]),
            ("blocks left after the run", figures["blocks_left"]),
            ("preemptions (swap / recompute)", f"{figures['preemptions_swap']} / {figures['preemptions_recompute']}"),
            ("TTFT p50 / p99 (as users saw it)", f"{seconds(figures['ttft_p50_s'])} / {seconds(figures['ttft_p99_s'])}"),
            ("page load p99 / max", f"{seconds(figures['page_load_p99_s'])} / {seconds(figures['page_load_max_s'])}"),
            ("config fetch p99", seconds(figures["config_p99_s"]))]
    print(f"Soak on {figures['cpu']}, {figures['model']}")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default=os.environ.get("MODEL"), help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--gpu-blocks", type=int, default=48, help="device KV pool, in 16-token blocks")
    parser.add_argument("--cpu-blocks", type=int, default=256, help="host swap pool, in blocks")
    parser.add_argument("--max-waiting", type=int, default=256,
                        help="the app's engine queue bound (app.py --max-waiting): beyond it a turn is told 'busy'")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per reply at most")
    parser.add_argument("--leave-share", type=float, default=0.1, help="share of turns that close the tab mid-reply")
    parser.add_argument("--bad-share", type=float, default=0.05, help="share of turns that send bad input")
    parser.add_argument("--think-s", type=float, default=2.0, help="a user's pause between turns, at most")
    parser.add_argument("--ramp-s", type=float, default=10.0, help="the users arrive over this many seconds")
    parser.add_argument("--hang-s", type=float, default=300.0, help="a turn with no answer by then has hung")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.serve:
        serve(args)
        return
    figures = run(args)
    print_table(figures)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
