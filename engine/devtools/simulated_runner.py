"""A model runner stand-in that stores token ids where K/V would go.

It performs the scheduler's swaps and copies on its token "cache", checks before every step
that each scheduled request reads back exactly its own earlier tokens through its block table
(so a wrong prefix hit, a lost swap or a missing copy-on-write fails loudly), and samples the
next token as a pure function of the sequence so far. Outputs therefore do not depend on how
requests were batched, preempted or cached: runs under memory pressure must equal runs without.
Used by the tests, the scheduler benchmark and `python -m engine.devtools.simulate`.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import xxhash

from engine.core.config import SchedulerConfig
from engine.core.scheduler_output import SchedulerOutput


class KVMismatchError(AssertionError):
    pass


def next_token(token_ids: Sequence[int], sample_index: int, vocab_size: int) -> int:
    """The simulated model: a deterministic token from the last 8 tokens, the length and the sample."""
    data = array("q", token_ids[-8:]).tobytes() + len(token_ids).to_bytes(8, "little")
    return xxhash.xxh64_intdigest(data, seed=sample_index) % vocab_size


def reference_generation(prompt: Sequence[int], max_tokens: int, vocab_size: int, eos_token_id: int | None,
                         max_model_len: int, sample_index: int = 0) -> list[int]:
    """What the simulated model generates for one prompt run alone: the oracle for the tests."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        token = next_token(tokens, sample_index if not out else 0, vocab_size)
        tokens.append(token)
        out.append(token)
        if token == eos_token_id or len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


class SimulatedRunner:
    def __init__(self, config: SchedulerConfig, vocab_size: int = 32000, verify: bool = True) -> None:
        self.block_size = config.block_size
        self.vocab_size = vocab_size
        self.verify = verify
        self.device = np.full((config.num_device_blocks, config.block_size), -1, dtype=np.int64)
        self.host = np.full((max(config.num_host_blocks, 1), config.block_size), -1, dtype=np.int64)

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for src, dst in out.blocks_to_swap_out:
            self.host[dst] = self.device[src]
        for src, dst in out.blocks_to_swap_in:
            self.device[dst] = self.host[src]
        for src, dst in out.blocks_to_copy:
            self.device[dst] = self.device[src]
        cache = self.device.reshape(-1)
        bs = self.block_size
        sampled = {}
        for item in out.scheduled:
            request = item.request
            end = item.start + item.num_new_tokens
            if self.verify:
                table = np.asarray(request.block_ids, dtype=np.int64)
                positions = np.arange(end)
                slots = table[positions // bs] * bs + positions % bs
                context = cache[slots[:item.start]]
                if not np.array_equal(context, request.all_token_ids[:item.start]):
                    bad = int(np.argmax(context != np.asarray(request.all_token_ids[:item.start])))
                    raise KVMismatchError(f"{request.request_id}: position {bad} reads {context[bad]}, "
                                          f"expected {request.all_token_ids[bad]}")
                cache[slots[item.start:]] = request.all_token_ids[item.start:end]
            if item.num_samples:
                history = request.all_token_ids[:end]
                sampled[request.request_id] = [next_token(history, i, self.vocab_size)
                                               for i in range(item.num_samples)]
        return sampled


def run_step(scheduler, runner: SimulatedRunner) -> tuple[SchedulerOutput, list]:
    """One engine step with the simulated model: schedule, execute, update."""
    out = scheduler.schedule()
    finished = scheduler.update(out, runner.execute(out))
    return out, finished
