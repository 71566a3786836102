"""engine/worker/quantized/row_attention.c (the attention of native_layers's layers): a batch of
decoding sequences' attention in one native call equals the torch reference (kernels/reference.py)
over the same paged cache (blocks out of order, a shared prefix, grouped query heads, contexts that
end mid-block)."""
from __future__ import annotations

import pytest
import torch

from engine.worker.kv_layout import layer_kv
from engine.worker.quantized import native
from kernels import reference


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seqused_k: torch.Tensor, num_kv_heads: int, scale: float) -> torch.Tensor:
    """row_attention.c's entry: q `[seqs, heads, dim]` (heads contiguous), a layer's caches as
    layer_kv gives them, int32 block table and contexts: the output `[seqs, heads, dim]`."""
    seqs, heads, dim = q.shape
    assert q.stride(2) == 1 and q.stride(1) == dim and block_table.stride(1) == 1
    out = torch.empty(seqs, heads, dim)
    native.library().row_attention(q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), k_cache.data_ptr(),
                                      v_cache.data_ptr(), block_table.data_ptr(), block_table.stride(0),
                                      seqused_k.data_ptr(), seqs, heads, num_kv_heads, dim, k_cache.shape[1],
                                      k_cache.stride(0), scale)
    return out


# blocks of 4 keys take the 8-wide loops; of 16 and 32, on AVX-512, the 16-key loops (head dims 64, 128)
@pytest.mark.parametrize("heads, kv_heads, block_size, dim", [(6, 2, 4, 64), (4, 4, 16, 64), (9, 3, 16, 64),
                                                              (32, 8, 32, 128), (7, 1, 16, 64)])
def test_a_batch_of_decodes_attends_as_the_reference_does(heads, kv_heads, block_size, dim):
    generator = torch.Generator().manual_seed(heads * block_size)
    num_blocks, layers = 40, 2
    contexts = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2, 7 * block_size]
    # the engine's cache ([blocks, layers, K/V, kv heads, block size, dim]); layer 1's views
    cache = torch.randn(num_blocks, layers, 2, kv_heads, block_size, dim, generator=generator)
    k_cache, v_cache = layer_kv(cache, 1)
    width = max(-(-c // block_size) for c in contexts)
    order = torch.randperm(num_blocks, generator=generator).int()
    shared = order[:2]  # the first two blocks shared by every sequence that reaches past them
    table = torch.zeros(len(contexts), width, dtype=torch.int32)
    for i in range(len(contexts)):
        table[i] = torch.cat([shared, order[2 + i * (width - 2):2 + (i + 1) * (width - 2)]])
    seqused_k = torch.tensor(contexts, dtype=torch.int32)
    # q as the forward has it: a view of the fused q/k/v rows, wider than the query heads
    qkv = torch.randn(len(contexts), (heads + 2 * kv_heads) * dim, generator=generator)
    q = qkv[:, :heads * dim].view(-1, heads, dim)
    scale = dim ** -0.5
    ours = decode_attention(q, k_cache, v_cache, table, seqused_k, kv_heads, scale)
    expected = reference.paged_attention(q, k_cache, v_cache, torch.arange(len(contexts) + 1, dtype=torch.int32),
                                         seqused_k, table, scale)
    assert ours.shape == (len(contexts), heads, dim)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
