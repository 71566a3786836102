"""Torch reference implementations of the paged-KV operations.

They are the CPU path of the engine and the oracle the Triton kernels are tested against.
Cache layout, shared by every op: one tensor `[num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim]`, so each block is one contiguous region across all layers (a swap
copies one region per block); per-layer K and V caches are the strided views
`cache[:, layer, 0]` and `cache[:, layer, 1]`, each `[num_blocks, block_size, num_kv_heads, head_dim]`.
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
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value


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
    mask: torch.Tensor | None


@dataclass
class _ShortQueries:
    """Decodes and short chunks, padded to the longest (see `_short_query_attention`)."""
    num_seqs: int
    max_q: int
    rows: torch.Tensor       # [num_seqs, max_q] rows of q (padding points at row 0)
    valid: torch.Tensor      # [num_seqs, max_q] which of them are real
    out_rows: torch.Tensor   # rows[valid]
    own: torch.Tensor        # [num_seqs, blocks] each sequence's blocks after the common ones
    own_len: int             # keys gathered from them (the longest sequence's)
    bias: torch.Tensor | None  # [num_seqs, 1, max_q * rep, own_len] additive mask (None: every key allowed)
    in_order: bool           # the queries are q's rows 0..num_seqs-1, one each (a batch of decodes)
    shared: torch.Tensor | None  # the blocks every sequence shares, read once for all
    first: int               # keys in the shared blocks


@dataclass
class AttentionPlan:
    """Everything about one step's attention that depends only on the batch's lengths and block
    tables: the rows, gathers and masks, built once per step instead of in every layer (on a
    CPU, those small ops cost more than the attention itself at decode sizes)."""
    short: _ShortQueries | None
    long: list[_LongQuery]


def plan(cu_seqlens_q: list[int], seqused_k: list[int], block_table: torch.Tensor, block_size: int,
         num_heads: int, num_kv_heads: int, dtype: torch.dtype, causal: bool = True) -> AttentionPlan:
    """The plan for a batch: the host-side lists of query offsets and context lengths."""
    device = block_table.device
    q_lens = [cu_seqlens_q[i + 1] - cu_seqlens_q[i] for i in range(len(seqused_k))]
    long = []
    for i, q_len in enumerate(q_lens):
        if q_len > SHORT_QUERY:
            k_len = seqused_k[i]
            mask = None
            if causal:  # query j sits at key position k_len - q_len + j and sees keys up to it
                mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
            long.append(_LongQuery(slice(cu_seqlens_q[i], cu_seqlens_q[i + 1]),
                                   block_table[i, :-(-k_len // block_size)], k_len, mask))
    seqs = [i for i, n in enumerate(q_lens) if 0 < n <= SHORT_QUERY]
    short = None
    if seqs:
        short = _plan_short(cu_seqlens_q, q_lens, seqused_k, block_table, block_size, num_heads // num_kv_heads,
                            dtype, causal, seqs)
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
    out = torch.empty_like(q) if out is None else out
    if attention_plan is None:
        attention_plan = plan(cu_seqlens_q.tolist(), seqused_k.tolist(), block_table, k_cache.shape[1], q.shape[1],
                              k_cache.shape[2], q.dtype, causal)
    if attention_plan.short is not None:
        _short_query_attention(q, k_cache, v_cache, attention_plan.short, softmax_scale, out)
    for item in attention_plan.long:
        out[item.rows] = _sequence_attention(q[item.rows], k_cache, v_cache, item, softmax_scale)
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens held by `blocks`: `[..., length, num_kv_heads, head_dim]`."""
    # index_select copies whole block rows; advanced indexing on the strided per-layer view is
    # ~2x slower here.
    gathered = cache.index_select(0, blocks.reshape(-1))  # [n, block_size, kv_heads, head_dim]
    return gathered.view(*blocks.shape[:-1], -1, *cache.shape[2:])[..., :length, :, :]


