"""engine/worker/quantized/lone_decode.py: a lone token through every layer in one native call
computes what the eager forward computes over the same quantized weights, reading and writing the
same paged cache; models it cannot serve keep the eager forward."""
from __future__ import annotations

import pytest
import torch
from gguf.quants import quantize

from engine import LLM, SamplingParams
from engine.worker.gguf_file import load_model
from engine.worker.models.llama import AttentionMetadata, LlamaModel
from engine.worker.quantized.lone_decode import LoneDecode
from tests.test_gguf_file import T, tiny_llama_tensors, write_gguf

BLOCK_SIZE = 4
# Every layer matrix kept quantized, in three formats (the tiny model's rows are 64 or 128 wide:
# too short for the K-quants' 256).
FORMATS = {"attn_q": T.Q8_0, "attn_k": T.Q4_1, "attn_v": T.Q8_0, "attn_output": T.Q4_0, "ffn_gate": T.Q4_1,
           "ffn_up": T.Q4_1, "ffn_down": T.Q8_0}


@pytest.fixture(scope="module")
def all_quantized_gguf(tmp_path_factory, tiny_hf) -> str:
    tensors = []
    for name, array, qtype in tiny_llama_tensors(tiny_hf):
        kind = name.split(".")[-2]
        if kind in FORMATS:
            dense = array if qtype == T.F32 else None
            if dense is None:  # tiny_llama_tensors quantized it to Q8_0: take the HF weights' float copy back
                from gguf.quants import dequantize
                dense = dequantize(array, qtype)
            array, qtype = quantize(dense, FORMATS[kind]), FORMATS[kind]
        tensors.append((name, array, qtype))
    return write_gguf(tmp_path_factory.mktemp("lone") / "tiny-all-quantized.gguf", "llama", tensors, file_type=7)


def native_model(path: str, config) -> LlamaModel:
    return LlamaModel(load_model(path, config, torch.float32, quantized=True), torch.float32, torch.device("cpu"))


def dequantized_model(path: str, config) -> LlamaModel:
    return LlamaModel(load_model(path, config, torch.float32), torch.float32, torch.device("cpu"))


def decode_logits(model: LlamaModel, ids: list[int], prompt: int, lone: LoneDecode | None) -> torch.Tensor:
    """Logits of ids[prompt:] one token at a time after a prefill of ids[:prompt], over a paged
    cache whose blocks are out of order, with `lone` as the model's lone-token path."""
    model.lone_decode = lone
    blocks = -(-len(ids) // BLOCK_SIZE)
    cache = torch.zeros(model.kv_cache_shape(2 * blocks + 1, BLOCK_SIZE))
    table = torch.randperm(2 * blocks + 1, generator=torch.Generator().manual_seed(1))[:blocks].int()[None]
    slots = [int(table[0, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(len(ids))]
    model.rotary.ensure(len(ids))

    def step(start: int, end: int) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots[start:end]),
                                 cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
                                 seqused_k=torch.tensor([end], dtype=torch.int32), block_table=table)
        return model.forward(torch.tensor(ids[start:end]), torch.arange(start, end), cache, meta,
                             torch.tensor([end - start - 1]))

    step(0, prompt)
    return torch.cat([step(p, p + 1) for p in range(prompt, len(ids))])


def test_a_lone_token_through_the_native_layers_is_the_eager_forward(all_quantized_gguf, tiny_hf):
    model = native_model(all_quantized_gguf, tiny_hf.config)
    lone = model.lone_decode
    assert isinstance(lone, LoneDecode)
    assert model.runs_lone_natively(1) and not model.runs_lone_natively(2)
    ids = torch.randint(0, tiny_hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    ours, eager = decode_logits(model, ids, 7, lone), decode_logits(model, ids, 7, None)
    assert ours.shape == (33, tiny_hf.config.vocab_size)
    assert torch.equal(ours.argmax(-1), eager.argmax(-1))
    # Both paths round the activations to two int8 levels before each matmul, and a float summed in
    # another order can round to the other side: so each is held to the file's dequantized weights
    # (the exact product), and the native path must be as close to them as eager is.
    exact = decode_logits(dequantized_model(all_quantized_gguf, tiny_hf.config), ids, 7, None)
    ours_error, eager_error = float((ours - exact).abs().max()), float((eager - exact).abs().max())
    assert ours_error < 1e-3 * float(exact.abs().max()) and ours_error < 2 * eager_error


def test_a_qkv_bias_is_added_before_the_rotation(all_quantized_gguf, tiny_hf):
    """Qwen2's q/k/v projections have a bias."""
    model = native_model(all_quantized_gguf, tiny_hf.config)
    generator = torch.Generator().manual_seed(3)
    for layer in model.layers:
        layer.qkv.bias = 0.5 * torch.randn(layer.qkv.out_features, generator=generator)
    lone = LoneDecode.of(model)  # takes the biases as it is made
    ids = torch.randint(0, tiny_hf.config.vocab_size, (24,), generator=generator).tolist()
    ours, eager = decode_logits(model, ids, 5, lone), decode_logits(model, ids, 5, None)
    without_bias = decode_logits(native_model(all_quantized_gguf, tiny_hf.config), ids, 5, None)
    assert torch.equal(ours.argmax(-1), eager.argmax(-1))
    assert float((ours - eager).abs().max()) < 1e-3 * float(eager.abs().max())
    assert float((ours - without_bias).abs().max()) > 0.05 * float(eager.abs().max())  # the bias counted


def test_models_it_cannot_serve_keep_the_eager_forward(all_quantized_gguf, tiny_hf, tmp_path):
    # q/k/v kept dense: not every layer matrix is quantized
    partly = write_gguf(tmp_path / "partly.gguf", "llama", tiny_llama_tensors(tiny_hf), file_type=7)
    assert native_model(partly, tiny_hf.config).lone_decode is None
    dequantized = dequantized_model(all_quantized_gguf, tiny_hf.config)
    assert dequantized.lone_decode is None and not dequantized.runs_lone_natively(1)
    in_bf16 = LlamaModel(load_model(all_quantized_gguf, tiny_hf.config, torch.bfloat16, quantized=True),
                         torch.bfloat16, torch.device("cpu"))
    assert in_bf16.lone_decode is None


def test_the_engine_decodes_a_lone_chat_natively_and_greedy_replies_match_the_eager_forward(embedded_gguf):
    """The embedded SmolLM2 Q4_1 through the engine: the lone chat's steps take the native path,
    and its greedy replies are the eager forward's, token for token."""
    llm = LLM(embedded_gguf, quantization="native", num_gpu_blocks=128, num_cpu_blocks=8, compile_decode=False)
    runner = llm.engine.core.runner
    model = runner.model
    assert isinstance(model.lone_decode, LoneDecode)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    ours = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert runner.last_path == "eager" and runner._last_plan is None  # the lone steps planned no attention
    lone, model.lone_decode = model.lone_decode, None
    try:
        eager = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    finally:
        model.lone_decode = lone
    assert ours == eager and all(len(t) == 24 for t in ours)
