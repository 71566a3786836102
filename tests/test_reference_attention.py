"""The torch reference ops (the CPU path, and later the Triton kernels' oracle) against plain
dense attention computed one sequence at a time."""
import pytest
import torch

from kernels import reference
from kernels.reference import copy_blocks, paged_attention, plan, store_kv, swap_blocks
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_store_kv_from_the_qkv_projection_writes_k_and_v(layout):
    """The engine's new k and v are neighbouring column ranges of one qkv output; in its cache
    layout both land in one write (`paired`), elsewhere in two: the same slots either way."""
    _, k_cache, v_cache, *_ = build([1], [1], kv_heads=2, heads=4, head_dim=8, layout=layout)
    qkv = torch.randn(3, (4 + 2 + 2) * 8)
    key, value = qkv[:, 32:48].view(3, 2, 8), qkv[:, 48:].view(3, 2, 8)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, torch.tensor([0, 17, 31]))
    for slot, row in zip([0, 17, 31], range(3)):
        block, offset = divmod(slot, 16)
        assert torch.equal(k_cache[block, offset], key[row]) and torch.equal(v_cache[block, offset], value[row])
        k_before[block, offset], v_before[block, offset] = key[row], value[row]
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)  # nothing else written


def test_paired_views_only_tensors_a_fixed_distance_apart():
    from kernels.reference import paired
    qkv = torch.randn(3, 40)
    both = paired(qkv[:, 8:16], qkv[:, 16:24], 1)
    assert both.shape == (3, 2, 8) and torch.equal(both[:, 1], qkv[:, 16:24])
    assert paired(qkv[:, 16:24], qkv[:, 8:16], 1) is None          # second before first
    assert paired(qkv[:, 8:16], qkv[:, 16:20], 1) is None          # shapes differ
    assert paired(qkv[:, 8:16], torch.randn(3, 8), 1) is None      # another tensor


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


def lone_decode_plan(k_len, block_table, previous=None):
    return plan([0, 1], [k_len], block_table[:, :-(-k_len // 16)], 16, 6, 2, torch.float32, previous=previous)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_lone_decoding_sequence_keeps_its_kv_from_step_to_step(layout, monkeypatch):
    """Step after step, one sequence decoding alone reads the K/V it kept from the last step plus
    the token stored this step, and gets exactly what a fresh gather of its whole context gives:
    across block boundaries, and when its buffer has to grow (small steps here) or the context
    outgrows what is kept at all."""
    monkeypatch.setattr(reference, "KEPT_STEP", 16)
    monkeypatch.setattr(reference, "MAX_KEPT", 80)
    _, k_cache, v_cache, _, _, block_table, tables = build([1], [100], kv_heads=2, heads=6, head_dim=8, layout=layout)
    gen = torch.Generator().manual_seed(1)
    previous = None
    for k_len in range(30, 100):
        block, offset = divmod(k_len - 1, 16)  # this step's token, stored before attention reads it
        k_cache[tables[0][block], offset] = torch.randn(2, 8, generator=gen)
        v_cache[tables[0][block], offset] = torch.randn(2, 8, generator=gen)
        q = torch.randn(1, 6, 8, generator=gen)
        args = (q, k_cache, v_cache, torch.tensor([0, 1]), torch.tensor([k_len]), block_table[:, :-(-k_len // 16)], 0.3)
        step = lone_decode_plan(k_len, block_table, previous)
        kept = paged_attention(*args, attention_plan=step)
        fresh = paged_attention(*args, attention_plan=lone_decode_plan(k_len, block_table))
        assert torch.equal(kept, fresh), k_len
        if k_len > 80:
            assert step.short.lone is None  # beyond MAX_KEPT: gathered every step
        elif previous is not None:
            assert step.short.lone.layers is previous.short.lone.layers  # carried on, not started again
        previous = step
    want = dense_attention(q, contiguous(k_cache, tables[0], 99), contiguous(v_cache, tables[0], 99), 0.3, causal=True)
    torch.testing.assert_close(kept.double(), want, rtol=1e-5, atol=1e-5)


def test_kept_kv_is_not_carried_to_another_sequence_or_a_skipped_step():
    _, k_cache, v_cache, _, _, block_table, _ = build([1, 1], [60, 60], kv_heads=2, heads=6, head_dim=8)
    q = torch.randn(1, 6, 8)
    first = lone_decode_plan(40, block_table[:1])
    paged_attention(q, k_cache, v_cache, None, None, None, 0.3, attention_plan=first)
    assert first.short.lone.layers  # this layer's K/V kept
    other_sequence = lone_decode_plan(41, block_table[1:], previous=first)
    skipped_a_step = lone_decode_plan(42, block_table[:1], previous=first)
    assert other_sequence.short.lone.layers is not first.short.lone.layers
    assert skipped_a_step.short.lone.layers is not first.short.lone.layers
    for step, rows in ((other_sequence, block_table[1:]), (skipped_a_step, block_table[:1])):
        k_len = step.short.alone
        fresh = lone_decode_plan(k_len, rows)
        args = (q, k_cache, v_cache, None, None, None, 0.3)
        assert torch.equal(paged_attention(*args, attention_plan=step), paged_attention(*args, attention_plan=fresh))
