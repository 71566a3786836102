"""The browser app end to end: a tiny engine behind the Gradio app, driven by gradio_client
sessions at once, as browsers would."""
from __future__ import annotations

import json
import threading
import uuid

import pytest

gr = pytest.importorskip("gradio")
import httpx  # noqa: E402
from gradio_client import Client  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402
from served_app import PeakRunning, served_chat  # noqa: E402
from waiting import DEADLINE_S, poll, wait_for  # noqa: E402

from engine import SamplingParams  # noqa: E402

MAX_TOKENS = 24


def new_user() -> str:
    return f"anon:{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    with served_chat(tiny_model_dir, tmp_path_factory.mktemp("app") / "chat.db",
                     num_gpu_blocks=128, num_cpu_blocks=64) as served_app:
        yield served_app


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
    boxes: dict[int, list] = {}

    def chat(i: int) -> None:
        session, job = send(url, users[i], prompts[i])
        results[i] = job.result(timeout=DEADLINE_S)
        boxes[i] = [outputs[2] for outputs in job.outputs()]
        session.close()

    # The engine must see several streams at once: the queue does not serialise them.
    with PeakRunning(client) as running_at_once:
        threads = [threading.Thread(target=chat, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
    assert sorted(results) == list(range(8))
    assert running_at_once.peak >= 2

    replies = []
    for i, user in enumerate(users):
        chat_view, conversation_id, _ = results[i]
        # The reply's first update empties the message box; the others leave it (to what is typed next).
        assert boxes[i][0] == "" and all(box == {"__type__": "update"} for box in boxes[i][1:])
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
    chat_view, conversation_id, box = long_job.result(timeout=DEADLINE_S)
    assert "too long" in shown_text(chat_view) and "Error" in shown_text(chat_view)
    assert conversation_id is None and box.startswith("word")  # the text stays, to be shortened
    assert store.conversations(long_user) == []
    other_chat, other_id, _ = other_job.result(timeout=DEADLINE_S)
    assert store.messages(other_user, other_id)[-1]["finish_reason"] in ("stop", "length")
    long_session.close()
    other_session.close()


def test_stop_stores_the_partial_reply_and_frees_blocks(served):
    client, store, url = served
    user = new_user()
    session, job = send(url, user, "Write a very long story about a lighthouse.", max_tokens=1000)
    def streaming() -> list | None:
        outputs = job.outputs()
        return outputs if len(outputs) >= 4 and outputs[-1][1] is not None else None
    outputs = wait_for(streaming, "the reply to start streaming")
    conversation_id = outputs[-1][1]
    job.cancel()

    poll(lambda: store.messages(user, conversation_id)[-1]["role"] == "assistant"
         and client.stats().device_blocks_used == 0, interval=0.05)
    messages = store.messages(user, conversation_id)
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
    chat_view, conversation_id, _ = job.result(timeout=DEADLINE_S)
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


# ---- bad input through the real API: a clear error, and nothing stored wrongly ----------------------
NOT_YOURS = "That conversation doesn't exist or isn't yours."
GREEDY = (0.0, 1.0, MAX_TOKENS)


def stored(store, user: str) -> list[tuple[str, str]]:
    """Every (role, content) the user has, conversation by conversation."""
    return [(m["role"], m["content"]) for c in store.conversations(user) for m in store.messages(user, c["id"])]


def refused_send(url: str, *args) -> str:
    """The message of the gr.Error that /send answers `args` with (it must raise one)."""
    session = Client(url, verbose=False)
    try:
        with pytest.raises(AppError) as refused:
            session.predict(*args, api_name="/send")
        return refused.value.message
    finally:
        session.close()


def raw_call(url: str, api_name: str, body: str) -> tuple[str, object]:
    """POST a JSON body as written (gradio_client cannot send NaN, infinities or lone
    surrogates: httpx refuses to encode them) to Gradio's REST API; the final event and its data."""
    with httpx.Client(base_url=url, timeout=60) as http:
        event_id = http.post(f"gradio_api/call/{api_name}", content=body,
                             headers={"content-type": "application/json"}).json()["event_id"]
        event = None
        with http.stream("GET", f"gradio_api/call/{api_name}/{event_id}") as events:
            for line in events.iter_lines():
                if line.startswith("event:"):
                    event = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and event in ("complete", "error"):
                    return event, json.loads(line.split(":", 1)[1])
    pytest.fail(f"{api_name} never finished")


@pytest.mark.parametrize("message, shown", [
    ("", "Type a message first."),
    (" \n\t  ", "Type a message first."),
])
def test_empty_messages_are_refused(served, message, shown):
    client, store, url = served
    user = new_user()
    assert refused_send(url, user, None, message, "None", "", *GREEDY) == shown
    assert stored(store, user) == []


@pytest.mark.parametrize("temperature, top_p, max_tokens, shown", [
    (-0.5, 1.0, 24, "Value -0.5 is less than minimum value 0.0."),   # Gradio's slider bounds
    (1e308, 1.0, 24, "Value 1e+308 is greater than maximum value 2.0."),
    (0.0, 0.0, 24, "Value 0.0 is less than minimum value 0.05."),
    (0.0, 1.0, -5, "Value -5 is less than minimum value 1."),
    (0.0, 1.0, 10**9, "Value 1000000000 is greater than maximum value 4096."),
    (0.0, 1.0, 16.5, "max new tokens must be a whole number, got 16.5"),
])
def test_sampling_parameters_out_of_range_are_refused(served, temperature, top_p, max_tokens, shown):
    client, store, url = served
    user = new_user()
    assert refused_send(url, user, None, "Hello", "None", "", temperature, top_p, max_tokens) == shown
    assert stored(store, user) == []


@pytest.mark.parametrize("sliders, shown", [
    ("NaN, 1.0, 24", "temperature must be between 0.0 and 2.0, got nan"),
    ("0.0, NaN, 24", "top_p must be between 0.05 and 1.0, got nan"),
    ("0.0, 1.0, NaN", "max new tokens must be between 1 and 4096, got nan"),
    ("Infinity, 1.0, 24", "Value inf is greater than maximum value 2.0."),
    ("-Infinity, 1.0, 24", "Value -inf is less than minimum value 0.0."),
    ("0.0, 1.0, Infinity", "Value inf is greater than maximum value 4096."),
])
def test_nan_and_infinite_sampling_parameters_are_refused(served, sliders, shown):
    client, store, url = served
    user = new_user()
    event, data = raw_call(url, "send", f'{{"data": ["{user}", null, "Hello", "None", "", {sliders}]}}')
    assert event == "error" and shown in str(data), (event, data)
    assert stored(store, user) == []


def test_a_lone_surrogate_is_refused(served):
    """JSON can carry half a UTF-16 pair; Python then holds a str that neither the tokenizer nor
    SQLite can encode. gradio_client cannot send one (httpx will not encode it): posted raw."""
    client, store, url = served
    user = new_user()
    event, data = raw_call(url, "send", f'{{"data": ["{user}", null, "half \\ud800 a pair", "None", "", 0.0, 1.0, 24]}}')
    assert event == "error" and "The message has characters that are not valid text" in str(data), (event, data)
    assert stored(store, user) == []


@pytest.fixture(scope="module")
def victim(served):
    """Another user's conversation, to aim at."""
    client, store, url = served
    user = new_user()
    session, job = send(url, user, "My private chat")
    _, conversation_id, _ = job.result(timeout=DEADLINE_S)
    session.close()
    return user, conversation_id


@pytest.mark.parametrize("which", ["another user's", "negative", "zero", "huge", "beyond SQLite", "fractional",
                                   "text"])
def test_conversation_ids_that_are_not_the_users_are_refused(served, victim, which):
    client, store, url = served
    owner, theirs = victim
    before = stored(store, owner)
    wrong, shown = {"another user's": (theirs, NOT_YOURS), "negative": (-theirs, NOT_YOURS), "zero": (0, NOT_YOURS),
                    "huge": (2**63 - 1, NOT_YOURS), "beyond SQLite": (10**30, NOT_YOURS),
                    "fractional": (1.5, "A conversation id is a whole number, not 1.5."),
                    "text": ("seven", "A conversation id is a whole number, not 'seven'.")}[which]
    user = new_user()
    assert refused_send(url, user, wrong, "Let me in", "None", "", *GREEDY) == shown
    session = Client(url, verbose=False)
    for api_name, args in (("/regenerate", (user, wrong, *GREEDY)), ("/edit_last", (user, wrong, "Mine", *GREEDY)),
                           ("/rename", (user, wrong, "Taken", "")), ("/delete_chat", (user, wrong, ""))):
        with pytest.raises(AppError) as refused:
            session.predict(*args, api_name=api_name)
        assert refused.value.message == shown, api_name
    session.close()
    assert stored(store, user) == [] and stored(store, owner) == before


def test_a_100k_character_message_is_refused_as_too_long(served):
    """The engine refuses a prompt longer than its KV cache: the chat says so, the text stays in
    the box to be shortened, and no conversation is created."""
    client, store, url = served
    user = new_user()
    text = ("lorem ipsum " * 10_000)[:100_000]
    session = Client(url, verbose=False)
    chat_view, conversation_id, box = session.predict(user, None, text, "None", "", *GREEDY, api_name="/send")
    session.close()
    assert "This conversation is too long for the model's memory" in shown_text(chat_view)
    assert conversation_id is None and box == text
    assert store.conversations(user) == [] and stored(store, user) == []

    # Beyond 100k characters it is refused before the engine or the store sees it, with the limit.
    with pytest.raises(AppError) as refused:
        session = Client(url, verbose=False)
        session.predict(user, None, "x" * 1_000_000, "None", "", *GREEDY, api_name="/send")
    session.close()
    assert refused.value.message == "The message is 1,000,000 characters long; the limit is 100,000. " \
                                    "Shorten it and try again."
    assert store.conversations(user) == []


def test_control_characters_are_stored_as_sent_and_html_is_shown_as_text(served):
    client, store, url = served
    user = new_user()
    odd = "NUL \x00 bell \x07 escape \x1b[31m vertical tab \x0b DEL \x7f end"
    session, job = send(url, user, odd)
    _, conversation_id, _ = job.result(timeout=DEADLINE_S)
    assert stored(store, user)[0] == ("user", odd)

    html = '<img src=x onerror="alert(1)"><script>alert(2)</script>'
    chat_view, same_id, _ = session.predict(user, conversation_id, html, "None", "", *GREEDY, api_name="/send")
    session.close()
    assert same_id == conversation_id and stored(store, user)[2] == ("user", html)  # verbatim
    shown = shown_text(chat_view[2:3])
    assert "<script>" not in shown and "<img" not in shown and "&lt;script&gt;" in shown


@pytest.mark.parametrize("query", ['"', '""', "NOT", "a OR", "*", "NEAR(", "NEAR(a b", "fox*", "title:fox",
                                   "a AND (b", "-fox", "^fox", "\x00", "'; drop table messages; --"])
def test_search_with_fts_syntax_finds_or_finds_nothing_never_fails(served, query):
    client, store, url = served
    user = new_user()
    session, job = send(url, user, 'The quick fox said "NOT" a OR b * NEAR( twice')
    _, conversation_id, _ = job.result(timeout=DEADLINE_S)
    found = session.predict(user, query, conversation_id, api_name="/search")
    session.close()
    assert [choice[1] for choice in found["choices"]] in ([], [conversation_id])
    assert stored(store, user)[0][1].startswith("The quick fox")


def test_fts_words_in_search_are_words(served):
    client, store, url = served
    user = new_user()
    session, job = send(url, user, "Notes on NEAR and NOT operators")
    _, conversation_id, _ = job.result(timeout=DEADLINE_S)
    for query in ("NOT", "NEAR(", '"operators"'):
        found = session.predict(user, query, conversation_id, api_name="/search")
        assert [choice[1] for choice in found["choices"]] == [conversation_id], query
    session.close()


def test_the_app_serves_the_openai_api_on_its_own_port_over_the_same_engine(served):
    """Bound to loopback, the app's /v1 answers without a key; its requests run on the chat's engine."""
    from openai import OpenAI

    client, store, url = served
    before = client.stats().total_generated_tokens
    openai = OpenAI(base_url=f"{url}v1", api_key="unused", max_retries=0)
    reply = openai.chat.completions.create(model=client.info().model, messages=[{"role": "user", "content": "Hi"}],
                                           temperature=0.0, max_tokens=8)
    assert reply.choices[0].message.content == engine_reply(client, "Hi", max_tokens=8)
    assert client.stats().total_generated_tokens > before
    assert "vllm:num_requests_running" in httpx.get(f"{url}metrics").text
    assert httpx.get(url).status_code == 200 and "PagedChat" in httpx.get(url).text  # the chat page still


def test_off_loopback_the_api_is_off_without_a_key_and_on_with_one(tiny_model_dir, tmp_path):
    from served_app import serve
    from engine.runtime.thread_client import EngineClient
    from engine.runtime.llm_engine import LLMEngine
    from storage import Store

    client = EngineClient(LLMEngine(tiny_model_dir, num_gpu_blocks=32))
    try:
        for api_key, expected in ((None, 404), ("s3cret", 401)):
            server, url = serve(client, Store(tmp_path / f"{api_key}.db"), host="0.0.0.0", api_key=api_key)
            try:
                assert httpx.get(f"{url}v1/models").status_code == expected
                if api_key:
                    ok = httpx.get(f"{url}v1/models", headers={"Authorization": f"Bearer {api_key}"})
                    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == client.info().model
            finally:
                server.close()
    finally:
        client.close()
