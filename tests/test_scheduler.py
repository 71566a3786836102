"""Scheduling decisions: budgets, chunking, preemption, swap order, refusal, abort, finishing."""
import pytest

from engine import FinishReason, PromptTooLongError, RequestStatus, SchedulerConfig
from engine.devtools.invariants import check_invariants
from engine.devtools.simulated_runner import run_step
from simulation import expected, expected_block_map, make, request, run


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 31 + i * 7) % 45 + 5 for i in range(length)]


def test_decodes_and_prefill_share_one_step_within_the_token_budget():
    sched, runner = make(num_device_blocks=64, max_num_batched_tokens=10)
    sched.add_request(request("a", prompt(1, 6), max_tokens=4, ignore_eos=True))
    run_step(sched, runner)
    sched.add_request(request("b", prompt(2, 30), max_tokens=4, ignore_eos=True))
    out, _ = run_step(sched, runner)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 9
    assert out.scheduled[1].num_samples == 0  # mid-prompt: nothing to sample yet


def test_chunked_prefill_catches_up_then_samples():
    sched, runner = make(num_device_blocks=64, max_num_batched_tokens=16)
    sched.add_request(request("a", prompt(3, 40), max_tokens=2, ignore_eos=True))
    chunks = []
    done = run(sched, runner, on_step=lambda out: chunks.append(
        [(s.start, s.num_new_tokens, s.num_samples) for s in out.scheduled]))
    assert chunks[:4] == [[(0, 16, 0)], [(16, 16, 0)], [(32, 8, 1)], [(40, 1, 1)]]
    assert done["a"].output_token_ids == expected(done["a"], 256)


def test_max_num_seqs_caps_the_batch():
    sched, runner = make(num_device_blocks=64, max_num_seqs=2)
    for i in range(4):
        sched.add_request(request(f"r{i}", prompt(i, 3), max_tokens=3, ignore_eos=True))
    counts = []
    run(sched, runner, on_step=lambda out: counts.append(len(out.scheduled)))
    assert max(counts) == 2 and sum(counts) == 4 * 3


def growing(sched, runner, n, length=6, max_tokens=24):
    reqs = [request(f"r{i}", prompt(i, length), max_tokens=max_tokens, ignore_eos=True) for i in range(n)]
    for r in reqs:
        sched.add_request(r)
    return reqs


def test_preemption_by_swap_in_a_tiny_pool():
    sched, runner = make(num_device_blocks=12, num_host_blocks=32, preemption_mode="swap")
    reqs = growing(sched, runner, 3)
    events = []
    done = run(sched, runner, on_step=lambda out: events.append(out))
    assert sched.num_preemptions_swap > 0 and sched.num_preemptions_recompute == 0
    first = next(out for out in events if out.preempted_ids)
    assert first.preempted_ids == ["r2"]  # the latest arrival is the victim
    assert first.blocks_to_swap_out and sum(len(o.blocks_to_swap_in) for o in events) > 0
    for r in reqs:
        assert done[r.request_id].output_token_ids == expected(r, sched.config.max_model_len)
    assert sched.kv.device.num_used == 0 and sched.kv.host.num_used == 0


def test_preemption_by_recompute_gives_the_same_outputs():
    sched, runner = make(num_device_blocks=12, preemption_mode="recompute")
    reqs = growing(sched, runner, 3)
    done = run(sched, runner)
    assert sched.num_preemptions_recompute > 0 and sched.num_preemptions_swap == 0
    for r in reqs:
        assert done[r.request_id].output_token_ids == expected(r, sched.config.max_model_len)
    assert sched.kv.device.num_used == 0


def test_recompute_victim_is_the_latest_arrival_and_goes_to_the_front():
    sched, runner = make(num_device_blocks=12, preemption_mode="recompute")
    growing(sched, runner, 3)
    while True:
        out, _ = run_step(sched, runner)
        if out.preempted_ids:
            break
        if not sched.waiting:
            sched.add_request(request("late", prompt(9, 30), max_tokens=2, ignore_eos=True))
    assert out.preempted_ids == ["r2"]
    assert [r.request_id for r in sched.waiting] == ["r2", "late"]
    assert sched.requests["r2"].num_computed_tokens == 0 and not sched.requests["r2"].block_ids


