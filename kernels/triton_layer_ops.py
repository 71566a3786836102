"""The decoder layer's small steps, each one Triton kernel, for a step on a GPU.

In torch's ops a layer of a small model's decode step is ~20 kernels, of which four are weight
matmuls and one attention: the rest are RMSNorm (written as a layer norm of [x, -x], with the cat
and the negation), residual adds, rotary embeddings (a flip, two products and a sum) and SiLU·up,
each a launch that reads and writes a few KiB. A 1B Llama's 32-chat decode step on an H200 spent
about a third of its device time in them. Here they are three kernels:
- `add_rms_norm`: the residual add and the next RMSNorm, one pass over each row;
- `rotary_store`: q and k rotated in place, and k and v written to their cache slots;
- `silu_and_mul`: the MLP's gate.
Each rounds where torch's ops round (after each product and sum in the model's dtype; RMSNorm
once, after the weight), so a step gives the torch path's numbers up to the order of a sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the residual stream, rounded as torch's add
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x), the sum written into `residual` in place; with no
    residual, (RMSNorm(x), x). Rows `[tokens, hidden]`, each contiguous."""
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    rows, cols = x.shape
    out = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(cols)
        _add_rms_norm_kernel[(rows,)](x, x if residual is None else residual, weight, out, x.stride(0),
                                      x.stride(0) if residual is None else residual.stride(0), out.stride(0),
                                      cols, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
                                      num_warps=max(1, min(8, block // 256)))
    return out, (x if residual is None else residual)


@triton.jit
def _rotary_store_kernel(qkv_ptr, positions_ptr, table_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                         stride_t, stride_p, stride_cs, stride_cb, stride_ct, stride_ch,
                         NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HALF_P2: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HALF_P2)
    mask = dims < half
    row = qkv_ptr + token * stride_t + head * HEAD_DIM
    x1 = tl.load(row + dims, mask=mask, other=0.0)
    x2 = tl.load(row + half + dims, mask=mask, other=0.0)
    dtype = x1.dtype
    angles = table_ptr + tl.load(positions_ptr + token).to(tl.int64) * stride_p
    c1 = tl.load(angles + dims, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(angles + half + dims, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(angles + stride_cs + dims, mask=mask, other=0.0).to(tl.float32)  # the signed sin: [-sin, sin]
    s2 = tl.load(angles + stride_cs + half + dims, mask=mask, other=0.0).to(tl.float32)
    # x·cos + [x2, x1]·signed_sin, each product rounded to the dtype, then the sum (layers/rotary.py)
    a1 = (x1.to(tl.float32) * c1).to(dtype).to(tl.float32)
    b1 = (x2.to(tl.float32) * s1).to(dtype).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(dtype).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2).to(dtype).to(tl.float32)
    y1 = (a1 + b1).to(dtype)
    y2 = (a2 + b2).to(dtype)
    tl.store(row + dims, y1, mask=mask)
    tl.store(row + half + dims, y2, mask=mask)
    if head >= NUM_HEADS:  # a K head: it and its V go to the token's cache slot
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:  # -1: padding, written nowhere
            kv_head = head - NUM_HEADS
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
            tl.store(k_cache_ptr + dst + dims, y1, mask=mask)
            tl.store(k_cache_ptr + dst + half + dims, y2, mask=mask)
            full = tl.arange(0, DIM_P2)
            v = tl.load(row + KV_HEADS * HEAD_DIM + full, mask=full < HEAD_DIM)
            tl.store(v_cache_ptr + dst + full, v, mask=full < HEAD_DIM)


def rotary_store(qkv: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, kv_heads: int,
                 head_dim: int) -> None:
    """Rotate the q and k heads of `qkv` (`[tokens, (num_heads + 2 kv_heads) * head_dim]`, q then k
    then v) in place by their tokens' `positions` (`table`: `[length, 2, head_dim]`, cos and signed
    sin, layers/rotary.py), and write each token's k and v at its `slot_mapping` slot (-1: not
    written) of the `[num_blocks, block_size, kv_heads, head_dim]` caches."""
    tokens = qkv.shape[0]
    assert qkv.stride(-1) == 1 and table.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share a layout"
    if tokens:
        _rotary_store_kernel[(tokens, num_heads + kv_heads)](
            qkv, positions, table, k_cache, v_cache, slot_mapping,
            qkv.stride(0), table.stride(0), table.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_HEADS=num_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
            HALF_P2=triton.next_power_of_2(head_dim // 2), DIM_P2=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=k_cache.shape[1], num_warps=1)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_g, stride_o, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * stride_g + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_g + width + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded, as torch's silu before the product
    tl.store(out_ptr + row * stride_o + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up of `gate_up` (`[tokens, 2 * width]`, gate then up): `[tokens, width]`."""
    assert gate_up.stride(-1) == 1
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                               width, BLOCK=block, num_warps=4)
    return out
