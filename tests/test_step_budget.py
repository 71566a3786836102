"""Stall-free batching: with a step-time target, prompts get only the time the decodes leave,
as the step-cost model learns it from the steps' own (here simulated) durations."""
import random

import pytest

from engine.core.scheduler import LONGEST_STEP
from engine.core.step_cost import StepCostModel, StepShape, keys_read
from engine.devtools.invariants import check_invariants
from engine.devtools.simulated_runner import run_step
from simulation import expected, make, request

# The simulated machine: a step's seconds from what it computes (a CPU-like shape: a prompt
# token costs far more than a decode row's share of the weights, attention grows with context).
BASE_S, DECODE_S, TOKEN_S, KEY_S = 0.004, 0.0015, 0.0006, 2e-7


def simulated_seconds(out) -> float:
    decodes = sum(item.num_new_tokens == 1 for item in out.scheduled)
    keys = sum(keys_read(item.start, item.num_new_tokens) for item in out.scheduled)
    return BASE_S + DECODE_S * decodes + TOKEN_S * out.num_prefill_tokens + KEY_S * keys


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 31 + i * 7) % 45 + 5 for i in range(length)]


def drive(sched, runner, steps_out: list, max_steps: int = 20_000) -> dict:
    done = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return done
        before = set(sched.requests) if sched.step_cost.ready else set()
        out, finished = run_step(sched, runner)
        seconds = simulated_seconds(out)
        sched.observe_step(out, seconds)
        check_invariants(sched)
        steps_out.append((out, seconds, before))
        done.update((r.request_id, r) for r in finished)
    raise AssertionError("not finished")


def test_the_model_learns_a_linear_cost_from_varied_steps():
    model = StepCostModel()
    rng = random.Random(0)
    for _ in range(60):
        shape = StepShape(rng.randrange(0, 20), rng.randrange(1, 300), rng.randrange(0, 200_000))
        seconds = BASE_S + DECODE_S * shape.num_decodes + TOKEN_S * shape.num_prefill_tokens + KEY_S * shape.keys_read
        model.observe(shape, seconds)
    probe = StepShape(8, 100, 50_000)
    truth = BASE_S + DECODE_S * 8 + TOKEN_S * 100 + KEY_S * 50_000
    assert model.predict(probe) == pytest.approx(truth, rel=0.02)
    # The inverse: tokens of a prompt at position 500 that fit in 50 ms.
    n = model.prompt_tokens_within(0.05, 500)
    assert TOKEN_S * n + KEY_S * keys_read(500, n) <= 0.05 * 1.02
    assert TOKEN_S * (n + 2) + KEY_S * keys_read(500, n + 2) > 0.05 * 0.98


def test_decodes_never_wait_behind_a_prompt_beyond_the_target():
    target_ms = 40.0
    sched, runner = make(num_device_blocks=512, max_num_batched_tokens=2048, max_step_ms=target_ms,
                         min_prompt_chunk=4, block_size=16)
    steps: list = []
    # Eight chats streaming, and a long prompt arriving once they are all decoding.
    chats = [request(f"chat{i}", prompt(i, 20), max_tokens=150, ignore_eos=True) for i in range(8)]
    for chat in chats:
        sched.add_request(chat)
    for _ in range(12):  # the chats' prompts (teaching the model), then decodes alone
        out, _ = run_step(sched, runner)
        sched.observe_step(out, simulated_seconds(out))
        steps.append((out, simulated_seconds(out)))
    long_prompt = request("long", prompt(99, 1500), max_tokens=4, ignore_eos=True)
    sched.add_request(long_prompt)
    after: list = []
    done = drive(sched, runner, after)
    with_prompt = [step for step in after if step[0].num_prefill_tokens]
    # The prompt was split over steps, each within the target, and every chat still streaming
    # decoded in each of them.
    assert len(with_prompt) >= 1500 * TOKEN_S / (target_ms / 1000)
    for out, seconds, before in with_prompt:
        if not before:
            continue  # the step-cost model had no fit yet: the smallest chunk
        decoding = {item.request_id for item in out.scheduled if item.num_new_tokens == 1}
        assert decoding >= {c.request_id for c in chats} & before
        assert seconds <= target_ms / 1000 * 1.05, f"a step with decodes took {seconds * 1000:.1f} ms"
    # And it still completes, with the same tokens as a run without a target.
    assert done["long"].output_token_ids == expected(long_prompt, sched.config.max_model_len)
    for chat in chats:
        assert done[chat.request_id].output_token_ids == expected(chat, sched.config.max_model_len)


