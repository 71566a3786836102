"""The chat page's logic without Gradio: `ChatController` around a real tiny engine and a real
store. Replies are greedy; the tiny model's text is gibberish, so the tests assert what is
shown and stored, never what is said. A reply is an async iterator: tests that read a whole one
use `collect`; those that stop, cancel or interleave replies are async."""
from __future__ import annotations

import asyncio
import gc
import threading
import time
import uuid

import pytest
from served_app import engine_idle
from waiting import async_wait_for

from engine import EngineBusyError, EngineClient, LLMEngine, decode_rate
from engine.outputs import Delta
from storage import Store
from ui import backends
from ui.backends.backend import Reply
from ui.chat_input import NOT_YOURS, ChatInputError
from ui.conversation import ChatController
from ui.replies import UNSAVED_MESSAGE, UNSAVED_REPLY, ChatView, last_user_index, last_user_message
from ui.turns import BUSY, MAX_REPLIES_PER_USER, TOO_MANY
from ui.presets import PRESETS

SYSTEM = PRESETS["Helpful assistant"]
MAX_TOKENS = 16


def greedy(max_tokens: int = MAX_TOKENS) -> tuple[float, float, float]:
    return 0.0, 1.0, max_tokens  # the sliders: temperature, top_p, max new tokens


def new_user() -> str:
    return f"anon:{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    """One tiny engine for the module: 64 blocks of 16 tokens, so a 3000-word prompt is refused."""
    engine_client = EngineClient(LLMEngine(tiny_model_dir, num_gpu_blocks=64, num_cpu_blocks=32))
    try:
        yield engine_client
    finally:
        engine_client.close()


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "chat.db") as store:
        yield store


@pytest.fixture(scope="module")
def backend(client):
    router = backends.in_process(client)
    yield router
    router.close()


@pytest.fixture
def slow_engine(client, monkeypatch):
    """Steps 5 ms apart: a long reply is still being written when the test acts mid-reply, however
    fast the tiny model runs. Set the returned event to hold the engine still (up to 10 s)."""
    step, hold = client.engine.step, threading.Event()

    def slow_step():
        deadline = time.monotonic() + 10
        while hold.is_set() and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(client.engine, "step", slow_step)
    yield hold
    hold.clear()


@pytest.fixture
def chat(backend, store):
    return ChatController(backend, store)


async def views_of(views) -> list[ChatView]:
    return [view async for view in views]


def collect(views) -> list[ChatView]:
    """Every view of a reply, read to its end on an event loop of its own."""
    return asyncio.run(views_of(views))


def turn(chat: ChatController, user: str, text: str, conversation_id: int | None = None,
         max_tokens: int = MAX_TOKENS) -> list[ChatView]:
    return collect(chat.send(user, conversation_id, text, SYSTEM, greedy(max_tokens)))


async def aturn(chat: ChatController, user: str, text: str, conversation_id: int | None = None,
                max_tokens: int = MAX_TOKENS) -> list[ChatView]:
    return await views_of(chat.send(user, conversation_id, text, SYSTEM, greedy(max_tokens)))


def roles(store: Store, user: str, conversation_id: int) -> list[str]:
    return [m["role"] for m in store.messages(user, conversation_id)]


# ---- send ------------------------------------------------------------------------------------------
def test_send_streams_a_growing_reply_then_stores_both_sides_with_metrics(chat, store, client, slow_engine):
    # slow_engine: steps 5 ms apart, so the reply's tokens reach the page apart on a CPU fast enough
    # to write all 24 before the page draws its second view (a Zen 5 did: two views)
    user = new_user()
    views = turn(chat, user, "  Tell me about paged attention please  ", max_tokens=24)

    conversation_id = views[-1].conversation_id
    assert conversation_id is not None and all(v.conversation_id == conversation_id for v in views)
    assert not any(v.refused for v in views)
    assert views[0].messages == [{"role": "user", "content": "Tell me about paged attention please"}]
    live = [v.messages[-1]["content"] for v in views[1:-1]]
    assert len(live) >= 3, "the reply did not stream"
    assert all(len(a) <= len(b) for a, b in zip(live, live[1:])) and len(live[0]) < len(live[-1])
    assert all(v.messages[0] == views[0].messages[0] for v in views)

    conversation = store.conversation(user, conversation_id)
    assert conversation["title"] == "Tell me about paged attention please"[:48]
    assert conversation["system_prompt"] == SYSTEM
    messages = store.messages(user, conversation_id)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "Tell me about paged attention please"
    reply = messages[1]
    assert reply["content"].strip() and reply["finish_reason"] in ("stop", "length") and not reply["stopped"]
    assert reply["prompt_tokens"] > 0 and reply["cached_tokens"] is not None
    assert 0 < reply["completion_tokens"] <= 24 and reply["ttft_s"] is not None
    assert "prompt tokens cached" in views[-1].messages[-1]["content"]  # the final view shows the metrics
    assert [c["id"] for c in store.conversations(user)] == [conversation_id]
    assert engine_idle(client)


def test_a_long_title_is_cut_and_a_new_system_prompt_is_kept(chat, store):
    user = new_user()
    text = "A question whose text runs on far beyond the length of a sidebar title"
    conversation_id = turn(chat, user, text)[-1].conversation_id
    assert store.conversation(user, conversation_id)["title"] == text[:48]
    collect(chat.send(user, conversation_id, "Now as a teacher", PRESETS["Teacher"], greedy()))
    assert store.conversation(user, conversation_id)["system_prompt"] == PRESETS["Teacher"]


def test_a_second_turn_hits_the_prefix_cache(chat, store, client):
    user = new_user()
    conversation_id = turn(chat, user, "First question, about lighthouses")[-1].conversation_id
    views = turn(chat, user, "And a second one", conversation_id)
    assert views[-1].conversation_id == conversation_id
    first, second = store.messages(user, conversation_id)[1::2]
    assert roles(store, user, conversation_id) == ["user", "assistant", "user", "assistant"]
    block = client.info().block_size
    assert second["cached_tokens"] > 0
    assert second["cached_tokens"] >= block * (first["prompt_tokens"] // block)  # the whole first prompt
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]


def test_another_user_sending_the_same_text_hits_only_the_preset_blocks(chat, store, client, tokenizer):
    # The same opening message from two users: the second is served the preset system prompt
    # from the cache (its full blocks, then its last tokens copied out of the first user's block
    # after them), and none of the first user's tokens.
    text = "Tell me, in detail, how lighthouses were kept lit before electricity. " * 3
    ada, bob = new_user(), new_user()
    ada_chat = turn(chat, ada, text)[-1].conversation_id
    bob_chat = turn(chat, bob, text)[-1].conversation_id
    system = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}], tokenize=False)
    block = client.info().block_size
    preset_tokens = len(tokenizer(system, add_special_tokens=False).input_ids)
    ada_first, bob_first = store.messages(ada, ada_chat)[1], store.messages(bob, bob_chat)[1]
    assert preset_tokens % block and ada_first["prompt_tokens"] == bob_first["prompt_tokens"] >= preset_tokens + 2 * block
    assert bob_first["cached_tokens"] == preset_tokens
    turn(chat, ada, "And after electricity?", ada_chat)
    assert store.messages(ada, ada_chat)[3]["cached_tokens"] >= ada_first["prompt_tokens"] // block * block


def test_a_prompt_too_long_for_the_cache_is_refused_and_stores_nothing(chat, store, client):
    user = new_user()
    views = turn(chat, user, "word " * 3000)
    assert len(views) == 1 and views[0].refused and views[0].conversation_id is None
    assert "too long" in views[0].messages[-1]["content"] and "Error" in views[0].messages[-1]["content"]
    assert store.conversations(user) == []

    conversation_id = turn(chat, user, "A short one first")[-1].conversation_id
    before = store.messages(user, conversation_id)
    [refused] = collect(chat.send(user, conversation_id, "word " * 3000, PRESETS["Teacher"], greedy()))
    assert refused.refused and refused.conversation_id == conversation_id
    assert store.messages(user, conversation_id) == before
    assert store.conversation(user, conversation_id)["system_prompt"] == SYSTEM  # not changed either
    assert engine_idle(client)


# ---- regenerate and edit ---------------------------------------------------------------------------
def test_regenerate_replaces_the_last_reply(chat, store):
    user = new_user()
    conversation_id = turn(chat, user, "Regenerate me")[-1].conversation_id
    old = store.messages(user, conversation_id)

    views = collect(chat.regenerate(user, conversation_id, greedy(MAX_TOKENS + 4)))
    assert all(v.conversation_id == conversation_id for v in views)
    assert views[0].messages[:1] == [{"role": "user", "content": "Regenerate me"}]
    new = store.messages(user, conversation_id)
    assert [m["role"] for m in new] == ["user", "assistant"]
    assert new[0] == old[0] and new[1]["id"] != old[1]["id"]
    assert new[1]["completion_tokens"] > 0 and new[1]["finish_reason"] in ("stop", "length")
    assert len(views[-1].messages) == 2 and "prompt tokens cached" in views[-1].messages[-1]["content"]


def test_regenerate_answers_a_last_message_that_has_no_reply(chat, store):
    user = new_user()
    conversation_id = store.create_conversation(user, title="Unanswered", system_prompt=SYSTEM)["id"]
    store.add_message(user, conversation_id, "user", "Are you there?")
    collect(chat.regenerate(user, conversation_id, greedy()))
    messages = store.messages(user, conversation_id)
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "Are you there?"


def test_edit_last_replaces_the_last_user_message_and_drops_its_reply(chat, store):
    user = new_user()
    conversation_id = turn(chat, user, "First message")[-1].conversation_id
    turn(chat, user, "A message with a typo", conversation_id)
    assert chat.last_user_message(user, conversation_id) == "A message with a typo"

    views = collect(chat.edit_last(user, conversation_id, "  The corrected message ", greedy()))
    shown_user = [m["content"] for m in views[0].messages if m["role"] == "user"]
    assert shown_user == ["First message", "The corrected message"] and views[0].messages[-1]["role"] == "user"
    messages = store.messages(user, conversation_id)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in messages[::2]] == ["First message", "The corrected message"]
    assert messages[3]["finish_reason"] in ("stop", "length")
    assert chat.last_user_message(user, conversation_id) == "The corrected message"


def test_edit_any_message_forks_and_versions_move_between_branches(chat, store):
    user = new_user()
    conversation_id = turn(chat, user, "First <question>")[-1].conversation_id
    turn(chat, user, "Second question", conversation_id)
    shown = chat.open_chat(user, conversation_id).messages
    # The chatbot's edit box starts from the message as shown (escaped); the edit is the source.
    assert shown[0]["content"] == "First &lt;question&gt;"
    views = collect(chat.edit_message(user, conversation_id, 0, "Edited & <first>", greedy()))
    rows = store.messages(user, conversation_id)
    assert [(m["role"], m["content"], m["version"], m["versions"]) for m in rows][0] == \
        ("user", "Edited & <first>", 2, 2)
    assert len(rows) == 2 and rows[1]["role"] == "assistant"
    final = views[-1].messages
    assert final[0]["content"].startswith("Edited &amp; &lt;first&gt;") and "2/2" in final[0]["content"]
    # Back to the first version: the whole first branch, four messages.
    first_id = rows[0]["previous_version_id"]
    back = chat.show_version(user, conversation_id, str(first_id))
    assert [m["role"] for m in back] == ["user", "assistant", "user", "assistant"]
    assert "1/2" in back[0]["content"] and "Second question" in back[2]["content"]
    assert chat.last_user_message(user, conversation_id) == "Second question"
    # Editing a reply, a missing index or another user's chat is refused.
    for index in (1, 7, None, -1):
        with pytest.raises(ChatInputError, match="no sent message to edit"):
            chat.edit_message(user, conversation_id, index, "x", greedy())
    with pytest.raises(ChatInputError, match=NOT_YOURS):
        chat.show_version(new_user(), conversation_id, str(first_id))
    with pytest.raises(ChatInputError, match="whole number"):
        chat.show_version(user, conversation_id, "12; drop table")


def test_regenerations_are_versions_of_one_reply(chat, store):
    user = new_user()
    conversation_id = turn(chat, user, "Regenerate me twice")[-1].conversation_id
    for _ in range(2):
        views = collect(chat.regenerate(user, conversation_id, greedy()))
    assert "3/3" in views[-1].messages[-1]["content"]
    replies = [m["id"] for m in store.db["messages"].rows_where("role = 'assistant' and conversation_id = ?",
                                                                 [conversation_id])]
    assert len(replies) == 3
    shown = chat.show_version(user, conversation_id, replies[0])
    assert "1/3" in shown[-1]["content"] and f"#pc-version-{replies[1]}" in shown[-1]["content"]


@pytest.mark.anyio
async def test_no_version_switch_while_a_reply_is_written(chat, store, slow_engine):
    user = new_user()
    conversation_id = (await aturn(chat, user, "Hold on"))[-1].conversation_id
    first = store.messages(user, conversation_id)[-1]["id"]
    views = chat.regenerate(user, conversation_id, greedy(200))
    await anext(views)
    with pytest.raises(ChatInputError, match="still being written"):
        chat.show_version(user, conversation_id, first)
    await views.aclose()


def test_the_context_meter_is_the_engines_numbers(chat, store, client):
    user = new_user()
    use, fit = chat.context(user, None)
    assert (use.tokens, use.limit, fit) == (0, client.engine.config.scheduler.max_model_len, False) and use.model
    conversation_id = turn(chat, user, "Count my tokens")[-1].conversation_id
    turn(chat, user, "And these too", conversation_id)
    reply = store.messages(user, conversation_id)[-1]
    use, _ = chat.context(user, conversation_id)
    assert use.tokens == reply["prompt_tokens"] + reply["completion_tokens"] and use.cached == reply["cached_tokens"]
    assert use.cached > 0 and not use.near_limit


@pytest.mark.anyio
async def test_the_memory_of_a_preset_chat_alone_counts_its_preset_blocks_as_shared(chat, store, client, slow_engine):
    user = new_user()
    conversation_id = (await aturn(chat, user, "Remember me"))[-1].conversation_id
    assert engine_idle(client)  # no other chat holds the preset's blocks
    views, _ = await streaming(chat, user, conversation_id)
    seen = []

    def latest_shares_and_owns():
        seen.append(chat.memory(user, conversation_id)[0])
        return seen[-1].shared and seen[-1].own
    # The monitor reads a new map once a second.
    await async_wait_for(latest_shares_and_owns, lambda: f"a memory with shared and own blocks: {seen[-3:]}",
                         interval=0.1)
    # The preset's 23 tokens fill one 16-token block, read from the prefix cache; the rest is its own.
    assert seen[-1].shared == 1 and seen[-1].own > 0 and seen[-1].host == 0, seen
    await views.aclose()


def test_a_full_chat_leaves_out_its_oldest_turns_only_when_asked(chat, store, client):
    user = new_user()
    phrase = "lighthouse keepers watch the sea "
    long_text = phrase * int(450 / (len(client.engine.encode(phrase * 20)) / 20))  # the engine holds 1,024
    conversation_id = turn(chat, user, "First: " + long_text)[-1].conversation_id
    turn(chat, user, "Second: " + long_text, conversation_id)
    refused = turn(chat, user, "Third: " + long_text, conversation_id)
    assert refused[-1].refused and "too long" in refused[-1].messages[-1]["content"]
    assert len(store.messages(user, conversation_id)) == 4  # nothing stored

    chat.set_fit_context(user, conversation_id, True)
    assert chat.context(user, conversation_id)[1] is True
    views = turn(chat, user, "Third: " + long_text, conversation_id)
    reply = store.messages(user, conversation_id)[-1]
    assert reply["role"] == "assistant" and reply["left_out"] in (2, 4)
    assert reply["prompt_tokens"] <= client.engine.config.scheduler.max_model_len
    assert f"without the {reply['left_out']} oldest messages" in views[-1].messages[-1]["content"]
    use, _ = chat.context(user, conversation_id)
    assert use.tokens == reply["prompt_tokens"] + reply["completion_tokens"]


def test_continue_in_a_new_chat_carries_a_summary(chat, store):
    user = new_user()
    conversation_id = turn(chat, user, "Remember the number 4096")[-1].conversation_id
    new_id = asyncio.run(chat.continue_with_summary(user, conversation_id, greedy()).new_chat())
    new = store.conversation(user, new_id)
    assert new_id != conversation_id and new["title"].endswith("(continued)")
    assert new["system_prompt"].startswith(SYSTEM) and "This chat continues an earlier one" in new["system_prompt"]
    assert store.messages(user, new_id) == [] and len(store.messages(user, conversation_id)) == 2
    with pytest.raises(ChatInputError, match=NOT_YOURS):
        chat.continue_with_summary(new_user(), conversation_id, greedy())


# ---- Stop -------------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_closing_mid_stream_stores_the_partial_reply_as_stopped(chat, store, client, slow_engine):
    user = new_user()
    views = chat.send(user, None, "Write a very long story about a lighthouse.", "", greedy(500))
    async for view in views:
        last = view.messages[-1]
        if last["role"] == "assistant" and last["content"] not in ("", "…"):
            break  # the first view with some of the reply in it
    else:
        pytest.fail("the reply never streamed")
    await views.aclose()

    conversation_id = view.conversation_id
    messages = store.messages(user, conversation_id)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    reply = messages[1]
    assert reply["stopped"] and reply["finish_reason"] == "abort"
    assert 0 < reply["completion_tokens"] < 500 and reply["content"].strip()
    assert engine_idle(client), client.stats()

    assert not chat.replying(user, conversation_id)  # the turn is over: after_stop has nothing to wait for
    shown = chat.after_stop(user, conversation_id)
    assert shown[-1]["role"] == "assistant" and "stopped" in shown[-1]["content"]


@pytest.mark.anyio
@pytest.mark.parametrize("when", ["before the first token", "mid-stream"])
async def test_cancelling_the_reader_aborts_and_stores_what_was_written(chat, store, client, slow_engine, when):
    """What Stop and a closed tab do: the task that reads the reply is cancelled."""
    user, ended = new_user(), []
    client.add_listener(lambda delta, now: ended.append(delta.finish_reason) if delta.finish_reason else None)
    if when == "before the first token":
        slow_engine.set()  # no step, so no token, until the reader is cancelled
    views = chat.send(user, None, "Write a very long story about a lighthouse.", SYSTEM, greedy(500))
    shown: list[ChatView] = []

    async def read() -> None:
        async for view in views:
            shown.append(view)

    reader = asyncio.create_task(read())
    await async_wait_for(lambda: shown and (when != "mid-stream" or shown[-1].messages[-1]["role"] == "assistant"),
                         "the reply to reach the point to cancel at", interval=0.005)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    slow_engine.clear()
    assert await asyncio.to_thread(engine_idle, client), client.stats()
    # Ended by the cancel, not run to its end (before the first token it may never have been submitted).
    assert not {"stop", "length"} & set(ended) and (ended or when == "before the first token"), ended
    assert not chat.replying(user, shown[0].conversation_id)
    stored = store.messages(user, shown[0].conversation_id)
    if when == "mid-stream":
        assert [m["role"] for m in stored] == ["user", "assistant"] and stored[1]["stopped"]
    else:
        assert [m["role"] for m in stored] in (["user"], ["user", "assistant"])  # a token may have landed


@pytest.mark.anyio
async def test_closing_before_the_reply_streams_aborts_the_request_and_stores_only_the_message(chat, store, client, slow_engine):
    user, ended = new_user(), []
    client.add_listener(lambda delta, now: ended.append(delta.finish_reason) if delta.finish_reason else None)
    views = chat.send(user, None, "Stop me before I start", "", greedy(500))
    first = await anext(views)  # the user's side, stored; no delta read yet
    await views.aclose()
    assert engine_idle(client), client.stats()
    assert not {"stop", "length"} & set(ended), ended  # ended by the close, not left to run to its end
    assert roles(store, user, first.conversation_id) == ["user"]
    assert chat.after_stop(user, first.conversation_id) == first.messages


def test_after_stop_with_no_stream_just_redraws(chat, store):
    user = new_user()
    conversation_id = turn(chat, user, "Nothing to stop")[-1].conversation_id
    assert chat.after_stop(user, None) == []
    assert [m["role"] for m in chat.after_stop(user, conversation_id)] == ["user", "assistant"]


# ---- users and mistakes -----------------------------------------------------------------------------
def test_another_users_conversation_is_not_found_and_stays_untouched(chat, store, client):
    alice, bob = new_user(), new_user()
    conversation_id = turn(chat, alice, "Alice's chat")[-1].conversation_id
    before = store.messages(alice, conversation_id)

    # Another user's, a negative and a huge id all read the same: nothing says the row exists.
    for wrong in (conversation_id, -conversation_id, 0, 10**30, 2**63):
        for attempt in (lambda: chat.send(bob, wrong, "Let me in", SYSTEM, greedy()),
                        lambda: chat.regenerate(bob, wrong, greedy()),
                        lambda: chat.edit_last(bob, wrong, "Mine now", greedy()),
                        lambda: chat.rename(bob, wrong, "Taken"),
                        lambda: chat.delete(bob, wrong),
                        lambda: chat.open_chat(bob, wrong),
                        lambda: chat.after_stop(bob, wrong)):
            with pytest.raises(ChatInputError) as refused:
                attempt()
            assert str(refused.value) == NOT_YOURS

    assert store.messages(alice, conversation_id) == before
    assert store.conversation(alice, conversation_id)["title"] == "Alice's chat"
    assert store.conversations(bob) == [] and chat.conversation_choices(bob, "Alice") == []
    assert engine_idle(client)


def test_user_mistakes_raise_chat_input_errors_with_the_page_wording(chat, store):
    user = new_user()
    with pytest.raises(ChatInputError, match="Type a message first"):
        chat.send(user, None, "   ", SYSTEM, greedy())
    with pytest.raises(ChatInputError, match="temperature must be between"):
        chat.send(user, None, "Hello", SYSTEM, (5.0, 1.0, 16))
    with pytest.raises(ChatInputError, match="max new tokens must be a whole number"):
        chat.send(user, None, "Hello", SYSTEM, (0.0, 1.0, 16.5))
    with pytest.raises(ChatInputError, match="Nothing to regenerate yet"):
        chat.regenerate(user, None, greedy())
    with pytest.raises(ChatInputError, match="no sent message to edit"):
        chat.edit_last(user, None, "An edit", greedy())
    with pytest.raises(ChatInputError, match="Open a chat and type its new title"):
        chat.rename(user, None, "A title")
    with pytest.raises(ChatInputError, match="Open a chat to delete it"):
        chat.check_deletable(None)
    assert store.conversations(user) == []

    conversation_id = turn(chat, user, "Now there is a chat")[-1].conversation_id
    with pytest.raises(ChatInputError, match="no sent message to edit"):
        chat.edit_last(user, conversation_id, "  ", greedy())
    with pytest.raises(ChatInputError, match="top_p must be between"):
        chat.regenerate(user, conversation_id, (0.0, 0.0, 16))
    with pytest.raises(ChatInputError, match="Open a chat and type its new title"):
        chat.rename(user, conversation_id, " ")
    assert issubclass(ChatInputError, ValueError)


def test_conversation_ids_that_are_not_whole_numbers_are_refused(chat, store):
    user = new_user()
    conversation_id = turn(chat, user, "A chat")[-1].conversation_id
    before = store.messages(user, conversation_id)
    for wrong in (1.5, float("nan"), float("inf"), "12", "abc", True, [conversation_id]):
        with pytest.raises(ChatInputError, match="A conversation id is a whole number"):
            chat.send(user, wrong, "Hello", SYSTEM, greedy())
        with pytest.raises(ChatInputError, match="A conversation id is a whole number"):
            chat.open_chat(user, wrong)
    assert [c["id"] for c in store.conversations(user)] == [conversation_id]
    assert store.messages(user, conversation_id) == before
    # A float that is a whole number (what a JSON client may send) is that id.
    assert turn(chat, user, "Again", float(conversation_id))[-1].conversation_id == conversation_id


def test_text_that_is_not_valid_unicode_is_refused_and_control_characters_are_kept(chat, store):
    user = new_user()
    for attempt in (lambda: chat.send(user, None, "half a pair \ud800 here", SYSTEM, greedy()),
                    lambda: chat.send(user, None, "Hello", "a prompt \udfff", greedy()),
                    lambda: chat.conversation_choices(user, "\ud800")):
        with pytest.raises(ChatInputError, match="not valid text"):
            attempt()
    assert store.conversations(user) == []

    odd = "NUL \x00 bell \x07 escape \x1b[31m and a tab \t here"
    conversation_id = turn(chat, user, odd)[-1].conversation_id
    assert store.messages(user, conversation_id)[0]["content"] == odd  # stored as sent
    with pytest.raises(ChatInputError, match="not valid text"):
        chat.rename(user, conversation_id, "\ud800")
    with pytest.raises(ChatInputError, match="not valid text"):
        chat.edit_last(user, conversation_id, "\ud800", greedy())
    assert store.messages(user, conversation_id)[0]["content"] == odd


# ---- one reply at a time per conversation ----------------------------------------------------------
async def streaming(chat: ChatController, user: str, conversation_id: int | None = None, max_tokens: int = 500):
    """A send whose reply has started streaming (its views, and the latest view)."""
    views = chat.send(user, conversation_id, "Write a very long story about a lighthouse.", SYSTEM, greedy(max_tokens))
    async for view in views:
        if view.messages[-1]["role"] == "assistant":
            return views, view
    pytest.fail("the reply never streamed")


@pytest.mark.anyio
async def test_a_second_turn_while_a_reply_streams_is_refused_and_changes_nothing(chat, store, client):
    user, other = new_user(), new_user()
    conversation_id = (await aturn(chat, user, "First question"))[-1].conversation_id
    elsewhere = (await aturn(chat, user, "Another chat"))[-1].conversation_id
    views, view = await streaming(chat, user, conversation_id)
    assert view.conversation_id == conversation_id and chat.replying(user, conversation_id)
    before = store.messages(user, conversation_id)

    for attempt in (lambda: chat.send(user, conversation_id, "Me too", SYSTEM, greedy()),
                    lambda: chat.regenerate(user, conversation_id, greedy()),
                    lambda: chat.edit_last(user, conversation_id, "Edited", greedy()),
                    lambda: chat.delete(user, conversation_id)):
        with pytest.raises(ChatInputError) as refused:
            attempt()
        assert str(refused.value) == BUSY
    assert store.messages(user, conversation_id) == before
    # Another of the user's chats goes on; another user learns nothing about this one.
    assert (await aturn(chat, user, "Meanwhile", elsewhere))[-1].conversation_id == elsewhere
    assert not chat.replying(other, conversation_id)
    with pytest.raises(ChatInputError, match="doesn't exist"):
        chat.regenerate(other, conversation_id, greedy())

    rest = await views_of(views)  # the first reply finishes, and is stored; then the chat is free again
    assert rest and not chat.replying(user, conversation_id)
    assert roles(store, user, conversation_id) == ["user", "assistant"] * 2
    await views_of(chat.regenerate(user, conversation_id, greedy()))
    assert roles(store, user, conversation_id) == ["user", "assistant"] * 2
    assert engine_idle(client)


@pytest.mark.anyio
async def test_a_user_has_at_most_a_few_replies_in_progress(chat, store, client):
    user, other = new_user(), new_user()
    chats = [(await aturn(chat, user, f"Chat number {i}"))[-1].conversation_id for i in range(MAX_REPLIES_PER_USER + 1)]
    running = [await streaming(chat, user, conversation_id) for conversation_id in chats[:MAX_REPLIES_PER_USER]]
    before = store.messages(user, chats[-1])
    for attempt in (lambda: chat.send(user, chats[-1], "One more", SYSTEM, greedy()),
                    lambda: chat.send(user, None, "A new chat", SYSTEM, greedy()),
                    lambda: chat.regenerate(user, chats[-1], greedy())):
        with pytest.raises(ChatInputError) as refused:
            attempt()
        assert str(refused.value) == TOO_MANY
    assert store.messages(user, chats[-1]) == before and len(store.conversations(user)) == len(chats)
    assert (await aturn(chat, other, "Someone else is not held back"))[-1].conversation_id is not None

    views, _ = running.pop()
    await views.aclose()  # one stopped: a slot is free again
    assert (await aturn(chat, user, "Now it goes", chats[-1]))[-1].conversation_id == chats[-1]
    for views, _ in running:
        await views.aclose()
    assert engine_idle(client)


@pytest.mark.anyio
async def test_a_new_chat_is_held_from_its_first_view(chat, store):
    user = new_user()
    views, view = await streaming(chat, user)
    with pytest.raises(ChatInputError, match="still being written"):
        chat.send(user, view.conversation_id, "Me too", SYSTEM, greedy())
    await views.aclose()
    assert not chat.replying(user, view.conversation_id)


@pytest.mark.anyio
async def test_the_turn_is_released_however_the_reply_ends(chat, store, client):
    user = new_user()
    conversation_id = (await aturn(chat, user, "A chat to reuse"))[-1].conversation_id

    async def free() -> bool:  # the chat takes another turn (refused at once if it is still held)
        views = chat.regenerate(user, conversation_id, greedy())
        await views.aclose()
        return not chat.replying(user, conversation_id)

    await views_of(chat.regenerate(user, conversation_id, greedy()))  # finished
    assert await free()
    await views_of(chat.send(user, conversation_id, "word " * 3000, SYSTEM, greedy()))  # refused by the engine
    assert await free()
    views, _ = await streaming(chat, user, conversation_id)  # closed mid-stream (Stop)
    await views.aclose()
    assert await free()
    views = chat.send(user, conversation_id, "Stopped before it started", SYSTEM, greedy())
    await views.aclose()  # closed before its first view: an unstarted generator runs no finally
    assert await free() and roles(store, user, conversation_id)[-1] == "assistant"  # nothing was stored
    views = chat.send(user, conversation_id, "Dropped before it started", SYSTEM, greedy())
    del views  # dropped unstarted (a disconnect before the handler ran)
    gc.collect()
    assert await free()
    with pytest.raises(ChatInputError, match="Type a message first"):  # a mistake, found under the hold
        chat.send(user, conversation_id, "  ", SYSTEM, greedy())
    assert await free()
    assert chat._turns.in_progress(user) == 0  # every reply slot given back too
    assert engine_idle(client)


# ---- the store failing mid-reply ----------------------------------------------------------------------
def failing(*args, **kwargs):
    raise OSError("disk full")


def test_a_reply_the_store_cannot_keep_is_shown_with_an_error_and_nothing_half_written(chat, store, client,
                                                                                       monkeypatch):
    user = new_user()
    conversation_id = turn(chat, user, "Keep my first reply")[-1].conversation_id
    before = store.messages(user, conversation_id)
    monkeypatch.setattr(store, "replace_last_assistant", failing)
    views = collect(chat.regenerate(user, conversation_id, greedy()))
    *_, reply, error = views[-1].messages
    streamed = views[-2].messages[-1]["content"]
    assert reply["role"] == "assistant" and reply["content"] == streamed and streamed.strip()  # the text read
    assert UNSAVED_REPLY in error["content"] and "Error" in error["content"]
    assert store.messages(user, conversation_id) == before  # the old reply, whole; no half of the new one
    assert not chat.replying(user, conversation_id) and engine_idle(client)

    monkeypatch.setattr(store, "add_message", failing)  # storing the user's message fails
    views = collect(chat.send(user, None, "A new chat that cannot be stored", SYSTEM, greedy()))
    assert len(views) == 1 and views[0].refused and views[0].conversation_id is None
    assert UNSAVED_MESSAGE in views[0].messages[-1]["content"]
    assert [c["id"] for c in store.conversations(user)] == [conversation_id]  # no conversation without it
    assert chat._turns.in_progress(user) == 0 and engine_idle(client)


def test_an_engine_error_ends_the_turn(store):
    class FailingBackend:
        async def start(self, messages, params, *, request_id, **options):
            async def deltas():
                yield Delta(request_id, 0, "", (), finish_reason="error", error="RuntimeError: boom")
            return Reply(deltas())

    chat, user = ChatController(FailingBackend(), store), new_user()
    views = collect(chat.send(user, None, "Fail me", SYSTEM, greedy()))
    conversation_id = views[-1].conversation_id
    assert "boom" in views[-1].messages[-1]["content"] and not chat.replying(user, conversation_id)
    collect(chat.regenerate(user, conversation_id, greedy()))  # free again
    assert roles(store, user, conversation_id) == ["user"]


def test_a_busy_engine_refuses_the_turn_and_stores_nothing(store):
    class BusyBackend:
        async def start(self, messages, params, *, request_id, **options):
            raise EngineBusyError("the engine is busy: 256 requests are waiting (limit 256)")

    chat, user = ChatController(BusyBackend(), store), new_user()
    views = collect(chat.send(user, None, "Anyone there?", SYSTEM, greedy()))
    assert len(views) == 1 and views[0].refused and views[0].conversation_id is None
    assert "busy" in views[0].messages[-1]["content"] and "nothing was sent" in views[0].messages[-1]["content"]
    assert store.conversations(user) == []


def test_only_one_of_many_concurrent_turns_on_a_chat_starts(chat, store):
    user = new_user()
    conversation_id = turn(chat, user, "Race me")[-1].conversation_id
    started, refused, go = [], [], threading.Barrier(8)

    def attempt() -> None:
        go.wait()
        try:
            started.append(chat.regenerate(user, conversation_id, greedy()))
        except ChatInputError as error:
            refused.append(str(error))

    threads = [threading.Thread(target=attempt) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(started) == 1 and refused == [BUSY] * 7
    collect(started[0])
    assert not chat.replying(user, conversation_id)


# ---- the sidebar -------------------------------------------------------------------------------------
def test_sidebar_lists_searches_opens_renames_and_deletes(chat, store):
    user = new_user()
    first = store.create_conversation(user, title="Lighthouses", system_prompt=PRESETS["Teacher"])["id"]
    store.add_message(user, first, "user", "How do lighthouses work?")
    store.add_message(user, first, "assistant", "With a lamp.", finish_reason="stop")
    second = store.create_conversation(user, title="Custom", system_prompt="Talk like a pirate.")["id"]

    assert chat.conversation_choices(user) == [("Custom", second), ("Lighthouses", first)]
    [(label, found)] = chat.conversation_choices(user, "lamp")
    assert found == first and label.startswith("Lighthouses — ") and "[lamp]" in label

    opened = chat.open_chat(user, first)
    assert [m["role"] for m in opened.messages] == ["user", "assistant"]
    assert (opened.preset, opened.custom, opened.title) == ("Teacher", "", "Lighthouses")
    assert opened.last_user_message == "How do lighthouses work?"
    custom = chat.open_chat(user, second)
    assert (custom.preset, custom.custom, custom.messages, custom.last_user_message) == \
        ("Custom", "Talk like a pirate.", [], "")

    chat.rename(user, first, "Beacons")
    assert store.conversation(user, first)["title"] == "Beacons"
    chat.check_deletable(first)
    chat.delete(user, first)
    chat.delete(user, None)  # nothing open: nothing to do
    assert chat.conversation_choices(user) == [("Custom", second)]
    assert chat.last_user_message(user, None) == ""


def test_last_user_message_and_decode_rate_helpers():
    rows = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    assert last_user_index(rows) == 2 and last_user_message(rows) == "c"
    assert last_user_index(rows[1:2]) is None and last_user_message([]) == ""
    assert decode_rate(11, 2.0) == 5.0  # the first token is the TTFT's, not decoding's
    assert decode_rate(1, 2.0) is None and decode_rate(5, 0.0) is None
