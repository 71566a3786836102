"""The Triton kernels against the torch reference on fresh random inputs, under TRITON_INTERPRET=1
on a CPU (tests/conftest.py sets it when there is no GPU) or for real on a GPU. Outputs are
poisoned with NaN first, so an element a kernel fails to write fails the comparison."""
import zlib

import pytest
import torch

from kernels import reference
from paged_inputs import CASES, build

triton_attention = pytest.importorskip("kernels.triton_attention")
triton_cache = pytest.importorskip("kernels.triton_cache")
triton_layer_ops = pytest.importorskip("kernels.triton_layer_ops")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 keeps 8 significant bits: the reference rounds its probabilities to bf16 before the
# PV matmul and the kernel keeps them in fp32, so an output may land 2 ulps (2^-7 of itself) off.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
             torch.float16: dict(rtol=1e-2, atol=1e-2)}


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def poisoned(like):
    return torch.full_like(like, float("nan"))


# The interpreter pays ~25 ms a program and ~10 ms a key tile, and "long prefill" (a 130-token
# prompt beside a 300-token decode) was a third of this module. At half the length it still spans
# several query tiles at every GQA ratio, several key tiles and blocks, each ending part-full.
KERNEL_CASES = {**CASES, "long prefill": ([66, 1], [66, 150], 0)}
# A decode context long enough for 5 splits of 128 keys, the last one part-full, with a short
# sequence crossing into the second split by one key and another inside the first.
LONG_CONTEXT = [600, 47, 129]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (6, 2, 64), (8, 1, 128)])
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_paged_attention_equals_reference(case, heads, kv_heads, head_dim, dtype):
    q_lens, k_lens, shared = KERNEL_CASES[case]
    q, k_cache, v_cache, cu, seqused, table, _ = build(q_lens, k_lens, kv_heads, heads, head_dim, shared,
                                                       seed=zlib.crc32(case.encode()) % 1000, dtype=dtype)
    q, k_cache, v_cache, cu, seqused, table = on_device(q, k_cache, v_cache, cu, seqused, table)
    scale = head_dim ** -0.5
    want = reference.paged_attention(q, k_cache, v_cache, cu, seqused, table, scale)
    got = triton_attention.paged_attention(q, k_cache, v_cache, cu, seqused, table, scale, out=poisoned(q))
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_long_context_decodes_with_and_without_flash_decoding_splits(num_splits):
    q, k_cache, v_cache, cu, seqused, table, _ = build([1, 1, 1], LONG_CONTEXT, 3, 9, 64, seed=4)
    q, k_cache, v_cache, cu, seqused, table = on_device(q, k_cache, v_cache, cu, seqused, table)
    want = reference.paged_attention(q, k_cache, v_cache, cu, seqused, table, 0.125)
    got = triton_attention.paged_attention(q, k_cache, v_cache, cu, seqused, table, 0.125, out=poisoned(q),
                                           num_splits=num_splits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_store_kv_equals_reference_and_skips_padding():
    cache = poisoned(torch.empty(6, 2, 2, 16, 3, 64, device=DEVICE))
    expected = cache.clone()
    key, value = torch.randn(5, 3, 64, device=DEVICE), torch.randn(5, 3, 64, device=DEVICE)
    slots = torch.tensor([0, 17, -1, 95, 40], device=DEVICE)
    reference.store_kv(key, value, expected[:, 1, 0], expected[:, 1, 1], slots)
    triton_cache.store_kv(key, value, cache[:, 1, 0], cache[:, 1, 1], slots)
    torch.testing.assert_close(cache, expected, equal_nan=True)
    assert int(cache.isnan().logical_not().sum()) == 4 * 2 * 3 * 64  # four slots, K and V, nothing else


def test_copy_blocks_equals_reference():
    cache = torch.randn(8, 2, 2, 16, 3, 64, device=DEVICE)
    expected = cache.clone()
    pairs = torch.tensor([[1, 5], [2, 6], [1, 7]], device=DEVICE)
    reference.copy_blocks(expected, pairs)
    triton_cache.copy_blocks(cache, pairs)
    assert torch.equal(cache, expected)


def test_engine_outputs_with_triton_forced_equal_the_torch_path(tiny_model_dir, tokenizer, monkeypatch):
    from engine import LLM, SamplingParams
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in
               ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a land far away,"]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # Seeded forks over a few clear candidates: at temperature 1 the tiny random model's
    # distribution is nearly flat over 49k tokens, and float noise between the two attention
    # implementations (or two matmul kernels) picks a neighbouring token.
    forked = SamplingParams(n=2, temperature=0.7, top_k=8, seed=5, max_tokens=4, ignore_eos=True)

    calls = []
    launch = triton_attention.paged_attention
    monkeypatch.setattr(triton_attention, "paged_attention", lambda *a, **k: calls.append(1) or launch(*a, **k))

    def run(kernels):
        monkeypatch.setenv("PAGEDCHAT_KERNELS", kernels)
        # a host pool of 64 blocks: the default 1 GiB costs ~0.6 s of CPU to allocate
        # fp32: in 16 bits the two attentions' last-bit differences can move a sampled token
        llm = LLM(tiny_model_dir, num_gpu_blocks=64, num_cpu_blocks=64, max_num_batched_tokens=32, dtype="float32")
        outs = llm.generate(prompts, greedy) + llm.generate([prompts[2]], forked)
        return [[o.token_ids for o in out.outputs] for out in outs]

    with_triton = run("triton")
    assert calls, "the Triton kernels did not run"
    assert with_triton == run("torch")


@pytest.mark.parametrize("case", ["mixed", "decode_long"])
def test_a_step_plan_gives_the_same_result_without_reading_lengths_back(case, monkeypatch):
    """The plan is made once per step from host lengths; a layer's launch with it must not ask
    the device for cu_seqlens_q or seqused_k (a sync per layer, and no CUDA graph capture)."""
    q_lens, k_lens, shared = {"mixed": ([5, 1, 17, 1], [40, 33, 17, 130], 0),
                              "decode_long": ([1, 1, 1], LONG_CONTEXT, 0)}[case]
    q, k_cache, v_cache, cu, seqused, table, _ = build(q_lens, k_lens, 2, 8, 64, shared, seed=11)
    q, k_cache, v_cache, cu, seqused, table = on_device(q, k_cache, v_cache, cu, seqused, table)
    step_plan = triton_attention.plan(q_lens, max(k_lens), 8, 2, 64, q.device,
                                      num_splits=3 if case == "decode_long" else None)
    assert (step_plan.splits > 1) == (case == "decode_long")
    want = reference.paged_attention(q, k_cache, v_cache, cu, seqused, table, 0.125)
    for name in ("tolist", "item", "__int__", "max"):  # reading a length back now fails the test
        monkeypatch.setattr(torch.Tensor, name, lambda *a, name=name, **k: pytest.fail(f"Tensor.{name} during the launch"))
    got = triton_attention.paged_attention(q, k_cache, v_cache, cu, seqused, table, 0.125, out=poisoned(q),
                                           attention_plan=step_plan)
    monkeypatch.undo()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    again = triton_attention.paged_attention(q, k_cache, v_cache, cu, seqused, table, 0.125, out=poisoned(q),
                                             attention_plan=step_plan)  # the plan's buffers are reusable
    torch.testing.assert_close(again, want, rtol=1e-5, atol=1e-5)


def test_a_fixed_plan_refilled_per_step_gives_each_step_s_result():
    """One plan for any step up to its size (what a captured graph holds), its tiles refilled for
    each step: the tiles past the step's point at an empty sequence and change nothing."""
    plan = triton_attention.fixed_plan(48, 4, 8, 2, 64, DEVICE)
    for q_lens, k_lens in [([5, 1, 17, 1], [40, 33, 17, 130]), ([1, 1], [9, 70]), ([30], [45])]:
        q, k_cache, v_cache, cu, seqused, table, _ = build(q_lens, k_lens, 2, 8, 64, 0, seed=len(q_lens))
        pad = 4 + 1 - len(q_lens)  # the plan's sequence slots, the empty one last
        cu = torch.cat([cu, cu[-1:].repeat(pad)])
        seqused = torch.cat([seqused, torch.ones(pad, dtype=seqused.dtype)])
        table = torch.cat([table, torch.zeros(pad, table.shape[1], dtype=table.dtype)])
        q, k_cache, v_cache, cu, seqused, table = on_device(q, k_cache, v_cache, cu, seqused, table)
        want = reference.paged_attention(q, k_cache, v_cache, cu, seqused, table, 0.125)
        triton_attention.fill_tiles(plan, q_lens)
        got = triton_attention.paged_attention(q, k_cache, v_cache, cu, seqused, table, 0.125, out=poisoned(q),
                                               attention_plan=plan)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        triton_attention.fill_tiles(plan, [1] * 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_equals_the_add_and_the_norm(dtype):
    from engine.worker.models.layers.rms_norm import RMSNorm
    x, residual = torch.randn(5, 96, dtype=dtype, device=DEVICE), torch.randn(5, 96, dtype=dtype, device=DEVICE)
    weight = (1 + 0.1 * torch.randn(96)).to(dtype).to(DEVICE)
    norm = RMSNorm(weight, 1e-6)
    summed = x + residual
    out, stream = triton_layer_ops.add_rms_norm(x, residual.clone(), weight, 1e-6)
    # The residual stream rounded as torch's add; within an ulp in bf16, whose rounding Triton's
    # CPU interpreter does not do as a GPU does.
    ulp = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(stream, summed, **ulp)
    close = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)  # an ulp
    torch.testing.assert_close(out, norm(stream), **close)
    first, same = triton_layer_ops.add_rms_norm(x, None, weight, 1e-6)
    assert same is x
    torch.testing.assert_close(first, norm(x), **close)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_rotates_q_and_k_and_writes_k_and_v_at_their_slots(dtype):
    from engine.worker.models.layers.rotary import rotate
    heads, kv_heads, dim, block = 4, 2, 32, 16
    tokens = 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, device=DEVICE)
    angles = torch.randn(40, 2, dim, dtype=dtype, device=DEVICE)
    positions = torch.tensor([0, 7, 39, 3, 12], device=DEVICE)
    slots = torch.tensor([5, -1, 40, 17, 63], device=DEVICE)
    cache = poisoned(torch.empty(4, 2, 2, kv_heads, block, dim, dtype=dtype, device=DEVICE))
    k_cache, v_cache = cache[:, 1, 0].transpose(1, 2), cache[:, 1, 1].transpose(1, 2)
    want = qkv.clone()
    qk = want[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    cos_sin = angles[positions]
    rotate(qk, cos_sin[:, None, 0], cos_sin[:, None, 1], out=qk)
    expected = cache.clone()
    reference.store_kv(qk[:, heads:], want[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim),
                       expected[:, 1, 0].transpose(1, 2), expected[:, 1, 1].transpose(1, 2), slots)
    triton_layer_ops.rotary_store(qkv, positions, angles, k_cache, v_cache, slots, heads, kv_heads, dim)
    close = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2 ** -6)
    torch.testing.assert_close(qkv, want, **close)
    torch.testing.assert_close(cache, expected, equal_nan=True, **close)
    assert int(cache.isnan().logical_not().sum()) == 4 * 2 * kv_heads * dim  # four slots, K and V, nothing else


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_equals_silu_times_up(dtype):
    from engine.worker.models.layers.activation import silu_and_mul
    gate_up = 3 * torch.randn(6, 2 * 1100, dtype=dtype, device=DEVICE)  # two column blocks, the second part-full
    gate, up = gate_up.chunk(2, dim=-1)
    want = silu_and_mul(gate.clone(), up)
    got = triton_layer_ops.silu_and_mul(gate_up)
    # within two ulps in bf16 (two roundings, which the CPU interpreter does not do as a GPU does)
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 2 ** -6, atol=1e-5)