def test_a_prompt_still_progresses_when_decodes_alone_exceed_the_target():
    sched, runner = make(num_device_blocks=1024, max_num_batched_tokens=2048, max_step_ms=5.0,
                         min_prompt_chunk=16, block_size=16)
    for i in range(12):  # 12 decodes already cost 4 + 18 ms > 5 ms
        sched.add_request(request(f"chat{i}", prompt(i, 10), max_tokens=400, ignore_eos=True))
    steps: list = []
    for _ in range(8):
        out, _ = run_step(sched, runner)
        sched.observe_step(out, simulated_seconds(out))
    late = request("late", prompt(7, 300), max_tokens=2, ignore_eos=True)
    sched.add_request(late)
    chunks = []  # (its tokens this step, whether the model had a fit)
    while "late" in sched.requests:
        ready = sched.step_cost.ready
        out, _ = run_step(sched, runner)
        sched.observe_step(out, simulated_seconds(out))
        chunks += [(item.num_new_tokens, ready) for item in out.scheduled if item.request_id == "late"]
        assert len(chunks) < 100, "the late prompt made no progress"
    # its prompt done (past the 10 tokens it shares with chat7's, copied from the cache), then its tokens
    assert late.num_cached_tokens + sum(n for n, _ in chunks[:-1]) >= 300
    fitted = [n for n, ready in chunks[:-1] if ready]
    assert fitted and all(n == 16 for n in fitted[:-1]) and fitted[-1] <= 16


def test_without_a_target_the_token_budget_alone_decides():
    sched, runner = make(num_device_blocks=256, max_num_batched_tokens=512, block_size=16)
    sched.add_request(request("a", prompt(1, 400), max_tokens=2, ignore_eos=True))
    out, _ = run_step(sched, runner)
    sched.observe_step(out, 10.0)  # a slow step changes nothing without a target
    assert [item.num_new_tokens for item in out.scheduled] == [400]


def test_before_the_model_has_seen_decodes_prompts_beside_them_come_in_the_smallest_chunks():
    sched, runner = make(num_device_blocks=256, max_num_batched_tokens=2048, max_step_ms=50.0,
                         min_prompt_chunk=12, block_size=16)
    sched.add_request(request("a", prompt(1, 10), max_tokens=20, ignore_eos=True))
    out, _ = run_step(sched, runner)  # a's prompt: one step the model learns from
    sched.observe_step(out, simulated_seconds(out))
    assert not sched.step_cost.ready
    sched.add_request(request("b", prompt(2, 200), max_tokens=2, ignore_eos=True))
    out, _ = run_step(sched, runner)
    assert [(item.request_id, item.num_new_tokens) for item in out.scheduled] == [("a", 1), ("b", 12)]


def test_a_step_without_decodes_gives_its_prompts_the_token_budget():
    """No one is streaming yet: nothing to keep a pace for, so a lone prompt is not chunked."""
    sched, runner = make(num_device_blocks=256, max_num_batched_tokens=512, max_step_ms=5.0, block_size=16)
    for i in range(6):  # steps of prompts alone, each slow next to a 5 ms target
        sched.add_request(request(f"t{i}", prompt(i, 40), max_tokens=1, ignore_eos=True))
        out, _ = run_step(sched, runner)
        sched.observe_step(out, simulated_seconds(out))
    assert not sched.has_unfinished()
    sched.add_request(request("long", prompt(9, 400), max_tokens=2, ignore_eos=True))
    out, _ = run_step(sched, runner)
    assert [item.num_new_tokens for item in out.scheduled] == [400]


def test_the_step_time_options_are_checked():
    with pytest.raises(ValueError, match="max_step_ms"):
        make(num_device_blocks=8, max_step_ms=0)
    with pytest.raises(ValueError, match="min_prompt_chunk"):
        make(num_device_blocks=8, max_step_ms=10, min_prompt_chunk=0)


def test_under_saturation_prompts_keep_a_share_of_each_step():
    """Decodes that alone take several times the target (a saturated server): prompts still get a
    quarter of their time, so the queue moves at a pace that grows with the load."""
    sched, runner = make(num_device_blocks=2048, max_num_batched_tokens=4096, max_step_ms=5.0,
                         min_prompt_chunk=4, block_size=16)
    for i in range(40):
        sched.add_request(request(f"chat{i}", prompt(i, 10), max_tokens=400, ignore_eos=True))
    for i in range(8):  # the chats decode; a few short prompts teach the model steps with decodes
        sched.add_request(request(f"teach{i}", prompt(50 + i, 20 + 7 * i), max_tokens=1, ignore_eos=True))
        out, _ = run_step(sched, runner)
        sched.observe_step(out, simulated_seconds(out))
    assert sched.step_cost.ready
    sched.add_request(request("late", prompt(99, 400), max_tokens=2, ignore_eos=True))
    for _ in range(200):  # until the short prompts ahead of it are done and it gets a step of its own
        out, _ = run_step(sched, runner)
        sched.observe_step(out, simulated_seconds(out))
        chunks = [item.num_new_tokens for item in out.scheduled if item.num_new_tokens > 1]
        if [item.request_id for item in out.scheduled if item.num_new_tokens > 1] == ["late"]:
            break
    else:
        raise AssertionError("the late prompt never got a step")
    decodes = sum(item.num_new_tokens == 1 for item in out.scheduled)
    chunk = chunks[0]
    decode_s = BASE_S + DECODE_S * decodes
    expected = 0.25 * decode_s / TOKEN_S  # keys read are a small term here
    assert decodes >= 40 and expected * 0.8 <= chunk <= expected * 1.05, (chunk, expected)


