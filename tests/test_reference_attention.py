"""The torch reference ops (the CPU path, and later the Triton kernels' oracle) against plain
dense attention computed one sequence at a time."""
import pytest
import torch

from kernels.reference import copy_blocks, paged_attention, store_kv, swap_blocks


def dense_attention(q, k, v, scale, causal):
    """q: [q_len, heads, d]; k, v: [k_len, kv_heads, d]; bottom-right causal mask."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if causal:
        q_len, k_len = q.shape[0], k.shape[0]
        mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


def build(q_lens, k_lens, kv_heads, heads, head_dim, shared_blocks=0, block_size=16, seed=0, dtype=torch.float32):
    """Random contexts in a paged cache; sequences share their first `shared_blocks` blocks."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 4 + shared_blocks + sum(-(-k // block_size) for k in k_lens)
    cache = torch.randn(num_blocks, 2, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]  # layer 1 of 2: strided views, as in the engine
    free = torch.randperm(num_blocks, generator=gen).tolist()
    shared = [free.pop() for _ in range(shared_blocks)]
    tables = []
    for k_len in k_lens:
        n = -(-k_len // block_size)
        tables.append(shared[:n] + [free.pop() for _ in range(n - len(shared[:n]))])
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return q, k_cache, v_cache, cu, torch.tensor(k_lens, dtype=torch.int32), block_table, tables


def contiguous(cache, table, k_len, block_size=16):
    return cache[torch.tensor(table)].reshape(-1, *cache.shape[2:])[:k_len]


CASES = {
    "decodes": ([1] * 5, [1, 15, 16, 17, 100], 0),
    "decodes sharing a prompt": ([1] * 6, [40, 41, 64, 70, 90, 33], 2),
    "prefill after a prefix hit": ([7, 1, 20], [39, 50, 52], 2),
    "mixed prefill and decode": ([1, 5, 1, 64, 1], [16, 5, 200, 64, 17], 0),
    "long prefill": ([130, 1], [130, 300], 0),
    "one token": ([1], [1], 0),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (6, 2, 64), (8, 1, 128)])
def test_paged_attention_matches_dense(case, heads, kv_heads, head_dim):
    q_lens, k_lens, shared = CASES[case]
    q, k_cache, v_cache, cu, seqused, block_table, tables = build(q_lens, k_lens, kv_heads, heads, head_dim, shared)
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
