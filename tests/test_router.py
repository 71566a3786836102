"""The routing rule (ui/backends/router.py) on stand-in endpoints whose load and health the test
sets: stickiness, the system-prompt owner and its imbalance limit, least loaded, and what happens
when a backend is down, unreachable or full."""
from __future__ import annotations

import time

import pytest

from engine import Delta, EngineBusyError, SamplingParams
from ui.backends.backend import BackendError, Probe
from ui.backends.figures import MetricsSnapshot
from ui.backends.monitor import Monitor
from ui.backends.router import MAX_IMBALANCE, Router, prefix_key

PRESET = [{"role": "system", "content": "You are a reviewer."}]


class Stand:
    """An endpoint whose health, load and failures the test sets."""

    def __init__(self, name: str) -> None:
        self.name, self.url = name, f"http://{name}"
        self.on_unreachable = None
        self.up, self.running, self.kv_usage = True, 0, 0.0
        self.fails: Exception | None = None
        self.exports_metrics = True
        self.started: list[str] = []

    async def start(self, messages, params, *, request_id, user, num_shared_messages):
        if self.fails is not None:
            raise self.fails
        self.started.append(request_id)

        async def deltas():
            yield Delta(request_id, 0, "hi", (), finish_reason="stop")
        return deltas()

    def probe(self) -> Probe:
        if not self.up:
            return Probe(up=False, problem="connection refused")
        if not self.exports_metrics:
            return Probe(up=True, model="m", problem="no metrics")
        return Probe(up=True, model="m", metrics=MetricsSnapshot(time.time(), "vllm", kv_usage=self.kv_usage,
                                                                   running=self.running, waiting=0))

    def block_map(self):
        return None


@pytest.fixture
def cluster():
    stands = {name: Stand(name) for name in ("a", "b", "c")}
    monitor = Monitor(list(stands.values()))  # looked at by hand (`look`), not started
    router = Router(monitor)

    def look(**running: int) -> None:
        for name, count in running.items():
            stands[name].running = count
        for name in stands:
            monitor.look(name)
    look()
    return stands, router, look


async def start(router: Router, messages=None, previous=None, user="u1", shared=1) -> str:
    reply = await router.start(messages or PRESET + [{"role": "user", "content": "x"}], SamplingParams(),
                               request_id="r", user=user, num_shared_messages=shared, previous=previous)
    async for _ in reply.deltas:
        pass
    return reply.backend


@pytest.mark.anyio
async def test_least_loaded_then_lowest_kv_usage(cluster):
    stands, router, look = cluster
    look(a=3, b=1, c=1)
    stands["b"].kv_usage, stands["c"].kv_usage = 0.5, 0.2
    look()
    assert router.order() == ["c", "b", "a"]
    assert await start(router, shared=0, messages=[{"role": "user", "content": "x"}]) == "c"


@pytest.mark.anyio
async def test_a_conversation_sticks_to_its_backend_however_loaded(cluster):
    stands, router, look = cluster
    look(a=0, b=50, c=0)
    assert await start(router, previous="b") == "b"


@pytest.mark.anyio
async def test_a_known_system_prompt_goes_to_its_owner_within_the_imbalance_limit(cluster):
    stands, router, look = cluster
    look(a=0, b=0, c=0)
    stands["a"].fails = EngineBusyError("full")  # the first served preset lands on b
    assert await start(router) == "b"
    stands["a"].fails = None
    look(a=0, b=MAX_IMBALANCE, c=0)
    assert await start(router, user="u2") == "b"  # another user: the preset's blocks are shared
    look(a=0, b=MAX_IMBALANCE + 1, c=0)
    assert await start(router, user="u3") == "a"  # too busy: least loaded instead, and a owns it now
    look(a=0, b=0, c=0)
    assert await start(router, user="u4") == "a"


def test_the_prefix_key_is_the_preset_for_everyone_or_a_users_own_prompt_for_that_user():
    own = [{"role": "system", "content": "Talk like a pirate."}, {"role": "user", "content": "hi"}]
    assert prefix_key(PRESET + own[1:], "u1", 1) == prefix_key(PRESET + [{"role": "user", "content": "yo"}], "u2", 1)
    assert prefix_key(own, "u1", 0) != prefix_key(own, "u2", 0)
    assert prefix_key(own, "u1", 0) == prefix_key(own[:1] + [{"role": "user", "content": "x"}], "u1", 0)
    assert prefix_key([{"role": "user", "content": "hi"}], "u1", 0) is None


@pytest.mark.anyio
async def test_a_down_backend_is_skipped_and_used_again_once_it_answers(cluster):
    stands, router, look = cluster
    stands["a"].up = False
    look()
    assert "a" not in router.order() and await start(router, previous="a") in ("b", "c")
    stands["a"].up = True
    look()
    assert await start(router, previous="a") == "a"


def test_a_backend_back_from_down_is_not_judged_by_its_load_before_it_went(cluster):
    stands, router, look = cluster
    look(a=9, b=1, c=1)
    stands["a"].up = False
    look()
    stands["a"].up, stands["a"].exports_metrics = True, False  # back, but its first /metrics failed
    look()
    assert router.monitor.load("a") == (0, 0.0) and router.order()[0] == "a"


@pytest.mark.anyio
async def test_an_unreachable_or_full_backend_is_skipped_for_the_next(cluster):
    stands, router, look = cluster
    stands["a"].fails = BackendError("a could not be reached (ConnectError)")
    stands["b"].fails = EngineBusyError("b is busy")
    assert await start(router, previous="a") == "c"
    assert all(router.monitor.load(name)[0] == 0 for name in "abc")  # nothing left counted in flight


@pytest.mark.anyio
async def test_when_none_takes_it_the_chat_hears_why(cluster):
    stands, router, look = cluster
    for stand in stands.values():
        stand.fails = EngineBusyError(f"{stand.name} is busy")
    with pytest.raises(EngineBusyError, match="every backend is full"):
        await start(router)
    stands["b"].fails = BackendError("b could not be reached (ConnectError)")
    with pytest.raises(BackendError, match="b could not be reached"):
        await start(router)
    for stand in stands.values():
        stand.up = False
    look()
    with pytest.raises(BackendError, match="no backend is reachable right now: a: connection refused"):
        await start(router)


@pytest.mark.anyio
async def test_replies_in_flight_count_as_load_until_they_end(cluster):
    stands, router, look = cluster
    reply = await router.start([{"role": "user", "content": "x"}], SamplingParams(), request_id="r")
    assert router.monitor.load("a") == (1, 0.0) and router.order()[0] == "b"
    await reply.deltas.aclose()
    assert router.monitor.load("a") == (0, 0.0)