def test_a_model_that_predicts_free_decodes_leaves_prompts_the_whole_target():
    """A fit that puts none of a step's time on its decodes (its terms are kept non-negative, and
    a loaded machine's timings can fit so): the scheduler goes on, the prompts get the target."""
    sched, runner = saturated(100.0, 8, lambda: 0.0)
    sched.step_cost.coefficients = (0.0, 0.0, TOKEN_S, 0.0)  # decodes predicted free
    sched.add_request(request("late", prompt(99, 400), max_tokens=2, ignore_eos=True))
    out, _ = run_step(sched, runner)  # raised ZeroDivisionError while it planned the step
    check_invariants(sched)
    chunks = [item.num_new_tokens for item in out.scheduled if item.request_id == "late"]
    assert chunks == [int(0.100 / TOKEN_S)], chunks  # the whole 100 ms target


def saturated(target_ms: float, chats: int, clock) -> tuple:
    """A scheduler with `chats` chats decoding and a step-cost model that has learned from steps
    with decodes, the queue empty."""
    sched, runner = make(clock=clock, num_device_blocks=2048, max_num_batched_tokens=4096, max_step_ms=target_ms,
                         min_prompt_chunk=4, block_size=16)
    for i in range(chats):
        sched.add_request(request(f"chat{i}", prompt(i, 10), max_tokens=400, ignore_eos=True))
    for i in range(8):
        sched.add_request(request(f"teach{i}", prompt(50 + i, 20 + 7 * i), max_tokens=1, ignore_eos=True))
        out, _ = run_step(sched, runner)
        sched.observe_step(out, simulated_seconds(out))
    for _ in range(20):  # the teaching prompts done: decodes alone
        out, _ = run_step(sched, runner)
        sched.observe_step(out, simulated_seconds(out))
    assert sched.step_cost.ready and not sched.waiting
    return sched, runner


def test_the_longer_the_queue_waits_the_more_of_each_step_prompts_get_up_to_a_longest_step():
    """Twelve chats decode in about half the target: a fresh prompt gets the time they leave; one
    whose request has waited two seconds gets more (a quarter + two decode times), but only up
    to the longest step (1.25 times the target), so the streaming chats keep their pace."""
    now = [0.0]
    target_ms = 40.0
    sched, runner = saturated(target_ms, 12, lambda: now[0])

    def chunk_of(rid: str) -> tuple[int, int, float]:
        out, _ = run_step(sched, runner)
        seconds = simulated_seconds(out)
        sched.observe_step(out, seconds)
        return (sum(item.num_new_tokens for item in out.scheduled if item.request_id == rid),
                sum(item.num_new_tokens == 1 for item in out.scheduled), seconds)

    sched.add_request(request("fresh", prompt(98, 2000), max_tokens=2, ignore_eos=True))
    fresh, decodes, _ = chunk_of("fresh")
    decode_s = BASE_S + DECODE_S * decodes
    assert decodes == 12 and fresh == pytest.approx((target_ms / 1000 - decode_s) / TOKEN_S, rel=0.2)
    sched.finish_request("fresh")

    sched.add_request(request("late", prompt(99, 2000), max_tokens=2, ignore_eos=True))
    now[0] += 2.0  # it waited two seconds before this step: 2.25 decode times would pass the longest step
    late, decodes, seconds = chunk_of("late")
    decode_s = BASE_S + DECODE_S * decodes
    assert late == pytest.approx((LONGEST_STEP * target_ms / 1000 - decode_s) / TOKEN_S, rel=0.2)
    assert late > 1.4 * fresh and seconds <= LONGEST_STEP * target_ms / 1000 * 1.05