def test_swapped_requests_resume_before_waiting_ones():
    sched, runner = make(num_device_blocks=12, num_host_blocks=32, preemption_mode="swap", watermark=0.0)
    growing(sched, runner, 3)
    log = []

    def watch(out):
        scheduled = {s.request_id for s in out.scheduled}
        log.append((scheduled, {r.request_id for r in sched.swapped}))
    # Let r2 get swapped out, then queue a small request that would fit right away.
    while not sched.swapped:
        out, _ = run_step(sched, runner)
    sched.add_request(request("small", [5], max_tokens=1))
    run(sched, runner, on_step=watch)
    small_step = next(i for i, (scheduled, _) in enumerate(log) if "small" in scheduled)
    r2_back = next(i for i, (scheduled, _) in enumerate(log) if "r2" in scheduled)
    assert r2_back <= small_step
    assert all(not swapped for scheduled, swapped in log[:small_step + 1] if "small" in scheduled)


def test_full_host_pool_falls_back_to_recompute():
    sched, runner = make(num_device_blocks=12, num_host_blocks=2, preemption_mode="swap")
    reqs = growing(sched, runner, 3)
    done = run(sched, runner)
    assert sched.num_preemptions_recompute > 0
    for r in reqs:
        assert done[r.request_id].output_token_ids == expected(r, sched.config.max_model_len)


def test_auto_recomputes_a_victim_holding_little_of_its_own():
    system = prompt(5, 16)
    sched, runner = make(num_device_blocks=17, num_host_blocks=32, preemption_mode="auto")
    sched.add_request(request("big", prompt(1, 40), max_tokens=40, ignore_eos=True))
    sched.add_request(request("sys-a", system + [1], max_tokens=40, ignore_eos=True))
    run_step(sched, runner)
    run_step(sched, runner)
    sched.add_request(request("sys-b", system + [2], max_tokens=40, ignore_eos=True))
    while True:
        out, _ = run_step(sched, runner)
        if out.preempted_ids:
            break
    # sys-b shares its four system-prompt blocks with sys-a and owns one: recompute is cheap.
    assert out.preempted_ids == ["sys-b"] and not out.blocks_to_swap_out
    assert sched.requests["sys-b"].status is RequestStatus.WAITING
    assert sched.num_preemptions_recompute == 1 and sched.num_preemptions_swap == 0
    done = run(sched, runner)
    assert done["sys-b"].num_cached_tokens == 16


def test_auto_swaps_a_victim_with_many_blocks_of_its_own():
    sched, runner = make(num_device_blocks=12, num_host_blocks=32, preemption_mode="auto")
    growing(sched, runner, 3)
    while True:
        out, _ = run_step(sched, runner)
        if out.preempted_ids:
            break
    assert out.blocks_to_swap_out and sched.requests["r2"].status is RequestStatus.SWAPPED


def test_swap_in_reuses_blocks_still_cached_on_the_device():
    sched, runner = make(num_device_blocks=12, num_host_blocks=32, preemption_mode="swap")
    reqs = growing(sched, runner, 3)
    swapped_out = swapped_in = 0

    def watch(out):
        nonlocal swapped_out, swapped_in
        swapped_out += len(out.blocks_to_swap_out)
        swapped_in += len(out.blocks_to_swap_in)
    done = run(sched, runner, on_step=watch)
    assert 0 < swapped_in < swapped_out
    for r in reqs:
        assert done[r.request_id].output_token_ids == expected(r, sched.config.max_model_len)


def test_copy_on_write_for_forked_samples():
    sched, runner = make(num_device_blocks=32)
    sched.add_request(request("p", prompt(4, 6), max_tokens=5, n=3, ignore_eos=True))
    out, _ = run_step(sched, runner)
    assert out.scheduled[0].num_samples == 3
    parent, c1, c2 = sched.requests["p"], sched.requests["p#1"], sched.requests["p#2"]
    assert parent.block_ids == c1.block_ids == c2.block_ids
    shared_tail = parent.block_ids[-1]
    assert sched.kv.device.blocks[shared_tail].ref_count == 3
    out, _ = run_step(sched, runner)
    # The first two writers copy the shared partial block; the last one writes in place.
    assert [src for src, _ in out.blocks_to_copy] == [shared_tail, shared_tail]
    assert sched.kv.device.blocks[shared_tail].ref_count == 1
    assert len({parent.block_ids[-1], c1.block_ids[-1], c2.block_ids[-1]}) == 3
    assert parent.block_ids[0] == c1.block_ids[0] == c2.block_ids[0]  # full blocks stay shared
    done = run(sched, runner)
    for i, rid in enumerate(("p", "p#1", "p#2")):
        assert done[rid].output_token_ids == expected(parent, sched.config.max_model_len, sample_index=i)


def test_no_copy_when_the_forked_prompt_ends_on_a_block_boundary():
    sched, runner = make(num_device_blocks=32)
    sched.add_request(request("p", prompt(4, 8), max_tokens=3, n=2, ignore_eos=True))
    copies = []
    run(sched, runner, on_step=lambda out: copies.extend(out.blocks_to_copy))
    assert copies == []


