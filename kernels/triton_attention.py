"""Paged attention in Triton: one kernel for a varlen batch that mixes prefill chunks and decodes,
reading K/V through block tables; flash-attn's varlen convention (see `kernels.reference`).

Grid: (query tiles, K/V heads). A tile holds up to BLOCK_Q consecutive query tokens of one
sequence times the REP query heads that share a K/V head (grouped-query attention packs them
into the rows of one matrix), so K/V are loaded once per tile for all of those heads. Keys are
visited TILE_N at a time, each key's block looked up in the block table, with an online softmax
accumulated in fp32. For decode batches with few sequences and long contexts the key range is
also split across programs (flash-decoding) and a second kernel merges the partial results.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
                      cu_q_ptr, seqused_k_ptr, block_table_ptr, tile_seq_ptr, tile_start_ptr,
                      scale, split_len,
                      stride_qt, stride_qh, stride_ot, stride_oh,
                      stride_cb, stride_ct, stride_ch, stride_bt,
                      NUM_HEADS: tl.constexpr, REP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                      TILE_N: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    q_first = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
    k_len = tl.load(seqused_k_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_first + rows // REP
    head = kv_head * REP + rows % REP
    row_ok = (rows < BLOCK_Q * REP) & (q_tok < q_len)
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM
    q_offsets = (q_begin + q_tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = k_len - q_len + q_tok  # each query's position among the keys (bottom-right alignment)

    key_end = k_len
    if CAUSAL:
        key_end = tl.minimum(k_len, k_len - q_len + q_first + BLOCK_Q)
    key_begin = 0
    if SPLIT:
        key_begin = split * split_len
        key_end = tl.minimum(key_end, key_begin + split_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_P2], tl.float32)
    for start in range(key_begin, key_end, TILE_N):
        keys = start + tl.arange(0, TILE_N)
        key_ok = keys < key_end
        block = tl.load(block_table_ptr + seq * stride_bt + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_offsets = (block * stride_cb + (keys % BLOCK_SIZE) * stride_ct + kv_head * stride_ch)[:, None] + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        allowed = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            allowed = allowed & (keys[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        # Partials per (sequence, head, split): unnormalised sum, running max and softmax sum.
        part = (seq * NUM_HEADS + head).to(tl.int64) * tl.num_programs(2) + split
        tl.store(part_acc_ptr + part[:, None] * DIM_P2 + dims[None, :], acc, mask=out_mask)
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows saw no key
        out_offsets = (q_begin + q_tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, cu_q_ptr, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                         HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)
    split_ok = splits < NUM_SPLITS
    dims = tl.arange(0, DIM_P2)
    part = (seq * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + splits
    m = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    s = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * DIM_P2 + dims[None, :], mask=split_ok[:, None], other=0.0)
    m_all = tl.max(m, 0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))  # splits past the context are empty
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(s * weight, 0)
    row = tl.load(cu_q_ptr + seq).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@dataclass(frozen=True)
class Tiling:
    """The attention kernel's launch shape. A tile's rows are `q_tokens` query tokens times the
    heads that share a K/V head (at least 16, a power of two: what `tl.dot` takes); keys are read
    `tile_n` at a time. `benchmarks/kernels.py --sweep` times the alternatives on a GPU."""
    q_tokens: int
    tile_n: int = 32
    num_warps: int = 4
    num_stages: int = 3  # Triton's own default on CUDA


# From `benchmarks/kernels.py --sweep` on an H200 (bf16, 32/8 heads, d=128): decode 64 x 4,096
# keys 0.282 -> 0.250 ms (64 keys a step instead of 32); prefill 4 x 2,048 1.61 -> 0.65 ms
# (16 query tokens a tile instead of 4, two stages). Eight warps were slower at every shape.
DECODE_TILING = Tiling(q_tokens=1, tile_n=64, num_warps=4, num_stages=3)
PREFILL_TILING = Tiling(q_tokens=16, tile_n=32, num_warps=4, num_stages=2)


@dataclass(frozen=True)
class AttentionPlan:
    """How one step's batch is tiled: worked out once per step on the host from the lengths the
    model runner already holds, then shared by every layer, so a layer's launch needs no
    device-to-host read (the precondition for capturing decode steps in a CUDA graph)."""
    block_m: int               # query rows per tile: BLOCK_Q tokens x REP heads
    block_q: int               # query tokens per tile
    tiling: Tiling
    tile_seq: torch.Tensor     # [tiles] int32: the sequence of each tile
    tile_start: torch.Tensor   # [tiles] int32: its first query token within the sequence
    num_seqs: int
    splits: int                # flash-decoding: programs per (sequence, K/V head); 1 = no split
    split_len: int             # keys per split (a multiple of 16), 0 without splits
    part_acc: torch.Tensor     # split partial results, reused by every layer (one stream)
    part_max: torch.Tensor
    part_sum: torch.Tensor

    @property
    def num_tiles(self) -> int:
        return self.tile_seq.shape[0]


def plan(q_lens: list[int], max_k_len: int, num_heads: int, kv_heads: int, head_dim: int,
         device: torch.device | str, num_splits: int | None = None, tiling: Tiling | None = None) -> AttentionPlan:
    """The tiling of a batch with these query lengths and longest context. `num_splits` forces
    flash-decoding's split count for a decode-only batch (None: chosen from the shape); `tiling`
    the launch shape (None: DECODE_TILING or PREFILL_TILING)."""
    rep = num_heads // kv_heads
    decode_only = bool(q_lens) and max(q_lens) == 1
    tiling = tiling or (DECODE_TILING if decode_only else PREFILL_TILING)
    block_m = max(16, triton.next_power_of_2(rep * tiling.q_tokens))
    block_q = block_m // rep
    tiles = [(seq, first) for seq, n in enumerate(q_lens) for first in range(0, n, block_q)]
    splits = num_splits or _choose_splits(q_lens, max_k_len, kv_heads, torch.device(device))
    split_len = 0
    if splits > 1 and decode_only:
        split_len = triton.cdiv(triton.cdiv(max_k_len, splits), 16) * 16
        splits = triton.cdiv(max_k_len, split_len)
    else:
        splits = 1
    parts = len(q_lens) * num_heads * splits if splits > 1 else 1
    columns = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 2).T.contiguous().to(device)
    return AttentionPlan(block_m, block_q, tiling, columns[0], columns[1], len(q_lens), splits, split_len,
                         torch.empty(parts, triton.next_power_of_2(head_dim), dtype=torch.float32, device=device),
                         torch.empty(parts, dtype=torch.float32, device=device),
                         torch.empty(parts, dtype=torch.float32, device=device))


def fixed_plan(max_tokens: int, max_seqs: int, num_heads: int, kv_heads: int, head_dim: int,
               device: torch.device | str) -> AttentionPlan:
    """A plan for any batch of up to `max_tokens` query tokens over up to `max_seqs` sequences,
    prefill tiling, no splits: its tile list is as long as such a batch can need, and `fill_tiles`
    writes a step's tiles into it in place. A CUDA graph captured with it replays any such step;
    the tiles past the step's point at sequence `max_seqs`, which the caller keeps empty (no query
    token, one key), so they load one key and write nothing."""
    rep = num_heads // kv_heads
    block_m = max(16, triton.next_power_of_2(rep * PREFILL_TILING.q_tokens))
    block_q = block_m // rep
    tiles = max_tokens // block_q + max_seqs  # each sequence's tiles: its tokens / block_q, rounded up
    columns = torch.zeros(2, tiles, dtype=torch.int32, device=device)
    columns[0] = max_seqs
    dummy = torch.empty(1, dtype=torch.float32, device=device)
    return AttentionPlan(block_m, block_q, PREFILL_TILING, columns[0], columns[1], max_seqs + 1, 1, 0,
                         dummy.view(1, 1), dummy, dummy)


def fill_tiles(plan: AttentionPlan, q_lens: list[int]) -> None:
    """Write the tiles of a step with these query lengths into `plan` (from `fixed_plan`), the rest
    pointed at its empty sequence."""
    pad = plan.num_seqs - 1
    tiles = [(seq, first) for seq, n in enumerate(q_lens) for first in range(0, n, plan.block_q)]
    if len(tiles) > plan.num_tiles or len(q_lens) > pad:
        raise ValueError(f"{len(q_lens)} sequences in {len(tiles)} tiles do not fit a plan of {pad} sequences "
                         f"and {plan.num_tiles} tiles")
    columns = torch.tensor([[seq for seq, _ in tiles] + [pad] * (plan.num_tiles - len(tiles)),
                            [first for _, first in tiles] + [0] * (plan.num_tiles - len(tiles))], dtype=torch.int32)
    plan.tile_seq.copy_(columns[0])
    plan.tile_start.copy_(columns[1])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
                    softmax_scale: float, causal: bool = True, out: torch.Tensor | None = None,
                    num_splits: int | None = None, attention_plan: AttentionPlan | None = None) -> torch.Tensor:
    """Same contract as `kernels.reference.paged_attention`. Pass the step's `attention_plan`
    (see `plan`) to launch without reading anything back from the device; without one it is
    worked out here from the lengths (`num_splits` as in `plan`)."""
    total_q, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    rep = num_heads // kv_heads
    assert q.stride(-1) == k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty_like(q) if out is None else out
    if attention_plan is None:
        starts = cu_seqlens_q.tolist()
        q_lens = [b - a for a, b in zip(starts, starts[1:])]
        max_k_len = int(seqused_k.max()) if q_lens else 0
        attention_plan = plan(q_lens, max_k_len, num_heads, kv_heads, head_dim, q.device, num_splits)
    p = attention_plan
    if p.num_tiles == 0:
        return out
    split = p.splits > 1
    # Triton's CPU interpreter computes bf16/fp16 dot products wrongly (triton 3.9): there, and
    # only there, the operands are upcast to fp32 first.
    upcast = os.environ.get("TRITON_INTERPRET") == "1" and q.dtype != torch.float32
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    dim_p2 = triton.next_power_of_2(head_dim)
    _attention_kernel[(p.num_tiles, kv_heads, p.splits)](
        q, k_cache, v_cache, out, p.part_acc, p.part_max, p.part_sum,
        cu_seqlens_q, seqused_k, block_table, p.tile_seq, p.tile_start,
        softmax_scale, p.split_len,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        NUM_HEADS=num_heads, REP=rep, HEAD_DIM=head_dim, DIM_P2=dim_p2, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=p.block_m, BLOCK_Q=p.block_q, TILE_N=p.tiling.tile_n, CAUSAL=causal, SPLIT=split,
        PRECISION=precision, UPCAST=upcast, num_warps=p.tiling.num_warps, num_stages=p.tiling.num_stages)
    if split:
        _merge_splits_kernel[(p.num_seqs, num_heads)](
            out, p.part_acc, p.part_max, p.part_sum, cu_seqlens_q, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=p.splits, SPLITS_P2=triton.next_power_of_2(p.splits),
            HEAD_DIM=head_dim, DIM_P2=dim_p2)
    return out


def _choose_splits(q_lens: list[int], max_k_len: int, kv_heads: int, device: torch.device) -> int:
    """Flash-decoding pays off when a decode batch has too few (sequence, head) pairs to fill the
    GPU and long contexts to share out: aim for about two programs per multiprocessor."""
    if not q_lens or max(q_lens) != 1 or max_k_len < 512 or device.type != "cuda":
        return 1
    programs = len(q_lens) * kv_heads
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(2 * sms // programs, max_k_len // 256, 64))