def test_when_decodes_alone_pass_the_longest_step_the_queues_wait_adds_nothing():
    """Forty chats decoding take longer than the longest step (they came in before the model could
    say so): a prompt that waited two seconds still gets a quarter of their time, as a fresh one."""
    now = [0.0]
    sched, runner = saturated(5.0, 40, lambda: now[0])
    sched.add_request(request("late", prompt(99, 2000), max_tokens=2, ignore_eos=True))
    now[0] += 2.0
    out, _ = run_step(sched, runner)
    late = sum(item.num_new_tokens for item in out.scheduled if item.request_id == "late")
    decode_s = BASE_S + DECODE_S * sum(item.num_new_tokens == 1 for item in out.scheduled)
    assert late == pytest.approx(0.25 * decode_s / TOKEN_S, rel=0.2)


def test_requests_join_only_while_the_running_set_decodes_within_the_target():
    """A burst of 40 chats onto a server whose step-cost model knows a decode costs 1.5 ms over a
    4-ms step, with a 20-ms target: at most 10 run at once (4 + 1.5 x 10 <= 20 ms, leaving prompts
    a quarter more within the longest step), the others wait, and every one of them finishes."""
    sched, runner = saturated(20.0, 2, lambda: 0.0)
    burst = [request(f"burst{i}", prompt(200 + i, 12), max_tokens=30, ignore_eos=True) for i in range(40)]
    for r in burst:
        sched.add_request(r)
    steps: list = []
    most = 0
    for _ in range(5000):
        if not any(r.request_id in sched.requests for r in burst):
            break
        out, _ = run_step(sched, runner)
        sched.observe_step(out, simulated_seconds(out))
        check_invariants(sched)
        most = max(most, len(sched.running))
        steps.append(out)
    else:
        raise AssertionError("the burst never finished")
    assert 8 <= most <= 10, most
    assert sched.num_steps and all(r.is_finished for r in burst)


def test_past_a_chats_first_token_goal_the_queue_serves_the_newest_first():
    """More arrivals than the server computes: while the queue's oldest has waited at most a
    second, first come first served; past it, the newest first (the ones the server can take in
    time are taken in time), and once arrivals stop the backlog is served too, every request."""
    now = [0.0]
    sched, runner = saturated(20.0, 2, lambda: now[0])
    order: list[str] = []

    def step() -> None:
        out, _ = run_step(sched, runner)
        sched.observe_step(out, simulated_seconds(out))
        check_invariants(sched)
        order.extend(item.request_id for item in out.scheduled
                     if item.request_id not in order and not item.request_id.startswith("chat"))

    old = [request(f"old{i}", prompt(300 + i, 12), max_tokens=40, ignore_eos=True) for i in range(30)]
    for r in old:
        sched.add_request(r)
    for _ in range(5):
        step()
    started = list(order)
    assert started and started == [f"old{i}" for i in range(len(started))]  # in time: arrival order
    now[0] += 2.0  # the queue's oldest has now waited two seconds
    new = [request(f"new{i}", prompt(400 + i, 12), max_tokens=40, ignore_eos=True) for i in range(3)]
    for r in new:
        sched.add_request(r)
    while len(order) < len(started) + 3:
        step()
    assert order[len(started):len(started) + 3] == ["new2", "new1", "new0"]
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        step()
    assert all(r.is_finished for r in old + new) and sorted(order) == sorted(r.request_id for r in old + new)
    backlog = order[len(started) + 3:]
    assert backlog == sorted(backlog, key=lambda rid: -int(rid[3:]))  # still past a second: newest first


def test_preempted_requests_resume_before_the_queue_s_newest():
    """Newest first applies to requests that never ran: one preempted by recompute (it already
    streamed) keeps the queue's front whatever the order of the others."""
    now = [0.0]
    sched, runner = make(clock=lambda: now[0], num_device_blocks=12, block_size=4, preemption_mode="recompute")
    streaming = [request(f"s{i}", prompt(i, 8), max_tokens=30, ignore_eos=True) for i in range(2)]
    for r in streaming:
        sched.add_request(r)
    for _ in range(200):
        out, _ = run_step(sched, runner)
        check_invariants(sched)
        if out.preempted_ids:
            break
    else:
        raise AssertionError("nothing was preempted")
    victim = sched.requests[out.preempted_ids[0]]
    assert victim.output_token_ids and victim in sched.waiting
    for i in range(3):
        sched.add_request(request(f"new{i}", prompt(100 + i, 8), max_tokens=4, ignore_eos=True))
    now[0] += 2.0  # the new ones have waited past a second
    sched.add_request(request("newest", prompt(200, 8), max_tokens=4, ignore_eos=True))
    out, _ = run_step(sched, runner)
    check_invariants(sched)
    queue = [r.request_id for r in sched.waiting]
    assert queue == [victim.request_id, "newest", "new2", "new1", "new0"], queue  # the pool still full