def test_prompt_that_can_never_fit_is_refused_without_blocking_the_queue():
    sched, runner = make(num_device_blocks=8, max_model_len=20)
    sched.add_request(request("ok", prompt(1, 5), max_tokens=3, ignore_eos=True))
    with pytest.raises(PromptTooLongError, match="21 tokens.*max_model_len=20"):
        sched.add_request(request("huge", prompt(2, 21)))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(request("empty", []))
    done = run(sched, runner)
    assert list(done) == ["ok"]


def test_max_model_len_beyond_the_device_pool_is_refused_at_configuration():
    with pytest.raises(ValueError, match="8 blocks x 4 tokens = 32 tokens"):
        SchedulerConfig(num_device_blocks=8, block_size=4, max_model_len=33)
    assert SchedulerConfig(num_device_blocks=8, block_size=4).max_model_len == 32


def test_a_prompt_as_large_as_the_pool_runs_alone_despite_the_watermark():
    sched, runner = make(num_device_blocks=8, watermark=0.25)
    sched.add_request(request("whole", prompt(1, 32), max_tokens=5, ignore_eos=True))
    done = run(sched, runner)
    assert done["whole"].finish_reason is FinishReason.LENGTH and len(done["whole"].output_token_ids) == 1


@pytest.mark.parametrize("watermark, admitted", [(0.25, False), (0.0, True)])
def test_watermark_holds_back_admission_while_others_run(watermark, admitted):
    sched, runner = make(num_device_blocks=20, watermark=watermark)  # 0.25: keep 5 blocks free
    sched.add_request(request("a", prompt(1, 8), max_tokens=30, ignore_eos=True))
    run_step(sched, runner)
    run_step(sched, runner)  # a holds 3 blocks
    sched.add_request(request("b", prompt(2, 52), max_tokens=2, ignore_eos=True))  # 13 blocks: 4 left
    out, _ = run_step(sched, runner)
    assert ("b" in {s.request_id for s in out.scheduled}) is admitted
    done = run(sched, runner)
    assert set(done) == {"a", "b"}


def test_finishing_on_stop_ids_max_tokens_and_max_model_len():
    sched, runner = make(num_device_blocks=16, max_model_len=12)
    p = prompt(7, 5)
    first = expected(request("x", p, max_tokens=1), 64)[0]
    sched.add_request(request("stop-id", p, max_tokens=9, ignore_eos=True, stop_token_ids=[first]))
    sched.add_request(request("max-tokens", p, max_tokens=3, ignore_eos=True))
    sched.add_request(request("model-len", p, max_tokens=50, ignore_eos=True))
    done = run(sched, runner)
    assert done["stop-id"].finish_reason is FinishReason.STOP and done["stop-id"].stop_token_id == first
    assert done["stop-id"].output_token_ids == [first]
    assert done["max-tokens"].finish_reason is FinishReason.LENGTH and len(done["max-tokens"].output_token_ids) == 3
    assert done["model-len"].finish_reason is FinishReason.LENGTH and done["model-len"].num_tokens == 12


def test_eos_stops_unless_ignored():
    for seed in range(100):  # a prompt whose simulated reply reaches eos
        p = prompt(seed, 4)
        reply = expected(request("x", p, max_tokens=300), 1024)
        if reply[-1] == 0 and len(reply) < 300:
            break
    sched, runner = make(num_device_blocks=256)
    sched.add_request(request("eos", p, max_tokens=300))
    sched.add_request(request("ignore", p, max_tokens=len(reply) + 3, ignore_eos=True))
    done = run(sched, runner)
    assert done["eos"].output_token_ids == reply and done["eos"].finish_reason is FinishReason.STOP
    assert done["ignore"].output_token_ids[:len(reply)] == reply
    assert len(done["ignore"].output_token_ids) == len(reply) + 3


def test_abort_in_every_state_returns_every_block():
    sched, runner = make(num_device_blocks=12, num_host_blocks=32, preemption_mode="swap", max_num_seqs=4)
    growing(sched, runner, 3)
    sched.add_request(request("forked", prompt(9, 6), max_tokens=30, n=2, ignore_eos=True))
    sched.add_request(request("waiting", prompt(8, 5), max_tokens=3))
    while not sched.swapped:
        run_step(sched, runner)
    states = {r.request_id: r.status for r in sched.requests.values()}
    assert {RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.SWAPPED} <= set(states.values())
    assert sched.kv.host.num_used > 0
    for rid in list(states):
        if rid in sched.requests:
            assert sched.abort_request(rid)
        check_invariants(sched)
    assert not sched.has_unfinished()
    assert sched.kv.device.num_used == 0 and sched.kv.host.num_used == 0
    assert not sched.abort_request("r0")
    out = sched.schedule()
    assert set(out.finished_ids) == set(states) and not out.scheduled


