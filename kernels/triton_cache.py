"""Triton kernels for the KV cache's bookkeeping: writing new K/V at their slots, and copying
whole blocks for copy-on-write. Same contracts as `kernels.reference`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ct, stride_ch,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     HEADS_P2: tl.constexpr, DIM_P2: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding
        return
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, DIM_P2)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    dst = block * stride_cb + offset * stride_ct + heads * stride_ch + dims
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == value.stride(-1) == k_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share a layout"
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        HEADS_P2=triton.next_power_of_2(num_heads), DIM_P2=triton.next_power_of_2(head_dim))


@triton.jit
def _copy_blocks_kernel(cache_ptr, pairs_ptr, block_numel, CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    offsets = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < block_numel
    values = tl.load(cache_ptr + src * block_numel + offsets, mask=mask)
    tl.store(cache_ptr + dst * block_numel + offsets, values, mask=mask)


def copy_blocks(cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """`cache[dst] = cache[src]` for every (src, dst) row of `pairs`, in one launch."""
    if not pairs.numel():
        return
    assert cache.is_contiguous(), "the cache must be one contiguous tensor"
    block_numel = cache[0].numel()
    chunk = 1024
    pairs = pairs.to(device=cache.device, dtype=torch.int64).contiguous()
    _copy_blocks_kernel[(pairs.shape[0], triton.cdiv(block_numel, chunk))](cache, pairs, block_numel, CHUNK=chunk)
