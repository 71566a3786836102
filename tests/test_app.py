"""The browser app end to end: a tiny engine behind the Gradio app, driven by gradio_client
sessions at once, as browsers would."""
from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest

gr = pytest.importorskip("gradio")
from gradio_client import Client  # noqa: E402

from engine import SamplingParams  # noqa: E402

MAX_TOKENS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_user() -> str:
    return f"anon:{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    from app import build_app
    from engine.client import EngineClient
    from engine.llm_engine import LLMEngine
    from storage import Store

    client = EngineClient(LLMEngine(tiny_model_dir, num_gpu_blocks=128, num_cpu_blocks=64))
    store = Store(tmp_path_factory.mktemp("app") / "chat.db")
    demo = build_app(client, store)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield client, store, f"http://127.0.0.1:{port}/"
    finally:
        demo.close()
        client.close()


def send(url: str, user: str, text: str, max_tokens: int = MAX_TOKENS, conversation_id: int | None = None):
    """Start one chat turn from a fresh browser session: greedy, no system prompt."""
    session = Client(url, verbose=False)
    job = session.submit(user, conversation_id, text, "None", "", 0.0, 1.0, max_tokens, api_name="/send")
    return session, job


def shown_text(chat: list[dict]) -> str:
    content = chat[-1]["content"]
    return content if isinstance(content, str) else " ".join(part.get("text", "") for part in content)


def engine_reply(client, text: str, max_tokens: int = MAX_TOKENS) -> str:
    deltas = client.submit([{"role": "user", "content": text}], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return "".join(delta.text for delta in deltas)


def test_eight_browsers_chat_at_once(served):
    client, store, url = served
    users = [new_user() for _ in range(8)]
    prompts = [f"Question {i}: tell me about {word}." for i, word in
               enumerate(["paged attention", "sqlite", "rust", "oceans", "jazz", "prime numbers", "tea", "rockets"])]
    results: dict[int, tuple] = {}

    def chat(i: int) -> None:
        session, job = send(url, users[i], prompts[i])
        results[i] = job.result(timeout=60)
        session.close()

    peak_running = 0
    done = threading.Event()

    def watch() -> None:  # the engine must see several streams at once: the queue does not serialise them
        nonlocal peak_running
        while not done.is_set():
            peak_running = max(peak_running, client.stats().num_running)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=chat, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    done.set()
    watcher.join()
    assert sorted(results) == list(range(8))
    assert peak_running >= 2

    replies = []
    for i, user in enumerate(users):
        chat_view, conversation_id, box = results[i]
        assert box == ""
        conversations = store.conversations(user)
        assert [c["id"] for c in conversations] == [conversation_id]
        messages = store.messages(user, conversation_id)
        assert [m["role"] for m in messages] == ["user", "assistant"]
        assert messages[0]["content"] == prompts[i]
        reply = messages[1]
        assert reply["content"] == engine_reply(client, prompts[i])
        assert reply["finish_reason"] in ("stop", "length") and not reply["stopped"]
        assert reply["prompt_tokens"] > 0 and reply["completion_tokens"] > 0 and reply["ttft_s"] is not None
        assert "prompt tokens cached" in shown_text(chat_view)
        replies.append(reply["content"])
    assert len(set(users)) == 8
    assert len(set(replies)) == 8, replies


def test_too_long_prompt_is_an_error_in_the_chat_while_others_chat(served):
    client, store, url = served
    long_user, other_user = new_user(), new_user()
    long_session, long_job = send(url, long_user, "word " * 3000)
    other_session, other_job = send(url, other_user, "Hello there, how are you?")
    chat_view, conversation_id, box = long_job.result(timeout=60)
    assert "too long" in shown_text(chat_view) and "Error" in shown_text(chat_view)
    assert conversation_id is None and box.startswith("word")  # the text stays, to be shortened
    assert store.conversations(long_user) == []
    other_chat, other_id, _ = other_job.result(timeout=60)
    assert store.messages(other_user, other_id)[-1]["finish_reason"] in ("stop", "length")
    long_session.close()
    other_session.close()


def test_stop_stores_the_partial_reply_and_frees_blocks(served):
    client, store, url = served
    user = new_user()
    session, job = send(url, user, "Write a very long story about a lighthouse.", max_tokens=1000)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        outputs = job.outputs()
        if len(outputs) >= 4 and outputs[-1][1] is not None:
            break
        time.sleep(0.02)
    else:
        pytest.fail("the reply never started streaming")
    conversation_id = outputs[-1][1]
    job.cancel()

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        messages = store.messages(user, conversation_id)
        if messages[-1]["role"] == "assistant" and client.stats().device_blocks_used == 0:
            break
        time.sleep(0.05)
    reply = messages[-1]
    assert reply["role"] == "assistant", messages
    assert reply["stopped"] and reply["finish_reason"] == "abort"
    assert 0 < reply["completion_tokens"] < 1000 and reply["content"].strip()
    assert client.stats().device_blocks_used == 0
    session.close()


def test_regenerate_edit_rename_search_delete(served):
    client, store, url = served
    user = new_user()
    session, job = send(url, user, "Show me <script>alert(1)</script> please")
    chat_view, conversation_id, _ = job.result(timeout=60)
    assert "&lt;script&gt;" in shown_text(chat_view[:1])  # HTML shows as text, never runs

    chat_view, same_id = session.predict(user, conversation_id, 0.0, 1.0, MAX_TOKENS, api_name="/regenerate")
    assert same_id == conversation_id
    assert [m["role"] for m in store.messages(user, conversation_id)] == ["user", "assistant"]

    session.predict(user, conversation_id, "An edited question", 0.0, 1.0, MAX_TOKENS, api_name="/edit_last")
    messages = store.messages(user, conversation_id)
    assert [m["content"] for m in messages][0] == "An edited question"
    assert messages[1]["content"] == engine_reply(client, "An edited question")

    session.predict(user, conversation_id, "Lighthouse notes", "", api_name="/rename")
    assert store.conversation(user, conversation_id)["title"] == "Lighthouse notes"
    found = session.predict(user, "edited", conversation_id, api_name="/search")
    assert [choice[1] for choice in found["choices"]] == [conversation_id]  # a Radio update
    assert "[edited]" in found["choices"][0][0]
    assert [c["id"] for c in store.search(new_user(), "edited")] == []  # another user sees nothing

    session.predict(user, conversation_id, "", api_name="/delete_chat")
    assert store.conversations(user) == []
    session.close()
