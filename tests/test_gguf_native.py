"""A GGUF file served with its quantized weights kept quantized (quantization="native",
engine/worker/quantized): the decoder built from the file's blocks computes what the same file
dequantized computes; the option is checked at the edge; `python -m engine.serve` and the app
start on a GGUF path, answer, and say which file and type they run."""
from __future__ import annotations

import itertools
import json
import uuid

import httpx
import pytest
import torch
from engine_servers import EngineServer
from gguf import GGML_QUANT_SIZES
from gradio_client import Client
from openai import OpenAI
from served_app import served_chat
from waiting import DEADLINE_S

from engine import LLM, SamplingParams
from engine.core.sampling_params import StructuredOutputsParams
from engine.worker.loading import quantization_choice
from engine.worker.loading.gguf_file import inspect_gguf, load_model
from engine.worker.loading.quantization_choice import resolve_quantization
from engine.worker.models.llama import LlamaModel
from engine.worker.models.layers.quantized_linear import QuantizedLinear
from engine.worker.quantized.matrix import QuantizedMatrix
from tests.test_gguf_file import QUANTIZED, T, tiny_llama_tensors, write_gguf
from tests.test_gguf_formats import random_tensor

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LABEL = "SmolLM2-135M-Instruct.Q4_1.gguf · Q4_1, quantized (native)"


