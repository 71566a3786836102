"""Attention with every new token a row of its own over the paged cache, in native code
(engine/worker/quantized/row_attention.c): the eager forward's attention on a CPU in float32.

A decode is one row over its sequence's keys; a prompt chunk's tokens are rows over the same
blocks, each with its own context (its position + 1: causal), their K/V stored before any row
attends. Each row reads its keys where they lie through its block table, and the softmax is taken
block by block, so nothing is gathered or padded: a step of 32 decodes beside a new chat's
25-token turn costs its rows' reads and no more. torch's ops spent several times that on the
same step (each sequence's blocks gathered into copies, the decodes padded to the chunk's length,
batched matmuls a few rows tall): on a 2-core Intel Xeon in fp32, a 32-chat step of SmolLM2 took
112 ms with this attention, 144 through the compiled flat step and 186 through torch's ops
(benchmarks/mixed_step.py).

A long chunk's rows each reread the chunk's past where a matmul reads it once for all of them:
steps with a sequence of more than MAX_QUERY new tokens take torch's attention.
"""
from __future__ import annotations

import ctypes

import torch

import kernels

MAX_QUERY = 128  # a sequence's new tokens in a step, at most, for this attention


class RowAttention:
    """The native attention for one model's shape; `of` gives None where it cannot run."""

    def __init__(self, lib: ctypes.CDLL, num_kv_heads: int) -> None:
        self._lib, self.num_kv_heads = lib, num_kv_heads

    @classmethod
    def of(cls, dtype: torch.dtype, device: torch.device, num_kv_heads: int) -> RowAttention | None:
        """The attention for a model computing in `dtype` on `device`: float32 on a CPU only (the
        kernel reads a float32 cache), only where the native library builds and loads, and not
        where PAGEDCHAT_KERNELS forces one backend for every attention."""
        if dtype != torch.float32 or device.type != "cpu" or kernels.forced_backend() is not None:
            return None
        from engine.worker.quantized import native

        lib = native.library()
        return None if lib is None else cls(lib, num_kv_heads)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 contexts: torch.Tensor, scale: float) -> torch.Tensor:
        """q `[rows, heads, head_dim]` (heads contiguous; rows may be strided); one layer's caches
        as `kv_layout.layer_kv` gives them; tables `[rows, max_blocks]` and contexts `[rows]`, int32: each
        row's blocks and keys (its own included, already stored). Returns `[rows, heads, head_dim]`."""
        rows, heads, dim = q.shape
        out = torch.empty(rows, heads, dim)
        self._lib.row_attention(q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), k_cache.data_ptr(),
                                   v_cache.data_ptr(), tables.data_ptr(), tables.stride(0), contexts.data_ptr(), rows,
                                   heads, self.num_kv_heads, dim, k_cache.shape[1], k_cache.stride(0), scale)
        return out


def row_inputs(q_lens: list[int], k_lens: list[int], block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's table and context for a step whose sequence i brings `q_lens[i]` tokens and
    ends at `k_lens[i]` keys, with `block_table` `[seqs, max_blocks]` int32."""
    if all(n == 1 for n in q_lens):
        return block_table, torch.tensor(k_lens, dtype=torch.int32)
    sequence = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    contexts = [k - q + 1 + j for q, k in zip(q_lens, k_lens) for j in range(q)]
    return block_table[sequence].contiguous(), torch.tensor(contexts, dtype=torch.int32)
