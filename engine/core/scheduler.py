"""Iteration-level continuous batching over the paged KV cache.

Each step spends a token budget (`max_num_batched_tokens`) in this order:

1. Running requests, earliest arrival first: one token for a decode, the rest of the prompt
   (or as much as the budget allows: chunked prefill) for a request still prefilling. If the
   device pool cannot hold a request's next tokens, the latest-arrived running request not yet
   scheduled in this step is preempted, and then the next latest, until it fits; if none is
   left, the request preempts itself.
2. Swapped requests, earliest arrival first, swapped back in, but only in a step that
   preempted nothing (so memory is not swapped out and in again at once) and only while the
   device keeps a watermark of free blocks for the running requests to grow into.
3. Waiting requests, after their longest cached prefix is taken from the prefix cache; only
   when nothing is swapped out (swapped requests resume first), nothing was preempted, and
   under the same watermark. Requests that were preempted come first, then the new ones first
   come first served, until the oldest new one has waited longer than a chat's first-token goal
   (`QUEUE_PATIENCE_S`): then the newest first (adaptive LIFO, as in Facebook's "Fail at
   Scale"). Past its capacity, a server that keeps serving in arrival order makes every
   request late; newest first, the ones it can serve are served in time and the backlog waits
   until the load falls below what the server computes, then is served too. A prompt larger
   than the budget left starts with a chunk. A request whose next block is still being
   computed for another request waits for it (one step, usually) rather than computing it
   again. With a step-time target, a request joins the running set only while all of them
   would still decode within the target (`_room_to_decode`).

With a step-time target (`max_step_ms`), prompt tokens get only the time the step's decodes
leave under it, as the step-cost model (engine/core/step_cost.py, fitted online to this engine's
own steps) predicts: a long prompt is computed in chunks across steps, while every streaming
chat keeps its pace, instead of one step that stalls them all (Sarathi-Serve's stall-free
batching). So that prompts always progress, a step may compute `min_prompt_chunk` prompt tokens,
and prompts get at least a quarter of the decodes' time, even when the decodes alone take the
whole target (a saturated server). That share grows by one decode time for each second the
oldest request without a first token has waited, up to a step of 1.25 times the target: under a
load the target cannot hold, steps lengthen (the streaming chats slow) instead of the queue
backing up behind a few chats decoding in small batches, where both waits and throughput
collapse; but no further, and no more chats join the running set than decode within the target,
so that with the prompts' least share the step stays within that longest step (the streaming
chats keep a pace their readers follow however many wait; the next ones wait in the queue).
A step with no decodes has no one to stall: its prompts get the token budget alone (a lone
chat's first token comes sooner).

Preemption is by swap (the victim's blocks are copied to the host pool; it resumes from
there) or by recompute (its blocks are freed, it goes back to the front of the waiting queue,
and re-admission recomputes what the prefix cache no longer holds). `auto` chooses per victim:
recompute when the victim owns at most one block (its other blocks are shared with running
requests, so they stay on the device while those run and are hits when it returns: a recompute costs
at most one block of tokens, while a swap would copy its whole shared context to the host for
nothing), otherwise swap, because copying a block costs far less than recomputing it (for
SmolLM2-135M in fp32 on this CPU, ~30 us to copy a 16-token block against ~20 ms to recompute it).
When the host pool is full, swap falls back to recompute. No request is ever
dropped for lack of memory: `max_model_len` never exceeds what the device pool holds, so the
highest-priority request can always run alone.
"""
from __future__ import annotations

import time
from bisect import insort
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from engine.core.block_map import BlockMap, BlockMapState, PoolMirror
from engine.core.block_pool import NoFreeBlocksError
from engine.core.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import FinishReason, Request, RequestStatus, sample_id
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.core.stats import SchedulerStats, snapshot_stats
from engine.core.step_cost import StepCostModel, StepShape, keys_read


PROMPT_SHARE = 0.25  # of a step's decode time, the least that prompts get in it
QUEUE_PATIENCE_S = 1.0  # a chat's first-token goal: each second the queue's oldest waits adds one decode time
                        # for prompts, and past it the queue serves the newest first
LONGEST_STEP = 1.25  # times the target: the most that the queue's wait stretches a step


class PromptTooLongError(ValueError):
    pass


