"""Crash durability: `kill -9` of the app while 16 replies stream, then a restart on the same
database file. Every reply a user saw finish is stored as they saw it, the file passes SQLite's
integrity checks, nothing is half-written, and the restarted app serves again.

The app runs as a real process (`python app.py`) on the tiny random-weight model. Eight users
stream long replies, still running at the kill; eight others keep sending short ones, each in a
new chat, so the kill lands among commits. The file is checked with sqlite3 alone, before the
app opens it again.
"""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("gradio_client")
import httpx  # noqa: E402
from gradio_client import Client  # noqa: E402
from served_app import free_port  # noqa: E402

from ui import params, render  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120
STREAMING_TIMEOUT_S = 180  # a generous deadline: the suite runs two workers on two cores
# A long reply runs into the tiny model's 1024-token context: far longer than the test waits.
LONG_TOKENS, SHORT_TOKENS = 1000, 8
LONG_USERS, SHORT_USERS = 8, 8
DONE = "prompt tokens cached"  # the metrics line under a finished reply
assert LONG_TOKENS <= params.MAX_TOKENS.maximum


class App:
    """`python app.py` on a free loopback port and the given database, its output in `log`."""

    def __init__(self, model: str, db: Path, log: Path):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/"
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "app.py", "--model", model, "--port", str(port), "--db", str(db),
                 "--host", "127.0.0.1", "--num-gpu-blocks", "640", "--num-cpu-blocks", "64"],
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False"})

    def wait_until_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"the app exited with {self.process.returncode} before serving")
            try:
                if httpx.get(self.url, timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        pytest.fail(f"the app did not answer {self.url} within {START_TIMEOUT_S} s")

    def kill(self) -> None:
        """SIGKILL: no handler, no `finally`, no flush runs in the app."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


@contextmanager
def running_app(model: str, db: Path, log: Path) -> Iterator[App]:
    """The app, serving; killed on the way out however the test went (its log printed, which
    pytest shows when the test fails)."""
    app = App(model, db, log)
    try:
        app.wait_until_serving()
        yield app
    finally:
        app.kill()
        print(f"---- {log} ----\n" + log.read_text(errors="replace")[-20_000:])


@dataclass
class Turn:
    """A chat turn as its user saw it end."""
    user: str
    text: str
    conversation_id: int
    chat: list[dict]  # the chatbot's final messages


def new_user() -> str:
    return f"anon:{uuid.uuid4().hex}"


def send(session: Client, user: str, text: str, max_tokens: int, conversation_id: int | None = None):
    """Start a greedy chat turn with no system prompt: the gradio_client job."""
    return session.submit(user, conversation_id, text, "None", "", 0.0, 1.0, max_tokens, api_name="/send")


def words(text: str) -> str:
    """Text up to whitespace: the Chatbot strips a message and turns its tabs into spaces."""
    return " ".join(text.split())


def shown(message: dict) -> str:
    content = message["content"]
    return words(content if isinstance(content, str) else " ".join(part.get("text", "") for part in content))


def rendered(row: dict) -> str:
    """A stored message as the chatbot shows it."""
    return words(render.chat_message(row)["content"])


def finished_reply(chat: list[dict]) -> bool:
    return chat[-1]["role"] == "assistant" and DONE in shown(chat[-1])


def keep_chatting(session: Client, user: str, finished: list[Turn], cut: list[str]) -> None:
    """Short replies, each in a new chat, until the app dies: `finished` gets each turn that
    ended with its reply shown, `cut` the text of the one the kill interrupted."""
    for n in range(10_000):
        text = f"Turn {n} of {user[-6:]}: hello"  # unique, and short enough to be the chat's title
        try:
            chat, conversation_id, _ = send(session, user, text, SHORT_TOKENS).result(timeout=60)
        except Exception:
            chat = None
        if chat is None or not finished_reply(chat):
            cut.append(text)
            return
        finished.append(Turn(user, text, conversation_id, chat))


def conversations_in(db_path: Path) -> dict[int, dict]:
    """Every conversation in the file, with its messages in order."""
    db = sqlite3.connect(db_path)
    try:
        db.row_factory = sqlite3.Row
        found = {row["id"]: {**row, "messages": []} for row in db.execute("select * from conversations")}
        for row in db.execute("select * from messages order by id"):
            found[row["conversation_id"]]["messages"].append(dict(row))
        return found
    finally:
        db.close()


def check_integrity(db_path: Path) -> None:
    db = sqlite3.connect(db_path, isolation_level=None)
    try:
        assert db.execute("pragma integrity_check").fetchall() == [("ok",)]
        assert db.execute("pragma foreign_key_check").fetchall() == []
        for fts in ("messages_fts", "conversations_fts"):  # the full-text indexes match their tables
            db.execute(f"insert into {fts}({fts}) values ('integrity-check')")
    finally:
        db.close()


def test_kill_9_while_16_replies_stream_loses_no_finished_reply(tiny_model_dir, tmp_path):
    db_path = tmp_path / "chat.db"
    finished: list[Turn] = []
    cut: list[str] = []
    long_users = [new_user() for _ in range(LONG_USERS)]
    long_texts = {user: f"A long story for {user[-6:]}, please" for user in long_users}
    sessions: list[Client] = []
    chatting: list[threading.Thread] = []

    with running_app(tiny_model_dir, db_path, tmp_path / "app-1.log") as app:
        try:
            # Every session first (each takes a moment), then the long replies, then the short ones.
            sessions = [Client(app.url, verbose=False) for _ in range(LONG_USERS + SHORT_USERS)]
            long_jobs = {user: send(session, user, long_texts[user], LONG_TOKENS)
                         for user, session in zip(long_users, sessions)}
            for session in sessions[LONG_USERS:]:
                chatting.append(threading.Thread(target=keep_chatting, args=(session, new_user(), finished, cut)))
                chatting[-1].start()

            def streaming(job) -> bool:  # past the first view, which names the stored conversation
                outputs = job.outputs()
                return len(outputs) >= 3 and outputs[-1][1] is not None and not job.done()

            deadline = time.monotonic() + STREAMING_TIMEOUT_S
            while not (all(streaming(job) for job in long_jobs.values()) and len(finished) >= SHORT_USERS):
                assert time.monotonic() < deadline, "the long replies never all streamed, or short ones never finished"
                time.sleep(0.05)
            still_streaming = {user: job.outputs()[-1][1] for user, job in long_jobs.items() if streaming(job)}
            app.kill()
        finally:
            app.kill()  # (again, if the test failed first) so that the short chats end
            for thread in chatting:
                thread.join(timeout=90)
            for session in sessions:
                session.close()
    assert not any(thread.is_alive() for thread in chatting)
    # The kill landed mid-stream: long replies were running, short ones had finished.
    assert len(still_streaming) >= LONG_USERS // 2, still_streaming
    assert len(finished) >= SHORT_USERS and len(cut) == SHORT_USERS

    # ---- the file as the kill left it ----------------------------------------------------------
    check_integrity(db_path)
    conversations = conversations_in(db_path)
    for turn in finished:  # every reply a user saw finish is there, as they saw it
        conversation = conversations[turn.conversation_id]
        assert conversation["user_id"] == turn.user
        question, reply = conversation["messages"]
        assert (question["role"], question["content"]) == ("user", turn.text)
        assert reply["role"] == "assistant" and reply["finish_reason"] in ("stop", "length") and not reply["stopped"]
        assert rendered(reply) == shown(turn.chat[-1])
    for user, conversation_id in still_streaming.items():  # its question is kept, no partial reply
        conversation = conversations[conversation_id]
        assert conversation["user_id"] == user
        assert [(m["role"], m["content"]) for m in conversation["messages"]] == [("user", long_texts[user])]
    for conversation in conversations.values():  # nothing half-written anywhere
        roles = [m["role"] for m in conversation["messages"]]
        # A first send stores its chat and its message in one transaction: never a chat without it.
        assert roles in (["user", "assistant"], ["user"]), conversation
        assert conversation["messages"][0]["content"] == conversation["title"]
        if roles == ["user"]:  # only a reply the kill cut short is missing
            assert conversation["id"] in still_streaming.values() or conversation["title"] in cut, conversation

    # ---- restarted on the same file, the app serves again --------------------------------------
    last_turns = {turn.user: turn for turn in finished}  # each short user's last finished turn
    with running_app(tiny_model_dir, db_path, tmp_path / "app-2.log") as app:
        session = Client(app.url, verbose=False)
        try:
            for turn in last_turns.values():
                # The sidebar lists the chat (a chat must be among its choices to be opened), and
                # opening it shows it as its user saw it before the crash.
                listed = session.predict(turn.user, "", None, api_name="/search")
                assert turn.conversation_id in [choice[1] for choice in listed["choices"]]
                opened = session.predict(turn.user, turn.conversation_id, api_name="/open_chat")
                assert opened[:2] == (turn.chat, turn.conversation_id)
            turn = finished[-1]  # the last turn to finish before the crash goes on
            chat, conversation_id, box = send(session, turn.user, "And after the restart?", SHORT_TOKENS,
                                              turn.conversation_id).result(timeout=60)
        finally:
            session.close()
        assert conversation_id == turn.conversation_id and box != "And after the restart?" and finished_reply(chat)
        messages = conversations_in(db_path)[conversation_id]["messages"]
        assert [(m["role"], m["content"]) for m in messages[::2]] == [("user", turn.text),
                                                                     ("user", "And after the restart?")]
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
        assert rendered(messages[3]) == shown(chat[-1])
    check_integrity(db_path)
