"""engine/worker/quantized/decode_attention.py: a batch of decoding sequences' attention in one
native call equals the torch reference (kernels/reference.py) over the same paged cache (blocks
out of order, a shared prefix, grouped query heads, contexts that end mid-block), and the engine
takes it for a natively served model's batch of decodes."""
from __future__ import annotations

import pytest
import torch

import kernels
from engine import LLM, SamplingParams
from engine.worker.models.llama import layer_kv
from engine.worker.quantized.decode_attention import DecodeAttention
from kernels import reference


@pytest.mark.parametrize("heads, kv_heads, block_size", [(6, 2, 4), (4, 4, 16), (9, 3, 16)])
def test_a_batch_of_decodes_attends_as_the_reference_does(heads, kv_heads, block_size):
    generator = torch.Generator().manual_seed(heads * block_size)
    dim, num_blocks, layers = 64, 40, 2
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
    attention = DecodeAttention.of(heads, kv_heads, dim, scale)
    assert attention is not None
    ours = attention(q, k_cache, v_cache, table, seqused_k)
    expected = reference.paged_attention(q, k_cache, v_cache, torch.arange(len(contexts) + 1, dtype=torch.int32),
                                         seqused_k, table, scale)
    assert ours.shape == (len(contexts), heads, dim)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_the_engine_takes_it_for_a_batch_of_decodes_and_greedy_replies_are_unchanged(embedded_gguf, monkeypatch):
    """The embedded SmolLM2 Q4_1 served natively: three chats decoding together go through the native
    attention, and their greedy replies are the torch attention's, token for token."""
    llm = LLM(embedded_gguf, quantization="native", num_gpu_blocks=128, num_cpu_blocks=8, compile_decode=False)
    model = llm.engine.core.runner.model
    assert isinstance(model.decode_attention, DecodeAttention)
    assert all(layer.input_norm.native is not None for layer in model.layers)  # RMSNorm.native
    calls = []
    native_call = DecodeAttention.__call__
    monkeypatch.setattr(DecodeAttention, "__call__", lambda self, q, *rest: calls.append(q.shape[0]) or native_call(self, q, *rest))
    plans = []
    plan_attention = kernels.plan_attention
    monkeypatch.setattr(kernels, "plan_attention", lambda **kw: plans.append(kw["q_lens"]) or plan_attention(**kw))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers."]
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert calls and max(calls) == 3  # a layer's call per step of the three decoding together
    assert plans and all(max(q_lens) > 1 for q_lens in plans)  # only prompt steps planned torch's attention
    assert model.attends_natively(3, 3) and not model.attends_natively(4, 3)
    native, model.decode_attention = model.decode_attention, None
    try:
        torch_attention = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        model.decode_attention = native
    assert ours == torch_attention and all(len(t) == 16 for t in ours)