def logits_of(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    from benchmarks.gguf_quality import teacher_forced_logits
    return teacher_forced_logits(model, ids)


def test_the_tiny_llama_kept_quantized_computes_what_it_dequantized_computes(tmp_path, tiny_hf):
    path = write_gguf(tmp_path / "tiny.gguf", "llama", tiny_llama_tensors(tiny_hf), file_type=7)
    config = tiny_hf.config
    quantized = load_model(path, config, torch.float32, quantized=True)
    kept = quantized.quantized_weights
    layers = range(config.num_hidden_layers)
    assert set(kept) == {"model.embed_tokens.weight"} | {
        f"model.layers.{i}.{name}.weight" for i in layers
        for name in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj")}
    assert all(isinstance(m, QuantizedMatrix) and m.type_name == "Q8_0" for m in kept.values())
    assert quantized.model.embed_tokens.weight.is_meta  # no dense copy of what is kept quantized
    assert set(QUANTIZED) == {"token_embd", "ffn_gate", "ffn_up", "ffn_down", "attn_output"}

    native = LlamaModel(quantized, torch.float32, torch.device("cpu"))
    dense = LlamaModel(load_model(path, config, torch.float32), torch.float32, torch.device("cpu"))
    assert native.quantized and not dense.quantized
    assert isinstance(native.layers[0].gate_up, QuantizedLinear) and isinstance(native.lm_head, QuantizedLinear)
    assert native.num_parameters == dense.num_parameters
    ids = torch.randint(0, config.vocab_size, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    ours, theirs = logits_of(native, ids), logits_of(dense, ids)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert (ours - theirs).abs().max() < 1e-3 * theirs.abs().max()
    from benchmarks.gguf_quality import stepwise_logits  # gguf_quality.py's one-token-a-step pass: the same logits
    torch.testing.assert_close(stepwise_logits(native, ids[:12]), ours[:12], atol=1e-3 * float(theirs.abs().max()), rtol=0)


# the types llama-quantize writes for common downloads beyond the first six: its fallbacks (Q5_0,
# Q5_1, IQ4_NL) and the low-bit K-quants
FALLBACK_AND_LOW_BIT = (T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS)


@pytest.fixture(scope="module")
def wide_hf():
    """A 2-layer Llama whose rows are 256 and 512 wide (the K-quants' super-blocks), a small
    vocabulary; its matrices are replaced by random blocks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.3)
    return LlamaForCausalLM(config).eval()


def greedy(model: LlamaModel, prompt: list[int], count: int) -> list[int]:
    ids = list(prompt)
    for _ in range(count):
        ids.append(int(logits_of(model, ids)[-1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("qtype", FALLBACK_AND_LOW_BIT, ids=lambda t: t.name)
def test_each_format_kept_quantized_decodes_as_it_dequantized_does(tmp_path, wide_hf, qtype):
    """The embedding, the MLP and the attention output in `qtype` (random blocks), kept quantized:
    the same greedy tokens, next-token choices and (within the activations' rounding) logits as
    the file dequantized, through the batch loops (a prompt) and the int8 ones (a token a step)."""
    seeds = itertools.count(1)
    block_size = GGML_QUANT_SIZES[qtype][0]

    def random_blocks(weights):
        return random_tensor(qtype, weights.shape[0], next(seeds), blocks_per_row=weights.shape[1] // block_size)

    path = write_gguf(tmp_path / f"wide-{qtype.name}.gguf", "llama", tiny_llama_tensors(wide_hf, qtype, random_blocks))
    assert inspect_gguf(path).main_type == qtype.name
    config = wide_hf.config
    quantized = load_model(path, config, torch.float32, quantized=True)
    kept = quantized.quantized_weights
    assert len(kept) == 1 + 4 * config.num_hidden_layers
    assert all(m.type_name == qtype.name for m in kept.values())
    native = LlamaModel(quantized, torch.float32, torch.device("cpu"))
    dense = LlamaModel(load_model(path, config, torch.float32), torch.float32, torch.device("cpu"))
    assert native.quantized and not dense.quantized
    ids = torch.randint(0, config.vocab_size, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    ours, theirs = logits_of(native, ids), logits_of(dense, ids)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert (ours - theirs).abs().max() < 1e-3 * theirs.abs().max()
    from benchmarks.gguf_quality import stepwise_logits
    torch.testing.assert_close(stepwise_logits(native, ids[:12]), ours[:12], atol=1e-3 * float(theirs.abs().max()), rtol=0)
    assert greedy(native, ids[:4], 12) == greedy(dense, ids[:4], 12)


def test_the_quantization_option_is_checked(tiny_model_dir, embedded_gguf, monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(ValueError, match="'bogus'.*auto, native, dequantize"):
        resolve_quantization("bogus", embedded_gguf, cpu)
    with pytest.raises(ValueError, match="needs a quantized GGUF file.*not a GGUF file"):
        resolve_quantization("native", tiny_model_dir, cpu)
    with pytest.raises(ValueError, match="runs on CPUs"):
        resolve_quantization("native", embedded_gguf, gpu)
    # the embedded 135M is 0.5 GB dense: dense is faster there; a file 1 GiB or more dense is kept quantized
    assert resolve_quantization("auto", embedded_gguf, cpu)[0] == "dequantize"
    monkeypatch.setattr(quantization_choice, "NATIVE_FROM_DENSE_BYTES", 256 << 20)
    assert resolve_quantization("auto", embedded_gguf, cpu)[0] == "native"
    assert resolve_quantization("auto", embedded_gguf, gpu)[0] == "dequantize"
    assert resolve_quantization("auto", tiny_model_dir, cpu)[0] == "dequantize"
    assert resolve_quantization("dequantize", embedded_gguf, cpu)[0] == "dequantize"


def test_engine_serve_starts_on_a_gguf_path(embedded_gguf, tmp_path):
    server = EngineServer(embedded_gguf, tmp_path, num_gpu_blocks=128, num_cpu_blocks=16)
    server.options += ["--quantization", "native"]
    try:
        server.start(timeout=DEADLINE_S)
        reply = OpenAI(base_url=f"{server.url}/v1", api_key="none").chat.completions.create(
            model="tiny", messages=QUESTION, temperature=0, max_tokens=12)
        assert "Paris" in reply.choices[0].message.content
        kv_cache = httpx.get(f"{server.url}/v1/kv_cache", timeout=30).json()
        assert kv_cache["weights"] == "Q4_1, quantized (native)"
    finally:
        server.stop()


def test_the_app_starts_on_a_gguf_path_and_shows_the_file_and_type(embedded_gguf, tmp_path):
    from ui.backends.local import LocalEndpoint
    from ui.panel.view import header_html
    from ui.panel.history import StatsHistory

    with served_chat(embedded_gguf, tmp_path / "chat.db", quantization="native", num_gpu_blocks=128,
                     num_cpu_blocks=16) as (client, store, url):
        session = Client(url, verbose=False)
        user = f"anon:{uuid.uuid4().hex}"
        job = session.submit(user, None, QUESTION[0]["content"], "None", "", 0.0, 1.0, 12, api_name="/send")
        _, conversation_id, _ = job.result(timeout=DEADLINE_S)
        session.close()
        reply = store.messages(user, conversation_id)[-1]
        assert reply["role"] == "assistant" and "Paris" in reply["content"]
        info = client.info()
        assert info.label == LABEL
        assert LocalEndpoint(client).probe().model == LABEL  # what the context meter shows
        assert LABEL in header_html(StatsHistory(), info, ()).replace("&#x27;", "'")


def test_constrained_replies_on_the_native_path(embedded_gguf):
    """The native quantized steps give logits like any other path; the grammar masks them."""
    llm = LLM(embedded_gguf, quantization="native", num_gpu_blocks=64)
    paths = []
    execute = llm.engine.runner.execute

    def spy(out):
        result = execute(out)
        paths.append(llm.engine.runner.last_path)
        return result
    llm.engine.runner.execute = spy
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=2,
                            structured_outputs=StructuredOutputsParams(json=schema))
    replies = llm.chat([[{"role": "user", "content": q}] for q in ("Is water wet?", "Is fire cold?")], params)
    for reply in replies:
        assert reply.outputs[0].finish_reason == "stop"
        assert json.loads(reply.outputs[0].text)["answer"] in ("yes", "no")
    assert "native" in paths
