"""Torch reference implementations of the paged-KV operations.

They are the CPU path of the engine and the oracle the Triton kernels are tested against.
The ops take per-layer K and V caches `[num_blocks, block_size, num_kv_heads, head_dim]`, which
may be strided views. The engine's cache is one tensor `[num_blocks, num_layers, 2, num_kv_heads,
block_size, head_dim]`: each block is one contiguous region across all layers (a swap copies one
region per block), and inside it each head's keys are contiguous (attention reads them per head).
Its layer views are `cache[:, layer, 0].transpose(1, 2)` and `cache[:, layer, 1].transpose(1, 2)`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, slot_index: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write `key`/`value` `[num_tokens, num_kv_heads, head_dim]` into the caches at
    `slot_mapping` (block * block_size + offset); slot -1 marks padding and is skipped.
    `slot_index`: the same slots as (blocks, offsets), worked out once per step by the caller
    (`slot_index(...)`), so that the 30-odd layers of a step do not each divide and check them."""
    if slot_index is None:
        block_size = k_cache.shape[1]
        if slot_mapping.numel() and int(slot_mapping.min()) < 0:
            keep = slot_mapping >= 0
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        slot_index = (slot_mapping // block_size, slot_mapping % block_size)
    blocks, offsets = slot_index
    both_caches, both_new = paired(k_cache, v_cache, 2), paired(key, value, 1)
    if both_caches is not None and both_new is not None:  # the engine's layout: one write for K and V
        both_caches[blocks, offsets] = both_new
    else:
        k_cache[blocks, offsets] = key
        v_cache[blocks, offsets] = value


def paired(first: torch.Tensor, second: torch.Tensor, dim: int) -> torch.Tensor | None:
    """`first` and `second` as one view with a new dimension of size 2 at `dim`, when they can be:
    the same shape and strides in one storage, `second` a fixed distance after `first` (a layer's
    K and V caches in the engine's cache tensor; a step's new k and v in the qkv projection's
    output). None otherwise."""
    distance, size = second.data_ptr() - first.data_ptr(), first.element_size()
    if (distance <= 0 or distance % size or first.dtype != second.dtype or first.shape != second.shape
            or first.stride() != second.stride()):
        return None
    shape, strides = list(first.shape), list(first.stride())
    shape.insert(dim, 2)
    strides.insert(dim, distance // size)
    # A view of `first`'s storage that reaches `second`'s bytes reads and writes exactly those
    # bytes (allocations do not overlap); torch refuses one that would leave that storage.
    # (Cheaper than asking both tensors for their storages, which costs ~2 us a call here.)
    try:
        return first.as_strided(shape, strides, first.storage_offset())
    except RuntimeError:
        return None


def slot_index(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, offsets) of a step's new tokens, from its slots (no padding)."""
    return slot_mapping // block_size, slot_mapping % block_size


SHORT_QUERY = 64  # sequences with at most this many queries are batched together


@dataclass
class _LongQuery:
    """One long prefill chunk: its query rows, the blocks holding its context, and its mask."""
    rows: slice
    blocks: torch.Tensor
    k_len: int
    mask: torch.Tensor | None  # [q_len, k_len], where the chunk does not start the context
    causal: bool               # query i sees keys 0..i (the chunk is the whole context so far)


@dataclass
class _ShortQueries:
    """Decodes and short chunks, padded to the longest (see `_short_query_attention`)."""
    num_seqs: int
    max_q: int
    rows: torch.Tensor       # [num_seqs, max_q] rows of q (padding points at row 0)
    valid: torch.Tensor      # [num_seqs, max_q] which of them are real
    out_rows: torch.Tensor   # rows[valid]
    own: torch.Tensor        # [num_seqs * blocks] each sequence's blocks after the common ones, flattened
    own_len: int             # keys read from them: whole blocks, the longest sequence's
    bias: torch.Tensor | None  # [num_seqs, max_q * rep, own_len] additive mask (None: every key allowed)
    in_order: bool           # the queries are q's rows 0..num_seqs-1, one each (a batch of decodes)
    shared: torch.Tensor | None  # the blocks every sequence shares, read once for all
    first: int               # keys in the shared blocks
    alone: int | None = None  # one decoding sequence alone: its number of keys
    lone: LoneDecode | None = None  # ... and its K/V, kept from step to step (None: gathered)


# A lone chat's K/V is kept for contexts up to this many tokens (30 layers x 4,096 tokens of
# SmolLM2 are ~190 MB in fp32), in buffers that grow by KEPT_STEP tokens.
MAX_KEPT = 4096
KEPT_STEP = 256


class LoneDecode:
    """One sequence decoding alone, step after step: each layer's K/V gathered into a buffer once,
    then extended by the step's new token, instead of gathered whole every step. On a 2-core EPYC
    a ~300-token context's gather is ~30 µs a layer of a ~10-ms one-chat step, the copy of one
    token ~3 µs: one chat decodes ~4% faster in bf16 and 1-4% in fp32.

    A step continues the previous step's buffers only when that step also decoded one sequence
    alone, with the same blocks (maybe one more) and one token fewer: a running sequence's past
    K/V never changes in place. The caller passes no previous plan when blocks were swapped or
    copied in between."""

    def __init__(self, blocks: list[int], length: int, block_size: int) -> None:
        self.blocks, self.length, self.block_size = blocks, length, block_size
        # per layer (its K cache's address): (buffer [2, kv_heads, capacity, head_dim], tokens in it)
        self.layers: dict[int, tuple[torch.Tensor, int]] = {}

    def continue_from(self, previous: LoneDecode | None) -> None:
        if (previous is not None and previous.length + 1 == self.length
                and self.blocks[:len(previous.blocks)] == previous.blocks):
            self.layers = previous.layers

    def keys_values(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V of the whole context, `[num_kv_heads, length, head_dim]` each."""
        key, n = k_cache.data_ptr(), self.length
        buffer, filled = self.layers.get(key, (None, 0))
        # The buffer holds the context up to the previous token at least (more only when the same
        # step runs again, as benchmarks/forward_ab.py replays it): copy in this step's token.
        if buffer is not None and filled >= n - 1 and buffer.shape[2] >= n:
            block, offset = self.blocks[(n - 1) // self.block_size], (n - 1) % self.block_size
            both = paired(k_cache, v_cache, 0)
            if both is not None:
                buffer[:, :, n - 1].copy_(both[:, block, offset])
            else:
                buffer[0, :, n - 1].copy_(k_cache[block, offset])
                buffer[1, :, n - 1].copy_(v_cache[block, offset])
        else:
            k, v = _gather_kv(k_cache, v_cache, blocks, n)
            capacity = min(-(-n // KEPT_STEP) * KEPT_STEP + KEPT_STEP, MAX_KEPT)
            buffer = k.new_empty((2, k.shape[0], capacity, k.shape[2]))
            buffer[0, :, :n].copy_(k)
            buffer[1, :, :n].copy_(v)
        self.layers[key] = (buffer, max(filled, n))
        return buffer[0, :, :n], buffer[1, :, :n]


@dataclass
class AttentionPlan:
    """Everything about one step's attention that depends only on the batch's lengths and block
    tables: the rows, gathers and masks, built once per step instead of in every layer (on a
    CPU, those small ops cost more than the attention itself at decode sizes)."""
    short: _ShortQueries | None
    long: list[_LongQuery]


def plan(cu_seqlens_q: list[int], seqused_k: list[int], block_table: torch.Tensor, block_size: int,
         num_heads: int, num_kv_heads: int, dtype: torch.dtype, causal: bool = True,
         previous: AttentionPlan | None = None) -> AttentionPlan:
    """The plan for a batch: the host-side lists of query offsets and context lengths.
    `previous`: the last step's plan, whose kept K/V a lone decoding sequence may go on with
    (see `LoneDecode`); None where blocks were moved since."""
    device = block_table.device
    q_lens = [cu_seqlens_q[i + 1] - cu_seqlens_q[i] for i in range(len(seqused_k))]
    long = []
    for i, q_len in enumerate(q_lens):
        if q_len > SHORT_QUERY:
            k_len = seqused_k[i]
            mask = None
            if causal and q_len < k_len:  # query j sits at key position k_len - q_len + j and sees keys up to it
                mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
            long.append(_LongQuery(slice(cu_seqlens_q[i], cu_seqlens_q[i + 1]),
                                   block_table[i, :-(-k_len // block_size)], k_len, mask, causal and q_len == k_len))
    seqs = [i for i, n in enumerate(q_lens) if 0 < n <= SHORT_QUERY]
    short = None
    if seqs:
        short = _plan_short(cu_seqlens_q, q_lens, seqused_k, block_table, block_size, num_heads // num_kv_heads,
                            dtype, causal, seqs)
        if short.alone is not None and short.alone <= MAX_KEPT:
            short.lone = LoneDecode(short.own.tolist(), short.alone, block_size)
            previous_short = previous.short if previous is not None else None
            short.lone.continue_from(previous_short.lone if previous_short is not None else None)
    return AttentionPlan(short, long)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
                    softmax_scale: float, causal: bool = True, out: torch.Tensor | None = None,
                    attention_plan: AttentionPlan | None = None) -> torch.Tensor:
    """Attention for a varlen batch reading K/V through block tables (flash-attn's convention).

    q: `[total_q, num_heads, head_dim]`, sequence i's queries at `cu_seqlens_q[i]:cu_seqlens_q[i+1]`;
    its keys are the first `seqused_k[i]` tokens of the blocks `block_table[i]`. The causal mask
    is aligned bottom-right: the last query sees every key. `num_heads` is a multiple of
    `num_kv_heads` (grouped-query attention). Returns `[total_q, num_heads, head_dim]` (written
    into `out` when given). `attention_plan`: the step's `plan(...)`, shared by its layers
    (made here when not given).
    """
    if attention_plan is None:
        attention_plan = plan(cu_seqlens_q.tolist(), seqused_k.tolist(), block_table, k_cache.shape[1], q.shape[1],
                              k_cache.shape[2], q.dtype, causal)
    if out is None and attention_plan.short is not None and attention_plan.short.in_order:
        # A batch of decodes only: the result is the output, with no buffer to copy it into.
        return _short_query_attention(q, k_cache, v_cache, attention_plan.short, softmax_scale, None)
    out = torch.empty_like(q) if out is None else out
    if attention_plan.short is not None:
        _short_query_attention(q, k_cache, v_cache, attention_plan.short, softmax_scale, out)
    for item in attention_plan.long:
        out[item.rows] = _sequence_attention(q[item.rows], k_cache, v_cache, item, softmax_scale)
    return out


def _gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
               length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first `length` tokens held by `blocks` `[n]`, per head: each
    `[num_kv_heads, length, head_dim]` (with `blocks` `[seqs * n]`: `[num_kv_heads, seqs * n * block_size,
    head_dim]`, every sequence's keys in a row), the layout a batched matmul reads without a copy."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    both = paired(k_cache, v_cache, 0)  # [2, num_blocks, block_size, kv_heads, head_dim]
    if both is not None:
        # One layer's K and V sit a fixed distance apart in one cache tensor: one gather reads
        # both, with heads outermost. index_select copies a block's run for one head at a time,
        # whole when the cache is head-major inside a block (`[..., kv_heads, block_size, head_dim]`).
        k, v = both.permute(0, 3, 1, 2, 4).index_select(2, blocks).view(2, kv_heads, -1, head_dim)
    else:
        k = k_cache.permute(2, 0, 1, 3).index_select(1, blocks).view(kv_heads, -1, head_dim)
        v = v_cache.permute(2, 0, 1, 3).index_select(1, blocks).view(kv_heads, -1, head_dim)
    return k[:, :length], v[:, :length]


def _sequence_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, item: _LongQuery,
                        scale: float) -> torch.Tensor:
    """One long prefill chunk: its context gathered once, then torch's fused attention.

    Each K/V head is repeated for its query heads and the batch made 4-D: torch's flash kernel for
    CPUs takes neither grouped heads nor 3-D inputs, and its fallback (plain matmuls, the mask
    materialised) was ~6x slower on a 2,048-token prompt. A chunk that starts its context is
    causal by position, with no mask to build or read."""
    k, v = _gather_kv(k_cache, v_cache, item.blocks, item.k_len)  # [kv_heads, k_len, head_dim]
    rep = q.shape[1] // k.shape[0]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=item.mask,
                                         is_causal=item.causal, scale=scale)
    return out[0].transpose(0, 1)


def _plan_short(starts, q_lens, k_lens, block_table, bs, rep, dtype, causal, seqs) -> _ShortQueries:
    device = block_table.device
    num_seqs = len(seqs)
    max_q = max(q_lens[i] for i in seqs)
    lens = torch.tensor([k_lens[i] for i in seqs], device=device)
    qlens = torch.tensor([q_lens[i] for i in seqs], device=device)
    tables = block_table[torch.tensor(seqs, device=device)]
    common = _common_blocks(tables, min(k_lens[i] - q_lens[i] for i in seqs) // bs) if num_seqs > 1 else 0

    offsets = torch.arange(max_q, device=device)
    valid = offsets[None, :] < qlens[:, None]
    rows = torch.tensor([starts[i] for i in seqs], device=device)[:, None] + offsets[None, :]
    rows = torch.where(valid, rows, torch.zeros_like(rows))

    # Each sequence's own keys: positions common*bs .. k_len-1.
    max_len = max(k_lens[i] for i in seqs)
    first, num_blocks = common * bs, -(-max_len // bs) - common
    own = tables[:, common:common + num_blocks].reshape(-1).long()
    # Whole blocks, the keys past a sequence's end masked: a matmul reads a gather of whole blocks
    # in place, where a view cut to the last key would be copied first.
    key_pos = first + torch.arange(num_blocks * bs, device=device)
    allowed = key_pos[None, None, :] < lens[:, None, None]                  # [num_seqs, 1, own_len]
    if causal:
        query_pos = (lens - qlens)[:, None] + offsets[None, :]              # [num_seqs, max_q]
        allowed = allowed & (key_pos[None, None, :] <= query_pos[:, :, None])
    # A query's rep heads are rows q * rep + r of its K/V head's query block.
    allowed = allowed.repeat_interleave(rep, dim=1) if allowed.shape[1] > 1 else allowed.expand(-1, max_q * rep, -1)
    bias = None
    if not bool(allowed.all()):  # one decoding chat needs no mask: it sees every key it has
        bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    in_order = max_q == 1 and seqs == list(range(len(starts) - 1)) and starts[num_seqs] == num_seqs
    alone = max_len if num_seqs == 1 and max_q == 1 else None
    return _ShortQueries(num_seqs, max_q, rows, valid, rows[valid], own, num_blocks * bs, bias, in_order,
                         tables[0, :common].long() if common else None, first, alone)


def _short_query_attention(q, k_cache, v_cache, plan: _ShortQueries, scale, out) -> torch.Tensor:
    """Decodes and short prefill chunks, all at once, padded to the longest, as batched matmuls,
    written into `out` (which may be None when `plan.in_order`: then returned as a new tensor).

    Chats that share a system prompt share its blocks. The keys every sequence has in common and
    that lie before all of their queries (a shared prefix of whole blocks) are read once for the
    whole batch; only each sequence's own remainder is gathered per sequence. The scores of both
    parts meet in one softmax. Matmuls rather than torch's fused CPU attention: at these sizes
    (a few query rows per head) its fixed cost per call is several times the arithmetic.
    Scores are in the model's dtype and the softmax computes in fp32, as transformers' eager
    attention does.
    """
    kv_heads, heads, head_dim = k_cache.shape[2], q.shape[1], q.shape[2]
    rep, num_seqs, max_q = heads // kv_heads, plan.num_seqs, plan.max_q
    rows, first, own_len = max_q * rep, plan.first, plan.own_len
    if plan.alone is not None:
        # One decoding chat: torch's fused attention costs less than three matmuls and a softmax
        # at one query row per head (the rows of a K/V head need no mask: they see every key).
        if plan.lone is not None:
            k, v = plan.lone.keys_values(k_cache, v_cache, plan.own)
        else:
            k, v = _gather_kv(k_cache, v_cache, plan.own, plan.alone)
        query = (q if plan.in_order else q[plan.out_rows]).view(1, kv_heads, rep, head_dim)
        # reshape: CUDA's fused kernels may return heads and rows in another memory order
        result = F.scaled_dot_product_attention(query, k[None], v[None], scale=scale).reshape(1, heads, head_dim)
        if out is None:
            return result
        out[plan.out_rows] = result
        return out
    # [kv_heads, num_seqs, max_q * rep, head_dim]: a K/V head's query heads are just more rows.
    qs = torch.empty(kv_heads, num_seqs, max_q, rep, head_dim, dtype=q.dtype, device=q.device)
    torch.mul((q if plan.in_order else q[plan.rows]).view(num_seqs, max_q, kv_heads, rep, head_dim).permute(2, 0, 1, 3, 4),
              scale, out=qs)  # rearranged and scaled in one pass
    qs = qs.view(kv_heads, num_seqs, rows, head_dim)
    k, v = _gather_kv(k_cache, v_cache, plan.own, num_seqs * own_len)
    k = k.view(kv_heads * num_seqs, own_len, head_dim)
    v = v.view(kv_heads * num_seqs, own_len, head_dim)
    scores = torch.bmm(qs.view(kv_heads * num_seqs, rows, head_dim), k.transpose(1, 2))
    scores = scores.view(kv_heads, num_seqs, rows, own_len)
    if plan.bias is not None:
        scores += plan.bias
    if plan.shared is not None:
        kp, vp = _gather_kv(k_cache, v_cache, plan.shared, first)  # [kv_heads, first, head_dim]
        shared_scores = torch.bmm(qs.view(kv_heads, num_seqs * rows, head_dim), kp.transpose(1, 2))
        scores = torch.cat([shared_scores.view(kv_heads, num_seqs, rows, first), scores], dim=-1)
    probs = torch.softmax(scores, dim=-1)  # in fp32 inside, rounded once to the model's dtype
    result = torch.bmm(probs[..., first:].view(kv_heads * num_seqs, rows, own_len), v)
    result = result.view(kv_heads, num_seqs, max_q, rep, head_dim)
    if plan.shared is not None:
        shared_out = torch.bmm(probs[..., :first].view(kv_heads, num_seqs * rows, first), vp)
        result += shared_out.view(kv_heads, num_seqs, max_q, rep, head_dim)
    result = result.permute(1, 2, 0, 3, 4)  # [num_seqs, max_q, kv_heads, rep, head_dim]
    if out is None:  # in order, one query each: the rows are the output's
        return result.reshape(num_seqs, heads, head_dim)
    if plan.in_order:
        out.view(num_seqs, 1, kv_heads, rep, head_dim).copy_(result)
    else:
        out[plan.out_rows] = result.reshape(num_seqs, max_q, heads, head_dim)[plan.valid]
    return out


def _common_blocks(tables: torch.Tensor, limit: int) -> int:
    """How many leading block ids every row of `tables` shares, at most `limit`."""
    if limit <= 0:
        return 0
    same = (tables[:, :limit] == tables[:1, :limit]).all(dim=0)
    return int(same.cumprod(0).sum())


def copy_blocks(cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy-on-write: `cache[dst] = cache[src]` for each row (src, dst) of `pairs` `[n, 2]`."""
    if pairs.numel():
        cache[pairs[:, 1]] = cache[pairs[:, 0]]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy whole blocks between pools: `dst[d] = src[s]` for each row (s, d) of `pairs`.

    One copy per run of consecutive blocks (each block is one region across all layers), issued
    asynchronously on CUDA: the host pool is pinned, and later kernels on the stream wait for it.
    """
    for s0, d0, n in contiguous_runs(pairs.tolist()):
        dst[d0:d0 + n].copy_(src[s0:s0 + n], non_blocking=True)


def contiguous_runs(pairs: list[list[int]]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) for maximal runs where both ids go up by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in pairs:
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