def check_prompt_length(num_tokens: int, max_model_len: int, pool_tokens: int) -> None:
    """Refuse a prompt that could never run: empty, or longer than `max_model_len`."""
    if num_tokens == 0:
        raise ValueError("the prompt is empty: at least one token is needed")
    if num_tokens > max_model_len:
        raise PromptTooLongError(f"the prompt has {num_tokens} tokens, more than max_model_len={max_model_len} "
                                 f"(the device KV pool holds {pool_tokens} tokens)")


def _shape(out: SchedulerOutput) -> StepShape:
    decodes = keys = 0
    for item in out.scheduled:
        keys += keys_read(item.start, item.num_new_tokens)
        decodes += item.num_new_tokens == 1
    return StepShape(decodes, out.num_prefill_tokens, keys)


def _priority(request: Request) -> tuple[int, int]:
    return (request.arrival, request.sample_index)


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock  # arrival and first-token times (the queue's wait)
        self.kv = KVCacheManager(config.num_device_blocks, config.num_host_blocks, config.block_size,
                                 config.enable_prefix_caching, config.prefix_caching_hash_algo)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []   # earliest arrival first
        self.swapped: list[Request] = []   # earliest arrival first
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions_swap = 0
        self.num_preemptions_recompute = 0
        self.num_steps = 0
        self.total_prompt_tokens = 0
        self.total_generated_tokens = 0
        self.total_blocks_swapped_out = 0
        self.total_blocks_swapped_in = 0
        self.last_stats: SchedulerStats = snapshot_stats(self, SchedulerOutput())
        self._finished_ids: list[str] = []
        self._mirrors: tuple[PoolMirror, PoolMirror] | None = None  # made on the first block map
        self.step_cost = StepCostModel()
        self._prompt_time: float | None = None  # this step's seconds left for prompt tokens (None: no target)
        self._prompt_tokens = 0                 # prompt tokens scheduled in this step so far
        self._unlimited = True                  # no target, or no decode in this step to keep to it
        self._newest_first = False              # the waiting queue is in adaptive LIFO's newest-first order

    # ---- requests in and out ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or refuse it at once if it could never run."""
        limit = self.config.max_model_len
        check_prompt_length(request.num_prompt_tokens, limit, self.config.num_device_blocks * self.config.block_size)
        if request.request_id in self.requests:
            raise ValueError(f"a request with id {request.request_id!r} is already running")
        request.status = RequestStatus.WAITING
        request.max_total_tokens = min(request.max_total_tokens, limit)
        request.arrival_time = self.clock()
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """End a request in any state and return all its blocks; with `reason` ABORT this is
        abort, and it also ends the samples forked from it. False if no such request runs."""
        targets = [request_id]
        if reason is FinishReason.ABORT:
            targets += [r.request_id for r in self.requests.values() if r.parent_id == request_id and r.sample_index]
        found = False
        for rid in targets:
            request = self.requests.get(rid)
            if request is None:
                continue
            found = True
            queue = {RequestStatus.WAITING: self.waiting, RequestStatus.RUNNING: self.running,
                     RequestStatus.SWAPPED: self.swapped}[request.status]
            queue.remove(request)
            self._release(request, reason)
        return found

    def abort_request(self, request_id: str) -> bool:
        return self.finish_request(request_id, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg, kv = self.config, self.kv
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = cfg.max_num_batched_tokens
        running = self.running
        self._order_waiting()
        self._start_prompt_budget()

        # 1. Running requests.
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = self._chunk(request, len(request.all_token_ids) - request.num_computed_tokens, budget)
            if num_new == 0:  # a prompt with no time left in this step: the decodes after it go on
                i += 1
                continue
            room = self._allocate_or_preempt(request, num_new, out)
            if room is None:
                break  # it preempted itself, so every request after it was preempted already
            new_ids, copy = room
            if copy is not None:
                out.blocks_to_copy.append(copy)
            self._schedule(out, request, num_new, new_ids)
            budget -= num_new
            i += 1
        preempted = bool(out.preempted_ids)

        # 2. Swapped requests.
        if not preempted:
            while self.swapped and budget > 0 and len(running) < cfg.max_num_seqs:
                request = self.swapped[0]
                num_new = self._chunk(request, request.num_tokens - request.num_computed_tokens, budget)
                if num_new == 0 or not self._fits(kv.num_blocks_to_swap_in(request, num_new)):
                    break
                self.swapped.pop(0)
                out.blocks_to_swap_in += kv.swap_in(request)
                new_ids, _ = kv.allocate_slots(request, num_new)
                self._start_running(request)
                self._schedule(out, request, num_new, new_ids)
                budget -= num_new

        # 3. Waiting requests.
        if not preempted and not self.swapped:
            in_flight = self._blocks_in_flight() if self.waiting and cfg.enable_prefix_caching else set()
            compiling: list[Request] = []  # waiting for their grammars: passed over, kept in place
            while self.waiting and budget > 0 and len(running) < cfg.max_num_seqs:
                request = self.waiting[0]
                if request.waiting_for_grammar:
                    compiling.append(self.waiting.popleft())
                    continue
                if not self._room_to_decode(request):
                    break
                cached = kv.find_cached_prefix(request)
                hashes = request.block_hashes
                if len(cached) < len(hashes) and hashes[len(cached)] in in_flight:
                    break  # its next block is being computed for another request: hit it next step
                partial = kv.find_partial_block(request, len(cached))
                num_cached_tokens = len(cached) * cfg.block_size + (partial[1] if partial else 0)
                num_new = self._chunk(request, request.num_tokens - num_cached_tokens, budget, num_cached_tokens)
                if num_new == 0:
                    break
                if partial and not self._fits(kv.num_blocks_to_admit(request, cached, num_new, partial)):
                    # Holding the copy's source would take the pool's last free block: compute
                    # those tokens instead (this step computes fewer than it may, and that is all).
                    partial, num_cached_tokens = None, len(cached) * cfg.block_size
                if partial is None and not self._fits(kv.num_blocks_to_admit(request, cached, num_new)):
                    break
                self.waiting.popleft()
                kv.record_lookup(request, num_cached_tokens)
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_cached_tokens
                new_ids, copy = kv.admit(request, cached, num_new, partial)
                if copy is not None:
                    out.blocks_to_copy.append(copy)
                self._start_running(request)
                self._schedule(out, request, num_new, new_ids)
                budget -= num_new
                in_flight.update(hashes[len(cached):])
            self.waiting.extendleft(reversed(compiling))

        kv.release_pinned()
        self.num_steps += 1
        return out

    def update(self, out: SchedulerOutput, sampled: Mapping[str, Sequence[int]]) -> list[Request]:
        """Advance every scheduled request past the tokens it computed and append its sampled
        tokens (`sampled[request_id]` holds `num_samples` of them). Returns the requests that
        finished: stop token, `max_tokens` or `max_model_len`."""
        kv, bs = self.kv, self.config.block_size
        caching = self.config.enable_prefix_caching
        finished: list[Request] = []
        for item in out.scheduled:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue  # finished by the caller between schedule and update
            request.num_computed_tokens += item.num_new_tokens
            if caching and request.num_computed_tokens // bs > request.num_registered_blocks:
                kv.cache_full_blocks(request)
            if not item.num_samples:
                continue
            tokens = sampled[request.request_id]
            if item.num_samples > 1:
                for index, token in enumerate(tokens[1:item.num_samples], start=1):
                    child = self._fork(request, index)
                    if self._append_token(child, token):
                        finished.append(child)
            if self._append_token(request, tokens[0]):
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        self.total_prompt_tokens += out.num_prefill_tokens
        self.total_generated_tokens += out.num_decode_tokens
        self.total_blocks_swapped_out += len(out.blocks_to_swap_out)
        self.total_blocks_swapped_in += len(out.blocks_to_swap_in)
        self.last_stats = snapshot_stats(self, out)  # the state after the step
        return finished

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """Teach the step-cost model how long the step that `out` scheduled took."""
        if self.config.max_step_ms is None or not out.num_prefill_tokens:
            return
        self.step_cost.observe(_shape(out), seconds)

    def predict_step(self, out: SchedulerOutput) -> float:
        """The step-cost model's seconds for the step that `out` scheduled (0 before it has a fit)."""
        return self.step_cost.predict(_shape(out))

    # ---- the step-time target ------------------------------------------------------------
    def _start_prompt_budget(self) -> None:
        """The time this step leaves for prompt tokens: the target less what its decodes (every
        running request with one token to compute) are predicted to take. A step with no decodes
        keeps no one waiting between tokens: its prompts get the token budget alone."""
        self._prompt_tokens = 0
        self._prompt_time = None
        self._unlimited = True
        if self.config.max_step_ms is None:
            return
        decodes = keys = 0
        oldest = min((r.arrival_time for r in self.waiting), default=None)
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens == 1:
                decodes += 1
                keys += request.num_tokens
            elif request.first_token_time is None and (oldest is None or request.arrival_time < oldest):
                oldest = request.arrival_time
        if not decodes:
            return
        self._unlimited = False
        if self.step_cost.ready:
            target = self.config.max_step_ms / 1000
            decode_time = self.step_cost.predict(StepShape(decodes, 0, keys))
            # Under a load whose decodes alone overrun the target, prompts still get a share of
            # each step, larger the longer the queue's head has waited, but never so large that
            # the step passes LONGEST_STEP times the target: the queue keeps moving, and the
            # chats already streaming keep a pace their readers can follow.
            waited = 0.0 if oldest is None else max(self.clock() - oldest, 0.0)
            # A fit may put none of a step's time on its decodes (its terms are kept non-negative):
            # then the prompts have the whole target.
            room = (LONGEST_STEP * target - decode_time) / decode_time if decode_time > 0 else float("inf")
            share = min(PROMPT_SHARE + waited / QUEUE_PATIENCE_S, max(room, PROMPT_SHARE))
            self._prompt_time = max(target - decode_time, share * decode_time)

    def _order_waiting(self) -> None:
        """Preempted requests first (in the order they were put back), then the new ones: oldest
        first while the oldest has waited at most QUEUE_PATIENCE_S, newest first past that (see
        the module's docstring). Sorted only when the order changes or must be kept."""
        waiting = self.waiting
        fresh = [r for r in waiting if not r.num_preemptions]
        oldest = min((r.arrival_time for r in fresh), default=None)
        newest_first = oldest is not None and self.clock() - oldest > QUEUE_PATIENCE_S
        if len(fresh) > 1 and (newest_first or self._newest_first):
            fresh.sort(key=lambda r: r.arrival, reverse=newest_first)
            self.waiting = deque([r for r in waiting if r.num_preemptions] + fresh)
        self._newest_first = newest_first

    def _room_to_decode(self, request: Request) -> bool:
        """Whether `request` may join the running set under the step-time target: once it and
        every running request decode, their step must be predicted within the target (so that
        prompts' least share keeps the step within LONGEST_STEP targets). Past that, every chat
        already streaming would slow beyond what its reader follows to let one more start: it
        waits in the queue instead (and the ones streaming stay good).
        No limit without a target, before the cost model is ready, with nothing running, or
        where one sequence's decode alone takes half the target (a model too large for it: then
        batching is all that helps)."""
        if self.config.max_step_ms is None or not self.running or not self.step_cost.ready:
            return True
        target = self.config.max_step_ms / 1000
        predict = self.step_cost.predict
        if 2 * predict(StepShape(1, 0, request.num_tokens)) > target:
            return True
        keys = request.num_tokens + sum(r.num_tokens for r in self.running)
        return predict(StepShape(len(self.running) + 1, 0, keys)) * (1 + PROMPT_SHARE) <= LONGEST_STEP * target

    def _chunk(self, request: Request, remaining: int, budget: int, start: int | None = None) -> int:
        """How many of a request's `remaining` tokens to compute this step, from position `start`
        (default: its computed tokens). One token (a decode) always fits the step-time target; a
        prompt gets what is left of it (at least `min_prompt_chunk` tokens per step in all)."""
        num_new = min(remaining, budget)
        cfg = self.config
        if num_new <= 1 or self._unlimited:
            return num_new
        start = request.num_computed_tokens if start is None else start
        if self._prompt_time is None:  # no model of steps with decodes yet: the smallest chunk
            allowed = cfg.min_prompt_chunk - self._prompt_tokens
        else:
            allowed = self.step_cost.prompt_tokens_within(self._prompt_time, start)
            allowed = max(allowed, cfg.min_prompt_chunk - self._prompt_tokens)
        num_new = max(min(num_new, allowed), 0)
        if num_new:
            self._prompt_tokens += num_new
            if self._prompt_time is not None:
                self._prompt_time -= self.step_cost.predict(StepShape(0, num_new, keys_read(start, num_new))) \
                    - self.step_cost.predict(StepShape())
        return num_new

    # ---- helpers ------------------------------------------------------------------------
    def _fits(self, num_blocks: int) -> bool:
        """Admission test: leave the watermark free for the running requests to grow into. With
        nothing running there is nothing to protect, so a request as large as the pool fits."""
        reserve = self.config.watermark_blocks if self.running else 0
        return self.kv.device.num_free - num_blocks >= reserve

    def _blocks_in_flight(self) -> set[int]:
        """Hashes of the full blocks that running requests have still to compute. Admitting a
        request that needs one of them now would compute it twice; a step later it is a hit
        (chats sharing a system prompt that arrive together compute it once)."""
        bs = self.config.block_size
        pending: set[int] = set()
        for request in self.running:
            if request.num_computed_tokens < request.num_prompt_tokens:
                pending.update(request.block_hashes[request.num_computed_tokens // bs:])
        return pending

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             out: SchedulerOutput) -> tuple[list[int], tuple[int, int] | None] | None:
        """Room for the request's next tokens, preempting from the back of the running queue
        until it fits. None if the request had to preempt itself."""
        while True:
            try:
                return self.kv.allocate_slots(request, num_new)
            except NoFreeBlocksError:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is request:
                    return None

    def _schedule(self, out: SchedulerOutput, request: Request, num_new: int, new_ids: list[int]) -> None:
        start = request.num_computed_tokens
        num_samples = 0
        if start + num_new == len(request.all_token_ids):
            n = request.sampling_params.n
            num_samples = n if n > 1 and not request.forked and request.sample_index == 0 else 1
        out.scheduled.append(ScheduledRequest(request, start, num_new, new_ids, num_samples))
        if num_new == 1 and start >= request.num_prompt_tokens:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += num_new

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        insort(self.running, request, key=_priority)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        mode = self.config.preemption_mode
        if mode == "auto":
            mode = "recompute" if self.kv.num_exclusive_blocks(victim) <= 1 else "swap"
        if mode == "swap":
            pairs = self.kv.swap_out(victim)
            if pairs is not None:
                out.blocks_to_swap_out += pairs
                victim.status = RequestStatus.SWAPPED
                insort(self.swapped, victim, key=_priority)
                self.num_preemptions_swap += 1
            else:
                mode = "recompute"  # the host pool is full
        if mode == "recompute":
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.WAITING
            self.waiting.appendleft(victim)
            self.num_preemptions_recompute += 1
        victim.num_preemptions += 1
        out.preempted_ids.append(victim.request_id)

    def _fork(self, parent: Request, index: int) -> Request:
        parent.forked = True
        child = Request(sample_id(parent.request_id, index), parent.prompt_token_ids, parent.sampling_params,
                        parent.eos_token_id, parent_id=parent.request_id, sample_index=index,
                        cache_salt=parent.cache_salt, num_shared_prefix_tokens=parent.num_shared_prefix_tokens)
        child.arrival, child.arrival_time = parent.arrival, parent.arrival_time
        child.num_cached_tokens = parent.num_cached_tokens
        child.max_total_tokens = parent.max_total_tokens
        self.kv.fork(parent, child)
        self.requests[child.request_id] = child
        self._start_running(child)
        return child

    def _append_token(self, request: Request, token: int) -> bool:
        """Append a sampled token; finish the request (returning True) if it should stop."""
        request.all_token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = self.clock()
        if token in request.stop_ids:
            request.stop_token_id = token
            reason = FinishReason.STOP
        elif len(request.all_token_ids) >= request.max_total_tokens:
            reason = FinishReason.LENGTH
        else:
            return False
        self._release(request, reason)
        return True

    def _release(self, request: Request, reason: FinishReason) -> None:
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    # ---- snapshots ----------------------------------------------------------------------
    def current_stats(self) -> SchedulerStats:
        """Stats of the present state, with nothing scheduled: for between steps (after an abort)."""
        return snapshot_stats(self, SchedulerOutput())

    def refresh_stats(self) -> None:
        """Make `last_stats` the present state: after a step that failed before `update`."""
        self.last_stats = self.current_stats()

    def block_map_state(self) -> BlockMapState:
        """The engine thread's share of a block map: O(blocks changed since the last one) plus
        copies; `.build()` it elsewhere."""
        if self._mirrors is None:
            self._mirrors = PoolMirror(self.kv.device), PoolMirror(self.kv.host)
        return BlockMapState.take(*self._mirrors, self.requests.values())

    def block_map(self) -> BlockMap:
        return self.block_map_state().build()
