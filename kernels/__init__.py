"""Paged-KV operations: Triton kernels when the cache lives on CUDA, the torch reference otherwise.

`PAGEDCHAT_KERNELS=triton` or `=torch` forces one (Triton on the CPU needs TRITON_INTERPRET=1,
set before triton is imported: the tests do this). The engine calls these names only.
"""
from __future__ import annotations

import os

import torch

from kernels import reference

BACKENDS = ("triton", "torch")


def forced_backend() -> str | None:
    """The backend PAGEDCHAT_KERNELS forces for every attention and cache store, if any."""
    forced = os.environ.get("PAGEDCHAT_KERNELS", "").strip().lower()
    if forced and forced not in BACKENDS:
        raise ValueError(f"PAGEDCHAT_KERNELS must be one of {BACKENDS}, got {forced!r}")
    return forced or None


def backend(tensor: torch.Tensor) -> str:
    return forced_backend() or ("triton" if tensor.is_cuda else "torch")


def store_kv(key, value, k_cache, v_cache, slot_mapping, slot_index=None) -> None:
    """`slot_index`: the torch path's (blocks, offsets) of the slots, made once per step
    (`slot_index(...)`); the Triton kernel reads `slot_mapping` itself."""
    if backend(k_cache) == "triton":
        from kernels import triton_cache
        return triton_cache.store_kv(key, value, k_cache, v_cache, slot_mapping)
    return reference.store_kv(key, value, k_cache, v_cache, slot_mapping, slot_index)


def slot_index(slot_mapping: torch.Tensor, block_size: int, cache: torch.Tensor):
    """What the torch path's `store_kv` wants beside the slots (no padding), built once per step
    (None for the Triton path, which reads the slots on the device)."""
    if backend(cache) == "triton":
        return None
    return reference.slot_index(slot_mapping, block_size)


def plan_attention(q_lens: list[int], k_lens: list[int], num_heads: int, kv_heads: int, head_dim: int,
                   cache: torch.Tensor, num_splits: int | None = None, block_table: torch.Tensor | None = None,
                   block_size: int | None = None, previous: object | None = None):
    """The step's attention plan, shared by every layer, built on the host from the lengths
    instead of in every layer: the Triton path's tiling (`num_splits` fixes flash-decoding's
    split count; None: from the shape), or the torch path's rows, gathers and masks (which need
    the step's `block_table` and `block_size`; without them, None and each call plans for itself).
    `previous`: the last step's plan, unless blocks were swapped or copied since (the torch path
    lets a lone decoding sequence keep its gathered K/V from it)."""
    if backend(cache) != "triton":
        if block_table is None or block_size is None:
            return None
        cu_q = [0]
        for n in q_lens:
            cu_q.append(cu_q[-1] + n)
        return reference.plan(cu_q, k_lens, block_table, block_size, num_heads, kv_heads, cache.dtype,
                              previous=previous if isinstance(previous, reference.AttentionPlan) else None)
    from kernels import triton_attention
    return triton_attention.plan(q_lens, max(k_lens, default=0), num_heads, kv_heads, head_dim, cache.device,
                                 num_splits)


def fixed_plan_attention(max_tokens: int, max_seqs: int, num_heads: int, kv_heads: int, head_dim: int,
                         cache: torch.Tensor):
    """The Triton path's plan for any step of up to `max_tokens` tokens over `max_seqs` sequences,
    refilled for each step by `fill_plan` (what a CUDA graph of such steps captures); None for the
    torch path, which plans on the host in every call."""
    if backend(cache) != "triton":
        return None
    from kernels import triton_attention
    return triton_attention.fixed_plan(max_tokens, max_seqs, num_heads, kv_heads, head_dim, cache.device)


def fill_plan(plan, q_lens: list[int]) -> None:
    """Fill a `fixed_plan_attention` plan (None: nothing to fill) for a step with these query lengths."""
    if plan is not None:
        from kernels import triton_attention
        triton_attention.fill_tiles(plan, q_lens)


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal=True,
                    out=None, attention_plan=None) -> torch.Tensor:
    if backend(k_cache) == "triton":
        from kernels import triton_attention
        return triton_attention.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table,
                                                softmax_scale, causal, out, attention_plan=attention_plan)
    return reference.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, softmax_scale,
                                     causal, out, attention_plan=attention_plan)


def fuses_layer_ops(cache: torch.Tensor) -> bool:
    """Whether a step over this cache runs the decoder layer's small steps (residual add and
    RMSNorm, rotary and cache store, SiLU·up) as the fused kernels below: the Triton path's."""
    return backend(cache) == "triton"


def add_rms_norm(x, residual, weight, eps):
    from kernels import triton_layer_ops
    return triton_layer_ops.add_rms_norm(x, residual, weight, eps)


def rotary_store(qkv, positions, table, k_cache, v_cache, slot_mapping, num_heads, kv_heads, head_dim) -> None:
    from kernels import triton_layer_ops
    triton_layer_ops.rotary_store(qkv, positions, table, k_cache, v_cache, slot_mapping, num_heads, kv_heads,
                                  head_dim)


def silu_and_mul(gate_up):
    from kernels import triton_layer_ops
    return triton_layer_ops.silu_and_mul(gate_up)


def copy_blocks(cache, pairs) -> None:
    if backend(cache) == "triton":
        from kernels import triton_cache
        return triton_cache.copy_blocks(cache, pairs)
    return reference.copy_blocks(cache, pairs)


swap_blocks = reference.swap_blocks

__all__ = ["add_rms_norm", "backend", "copy_blocks", "fill_plan", "fixed_plan_attention", "fuses_layer_ops",
           "paged_attention", "plan_attention", "rotary_store", "silu_and_mul", "slot_index", "store_kv", "swap_blocks"]
