"""Helpers for driving the scheduler with the simulated runner in tests."""
from __future__ import annotations

from engine import BlockInfo, BlockMap, BlockState, Request, SamplingParams, Scheduler, SchedulerConfig
from engine.devtools.invariants import check_invariants
from engine.devtools.simulated_runner import SimulatedRunner, reference_generation, run_step

VOCAB = 50
EOS = 0


def make(clock=lambda: 0.0, **config) -> tuple[Scheduler, SimulatedRunner]:
    """A scheduler and its simulated runner; the scheduler's clock stands still unless a test
    passes one (the queue's wait then never depends on how fast the machine runs the test)."""
    config.setdefault("block_size", 4)
    cfg = SchedulerConfig(**config)
    return Scheduler(cfg, clock), SimulatedRunner(cfg, vocab_size=VOCAB)


def request(rid: str, prompt: list[int], max_tokens: int = 8, cache_salt: str | None = None,
            num_shared_prefix_tokens: int = 0, **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_id=EOS,
                   cache_salt=cache_salt, num_shared_prefix_tokens=num_shared_prefix_tokens)


def run(scheduler: Scheduler, runner: SimulatedRunner, max_steps: int = 10_000, on_step=None) -> dict[str, Request]:
    """Step until nothing is left, checking invariants after every step; returns finished requests."""
    done: dict[str, Request] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return done
        out, finished = run_step(scheduler, runner)
        check_invariants(scheduler)
        if on_step:
            on_step(out)
        done.update((r.request_id, r) for r in finished)
    raise AssertionError(f"not finished after {max_steps} steps")


def expected(req: Request, max_model_len: int, sample_index: int = 0) -> list[int]:
    return reference_generation(req.prompt_token_ids, req.sampling_params.max_tokens, VOCAB,
                                None if req.sampling_params.ignore_eos else EOS, max_model_len, sample_index)


def expected_block_map(scheduler) -> BlockMap:
    """The block map read straight off the pools and the block tables: the oracle for the
    scheduler's incrementally kept one."""
    def infos(pool, owner_of, preset):
        out = []
        for block in pool.blocks:
            state = (BlockState.USED if block.ref_count else
                     BlockState.CACHED if block.block_hash is not None else BlockState.FREE)
            out.append(BlockInfo(block.block_id, state, block.ref_count, block.num_tokens, block.block_hash,
                                 tuple(owner_of.get(block.block_id, ())), block.block_id in preset))
        return tuple(out)

    kv = scheduler.kv
    device, host, device_preset, host_preset = {}, {}, set(), set()
    for request in scheduler.requests.values():
        # Blocks wholly inside a salted request's shared prefix are hashed without its salt.
        unsalted = request.num_shared_prefix_tokens // kv.block_size if request.cache_salt is not None else 0
        for i, block_id in enumerate(request.block_ids):
            device.setdefault(block_id, []).append(request.request_id)
            if i < unsalted:
                device_preset.add(block_id)
        for i, block_id in enumerate(request.host_block_ids):
            host.setdefault(block_id, []).append(request.request_id)
            if i < unsalted:
                host_preset.add(block_id)
    return BlockMap(kv.block_size, infos(kv.device, device, device_preset), infos(kv.host, host, host_preset))
