"""Fault injection into the engine client's loop: a fault fails only what it touches, and no
caller ever waits on a dead engine."""
import threading

import pytest
from waiting import DEADLINE_S, wait_for

from engine import EngineBusyError, EngineClient, EngineDeadError, LLMEngine, SamplingParams
from engine.devtools.invariants import check_invariants

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class Injected(RuntimeError):
    pass


class LoopKilled(BaseException):
    """Not an Exception: nothing in the loop catches it, as with a fault the loop cannot survive."""


@pytest.fixture
def client(tiny_model_dir):
    client = EngineClient(LLMEngine(tiny_model_dir, num_gpu_blocks=64, num_cpu_blocks=32))
    yield client
    client.close()


def fail_on_calls(target, name: str, calls: set[int], error: BaseException):
    """Make `target.name` raise `error` on the given 1-based calls, and behave otherwise."""
    original, count = getattr(target, name), [0]

    def wrapper(*args, **kwargs):
        count[0] += 1
        if count[0] in calls:
            raise error
        return original(*args, **kwargs)
    setattr(target, name, wrapper)


def collect(stream, timeout: float = DEADLINE_S) -> list:
    """Read a stream to its end on another thread; fail the test rather than hang."""
    deltas, done = [], threading.Event()

    def read():
        deltas.extend(stream)
        done.set()
    threading.Thread(target=read, daemon=True).start()
    assert done.wait(timeout), "the stream never ended"
    return deltas


def finals(deltas) -> dict[int, object]:
    return {d.index: d for d in deltas if d.finish_reason is not None}


def wait_until_empty(client) -> None:
    engine = client.engine
    wait_for(lambda: not engine.has_unfinished() and client.stats().device_blocks_used == 0,
             lambda: f"the engine empty; it still holds work: {client.stats()}")
    check_invariants(engine.scheduler)


def test_a_forward_that_raises_fails_only_its_step_and_later_requests_succeed(client):
    reference = "".join(d.text for d in collect(client.submit("Tell me about paged attention.", PARAMS)))
    fail_on_calls(client.engine.runner, "execute", {1}, Injected("the forward broke"))
    failed = finals(collect(client.submit("A request in the failing step.", PARAMS)))
    assert failed[0].finish_reason == "error" and "Injected: the forward broke" in failed[0].error
    wait_until_empty(client)
    again = collect(client.submit("Tell me about paged attention.", PARAMS))
    assert finals(again)[0].finish_reason == "length"
    assert "".join(d.text for d in again) == reference
    wait_until_empty(client)


@pytest.mark.parametrize("failing_call", [1, 3], ids=["before-the-fork", "after-the-fork"])
def test_n_samples_each_get_a_final_error(client, failing_call):
    fail_on_calls(client.engine.runner, "execute", {failing_call}, Injected("sampling broke"))
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    ends = finals(collect(client.submit("Two samples, please.", params)))
    assert set(ends) == {0, 1}
    assert all(d.finish_reason == "error" and "sampling broke" in d.error for d in ends.values())
    wait_until_empty(client)
    ok = finals(collect(client.submit("Two samples, please.", params)))
    assert {i: d.finish_reason for i, d in ok.items()} == {0: "length", 1: "length"}


def test_a_step_bug_outside_the_forward_fails_open_requests_and_the_loop_goes_on(client):
    fail_on_calls(client.engine.scheduler, "update", {1}, Injected("bookkeeping broke"))
    ends = finals(collect(client.submit("Hello there.", PARAMS)))
    assert ends[0].finish_reason == "error" and "bookkeeping broke" in ends[0].error
    assert finals(collect(client.submit("Hello again.", PARAMS)))[0].finish_reason == "length"


def test_a_killed_loop_ends_every_stream_with_its_error_and_submit_raises(client):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    streams = [client.submit(f"Long reply number {i}.", params) for i in range(3)]
    for stream in streams:
        next(stream)  # all three are streaming
    fail_on_calls(client.engine, "step", {1}, LoopKilled("the loop thread dies"))
    for stream in streams:  # ended by the fault ("error"), not by writing their 200 tokens out ("length")
        ends = finals(collect(stream))
        assert ends[0].finish_reason == "error" and "LoopKilled" in ends[0].error
    assert client.closed
    with pytest.raises(EngineDeadError, match="stopped after a fault"):
        client.submit("Anyone there?", PARAMS)
    with pytest.raises(EngineDeadError):
        client.block_map(timeout=2.0)


def test_block_map_that_raises_reaches_its_caller_only(client):
    fail_on_calls(client.engine, "block_map_state", {1}, Injected("map broke"))
    with pytest.raises(Injected, match="map broke"):
        client.block_map()
    assert len(client.block_map().device) == 64
    assert finals(collect(client.submit("Still serving?", PARAMS)))[0].finish_reason == "length"


def test_submit_on_a_closed_client_raises_a_named_error(tiny_model_dir):
    closed = EngineClient(LLMEngine(tiny_model_dir, num_gpu_blocks=16, num_cpu_blocks=0))
    closed.close()
    with pytest.raises(EngineDeadError, match="closed"):
        closed.submit("hi", PARAMS)


def test_a_full_waiting_queue_refuses_at_once_and_takes_work_again_once_it_drains(deep_model_dir):
    busy = EngineClient(LLMEngine(deep_model_dir, num_gpu_blocks=64, num_cpu_blocks=0, max_num_seqs=1),
                        max_waiting=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        # Long enough to hold the only seat (max_num_seqs=1) until this test lets it go.
        running = busy.submit("I run first.", SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
        next(running)
        queued = [busy.submit(f"I wait, number {i}.", params) for i in range(2)]
        # Refused, not queued until a seat frees: the seat is held until `running` is closed below.
        with pytest.raises(EngineBusyError, match=r"2 requests are waiting \(limit 2\)"):
            busy.submit("One too many.", params)
        running.close()  # the seat frees; the two waiting requests run
        for stream in queued:
            assert finals(collect(stream))[0].finish_reason == "length"
        assert finals(collect(busy.submit("After the queue drained.", params)))[0].finish_reason == "length"
    finally:
        busy.close()
