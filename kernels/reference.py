"""Torch reference implementations of the paged-KV operations.

They are the CPU path of the engine and the oracle the Triton kernels are tested against.
Cache layout, shared by every op: one tensor `[num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim]`, so each block is one contiguous region across all layers (a swap
copies one region per block); per-layer K and V caches are the strided views
`cache[:, layer, 0]` and `cache[:, layer, 1]`, each `[num_blocks, block_size, num_kv_heads, head_dim]`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write `key`/`value` `[num_tokens, num_kv_heads, head_dim]` into the caches at
    `slot_mapping` (block * block_size + offset); slot -1 marks padding and is skipped."""
    block_size = k_cache.shape[1]
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
                    softmax_scale: float, causal: bool = True) -> torch.Tensor:
    """Attention for a varlen batch reading K/V through block tables (flash-attn's convention).

    q: `[total_q, num_heads, head_dim]`, sequence i's queries at `cu_seqlens_q[i]:cu_seqlens_q[i+1]`;
    its keys are the first `seqused_k[i]` tokens of the blocks `block_table[i]`. The causal mask
    is aligned bottom-right: the last query sees every key. `num_heads` is a multiple of
    `num_kv_heads` (grouped-query attention). Returns `[total_q, num_heads, head_dim]`.
    """
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    k_lens = seqused_k.tolist()
    decode = [i for i in range(len(k_lens)) if starts[i + 1] - starts[i] == 1]
    if decode:
        _decode_attention(q, k_cache, v_cache, starts, k_lens, block_table, softmax_scale, decode, out)
    for i in range(len(k_lens)):
        q_len = starts[i + 1] - starts[i]
        if q_len > 1:
            rows = slice(starts[i], starts[i + 1])
            out[rows] = _sequence_attention(q[rows], k_cache, v_cache, block_table[i], k_lens[i],
                                            softmax_scale, causal)
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens held by `blocks`: `[..., length, num_kv_heads, head_dim]`."""
    gathered = cache[blocks]  # [..., num_blocks, block_size, kv_heads, head_dim]
    shape = gathered.shape
    return gathered.reshape(*shape[:-4], shape[-4] * shape[-3], *shape[-2:])[..., :length, :, :]


def _sequence_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                        k_len: int, scale: float, causal: bool) -> torch.Tensor:
    num_blocks = -(-k_len // k_cache.shape[1])
    k = _gather(k_cache, blocks[:num_blocks], k_len).transpose(0, 1)  # [kv_heads, k_len, head_dim]
    v = _gather(v_cache, blocks[:num_blocks], k_len).transpose(0, 1)
    q_len = q.shape[0]
    mask = None
    if causal:
        # Query j sits at key position k_len - q_len + j and sees keys up to it.
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(0, 1)


def _decode_attention(q, k_cache, v_cache, starts, k_lens, block_table, scale, rows, out) -> None:
    """All one-query sequences at once, padded to the longest context and masked."""
    index = torch.tensor(rows, device=q.device)
    lens = torch.tensor([k_lens[i] for i in rows], device=q.device)
    max_len = int(lens.max())
    num_blocks = -(-max_len // k_cache.shape[1])
    tables = block_table[index, :num_blocks]
    k = _gather(k_cache, tables, max_len).transpose(1, 2)  # [rows, kv_heads, max_len, head_dim]
    v = _gather(v_cache, tables, max_len).transpose(1, 2)
    positions = [starts[i] for i in rows]
    qd = q[positions].unsqueeze(2)  # [rows, heads, 1, head_dim]
    mask = (torch.arange(max_len, device=q.device) < lens[:, None])[:, None, None, :]
    out[positions] = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale,
                                                    enable_gqa=True).squeeze(2)


def copy_blocks(cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy-on-write: `cache[dst] = cache[src]` for each row (src, dst) of `pairs` `[n, 2]`."""
    if pairs.numel():
        cache[pairs[:, 1]] = cache[pairs[:, 0]]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy whole blocks between pools: `dst[d] = src[s]` for each row (s, d) of `pairs`."""
    if pairs.numel():
        dst[pairs[:, 1].to(dst.device)] = src[pairs[:, 0].to(src.device)].to(dst.device, non_blocking=True)
