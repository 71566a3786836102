"""Decode steps replayed from CUDA graphs.

A decode step of a small model on a GPU is mostly launch overhead: hundreds of small kernels,
each queued by Python. Capturing the forward pass once per batch size in a CUDA graph and
replaying it queues them all with one call. A graph replays fixed addresses and fixed shapes,
so a decode batch is copied into static buffers and padded up to the nearest captured size
("bucket"); padded rows read one key from block 0 and write nothing (slot -1), and their logits
are dropped. The attention plan of each bucket is fixed too: one query tile per sequence and no
flash-decoding split (a split length would be baked into the graph while contexts grow).

Without CUDA (or with `capture=False`, or the torch kernels forced) the same padded static-buffer
path runs eagerly: that is how the tests on a CPU check that padding changes no output.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

import kernels
from engine.worker.models.llama import AttentionMetadata, LlamaModel

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def buckets_up_to(max_batch: int) -> list[int]:
    """The captured batch sizes: BUCKETS up to max_batch, and max_batch itself."""
    sizes = [b for b in BUCKETS if b < max_batch]
    return sizes + [max_batch]


class CudaGraphs:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, max_batch: int, max_blocks_per_seq: int,
                 capture: bool = True) -> None:
        if max_batch < 1 or max_blocks_per_seq < 1:
            raise ValueError(f"max_batch and max_blocks_per_seq must be positive, got {max_batch}, {max_blocks_per_seq}")
        self.model, self.kv_cache = model, kv_cache
        self.buckets = buckets_up_to(max_batch)
        n, device = self.buckets[-1], kv_cache.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seqused_k = torch.ones(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self._meta = {b: self._bucket_meta(b) for b in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        # Only the Triton kernels can be captured: the torch path plans on the host and reads
        # slot values back from the device, which a capturing stream refuses. Forced onto a GPU
        # (PAGEDCHAT_KERNELS=torch), it runs the same padded path eagerly.
        if capture and device.type == "cuda" and kernels.backend(kv_cache) == "triton":
            self._capture()

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def _bucket_meta(self, b: int) -> AttentionMetadata:
        shape = self.model.shape
        plan = kernels.plan_attention([1] * b, [1] * b, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                      self.kv_cache, num_splits=1)
        return AttentionMetadata(self.slot_mapping[:b], self.cu_seqlens_q[:b + 1], self.seqused_k[:b],
                                 self.block_table[:b], plan)

    def _forward(self, b: int) -> torch.Tensor:
        return self.model.forward(self.input_ids[:b], self.positions[:b], self.kv_cache, self._meta[b],
                                  self.logits_indices[:b])

    def _capture(self) -> None:
        """One graph per bucket, largest first, all in one memory pool (only one replays at a time)."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile and autotune outside the capture
            for b in reversed(self.buckets):
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for b in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[b] = self._forward(b)
            self._graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], k_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """Logits `[len(input_ids), vocab]` of a decode batch (one new token per sequence)."""
        n = len(input_ids)
        if not 0 < n <= self.max_batch:
            raise ValueError(f"a decode batch of {n} sequences does not fit the buckets (1..{self.max_batch})")
        b = next(size for size in self.buckets if size >= n)
        width = self.block_table.shape[1]
        if max(len(t) for t in block_tables) > width:
            raise ValueError(f"a block table is longer than the {width} blocks a sequence may hold")
        table = np.zeros((b, width), dtype=np.int32)
        for row, blocks in enumerate(block_tables):
            table[row, :len(blocks)] = blocks
        pad = b - n
        # Host-built, then one copy each into the static buffers (non-blocking from pinned memory
        # would need pinned staging; these are a few KiB).
        self.input_ids[:b].copy_(torch.tensor(input_ids + [0] * pad))
        self.positions[:b].copy_(torch.tensor(positions + [0] * pad))
        self.slot_mapping[:b].copy_(torch.tensor(slots + [-1] * pad))
        self.seqused_k[:b].copy_(torch.tensor(k_lens + [1] * pad, dtype=torch.int32))
        self.block_table[:b].copy_(torch.from_numpy(table))
        graph = self._graphs.get(b)
        if graph is not None:
            graph.replay()
            return self._logits[b][:n]
        return self._forward(b)[:n]

