"""A batch of decoding sequences' attention in one native call (decode_attention.c).

On a CPU, torch's attention for a batch of decodes is a dozen small ops a layer (kernels/
reference.py), whose dispatch and copies cost far more than the arithmetic: 31% of a 32-chat step
of the embedded SmolLM2 served natively. `DecodeAttention` reads each sequence's keys in place
through its block table instead. It serves the models `LoneDecode` serves (float32 on a CPU, every
layer matrix quantized), for steps whose every sequence computes one token.
"""
from __future__ import annotations

import ctypes

import torch

from engine.worker.quantized import native


class DecodeAttention:
    def __init__(self, lib: ctypes.CDLL, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self._lib, self.num_heads, self.num_kv_heads, self.head_dim, self.scale = lib, num_heads, num_kv_heads, head_dim, scale

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> DecodeAttention | None:
        lib = native.library()
        return None if lib is None or num_heads % num_kv_heads else cls(lib, num_heads, num_kv_heads, head_dim, scale)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seqused_k: torch.Tensor) -> torch.Tensor:
        """q `[num_seqs, num_heads, head_dim]` float32 (sequence i's one query token in row i, its
        heads contiguous), one layer's K and V caches as `layer_kv` gives them (`[num_blocks,
        block_size, num_kv_heads, head_dim]` views of the engine's head-major cache), the
        sequences' `block_table` `[num_seqs, max_blocks]` and `seqused_k` `[num_seqs]` (int32,
        their keys, this token's included): the attention output, `[num_seqs, num_heads, head_dim]`."""
        seqs = q.shape[0]
        assert q.dtype == k_cache.dtype == torch.float32 and q.stride(2) == 1 and q.stride(1) == self.head_dim
        assert block_table.dtype == seqused_k.dtype == torch.int32 and block_table.stride(1) == 1
        out = torch.empty(seqs, self.num_heads, self.head_dim)
        seqused_k = seqused_k.contiguous()
        block_size = k_cache.shape[1]
        self._lib.decode_attention(q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), k_cache.data_ptr(),
                                   v_cache.data_ptr(), block_table.data_ptr(), block_table.stride(0),
                                   seqused_k.data_ptr(), seqs, self.num_heads, self.num_kv_heads, self.head_dim,
                                   block_size, k_cache.stride(0), self.scale)
        return out
