"""A browser that goes away mid-turn, over real HTTP: the app served by uvicorn, a turn started as
Gradio's own client starts one (POST queue/join, then the session's event stream), and the
connection closed — before the reply's first token and mid-stream. The engine request must be
gone, ended by an abort (not by running out), and its blocks back."""
from __future__ import annotations

import uuid

import pytest

pytest.importorskip("gradio")
from served_app import served_chat  # noqa: E402
from waiting import poll, wait_for  # noqa: E402

from benchmarks.gradio_http import BrowserEvent, fn_index, submit  # noqa: E402

from engine import SamplingParams  # noqa: E402

LONG_STORY = "Write a very long story about a lighthouse."


@pytest.fixture(scope="module")
def served(deep_model_dir, tmp_path_factory):
    """One sequence at a time, so a second request waits for its first token as long as we like."""
    with served_chat(deep_model_dir, tmp_path_factory.mktemp("disconnect") / "chat.db",
                     num_gpu_blocks=96, num_cpu_blocks=32, max_num_seqs=1) as served_app:
        yield served_app


def open_turn(url: str, user: str, text: str, max_tokens: int) -> BrowserEvent:
    """A Send from a fresh browser session, greedy, no system prompt, its event stream open."""
    return submit(url, fn_index(url, "send"), [user, None, text, "None", "", 0.0, 1.0, max_tokens])


def wait_until_idle(client) -> None:
    """No request runs, waits or is swapped and no device block is in use."""
    def idle():
        stats = client.stats()
        return stats.num_running + stats.num_waiting + stats.num_swapped == 0 and stats.device_blocks_used == 0
    wait_for(idle, lambda: f"the engine idle; it holds {client.stats()}")


def chat_blocks(client) -> int:
    """Device blocks held by chat requests (their ids start with `chat`)."""
    return sum(any(owner.startswith("chat") for owner in block.owners) for block in client.block_map().device)


def new_user() -> str:
    return f"anon:{uuid.uuid4().hex}"


def turn_behind_a_blocker(client, url: str, attempts: int = 3):
    """A request holding the only sequence slot (900 tokens, unread) and a chat turn of a new user
    waiting behind it in the engine: (blocker, user, turn). The blocker lasts a few seconds; on a
    loaded host the turn's trip through HTTP and Gradio's queue has outlasted it, and the turn then
    simply ran: that attempt is wound up and the setup tried again."""
    for _ in range(attempts):
        blocker = client.submit("Keep the only sequence slot busy.",
                                SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
        next(blocker)  # it runs; a chat turn now waits for the slot
        # The stats are the latest step's: once the blocker decodes, its prompt is counted.
        wait_for(lambda: client.stats().num_decode_tokens > 0, "the blocker to decode", interval=0.005)
        prompts_before = client.stats().total_prompt_tokens
        user = new_user()
        turn = open_turn(url, user, "Waiting for my turn", max_tokens=64)
        # The first view (the user's message, stored) arrives while the request waits for a slot;
        # after it, the handler has nothing to yield until the first token.
        first = next(m for m in turn.messages() if m.get("msg") in ("process_generating", "process_completed"))
        assert first["msg"] == "process_generating"
        wait_for(lambda: client.stats().num_waiting == 1 or client.stats().total_prompt_tokens > prompts_before,
                 lambda: f"the turn to reach the engine; it holds {client.stats()} (loop running: "
                         f"{not client.closed}); the turn's first view: {str(first)[-1500:]}", interval=0.005)
        if client.stats().num_waiting == 1:
            return blocker, user, turn
        turn.leave()  # the blocker ran out first and the turn's prompt was computed
        blocker.close()
        wait_until_idle(client)
    pytest.fail(f"in {attempts} attempts the turn never queued behind a 900-token request")


def test_a_browser_gone_before_the_first_token_frees_its_request(served):
    client, store, url = served
    blocker, user, turn = turn_behind_a_blocker(client, url)
    try:
        turn.leave()
        # Neither waiting nor running, while the blocker (900 tokens, unread) still holds the only
        # slot: gone by the abort, not by having had its turn.
        wait_for(lambda: not (client.stats().num_waiting or chat_blocks(client)),
                 "the waiting request to go with its browser")
        assert client.stats().num_running == 1  # the blocker alone: the chat's request is gone
    finally:
        blocker.close()  # aborts it
    wait_until_idle(client)
    [conversation] = store.conversations(user)
    assert [m["role"] for m in store.messages(user, conversation["id"])] == ["user"]  # no reply was written


def test_a_browser_gone_mid_stream_frees_its_blocks_and_keeps_the_partial_reply(served):
    client, store, url = served
    user = new_user()
    turn = open_turn(url, user, LONG_STORY, max_tokens=900)
    try:
        for message in turn.messages():
            if message.get("msg") == "process_generating" and client.stats().num_running == 1 \
                    and client.stats().device_blocks_used > 0:
                break  # the reply is streaming to us
            assert message.get("msg") != "process_completed", f"the reply ended before we left: {message}"
    finally:
        turn.leave()
    wait_until_idle(client)

    def stored_messages():  # the stopped reply is stored as the handler ends
        [conversation] = store.conversations(user)
        stored = store.messages(user, conversation["id"])
        return stored if len(stored) == 2 else None
    stored = poll(stored_messages) or store.messages(user, store.conversations(user)[0]["id"])
    # Ended by the abort (its finish reason, fewer than its 900 tokens), not by running out.
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert stored[1]["stopped"] and stored[1]["finish_reason"] == "abort" and stored[1]["content"].strip()
    assert 0 < stored[1]["completion_tokens"] < 900
