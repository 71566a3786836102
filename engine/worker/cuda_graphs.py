"""Steps replayed from CUDA graphs: decode batches, and flattened batches of prompt chunks beside decodes.

A step of a small model on a GPU is mostly launch overhead: hundreds of small kernels, each queued
by Python. Capturing the forward pass once per size in a CUDA graph and replaying it queues them
all with one call. A graph replays fixed addresses and fixed shapes, so a step's inputs are copied
into static buffers and padded up to the nearest captured size ("bucket"):
- a decode batch (one new token per sequence) to a batch bucket: padded rows are sequences that
  read one key from block 0 and write nothing (slot -1), and their logits are dropped. One query
  tile per sequence and no flash-decoding split (a split length would be baked into the graph
  while contexts grow).
- any other step (prompt chunks, with or without decodes beside them: vLLM's flattened batch) to
  a token bucket, over `max_batch` sequence slots and one more kept empty: the attention's tile
  list is as long as such a step can need and refilled each step (kernels.fill_plan), the tiles
  past the step's pointing at the empty sequence; padded tokens belong to no sequence (their rows
  are computed and never read, and write nothing to the cache). Only the sampled rows' logits
  are computed.

Without CUDA (or with `capture=False`, or the torch kernels forced) the same padded static-buffer
paths run eagerly: that is how the tests on a CPU check that padding changes no output.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

import kernels
from engine.worker.models.llama import AttentionMetadata, LlamaModel

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


def buckets_up_to(max_batch: int, sizes: tuple[int, ...] = BUCKETS) -> list[int]:
    """The captured sizes: `sizes` up to max_batch, and max_batch itself."""
    return [b for b in sizes if b < max_batch] + [max_batch]


class CudaGraphs:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, max_batch: int, max_blocks_per_seq: int,
                 capture: bool = True, max_tokens: int = 0) -> None:
        """`max_tokens` > 0: flattened steps of up to that many tokens (and `max_batch` sequences)
        too; 0: decode batches only."""
        if max_batch < 1 or max_blocks_per_seq < 1 or max_tokens < 0:
            raise ValueError(f"max_batch and max_blocks_per_seq must be positive and max_tokens not negative, "
                             f"got {max_batch}, {max_blocks_per_seq}, {max_tokens}")
        self.model, self.kv_cache = model, kv_cache
        self.buckets = buckets_up_to(max_batch)
        self.token_buckets = buckets_up_to(max_tokens, TOKEN_BUCKETS) if max_tokens else []
        n, device = self.buckets[-1], kv_cache.device
        tokens = max(n, max_tokens)
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seqused_k = torch.ones(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        # A flattened step's sequences: max_batch slots and the empty one after them.
        self.flat_cu_seqlens_q = torch.zeros(n + 2, dtype=torch.int32, device=device)
        self.flat_seqused_k = torch.ones(n + 1, dtype=torch.int32, device=device)
        self.flat_block_table = torch.zeros(n + 1, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.flat_logits_indices = torch.zeros(n, dtype=torch.int64, device=device)
        shape = model.shape
        self.flat_plan = kernels.fixed_plan_attention(tokens, n, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                                      kv_cache) if max_tokens else None
        self._meta = {b: self._bucket_meta(b) for b in self.buckets}
        self._flat_meta = {t: AttentionMetadata(self.slot_mapping[:t], self.flat_cu_seqlens_q, self.flat_seqused_k,
                                                self.flat_block_table, self.flat_plan) for t in self.token_buckets}
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self._logits: dict[tuple[str, int], torch.Tensor] = {}
        # Only the Triton kernels can be captured: the torch path plans on the host and reads
        # slot values back from the device, which a capturing stream refuses. Forced onto a GPU
        # (PAGEDCHAT_KERNELS=torch), it runs the same padded paths eagerly.
        if capture and device.type == "cuda" and kernels.backend(kv_cache) == "triton":
            self._capture()

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def max_tokens(self) -> int:
        return self.token_buckets[-1] if self.token_buckets else 0

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def takes_flat(self, num_tokens: int, num_seqs: int) -> bool:
        """Whether a step of this many tokens over this many sequences fits a flat bucket."""
        return 0 < num_tokens <= self.max_tokens and num_seqs <= self.max_batch

    def _bucket_meta(self, b: int) -> AttentionMetadata:
        shape = self.model.shape
        plan = kernels.plan_attention([1] * b, [1] * b, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                      self.kv_cache, num_splits=1)
        return AttentionMetadata(self.slot_mapping[:b], self.cu_seqlens_q[:b + 1], self.seqused_k[:b],
                                 self.block_table[:b], plan)

    def _forward(self, key: tuple[str, int]) -> torch.Tensor:
        kind, size = key
        if kind == "decode":
            return self.model.forward(self.input_ids[:size], self.positions[:size], self.kv_cache, self._meta[size],
                                      self.logits_indices[:size])
        return self.model.forward(self.input_ids[:size], self.positions[:size], self.kv_cache, self._flat_meta[size],
                                  self.flat_logits_indices)

    def _keys(self) -> list[tuple[str, int]]:
        """Every graph's key, largest first (the first capture sizes the shared memory pool)."""
        return ([("flat", t) for t in reversed(self.token_buckets)] + [("decode", b) for b in reversed(self.buckets)])

    def _capture(self) -> None:
        """One graph per bucket, largest first, all in one memory pool (only one replays at a time)."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile and autotune outside the capture
            for key in self._keys():
                self._forward(key)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for key in self._keys():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[key] = self._forward(key)
            self._graphs[key] = graph
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batches of %s sequences and flattened steps of %s tokens",
                 self.buckets, self.token_buckets or "no")

    def _table(self, rows: int, block_tables: list[list[int]]) -> torch.Tensor:
        width = self.block_table.shape[1]
        if max(len(t) for t in block_tables) > width:
            raise ValueError(f"a block table is longer than the {width} blocks a sequence may hold")
        table = np.zeros((rows, width), dtype=np.int32)
        for row, blocks in enumerate(block_tables):
            table[row, :len(blocks)] = blocks
        return torch.from_numpy(table)

    def _replay(self, key: tuple[str, int]) -> torch.Tensor:
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return self._logits[key]
        return self._forward(key)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], k_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """Logits `[len(input_ids), vocab]` of a decode batch (one new token per sequence)."""
        n = len(input_ids)
        if not 0 < n <= self.max_batch:
            raise ValueError(f"a decode batch of {n} sequences does not fit the buckets (1..{self.max_batch})")
        b = next(size for size in self.buckets if size >= n)
        table = self._table(b, block_tables)
        pad = b - n
        # Host-built, then one copy each into the static buffers (non-blocking from pinned memory
        # would need pinned staging; these are a few KiB).
        self.input_ids[:b].copy_(torch.tensor(input_ids + [0] * pad))
        self.positions[:b].copy_(torch.tensor(positions + [0] * pad))
        self.slot_mapping[:b].copy_(torch.tensor(slots + [-1] * pad))
        self.seqused_k[:b].copy_(torch.tensor(k_lens + [1] * pad, dtype=torch.int32))
        self.block_table[:b].copy_(table)
        return self._replay(("decode", b))[:n]

    def run_flat(self, input_ids: list[int], positions: list[int], slots: list[int], cu_q: list[int],
                 k_lens: list[int], block_tables: list[list[int]], sample_rows: list[int]) -> torch.Tensor:
        """Logits `[len(sample_rows), vocab]` of any step that `takes_flat`: the last token of each
        sequence in `sample_rows` (indices into the step's sequences)."""
        n, seqs = len(input_ids), len(k_lens)
        if not self.takes_flat(n, seqs):
            raise ValueError(f"a step of {n} tokens over {seqs} sequences does not fit the flat buckets "
                             f"(up to {self.max_tokens} tokens, {self.max_batch} sequences)")
        t = next(size for size in self.token_buckets if size >= n)
        slots_total = self.max_batch + 1  # the last one stays empty: padded attention tiles point at it
        self.input_ids[:t].copy_(torch.tensor(input_ids + [0] * (t - n)))
        self.positions[:t].copy_(torch.tensor(positions + [0] * (t - n)))
        self.slot_mapping[:t].copy_(torch.tensor(slots + [-1] * (t - n)))
        self.flat_cu_seqlens_q.copy_(torch.tensor(cu_q + [n] * (slots_total + 1 - len(cu_q)), dtype=torch.int32))
        self.flat_seqused_k.copy_(torch.tensor(k_lens + [1] * (slots_total - seqs), dtype=torch.int32))
        self.flat_block_table.copy_(self._table(slots_total, block_tables))
        rows = [cu_q[i + 1] - 1 for i in sample_rows]
        self.flat_logits_indices.copy_(torch.tensor(rows + [0] * (self.max_batch - len(rows))))
        kernels.fill_plan(self.flat_plan, [b - a for a, b in zip(cu_q, cu_q[1:])])
        return self._replay(("flat", t))[:len(rows)]