def _sequence_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, item: _LongQuery,
                        scale: float) -> torch.Tensor:
    """One long prefill chunk: its context gathered once, then torch's fused attention."""
    k = _gather(k_cache, item.blocks, item.k_len).transpose(0, 1)  # [kv_heads, k_len, head_dim]
    v = _gather(v_cache, item.blocks, item.k_len).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=item.mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(0, 1)


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
    own = tables[:, common:common + num_blocks]
    key_pos = first + torch.arange(max_len - first, device=device)
    allowed = key_pos[None, None, :] < lens[:, None, None]                  # [num_seqs, 1, own_len]
    if causal:
        query_pos = (lens - qlens)[:, None] + offsets[None, :]              # [num_seqs, max_q]
        allowed = allowed & (key_pos[None, None, :] <= query_pos[:, :, None])
    allowed = allowed.repeat_interleave(rep, dim=1) if allowed.shape[1] > 1 else allowed.expand(-1, max_q * rep, -1)
    bias = None
    if not bool(allowed.all()):  # one decoding chat needs no mask: it sees every key it has
        bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))[:, None]
    in_order = max_q == 1 and seqs == list(range(len(starts) - 1)) and starts[num_seqs] == num_seqs
    return _ShortQueries(num_seqs, max_q, rows, valid, rows[valid], own, max_len - first, bias, in_order,
                         tables[0, :common] if common else None, first)


def _short_query_attention(q, k_cache, v_cache, plan: _ShortQueries, scale, out) -> None:
    """Decodes and short prefill chunks, all at once, padded to the longest.

    Chats that share a system prompt share its blocks. The keys every sequence has in common and
    that lie before all of their queries (a shared prefix of whole blocks) are read once for the
    whole batch; only each sequence's own remainder is gathered per sequence. The two partial
    attentions are merged through their log-sum-exps (flash-attention's rescaling).
    """
    kv_heads, heads, head_dim = k_cache.shape[2], q.shape[1], q.shape[2]
    rep, num_seqs, max_q = heads // kv_heads, plan.num_seqs, plan.max_q
    # [num_seqs, kv_heads, max_q * rep, head_dim]: a K/V head's query heads are just more rows.
    qs = (q if plan.in_order else q[plan.rows]).view(num_seqs, max_q, kv_heads, rep, head_dim).permute(0, 2, 1, 3, 4)
    qs = qs.reshape(num_seqs, kv_heads, max_q * rep, head_dim)
    k = _gather(k_cache, plan.own, plan.own_len).transpose(1, 2)  # [num_seqs, kv_heads, own_len, head_dim]
    v = _gather(v_cache, plan.own, plan.own_len).transpose(1, 2)
    result, lse = _attention_with_lse(qs, k, v, plan.bias, scale)

    if plan.shared is not None:
        kp = _gather(k_cache, plan.shared, plan.first).transpose(0, 1)[None]  # [1, kv_heads, first, head_dim]
        vp = _gather(v_cache, plan.shared, plan.first).transpose(0, 1)[None]
        qp = qs.transpose(0, 1).reshape(1, kv_heads, num_seqs * max_q * rep, head_dim)
        shared_out, shared_lse = _attention_with_lse(qp, kp, vp, None, scale)
        shared_out = shared_out.view(kv_heads, num_seqs, max_q * rep, head_dim).transpose(0, 1)
        shared_lse = shared_lse.view(kv_heads, num_seqs, max_q * rep).transpose(0, 1)
        total = torch.logaddexp(lse, shared_lse)
        result = (result * (lse - total).exp()[..., None].to(result.dtype)
                  + shared_out * (shared_lse - total).exp()[..., None].to(result.dtype))
    result = result.view(num_seqs, kv_heads, max_q, rep, head_dim).permute(0, 2, 1, 3, 4)
    if plan.in_order:
        out.copy_(result.reshape(num_seqs, heads, head_dim))
    else:
        out[plan.out_rows] = result.reshape(num_seqs, max_q, heads, head_dim)[plan.valid]


def _attention_with_lse(q, k, v, bias, scale):
    """Softmax attention and each query row's log-sum-exp of its scores (fp32). q, k, v:
    `[batch, heads, rows, head_dim]`, k and v may be strided views; bias: additive mask or None."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                          scale=scale)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    lse = scores.logsumexp(dim=-1)
    return ((scores - lse[..., None]).exp() @ v.float()).to(q.dtype), lse


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
