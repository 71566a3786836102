"""Steps replayed from CUDA graphs: decode batches, and flattened batches of prompt chunks beside decodes.

A step of a small model on a GPU is mostly launch overhead: hundreds of small kernels, each queued
by Python. Capturing the forward pass once per size in a CUDA graph and replaying it queues them
all with one call. A graph replays fixed addresses and fixed shapes, so a step's inputs are copied
into static buffers and padded up to the nearest captured size ("bucket"):
- a decode batch (one new token per sequence) to a batch bucket: padded rows are sequences that
  read one key of the block their table row names and write nothing (slot -1), and their logits
  are dropped. One query
  tile per sequence and no flash-decoding split (a split length would be baked into the graph
  while contexts grow).
- any other step (prompt chunks, with or without decodes beside them: vLLM's flattened batch) to
  a token bucket, over `max_batch` sequence slots and one more kept empty: the attention's tile
  list is as long as such a step can need and refilled each step (kernels.fill_plan), the tiles
  past the step's pointing at the empty sequence; padded tokens belong to no sequence (their rows
  are computed and never read, and write nothing to the cache). Logits are computed for the
  sampled rows only (`max_batch` of them, the unused ones row 0's).
The inputs of a step go to the device in one transfer (HostStaging), and every graph writes its
logits into one shared buffer.

Without CUDA (or with `capture=False`, or the torch kernels forced) the same padded static-buffer
paths run eagerly: that is how the tests on a CPU check that padding changes no output.
"""
from __future__ import annotations

import logging

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
        """`max_tokens` > 0: flattened steps of up to that many tokens (at most TOKEN_BUCKETS'
        largest) and `max_batch` sequences too; 0: decode batches only."""
        if max_batch < 1 or max_blocks_per_seq < 1 or max_tokens < 0:
            raise ValueError(f"max_batch and max_blocks_per_seq must be positive and max_tokens not negative, "
                             f"got {max_batch}, {max_blocks_per_seq}, {max_tokens}")
        self.model, self.kv_cache = model, kv_cache
        self.buckets = buckets_up_to(max_batch)
        # Captured up to TOKEN_BUCKETS' largest: a step beyond it is long enough to pay its own
        # launches, and its graph's activations would be held for every smaller step.
        self.token_buckets = buckets_up_to(min(max_tokens, TOKEN_BUCKETS[-1]), TOKEN_BUCKETS) if max_tokens else []
        n, device = self.buckets[-1], kv_cache.device
        tokens = max(n, self.token_buckets[-1] if self.token_buckets else 0)
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
        # per token bucket: a tile list as long as a step of that many tokens can need
        self.flat_plans = {t: kernels.fixed_plan_attention(t, n, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                                           kv_cache) for t in self.token_buckets}
        # every input of the largest step: token ids, positions, slots, query starts, context
        # lengths, sampled rows, block tables
        self._staging = HostStaging(3 * tokens + (n + 2) + (n + 1) + n + n * max_blocks_per_seq, device)
        self._meta = {b: self._bucket_meta(b) for b in self.buckets}
        self._flat_meta = {t: AttentionMetadata(self.slot_mapping[:t], self.flat_cu_seqlens_q, self.flat_seqused_k,
                                                self.flat_block_table, self.flat_plans[t]) for t in self.token_buckets}
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
        # Every graph writes its logits into one buffer, and the tensor it computed them in is let
        # go after its capture, so later captures reuse that memory: a graph of 256 rows' fp32
        # logits over Qwen2.5's 151,936 tokens is 155 MB, and there are over twenty graphs.
        out = torch.empty(self.max_batch, self.model.shape.vocab_size, dtype=torch.float32, device=self.kv_cache.device)
        for key in self._keys():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(key)
                out[:logits.shape[0]].copy_(logits)
            self._logits[key] = out[:logits.shape[0]]
            self._graphs[key] = graph
            del logits
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batches of %s sequences and flattened steps of %s tokens",
                 self.buckets, self.token_buckets or "no")

    def _stage_table(self, block_tables: list[list[int]]) -> tuple[slice, int]:
        """The sequences' block tables, each padded with block 0 to the longest, staged. Columns
        past the longest, and the rows of padding sequences, keep what they held: block ids
        written by an earlier step, or 0 (a padding sequence reads one key of its row's first block)."""
        width = max(len(t) for t in block_tables)
        if width > self.block_table.shape[1]:
            raise ValueError(f"a block table is longer than the {self.block_table.shape[1]} blocks a sequence may hold")
        return self._staging.put_rows(block_tables, width), width

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
        stage = self._staging
        stage.begin()
        ids, pos, slot = stage.put(input_ids, b, 0), stage.put(positions, b, 0), stage.put(slots, b, -1)
        lens = stage.put(k_lens, b, 1)
        table, width = self._stage_table(block_tables)
        sent = stage.send()
        self.input_ids[:b].copy_(sent[ids])
        self.positions[:b].copy_(sent[pos])
        self.slot_mapping[:b].copy_(sent[slot])
        self.seqused_k[:b].copy_(sent[lens])
        self.block_table[:n, :width].copy_(sent[table].view(n, width))
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
        rows = [cu_q[i + 1] - 1 for i in sample_rows]
        stage = self._staging
        stage.begin()
        ids, pos, slot = stage.put(input_ids, t, 0), stage.put(positions, t, 0), stage.put(slots, t, -1)
        starts = stage.put(cu_q, slots_total + 1, n)
        lens = stage.put(k_lens, slots_total, 1)
        sampled = stage.put(rows, self.max_batch, 0)
        table, width = self._stage_table(block_tables)
        sent = stage.send()
        self.input_ids[:t].copy_(sent[ids])
        self.positions[:t].copy_(sent[pos])
        self.slot_mapping[:t].copy_(sent[slot])
        self.flat_cu_seqlens_q.copy_(sent[starts])
        self.flat_seqused_k.copy_(sent[lens])
        self.flat_logits_indices.copy_(sent[sampled])
        self.flat_block_table[:seqs, :width].copy_(sent[table].view(seqs, width))
        kernels.fill_plan(self.flat_plans[t], [b - a for a, b in zip(cu_q, cu_q[1:])])
        return self._replay(("flat", t))[:len(rows)]


