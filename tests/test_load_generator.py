"""Synthetic load users on the live engine: batching, prefix sharing and swapping show up, and
stop() leaves nothing behind; refusals and errors never kill a user."""
import copy
import threading
import time

import pytest
from waiting import poll, wait_for

import ui.panel.load_generator as load_generator

from engine.runtime.thread_client import EngineClient
from engine.runtime.llm_engine import LLMEngine
from engine.outputs import Delta
from ui.panel.load_generator import LOAD_SYSTEM_PROMPT, MAX_TOKENS_LIMIT, MAX_USERS, LoadGenerator, LoadStatus


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    # A device pool far too small for 8 users (each conversation grows to ~30 blocks) and a
    # bigger host pool, so the scheduler has to preempt by swapping.
    client = EngineClient(LLMEngine(tiny_model_dir, num_gpu_blocks=48, num_cpu_blocks=128))
    yield client
    client.close()


@pytest.fixture
def generators():
    """Generators made by a test; whatever it leaves running is stopped at the end."""
    made: list[LoadGenerator] = []
    yield made
    for generator in made:
        generator.stop(timeout=30)


def make(generators, client, **kwargs) -> LoadGenerator:
    generator = LoadGenerator(client, **kwargs)
    generators.append(generator)
    return generator


def assert_engine_idle(client) -> None:
    def idle():
        s = client.stats()
        return (s.device_blocks_used == 0 and s.host_blocks_used == 0
                and s.num_running == s.num_waiting == s.num_swapped == 0)
    wait_for(idle, lambda: f"the engine idle after stop(); still busy: {client.stats()}")


def wait_for_new_threads(before: set[threading.Thread], count: int) -> None:
    """Exactly `count` threads that were not in `before` (one that merely comes and goes, not the
    generator's, does not fail the test: the count is waited for, not read once)."""
    wait_for(lambda: len(set(threading.enumerate()) - before) == count,
             lambda: f"{count} new threads; there are {[t.name for t in set(threading.enumerate()) - before]}")


def wait_for_status(generator, condition, what: str) -> LoadStatus:
    """The generator's first status for which `condition` holds."""
    def status() -> LoadStatus | None:
        current = generator.status()
        return current if condition(current) else None
    return wait_for(status, lambda: f"{what}; status {generator.status()}")


def endings(client) -> dict[str, tuple[str, float]]:
    """request id -> (finish reason, when it came), for load requests, as the client routes them."""
    ends: dict[str, tuple[str, float]] = {}

    def listen(delta, now: float) -> None:
        if delta.finish_reason is not None and delta.request_id.startswith("load"):
            ends.setdefault(delta.request_id, (delta.finish_reason, now))
    client.add_listener(listen)
    return ends


def an_hour_long_pause(monkeypatch) -> None:
    """From now on a user that is refused or fails pauses for an hour: a stop() that waited the
    pause out would raise its TimeoutError (30 s) instead of returning."""
    monkeypatch.setattr(load_generator, "_RETRY_WAIT_S", 3600.0)


def load_owners(block_map) -> set[str]:
    return {o for b in block_map.device + block_map.host for o in b.owners if o.startswith("load")}


