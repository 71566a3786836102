"""How the engine's paged KV cache is laid out, for every path that reads or writes it: one tensor
`[num_blocks, layers, 2, kv_heads, block_size, head_dim]`, K then V of each layer, head-major
inside a block (a head's keys of a block lie together, as the attention kernels stream them; see
kernels/reference.py)."""
from __future__ import annotations

import torch


def kv_cache_shape(num_blocks: int, num_layers: int, num_kv_heads: int, block_size: int,
                   head_dim: int) -> tuple[int, ...]:
    return (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)


def layer_kv(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V caches as the kernels take them, `[num_blocks, block_size, num_kv_heads,
    head_dim]` views of the engine's cache."""
    return kv_cache[:, layer, 0].transpose(1, 2), kv_cache[:, layer, 1].transpose(1, 2)