def test_aborting_a_forked_request_ends_all_its_samples():
    sched, runner = make(num_device_blocks=32)
    sched.add_request(request("p", prompt(4, 6), max_tokens=20, n=3, ignore_eos=True))
    run_step(sched, runner)
    assert {"p", "p#1", "p#2"} <= set(sched.requests)
    sched.abort_request("p")
    assert not sched.requests and sched.kv.device.num_used == 0


def test_finish_request_ends_a_request_with_the_callers_reason():
    sched, runner = make(num_device_blocks=32)
    sched.add_request(request("a", prompt(4, 6), max_tokens=20, ignore_eos=True))
    run_step(sched, runner)
    req = sched.requests["a"]
    assert sched.finish_request("a", FinishReason.STOP)
    assert req.finish_reason is FinishReason.STOP and sched.kv.device.num_used == 0


def test_stats_and_block_map_add_up():
    sched, runner = make(num_device_blocks=12, num_host_blocks=8, preemption_mode="swap")
    growing(sched, runner, 3)
    saw_swap = False
    while sched.has_unfinished():
        out, _ = run_step(sched, runner)
        st = sched.last_stats
        bm = sched.block_map()
        states = [b.state.value for b in bm.device]
        assert len(bm.device) == st.device_blocks_total == 12 and len(bm.host) == st.host_blocks_total == 8
        assert states.count("used") == st.device_blocks_used
        assert states.count("cached") == st.device_blocks_cached
        assert states.count("free") == 12 - st.device_blocks_used - st.device_blocks_cached
        assert sum(b.state.value == "used" for b in bm.host) == st.host_blocks_used
        assert st.num_running + st.num_waiting + st.num_swapped == len(sched.requests)
        assert st.blocks_swapped_out == len(out.blocks_to_swap_out)
        assert st.num_prefill_tokens + st.num_decode_tokens == sum(s.num_new_tokens for s in out.scheduled)
        for info in bm.device + bm.host:
            assert len(info.owners) == info.ref_count
        saw_swap |= st.blocks_swapped_out > 0
    assert saw_swap and sched.last_stats.num_preemptions_swap > 0


def test_cumulative_counters_are_the_sums_of_the_per_step_values():
    sched, runner = make(num_device_blocks=12, num_host_blocks=32, preemption_mode="swap")
    growing(sched, runner, 3)
    steps = []
    run(sched, runner, on_step=lambda out: steps.append(sched.last_stats))
    last = sched.last_stats
    assert last.total_prompt_tokens == sum(s.num_prefill_tokens for s in steps) > 0
    assert last.total_generated_tokens == sum(s.num_decode_tokens for s in steps) > 0
    assert last.total_blocks_swapped_out == sum(s.blocks_swapped_out for s in steps) > 0
    assert last.total_blocks_swapped_in == sum(s.blocks_swapped_in for s in steps) > 0
    for before, after in zip(steps, steps[1:]):  # never decrease
        assert after.total_prompt_tokens >= before.total_prompt_tokens
        assert after.total_blocks_swapped_in >= before.total_blocks_swapped_in
    idle = sched.current_stats()  # a snapshot between steps counts nothing twice
    assert idle.total_prompt_tokens == last.total_prompt_tokens and idle.num_prefill_tokens == 0


def test_the_block_map_follows_every_step_of_forks_swaps_and_chunks():
    # Chunked prefill of a forked request: the fork shares blocks the map already copied, so a
    # ref count that changes without marking its block would show here.
    sched, runner = make(num_device_blocks=10, num_host_blocks=16, max_num_batched_tokens=4, preemption_mode="swap")
    sched.add_request(request("fork", list(range(1, 14)), max_tokens=10, n=3, ignore_eos=True))
    sched.add_request(request("other", list(range(20, 30)), max_tokens=12, ignore_eos=True))
    assert sched.block_map() == expected_block_map(sched)
    maps = []
    run(sched, runner, on_step=lambda out: maps.append((sched.block_map(), expected_block_map(sched))))
    assert all(got == want for got, want in maps)
    assert any(info.ref_count > 1 for got, _ in maps for info in got.device)  # the fork was seen
    assert sched.num_preemptions_swap > 0  # and blocks went to the host pool and back
