"""What one scheduler step tells the model runner: plain data, read once, never written back."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request            # read-only for the runner: tokens, block table, sampling params
    start: int                  # num_computed_tokens before this step: the first position to compute
    num_new_tokens: int         # tokens computed this step: positions start .. start + num_new_tokens - 1
    new_block_ids: list[int]    # appended to the block table this step
    num_samples: int            # tokens to sample at the last position: 0 mid-prompt, n when forking

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Order for the runner: swap out, swap in, copy, then the forward pass.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)      # (device src, device dst)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # finished or aborted since the last step
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens
