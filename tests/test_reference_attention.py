"""The torch reference ops (the CPU path, and later the Triton kernels' oracle) against plain
dense attention computed one sequence at a time."""
import pytest
import torch

from kernels.reference import copy_blocks, paged_attention, store_kv, swap_blocks
from paged_inputs import CASES, LAYOUTS, build, contiguous, dense_attention


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (6, 2, 64), (8, 1, 128)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_attention_matches_dense(case, heads, kv_heads, head_dim, layout):
    q_lens, k_lens, shared = CASES[case]
    q, k_cache, v_cache, cu, seqused, block_table, tables = build(q_lens, k_lens, kv_heads, heads, head_dim, shared,
                                                                  layout=layout)
    scale = head_dim ** -0.5
    out = paged_attention(q, k_cache, v_cache, cu, seqused, block_table, scale)
    for i, (q_len, k_len) in enumerate(zip(q_lens, k_lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        want = dense_attention(q[rows], contiguous(k_cache, tables[i], k_len), contiguous(v_cache, tables[i], k_len),
                               scale, causal=True)
        torch.testing.assert_close(out[rows].double(), want, rtol=1e-5, atol=1e-5)


def test_bf16_matches_dense_loosely():
    q_lens, k_lens, shared = CASES["decodes sharing a prompt"]
    q, k_cache, v_cache, cu, seqused, block_table, tables = build(q_lens, k_lens, 2, 6, 64, shared, dtype=torch.bfloat16)
    out = paged_attention(q, k_cache, v_cache, cu, seqused, block_table, 0.125)
    for i, k_len in enumerate(k_lens):
        want = dense_attention(q[i:i + 1], contiguous(k_cache, tables[i], k_len), contiguous(v_cache, tables[i], k_len),
                               0.125, causal=True)
        torch.testing.assert_close(out[i:i + 1].double(), want, rtol=2e-2, atol=2e-2)


def test_store_kv_writes_slots_and_skips_padding():
    cache = torch.zeros(4, 2, 2, 4, 2, 8)
    k_cache, v_cache = cache[:, 0, 0], cache[:, 0, 1]
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    store_kv(key, value, k_cache, v_cache, torch.tensor([5, -1, 14]))
    assert torch.equal(k_cache[1, 1], key[0]) and torch.equal(v_cache[3, 2], value[2])
    assert int((cache != 0).sum()) == 2 * 2 * 2 * 8  # two slots, K and V, nothing else (layer 1 untouched)


def test_block_copies_and_swaps_move_whole_blocks_across_layers():
    device = torch.randn(6, 3, 2, 4, 2, 8)
    host = torch.zeros(4, 3, 2, 4, 2, 8)
    swap_blocks(device, host, torch.tensor([[5, 0], [2, 3]]))
    assert torch.equal(host[0], device[5]) and torch.equal(host[3], device[2]) and not host[1].any()
    copy_blocks(device, torch.tensor([[1, 4]]))
    assert torch.equal(device[4], device[1])
    fresh = torch.zeros_like(device)
    swap_blocks(host, fresh, torch.tensor([[3, 1]]))
    assert torch.equal(fresh[1], device[2])


def test_swaps_copy_runs_of_consecutive_blocks_at_once():
    from kernels.reference import contiguous_runs
    assert contiguous_runs([[4, 0], [5, 1], [6, 2], [9, 3], [10, 7], [11, 8]]) == [(4, 0, 3), (9, 3, 1), (10, 7, 2)]
    assert contiguous_runs([]) == []