class RecordingClient:
    """Passes through to a real client and records every submit (messages copied at the time)."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.lock = threading.Lock()
        self.submits: list[tuple[str, list[dict], object]] = []

    def submit(self, prompt, params=None, request_id=None):
        with self.lock:
            self.submits.append((request_id, copy.deepcopy(prompt), params))
        return self.client.submit(prompt, params, request_id=request_id)

    def abort(self, request_id: str) -> None:
        self.client.abort(request_id)


def test_system_prompt_is_a_few_hundred_tokens(tokenizer):
    n = len(tokenizer(LOAD_SYSTEM_PROMPT, add_special_tokens=False).input_ids)
    assert 200 <= n <= 400, n


def test_load_shows_batching_shared_prefixes_and_swapping_and_stop_leaves_nothing(client, generators):
    generator = make(generators, client, think_time_s=0.05)
    threads_before = set(threading.enumerate())
    start = client.stats()
    generator.start(8)
    assert generator.running and generator.status().users == 8
    wait_for_new_threads(threads_before, 8)

    max_running = 0
    shared_across_conversations = False

    def seen_everything() -> bool:
        nonlocal max_running, shared_across_conversations
        stats = client.stats()
        max_running = max(max_running, stats.num_running)
        if not shared_across_conversations:
            for block in client.block_map().device:
                keys = {owner.split("/")[0] for owner in block.owners}
                if block.ref_count > 1 and len(keys) >= 2 and all(k.startswith("load") for k in keys):
                    shared_across_conversations = True
        return (generator.status().replies > 0 and stats.prefix_cache_hits > start.prefix_cache_hits
                and stats.total_blocks_swapped_out > start.total_blocks_swapped_out
                and max_running >= 2 and shared_across_conversations)

    poll(seen_everything, interval=0.05)
    stats, status = client.stats(), generator.status()
    assert status.replies > 0, status
    assert stats.prefix_cache_hits > start.prefix_cache_hits
    assert stats.total_blocks_swapped_out > start.total_blocks_swapped_out, "no swap preemption happened"
    assert max_running >= 2
    assert shared_across_conversations, "no device block was shared by two load conversations"
    assert status.errors == 0 and status.last_error is None, status

    generator.stop()  # raises if a user thread outlived it
    assert not generator.running and not generator.status().running
    wait_for_new_threads(threads_before, 0)
    assert load_owners(client.block_map()) == set(), "a load request is still in the engine"
    assert_engine_idle(client)


def test_conversations_grow_turn_by_turn_then_start_afresh(client, generators):
    recorder = RecordingClient(client)
    generator = make(generators, recorder, think_time_s=0.0, turns_per_conversation=2)
    generator.start(3, max_tokens=4)
    wait_for_status(generator, lambda s: s.replies >= 12, "12 replies")
    generator.stop()
    by_id = {request_id: (messages, params) for request_id, messages, params in recorder.submits}
    assert len(by_id) == len(recorder.submits), "a request id was used twice"

    for request_id, (messages, params) in by_id.items():
        conversation, turn = request_id.split("/t")
        turn = int(turn)
        assert turn < 2
        assert messages[0] == {"role": "system", "content": LOAD_SYSTEM_PROMPT}
        assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * turn + ["user"]
        assert params.max_tokens == 4 and params.seed is not None
        if turn:  # the previous turn's prompt is a prefix of this one: the prefix cache can reuse it
            previous, _ = by_id[f"{conversation}/t{turn - 1}"]
            assert messages[:len(previous)] == previous

    # At the same moment (first turn of the first conversation) every user asks something else.
    first_questions = [by_id[f"load1-u{u}-c0/t0"][0][-1]["content"] for u in range(3)]
    assert len(set(first_questions)) == 3
    # Each conversation is a fresh one: users cycle through conversations, not one growing chat.
    assert any(request_id.startswith("load1-u0-c1/") for request_id in by_id)
    seeds = [params.seed for _, params in by_id.values()]
    assert len(set(seeds)) == len(seeds)


def test_empty_system_prompt_sends_no_system_message(client, generators):
    recorder = RecordingClient(client)
    generator = make(generators, recorder, think_time_s=0.0)
    generator.start(2, system_prompt="", max_tokens=2)
    wait_for_status(generator, lambda s: s.replies >= 2, "2 replies")
    generator.stop()
    assert recorder.submits
    assert all(m["role"] != "system" for _, messages, _ in recorder.submits for m in messages)


@pytest.mark.parametrize("kwargs, limit", [
    ({"users": 0}, str(MAX_USERS)), ({"users": MAX_USERS + 1}, str(MAX_USERS)), ({"users": 2.0}, str(MAX_USERS)),
    ({"users": 2, "max_tokens": 0}, str(MAX_TOKENS_LIMIT)),
    ({"users": 2, "max_tokens": MAX_TOKENS_LIMIT + 1}, str(MAX_TOKENS_LIMIT)),
])
def test_start_validates_users_and_max_tokens(client, generators, kwargs, limit):
    generator = make(generators, client)
    with pytest.raises(ValueError, match=limit):
        generator.start(**kwargs)
    assert generator.status() == LoadStatus(running=False, users=0, replies=0, refused=0, errors=0, last_error=None)


def test_a_bad_start_leaves_the_running_users_alone(client, generators):
    generator = make(generators, client)
    generator.start(2, max_tokens=4)
    with pytest.raises(ValueError, match=str(MAX_USERS)):
        generator.start(MAX_USERS + 1)
    assert generator.running and generator.status().users == 2
    generator.stop()
    assert_engine_idle(client)


def test_start_while_running_restarts_with_fresh_counters_and_new_ids(client, generators):
    recorder = RecordingClient(client)
    generator = make(generators, recorder, think_time_s=0.0)
    generator.start(3, max_tokens=64)
    wait_for_status(generator, lambda s: s.replies >= 3, "3 replies")

    generator.start(2, max_tokens=64)  # users are mid-reply: they are stopped and aborted first
    status = generator.status()
    assert status.running and status.users == 2
    assert (status.replies, status.refused, status.errors) == (0, 0, 0)
    wait_for_status(generator, lambda s: s.replies >= 2, "2 replies")
    generator.stop()

    status = generator.status()
    assert status.refused == 0 and status.errors == 0, status
    ids = [request_id for request_id, _, _ in recorder.submits]
    assert len(set(ids)) == len(ids), "a request id was used twice"
    second = {request_id for request_id in ids if request_id.startswith("load2-")}
    assert second and all(request_id.startswith(("load1-", "load2-")) for request_id in ids)
    assert {request_id.split("-")[1] for request_id in second} == {"u0", "u1"}
    assert_engine_idle(client)


def test_stop_aborts_long_replies_and_queued_requests(client, generators):
    # 6 users asking for 512 tokens each: a reply takes seconds, and some wait in the queue.
    ends = endings(client)
    decoded: set[str] = set()
    client.add_listener(lambda delta, now: delta.token_ids and delta.request_id.startswith("load")
                        and decoded.add(delta.request_id))
    generator = make(generators, client, think_time_s=0.0)
    generator.start(6, max_tokens=MAX_TOKENS_LIMIT)
    wait_for(lambda: decoded, "a load reply to decode its first tokens")
    stopping = time.monotonic()
    generator.stop()
    # Whatever was still in the engine when stop() came was aborted, not waited for to finish.
    late = {request_id: reason for request_id, (reason, at) in ends.items() if at >= stopping}
    assert late and set(late.values()) == {"abort"}, late
    assert load_owners(client.block_map()) == set()
    assert_engine_idle(client)


def test_stop_before_start_and_twice_is_fine(client):
    generator = LoadGenerator(client)
    generator.stop()
    assert generator.status() == LoadStatus(running=False, users=0, replies=0, refused=0, errors=0, last_error=None)
    generator.start(1, max_tokens=2)
    generator.stop()
    generator.stop()
    assert not generator.running
    assert generator.status().users == 1


def test_refused_conversations_do_not_kill_users_nor_spin(tiny_model_dir, generators, monkeypatch):
    # 8 blocks of 16 tokens: max_model_len 128, far below the system prompt alone.
    small = EngineClient(LLMEngine(tiny_model_dir, num_gpu_blocks=8, num_cpu_blocks=0))
    threads_before = set(threading.enumerate())
    generator = make(generators, small)
    try:
        users = 3
        generator.start(users)
        wait_for_status(generator, lambda s: s.refused >= users, "every user refused")
        refused, began = generator.status().refused, time.monotonic()
        # Users keep retrying (after ~1 s each), however long a busy machine takes to show it.
        status = wait_for_status(generator, lambda s: s.refused >= refused + users, "users retrying")
        elapsed = time.monotonic() - began
        assert status.running and status.errors == 0, status
        # Each refused fresh conversation waits ~1 s before the next try: a slow machine retries
        # less often, never more.
        assert status.refused - refused <= users * (elapsed + 1), "users retry without waiting"
        wait_for_new_threads(threads_before, users)
        assert all(t.is_alive() for t in set(threading.enumerate()) - threads_before)

        an_hour_long_pause(monkeypatch)
        refused = generator.status().refused
        wait_for_status(generator, lambda s: s.refused > refused, "a user refused again, now to pause an hour")
        generator.stop()  # it wakes the paused users rather than waiting the pause out
        wait_for_new_threads(threads_before, 0)
        assert_engine_idle(small)
    finally:
        generator.stop()  # before the client closes, even when an assertion failed
        small.close()


def test_a_conversation_that_outgrows_the_cache_starts_afresh(tiny_model_dir, tokenizer, generators):
    # Room for the system prompt and one question and reply, not for a second turn on top.
    prompt_tokens = len(tokenizer(LOAD_SYSTEM_PROMPT, add_special_tokens=False).input_ids)
    num_blocks = (prompt_tokens + 60) // 16
    small = EngineClient(LLMEngine(tiny_model_dir, num_gpu_blocks=num_blocks, num_cpu_blocks=32))
    generator = make(generators, small, think_time_s=0.0)
    try:
        generator.start(2, max_tokens=48)
        wait_for_status(generator, lambda s: s.refused >= 1, "a refused turn")
        replies = generator.status().replies
        wait_for_status(generator, lambda s: s.replies > replies + 1, "replies after the refusal")
        status = generator.status()
        assert status.running and status.errors == 0, status
        generator.stop()
        assert_engine_idle(small)
    finally:
        generator.stop()  # before the client closes, even when an assertion failed
        small.close()


class FakeClient:
    """A client whose submit raises, or whose streams end with an engine error."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.release = threading.Event()
        self.submits = 0

    def submit(self, prompt, params=None, request_id=None):
        self.submits += 1
        if self.mode == "raise":
            raise RuntimeError("the engine loop is gone")
        if self.mode == "hang":
            self.release.wait()
            raise ValueError("released")
        return iter([Delta(request_id, 0, "", (), finish_reason="error", error="RuntimeError: boom")])

    def abort(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("mode, message", [("raise", "RuntimeError: the engine loop is gone"),
                                           ("error", "RuntimeError: boom")])
def test_errors_are_counted_and_users_keep_going_without_spinning(generators, mode, message, monkeypatch):
    fake = FakeClient(mode)
    generator = make(generators, fake)
    generator.start(2)
    wait_for_status(generator, lambda s: s.errors >= 2, "the first errors")
    errors, began = generator.status().errors, time.monotonic()
    # Users keep going after an error (after ~1 s each), however long a busy machine takes to show it.
    status = wait_for_status(generator, lambda s: s.errors >= errors + 2, "users going on after errors")
    elapsed = time.monotonic() - began
    assert status.running and status.replies == 0 and status.refused == 0
    assert message in status.last_error
    # A slow machine retries less often, never more.
    assert status.errors - errors <= 2 * (elapsed + 1), f"errors retried without waiting: {status}"

    an_hour_long_pause(monkeypatch)
    errors = generator.status().errors
    wait_for_status(generator, lambda s: s.errors > errors, "a user failing again, now to pause an hour")
    generator.stop()  # it wakes the paused users rather than waiting the pause out


def test_stop_names_the_users_that_did_not_stop(generators):
    fake = FakeClient("hang")
    generator = make(generators, fake)
    generator.start(2)
    try:
        wait_for(lambda: fake.submits == 2, lambda: f"both users submitting; {fake.submits} did")
        with pytest.raises(TimeoutError, match="2 of 2 load users"):
            generator.stop(timeout=0.2)
        assert not generator.running
        with pytest.raises(TimeoutError):  # still stuck: a second stop() does not pretend otherwise
            generator.stop(timeout=0.1)
    finally:
        fake.release.set()
    generator.stop()
