"""Random paged-attention inputs and a dense oracle, shared by the reference and Triton tests."""
import torch


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


LAYOUTS = ("head-major", "token-major", "separate")


def build(q_lens, k_lens, kv_heads, heads, head_dim, shared_blocks=0, block_size=16, seed=0, dtype=torch.float32,
          layout="head-major"):
    """Random contexts in a paged cache; sequences share their first `shared_blocks` blocks.
    `layout`: the engine's cache (one tensor, head-major blocks; the K and V caches are layer 1's
    strided views), the same with token-major blocks, or K and V in tensors of their own."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 4 + shared_blocks + sum(-(-k // block_size) for k in k_lens)
    if layout == "head-major":
        cache = torch.randn(num_blocks, 2, 2, kv_heads, block_size, head_dim, generator=gen).to(dtype)
        k_cache, v_cache = cache[:, 1, 0].transpose(1, 2), cache[:, 1, 1].transpose(1, 2)
    elif layout == "token-major":
        cache = torch.randn(num_blocks, 2, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    else:
        k_cache, v_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        k_cache, v_cache = k_cache.clone(), v_cache.clone()
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
