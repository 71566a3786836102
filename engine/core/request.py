"""One generation request as the scheduler sees it: its tokens, its progress and its blocks."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from engine.core.sampling_params import SamplingParams

_arrivals = itertools.count()


def sample_id(request_id: str, index: int) -> str:
    """The core's id of a request's sample: the request itself for the first, a forked child
    (`id#index`) for each other one (n > 1)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def is_sample_of(sample: str, request_id: str) -> bool:
    return sample == request_id or sample.startswith(f"{request_id}#")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"      # a stop token (or, decided by the caller, a stop string)
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


@dataclass(eq=False, slots=True)
class Request:
    """A request never has separate prefill and decode phases: each step computes
    `num_tokens - num_computed_tokens` more tokens (or a chunk of them). A fresh prompt, a
    prefix-cache hit, a recompute after preemption and a decode step are all that one rule."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    # n > 1: sample 0 is the request itself; samples 1..n-1 are forked from it once the prompt
    # is computed, sharing its blocks.
    parent_id: str | None = None
    sample_index: int = 0
    # Prefix-cache isolation (engine/core/block_hash.py): the blocks after the first
    # `num_shared_prefix_tokens` tokens are salted with `cache_salt`, usually the user.
    cache_salt: str | None = None
    num_shared_prefix_tokens: int = 0

    all_token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache on first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    forked: bool = False
    num_preemptions: int = 0
    stop_ids: frozenset[int] = field(init=False)  # stop tokens, eos included unless ignored (or constrained)
    # Never sampled before min_tokens: the stop tokens and eos even when ignored, as vLLM does, so
    # a reply forced to a length reads on past where it would have ended, never through an eos.
    held_back_ids: frozenset[int] = field(init=False)
    max_total_tokens: int = -1  # prompt + max_tokens, capped by the scheduler at max_model_len
    # A constrained request (structured_outputs) waits, unscheduled, until its grammar is compiled.
    waiting_for_grammar: bool = False
    arrival: int = field(init=False)  # priority: lower arrives earlier and is preempted last
    arrival_time: float = field(init=False)
    first_token_time: float | None = None

    block_ids: list[int] = field(default_factory=list)       # device block table
    host_block_ids: list[int] = field(default_factory=list)  # host block table while swapped
    block_hashes: list[int] = field(default_factory=list)    # hash chain of the full blocks so far
    num_registered_blocks: int = 0  # leading full blocks already offered to the prefix cache

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        params = self.sampling_params
        eos = () if self.eos_token_id is None else (self.eos_token_id,)
        self.held_back_ids = frozenset((*params.stop_token_ids, *eos))
        # A grammar allows eos only where the reply may end, and a reply it has ended ends there.
        ignore_eos = params.ignore_eos and params.structured_outputs is None
        self.stop_ids = frozenset(params.stop_token_ids) if ignore_eos else self.held_back_ids
        self.max_total_tokens = self.num_prompt_tokens + params.max_tokens
        self.arrival = next(_arrivals)
        self.arrival_time = time.monotonic()
        if not 0 <= self.num_shared_prefix_tokens <= self.num_prompt_tokens:
            raise ValueError(f"num_shared_prefix_tokens must be within the prompt's {self.num_prompt_tokens} "
                             f"tokens, got {self.num_shared_prefix_tokens}")
        if self.sampling_params.n > 1 and self.sample_index == 0:
            self.parent_id = self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
