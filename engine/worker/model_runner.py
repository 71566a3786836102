"""Executes one scheduler step on the model: moves blocks, builds the flattened batch, runs the
forward pass and samples.

It owns the KV-cache tensors: the device pool and the host swap pool (pinned when the device is
CUDA), each `[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`, so every block is
one contiguous region across all layers and a swap moves one region per block.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import kernels
from engine.core.request import sample_id
from engine.core.scheduler_output import SchedulerOutput
from engine.worker.compiled.shapes import BATCH_BLOCK_SIZE, MAX_BATCH, MAX_CONTEXT
from engine.worker.compiled.steps import CompiledSteps
from engine.worker.cuda_graphs import CudaGraphs
from engine.worker.flat_batch import FlatSequence
from engine.worker.host_allocator import release_freed_memory
from engine.worker.models.layers import row_attention
from engine.worker.models.layers.row_attention import row_inputs
from engine.worker.models.llama import AttentionMetadata, LlamaModel
from engine.worker.sampler import SamplingRow, make_generator, sample

if TYPE_CHECKING:  # the grammar library loads with the first constrained request, not with every engine
    from engine.worker.structured.grammar_matchers import GrammarMatchers


# The longest prompt chunk the compiled flat step takes (its attention pads chunks to the longest).
FLAT_MAX_CHUNK = 256
ROWS_OUTRUN_FLAT = 12  # decodes in a step from which the native row attention beats the flat step (_rows_outrun_flat)


class ModelRunner:
    def __init__(self, model: LlamaModel, num_device_blocks: int, num_host_blocks: int, block_size: int,
                 max_model_len: int | None = None, decode_graph_batch: int = 0,
                 compiled: CompiledSteps | None = None, graph_tokens: int = 0) -> None:
        """`decode_graph_batch` > 0: decode batches up to that size run through CudaGraphs
        (captured CUDA graphs on a GPU; the same padded path, eagerly, elsewhere), and with
        `graph_tokens` > 0 so do other steps of up to that many tokens over as many sequences
        (prompt chunks beside decodes, flattened). `compiled`: a lone sequence's decode steps, and
        batches of decodes, run through it once it is ready."""
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.kv_cache = torch.zeros(model.kv_cache_shape(num_device_blocks, block_size), dtype=model.dtype,
                                    device=self.device)
        # No position reaches max_model_len (the scheduler ends a request there, and it never
        # exceeds the pool): the rotary table is sized once and never moves (a CUDA graph holds
        # its address).
        max_model_len = max_model_len or num_device_blocks * block_size
        model.rotary.ensure(max_model_len)
        self.graphs = None
        if decode_graph_batch > 0:
            self.graphs = CudaGraphs(model, self.kv_cache, decode_graph_batch, -(-max_model_len // block_size),
                                     max_tokens=graph_tokens)
        pin = self.device.type == "cuda"
        self.host_cache = torch.zeros(model.kv_cache_shape(max(num_host_blocks, 0), block_size),
                                      dtype=model.dtype, pin_memory=pin)
        self._generators: dict[str, torch.Generator | None] = {}
        self.compiled = compiled
        # Two paths keep a lone decoding chat's K/V from step to step: the eager path in its last
        # attention plan, the compiled lone step in its buffer. One rule keeps both right: every
        # write to the cache (a step on any path, a swap, a copy) bumps `_cache_writes`; each keeper
        # notes its value after its own write, and one that missed a write is dropped at once.
        self._last_plan = None
        self._cache_writes = 0
        self._plan_writes = self._lone_writes = -1
        # Per request sampled this step (when its params ask for logprobs): for each sample, the
        # model's log-probabilities of its top tokens and of the sampled one.
        self.logprobs: dict[str, list[dict[int, float]]] = {}
        # How the last step ran: "lone" or "flat" (compiled), "graphs" or "graphs-flat" (CUDA), "eager" (torch's ops), "eager-native"
        # (torch's ops, the native row attention) or "native" (a quantized model's layers in native code)
        self.last_path = ""
        self._plain_dropped = False
        # The constrained requests' grammars (structured output): set by the engine core with its
        # first constrained request.
        self.grammars: GrammarMatchers | None = None

    def release_plain_copies(self) -> None:
        """Let the matrices' plain copies go (LlamaModel.drop_plain_copies) and give their memory
        back to the kernel: once every compiled step is in, or before they load (a server, with
        them built). Only between steps: an eager step may be reading them."""
        if not self._plain_dropped:
            self._plain_dropped = True
            if self.model.drop_plain_copies() and self.device.type == "cpu":
                release_freed_memory()

    def step_paths(self) -> tuple[str, ...]:
        """The ways a step may run here, in the order `execute` tries them (its `last_path` names)."""
        paths = ["graphs"] if self.graphs is not None else []
        paths += ["graphs-flat"] if self.graphs is not None and self.graphs.max_tokens else []
        paths += list(self.compiled.kinds) if self.compiled is not None else []
        paths += ["native"] if self.model.native_layers is not None else []
        paths += ["eager-native"] if self.model.row_attention is not None else []
        return (*paths, "eager")

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        if not self._plain_dropped and self.compiled is not None and self.compiled.ready and self.compiled.flat_ready:
            self.release_plain_copies()  # here, between steps, where no eager step reads them
        for request_id in out.finished_ids:
            self._generators.pop(request_id, None)
            if self.grammars is not None:
                self.grammars.remove(request_id)
        if out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy:
            self._move_blocks(out)
            self._wrote("moves")
        if not out.scheduled:
            return {}
        input_ids, positions, slots, cu_q, k_lens, table_rows, sample_rows = [], [], [], [0], [], [], []
        bs = self.block_size
        for item in out.scheduled:
            request = item.request
            start, end = item.start, item.start + item.num_new_tokens
            input_ids += request.all_token_ids[start:end]
            positions += range(start, end)
            table = request.block_ids
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            cu_q.append(cu_q[-1] + item.num_new_tokens)
            k_lens.append(end)
            table_rows.append(table)
            if item.num_samples:
                sample_rows.append(len(cu_q) - 2)
        known_argmax = None
        if self.graphs is not None and len(input_ids) == len(table_rows) <= self.graphs.max_batch:
            # A decode batch (one new token per sequence): replayed from a captured graph.
            logits = self.graphs.run(input_ids, positions, slots, k_lens, table_rows)
            if len(sample_rows) < len(table_rows):  # a sequence's last prompt token is not sampled
                logits = logits[torch.tensor(sample_rows, dtype=torch.int64, device=logits.device)]
            self.last_path = "graphs"
        elif self.graphs is not None and self.graphs.takes_flat(len(input_ids), len(table_rows)):
            # Prompt chunks and decodes flattened into one batch, replayed from a captured graph.
            logits = self.graphs.run_flat(input_ids, positions, slots, cu_q, k_lens, table_rows, sample_rows)
            self.last_path = "graphs-flat"
        elif (len(input_ids) == 1 and sample_rows and self.compiled is not None and self.compiled.ready
              and k_lens[0] <= MAX_CONTEXT):
            # One sequence decoding alone: what a single user waits for, as one compiled call.
            logits, known_argmax = self.compiled.decode(input_ids[0], positions[0], table_rows[0], k_lens[0],
                                                        self.kv_cache, bs)
            self.last_path = "lone"
        elif self._flat_fits(table_rows, cu_q, k_lens) and not self._rows_outrun_flat(input_ids, cu_q):
            # Decodes and prompt chunks, any mix of them, as one compiled call.
            sequences = [FlatSequence(item.request.all_token_ids[item.start:item.start + item.num_new_tokens],
                                      item.start, item.request.block_ids, item.num_samples > 0) for item in out.scheduled]
            logits, known_argmax = self.compiled.run_flat(sequences, self.kv_cache, bs)
            self.last_path = "flat"
        else:  # sets last_path: "eager", "eager-native" (the native row attention) or "native" (a quantized model's layers)
            logits = self._forward_eager(input_ids, positions, slots, cu_q, k_lens, table_rows, sample_rows)
        self._wrote(self.last_path)
        if not sample_rows:
            return {}
        return self._sample(out, logits, sample_rows, known_argmax)

    def _flat_fits(self, table_rows: list[list[int]], cu_q: list[int], k_lens: list[int]) -> bool:
        """Whether the compiled flat step takes this step: it is loaded, the cache has its block
        size, and the step is one a chat server makes (chunks up to FLAT_MAX_CHUNK tokens:
        longer prompts take the eager forward, whose attention tiles long queries)."""
        return (self.compiled is not None and self.compiled.flat_ready and self.block_size == BATCH_BLOCK_SIZE
                and len(table_rows) <= MAX_BATCH and max(k_lens) <= MAX_CONTEXT
                and max(b - a for a, b in zip(cu_q, cu_q[1:])) <= FLAT_MAX_CHUNK)

    def _rows_outrun_flat(self, input_ids: list[int], cu_q: list[int]) -> bool:
        """Whether the eager forward with the native row attention beats the compiled flat step
        on this step: where it has ROWS_OUTRUN_FLAT decodes or more. The decodes' attention is
        where the native rows win (a 32-chat step of SmolLM2 in fp32 on a 2-core Intel Xeon, 112
        against 144 ms; with a 25-token chunk beside them 144 against 180); in fewer rows the
        eager forward's ~450 small ops cost more than that (4 rows 56 against 48 ms, 8 rows 65
        against 61, 16 rows 84 against 90)."""
        q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
        return sum(n == 1 for n in q_lens) >= ROWS_OUTRUN_FLAT and self.uses_row_attention(q_lens)

    def uses_row_attention(self, q_lens: list[int]) -> bool:
        """Whether an eager step with these sequences' new tokens takes the native row attention."""
        return self.model.row_attention is not None and max(q_lens) <= row_attention.MAX_QUERY

    def idle(self) -> None:
        """Nothing is left to run: drop what only a next step could use (a lone chat's kept K/V,
        up to ~190 MB for 4,096 tokens of SmolLM2 in fp32), rather than hold it while idle."""
        self._forget_kept()

    def _forget_kept(self) -> None:
        self._last_plan = None
        if self.compiled is not None:
            self.compiled.forget()

    def _wrote(self, path: str) -> None:
        """The cache was written by `path` ("lone", "eager", or anything else): the keeper that
        wrote it stays current, the other is dropped now (up to ~190 MB), not at its next use."""
        self._cache_writes += 1
        if path == "lone":
            self._lone_writes = self._cache_writes
        elif path == "eager":
            self._plan_writes = self._cache_writes
        if self._plan_writes != self._cache_writes:
            self._last_plan = None
        if self.compiled is not None and self._lone_writes != self._cache_writes:
            self.compiled.forget()

    def _forward_eager(self, input_ids: list[int], positions: list[int], slots: list[int], cu_q: list[int],
                       k_lens: list[int], table_rows: list[list[int]], sample_rows: list[int]) -> torch.Tensor:
        device, shape = self.device, self.model.shape
        width = max(len(t) for t in table_rows)
        block_table = torch.tensor([t + [0] * (width - len(t)) for t in table_rows], dtype=torch.int32)
        block_table = block_table.to(device, non_blocking=True)
        slot_mapping = torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True)
        q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
        # A step the model decodes natively reads and writes the paged cache itself: no store index, no plan.
        native = self.model.decodes_natively(len(input_ids), len(k_lens), max(q_lens))
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            slot_index=None if native else kernels.slot_index(slot_mapping, self.block_size, self.kv_cache),
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32).to(device, non_blocking=True),
            seqused_k=torch.tensor(k_lens, dtype=torch.int32).to(device, non_blocking=True),
            block_table=block_table)
        if not native and self.uses_row_attention(q_lens):
            meta.row_tables, meta.row_contexts = row_inputs(q_lens, k_lens, block_table)
        elif not native:
            meta.plan = kernels.plan_attention(
                q_lens=q_lens, k_lens=k_lens, num_heads=shape.num_heads,
                kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, cache=self.kv_cache, block_table=block_table,
                block_size=self.block_size, previous=self._last_plan)
        self._last_plan = meta.plan
        self.last_path = "native" if native else "eager-native" if meta.row_contexts is not None else "eager"
        # Empty when every request is mid-prompt: the step only fills the cache.
        logits_indices = torch.tensor([cu_q[i + 1] - 1 for i in sample_rows], dtype=torch.int64, device=device)
        return self.model.forward(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device),
                                  self.kv_cache, meta, logits_indices)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor, sample_rows: list[int],
                known_argmax: torch.Tensor | None = None) -> dict[str, list[int]]:
        rows = []
        items = [out.scheduled[i] for i in sample_rows]
        grammars = self.grammars
        constrained = [i for i, item in enumerate(items) if grammars is not None and grammars.constrains(item.request_id)]
        constrained_rows = set(constrained)
        for i, item in enumerate(items):
            request = item.request
            params = request.sampling_params
            # A grammar decides where a constrained reply may end: min_tokens holds nothing back there.
            held = request.num_output_tokens < params.min_tokens and i not in constrained_rows
            rows.append(SamplingRow(params, request.all_token_ids, self._generator(request), item.num_samples,
                                    request.num_prompt_tokens, request.held_back_ids if held else frozenset()))
        allowed = logits
        if constrained:
            wants_logprobs = any(item.request.sampling_params.logprobs is not None for item in items)
            allowed = logits.float().clone() if wants_logprobs else logits.float()  # logprobs: the model's own
            grammars.mask_(allowed, [items[i].request_id for i in constrained], constrained,
                           [items[i].request.sampling_params.max_tokens - items[i].request.num_output_tokens
                            for i in constrained])
            known_argmax = None
        tokens = sample(allowed, rows, known_argmax)
        for i in constrained:
            request_id = items[i].request_id
            for index, token in enumerate(tokens[i][1:], start=1):  # samples forked this step
                grammars.fork(request_id, sample_id(request_id, index))
                grammars.accept(sample_id(request_id, index), token)
            grammars.accept(request_id, tokens[i][0])
        self.logprobs = {}
        for i, (item, toks) in enumerate(zip(items, tokens)):
            k = item.request.sampling_params.logprobs
            if k is not None:
                self.logprobs[item.request_id] = _top_logprobs(logits[i], k, toks)
        return {item.request_id: toks for item, toks in zip(items, tokens)}

    def _generator(self, request) -> torch.Generator | None:
        """One generator per request, so a seeded request samples the same tokens whatever else
        is in the batch. Forked samples are seeded seed + sample index."""
        rid = request.request_id
        if rid not in self._generators:
            seed = request.sampling_params.seed
            self._generators[rid] = make_generator(None if seed is None else seed + request.sample_index,
                                                   self.device)
        return self._generators[rid]

    def _move_blocks(self, out: SchedulerOutput) -> None:
        # Order matters: a block swapped out may be handed to another request in the same step.
        if out.blocks_to_swap_out:
            kernels.swap_blocks(self.kv_cache, self.host_cache, torch.tensor(out.blocks_to_swap_out))
        if out.blocks_to_swap_in:
            kernels.swap_blocks(self.host_cache, self.kv_cache, torch.tensor(out.blocks_to_swap_in))
        if out.blocks_to_copy:
            kernels.copy_blocks(self.kv_cache, torch.tensor(out.blocks_to_copy, device=self.device))


def _top_logprobs(logits: torch.Tensor, k: int, sampled: list[int]) -> list[dict[int, float]]:
    logprobs = logits.float().log_softmax(-1)
    top = logprobs.topk(k) if k else None
    base = dict(zip(top.indices.tolist(), top.values.tolist())) if k else {}
    return [{**base, token: float(logprobs[token])} for token in sampled]