class HostStaging:
    """A step's inputs written on the host into one buffer (pinned, on a GPU machine) and sent to
    the device in one transfer, then split there into the graphs' static buffers: one copy a step
    where there was one per buffer, each of which, from pageable memory, waited for the device."""

    def __init__(self, size: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.host = torch.empty(size, dtype=torch.int64, pin_memory=pinned)
        self.array = self.host.numpy()
        self.device_copy = torch.empty(size, dtype=torch.int64, device=device)
        self.sent = torch.cuda.Event() if pinned else None
        self.used = 0

    def begin(self) -> None:
        if self.sent is not None:
            self.sent.synchronize()  # the last transfer has read the buffer: it may be written again
        self.used = 0

    def put(self, values: list[int], length: int, pad: int) -> slice:
        """`values`, then `pad` up to `length` entries; the place they will have on the device."""
        start, end = self.used, self.used + length
        if end > self.array.shape[0]:
            raise ValueError(f"a step's inputs need more than the {self.array.shape[0]} staged entries")
        self.array[start:start + len(values)] = values
        self.array[start + len(values):end] = pad
        self.used = end
        return slice(start, end)

    def put_rows(self, rows: list[list[int]], width: int) -> slice:
        """Rows of at most `width` values as a `[len(rows), width]` block, each padded with 0."""
        place = self.put([], len(rows) * width, 0)
        block = self.array[place].reshape(len(rows), width)
        for i, row in enumerate(rows):
            block[i, :len(row)] = row
        return place

    def send(self) -> torch.Tensor:
        """The staged entries, on the device (in stream order: the copies that read them follow)."""
        sent = self.device_copy[:self.used]
        sent.copy_(self.host[:self.used], non_blocking=True)
        if self.sent is not None:
            self.sent.record()
        return sent
