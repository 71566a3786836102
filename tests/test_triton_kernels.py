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
        llm = LLM(tiny_model_dir, num_gpu_blocks=64, num_cpu_blocks=64, max_num_batched_tokens=32)
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
