"""One block map per interval for the in-process engine, however many ask: every open panel and
every streaming chat's memory strip (through the backend) read the same one."""
from __future__ import annotations

import threading
import time

import pytest

from engine import EngineClient, LLMEngine
from ui import backends
from ui.backends.block_map_cache import BlockMapCache
from ui.backends.local import LOCAL_NAME
from ui.panel.feed import PanelFeed

HOUR = 3600.0  # an interval no test outlasts: every call in a test falls within one


class CountedMaps:
    """Wraps a client's `block_map`: counts the calls, and holds each one until released, so
    callers that come meanwhile find a fetch under way."""

    def __init__(self, client: EngineClient) -> None:
        self.calls = 0
        self.release = threading.Event()
        self._block_map = client.block_map
        client.block_map = self

    def __call__(self, timeout: float = 10.0):
        self.calls += 1
        self.release.wait(10.0)
        return self._block_map(timeout)


@pytest.fixture
def client(tiny_model_dir):
    client = EngineClient(LLMEngine(tiny_model_dir, num_gpu_blocks=32, num_cpu_blocks=8))
    yield client
    client.close()


def ask_at_once(callers, started_calls: CountedMaps) -> list:
    """Call every `caller` on a thread of its own, all while the first fetch is held."""
    results: list = [None] * len(callers)

    def call(i: int) -> None:
        results[i] = callers[i]()
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(callers))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10.0
    while started_calls.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    started_calls.release.set()
    for thread in threads:
        thread.join(20.0)
    assert not any(thread.is_alive() for thread in threads)
    return results


def test_many_chats_asking_the_backend_at_once_cost_one_block_map(client):
    counted = CountedMaps(client)
    router = backends.in_process(client, interval_s=HOUR)
    try:
        found = ask_at_once([lambda: router.block_map(LOCAL_NAME)] * 16, counted)
    finally:
        router.close()
    assert counted.calls == 1
    assert all(f is not None and f[0] is found[0][0] for f in found)


def test_the_panel_and_the_memory_strip_read_one_block_map(client):
    counted = CountedMaps(client)
    feed = PanelFeed(client, interval_s=HOUR)
    router = backends.in_process(client, interval_s=HOUR, block_map_cache=feed.block_map_cache)
    try:
        callers = [feed.block_map, lambda: router.block_map(LOCAL_NAME)[0]] * 8
        maps = ask_at_once(callers, counted)
    finally:
        router.close()
    assert counted.calls == 1
    assert all(m is maps[0] for m in maps)
    assert len(maps[0].device) == 32


def test_a_failed_fetch_answers_its_whole_interval():
    """An engine that cannot answer (stuck in a long step) is asked once per interval, not once
    per chat: every caller of that interval gets the same error."""
    calls = []

    def fetch():
        calls.append(1)
        raise TimeoutError("no answer")
    cache = BlockMapCache(fetch, interval_s=HOUR)
    for _ in range(3):
        with pytest.raises(TimeoutError, match="no answer"):
            cache.get()
    assert len(calls) == 1
    with pytest.raises(ValueError, match="interval_s"):
        BlockMapCache(fetch, interval_s=0)
