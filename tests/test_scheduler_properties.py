"""Random add / step / abort / finish sequences on tiny pools: the invariants hold after every
step, the incrementally kept block map equals one read off the pools, nothing is lost, and every
request that ran to its end produced exactly what it would have produced alone (the simulated
model samples from the sequence so far)."""
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine import FinishReason, PromptTooLongError, Scheduler, SchedulerConfig
from engine.devtools.invariants import check_invariants
from engine.devtools.simulated_runner import SimulatedRunner, reference_generation, run_step
from simulation import EOS, VOCAB, expected_block_map, request

PREFIXES = [[], [5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 20, 21], [30, 31, 32, 33, 34, 35, 36]]

configs = st.builds(
    dict,
    num_device_blocks=st.integers(3, 14),
    num_host_blocks=st.sampled_from([0, 2, 6, 12, 24]),
    block_size=st.sampled_from([1, 2, 4]),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 24),
    enable_prefix_caching=st.booleans(),
    preemption_mode=st.sampled_from(["swap", "recompute", "auto"]),
    watermark=st.sampled_from([0.0, 0.1]),
)
adds = st.tuples(st.just("add"), st.sampled_from(range(len(PREFIXES))),
                 st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=12),
                 st.integers(1, 16), st.sampled_from([1, 1, 2, 3]), st.booleans())
steps = st.tuples(st.just("step"), st.integers(1, 6))
ends = st.tuples(st.sampled_from(["abort", "finish"]), st.integers(0, 12))
maps = st.tuples(st.just("map"))  # the incremental block map, checked at random moments
ops = st.lists(st.one_of(adds, adds, steps, steps, ends, maps), min_size=4, max_size=50)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, script=ops)
def test_random_workloads_keep_every_invariant(config, script):
    cfg = SchedulerConfig(**config)
    sched, runner = Scheduler(cfg), SimulatedRunner(cfg, vocab_size=VOCAB)
    added, aborted, stopped, finished, seen = {}, set(), set(), {}, set()

    def step():
        out, done = run_step(sched, runner)
        check_invariants(sched)
        finished.update((r.request_id, r) for r in done)
        seen.update(sched.requests)
        for what, happened in (("swap out", out.blocks_to_swap_out), ("swap in", out.blocks_to_swap_in),
                               ("copy-on-write", out.blocks_to_copy), ("preempt", out.preempted_ids)):
            if happened:
                event(what)

    for op in script:
        if op[0] == "add":
            _, prefix, tail, max_tokens, n, ignore_eos = op
            rid = f"r{len(added)}"
            req = request(rid, PREFIXES[prefix] + tail, max_tokens=max_tokens, n=n, ignore_eos=ignore_eos)
            try:
                sched.add_request(req)
            except PromptTooLongError:
                assert req.num_prompt_tokens > cfg.max_model_len
                continue
            except ValueError:
                assert req.num_prompt_tokens == 0
                continue
            added[rid] = req
            seen.add(rid)
        elif op[0] == "map":
            assert sched.block_map() == expected_block_map(sched)
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
        else:
            rid = f"r{op[1]}"
            reason = FinishReason.ABORT if op[0] == "abort" else FinishReason.STOP
            if sched.finish_request(rid, reason):
                (aborted if reason is FinishReason.ABORT else stopped).add(rid)
            check_invariants(sched)

    for _ in range(20_000):
        if not sched.has_unfinished():
            break
        step()
    assert not sched.has_unfinished(), "a request never finished"
    assert sched.kv.device.num_used == 0 and sched.kv.host.num_used == 0
    assert sched.block_map() == expected_block_map(sched)

    if sched.kv.prefix_cache_hits:
        event("prefix-cache hit")
    group = {sid: sid.split("#")[0] for sid in seen}
    lost = [sid for sid in seen if sid not in finished and sid not in stopped and group[sid] not in aborted]
    assert not lost, f"requests lost: {lost}"
    for rid, req in added.items():
        if rid in aborted:
            continue
        for i in range(req.sampling_params.n):
            sid = rid if i == 0 else f"{rid}#{i}"
            if sid in stopped or (i and rid in stopped and sid not in seen):
                continue  # ended by the caller, or its parent was before it could fork
            want = reference_generation(req.prompt_token_ids, req.sampling_params.max_tokens, VOCAB,
                                        None if req.sampling_params.ignore_eos else EOS, cfg.max_model_len, i)
            assert finished[sid].output_token_ids == want, sid
