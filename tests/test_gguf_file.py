"""A GGUF file by path (engine/worker/loading/gguf_file.py and model_loader's GGUF path): unsupported
files are refused, naming what is wrong, before anything is cached; a tiny Llama written to GGUF
(F32 and Q8_0 tensors, llama.cpp's query/key row order, Llama 3's rope_freqs) loads back to its
own weights; the embedded SmolLM2 GGUF named by path caches only its config and tokenizer, takes
its tokenizer and chat template from the file and decodes as the embedded default does."""
from __future__ import annotations

from pathlib import Path

import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from engine import LLM, SamplingParams
from engine.worker.loading import gguf_folder, model_files, model_loader
from engine.worker.loading.architectures import UnsupportedModelError
from engine.worker.loading.gguf_file import inspect_gguf, load_model

T = GGMLQuantizationType


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGEDCHAT_CACHE", str(cache))
    return cache


def write_gguf(path, arch: str, tensors, file_type: int = 0) -> str:
    """A GGUF at `path` holding `tensors`, (name, array, type) each (quantized arrays as
    gguf.quants gives them)."""
    return str(write_gguf_parts(path, arch, tensors, file_type)[0])


def write_gguf_parts(path, arch: str, tensors, file_type: int = 0, split_max_tensors: int = 0,
                     metadata=None) -> list[Path]:
    """`write_gguf`, split as llama.cpp's gguf-split splits (at `split_max_tensors` tensors a
    part; 0: one file), `metadata(writer)` adding keys first. Returns the files written."""
    writer = GGUFWriter(str(path), arch=arch, split_max_tensors=split_max_tensors)
    writer.add_file_type(file_type)
    if metadata is not None:
        metadata(writer)
    for name, array, qtype in tensors:
        writer.add_tensor(name, array, raw_dtype=None if qtype == T.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(Path(path))


def test_unsupported_architecture_is_refused_by_name(tmp_path, private_cache):
    path = write_gguf(tmp_path / "phi.gguf", "phi3", [("token_embd.weight", np.zeros((8, 32), np.float32), T.F32)])
    with pytest.raises(UnsupportedModelError, match="'phi3'.*llama, mistral, qwen2"):
        LLM(model=path)
    blob = tmp_path / "sha256-0123abcd"  # how Ollama keeps a model: no extension, found by its magic
    blob.write_bytes(open(path, "rb").read())
    with pytest.raises(UnsupportedModelError, match="'phi3'"):
        model_files.resolve_model(str(blob))
    assert not private_cache.exists()  # refused before anything was read into the cache


@pytest.mark.parametrize("qtype", [T.Q8_1, T.IQ2_XXS])
def test_unsupported_tensor_type_is_refused_naming_the_tensor(tmp_path, private_cache, qtype):
    weights = np.random.default_rng(0).standard_normal((8, 32), dtype=np.float32)
    raw = np.zeros((8, GGML_QUANT_SIZES[qtype][1]), np.uint8)  # a block a row
    path = write_gguf(tmp_path / f"odd-{qtype.name}.gguf", "llama",
                      [("token_embd.weight", weights, T.F32), ("blk.0.attn_q.weight", raw, qtype)])
    with pytest.raises(UnsupportedModelError, match=f"'blk.0.attn_q.weight'.*{qtype.name}"):
        model_files.resolve_model(path)
    with pytest.raises(UnsupportedModelError, match=qtype.name):
        model_loader.load_tokenizer(path)
    assert not private_cache.exists()


GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's row order for Llama's q and k projections."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


QUANTIZED = ("token_embd", "ffn_gate", "ffn_up", "ffn_down", "attn_output")  # in Q8_0; the rest in F32


def tiny_llama_tensors(hf_model, qtype: GGMLQuantizationType = T.Q8_0, encode=None):
    """The model's tensors by GGUF name, those named in QUANTIZED in `qtype` (`encode`d: by
    default gguf.quants.quantize), the rest in F32."""
    encode = encode or (lambda weights: quantize(weights, qtype))
    config = hf_model.config
    state = {name: t.detach().float().numpy() for name, t in hf_model.state_dict().items()}
    tensors = [("token_embd.weight", state["model.embed_tokens.weight"]), ("output_norm.weight", state["model.norm.weight"])]
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in GGUF_NAMES.items():
            weights = state[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weights = llama_cpp_permute(weights, config.num_attention_heads)
            elif gguf_name == "attn_k":
                weights = llama_cpp_permute(weights, config.num_key_value_heads)
            tensors.append((f"blk.{layer}.{gguf_name}.weight", weights))
    return [(name, encode(w), qtype) if name.split(".")[-2] in QUANTIZED else (name, w, T.F32)
            for name, w in tensors]


def test_tiny_llama_loads_from_gguf(tmp_path, tiny_hf):
    """Weights only (the config given, as the cached folder's would be): names, llama.cpp's q/k
    row order, F32 and Q8_0 tensors and Llama 3's rope_freqs, against the model written."""
    config = tiny_hf.config
    rope_factors = np.linspace(1.0, 8.0, config.hidden_size // config.num_attention_heads // 2, dtype=np.float32)
    tensors = [*tiny_llama_tensors(tiny_hf), ("rope_freqs.weight", rope_factors, T.F32)]  # Llama 3's RoPE scaling
    path = write_gguf(tmp_path / "tiny.gguf", "llama", tensors, file_type=7)
    info = inspect_gguf(path)
    assert (info.architecture, info.file_type, info.main_type) == ("llama", "Q8_0", "Q8_0")
    assert info.num_parameters == len(rope_factors) + sum(
        t.numel() for name, t in tiny_hf.state_dict().items() if name != "lm_head.weight")

    model = load_model(path, config, torch.float32)
    ours, theirs = model.state_dict(), tiny_hf.state_dict()
    assert set(ours) == set(theirs)
    quantized = {"model.embed_tokens.weight", "lm_head.weight"} | {
        f"model.layers.{layer}.{hf}.weight" for layer in range(config.num_hidden_layers)
        for hf, gguf in GGUF_NAMES.items() if gguf in QUANTIZED}
    for name, expected in theirs.items():
        if name in quantized:  # each row quantized on its own: llama.cpp's row order commutes with it
            expected = torch.from_numpy(dequantize(quantize(expected.numpy(), T.Q8_0), T.Q8_0))
        assert torch.equal(ours[name], expected), name
    assert torch.equal(model.model.rotary_emb.inv_freq, tiny_hf.model.rotary_emb.inv_freq / torch.from_numpy(rope_factors))


@pytest.mark.parametrize("quantized", [False, True])
def test_a_llama_gguf_is_read_as_its_transformers_model(tmp_path, tiny_hf, quantized):
    """read_checkpoint (no transformers model built) gives the engine what load_model's model
    gives it through checkpoint.of_transformers: the same weights to the bit, the same matrices
    kept quantized, the rotary frequencies divided by rope_freqs alike."""
    from engine.worker.loading.checkpoint import of_transformers
    from engine.worker.loading.gguf_file import read_checkpoint
    from tests.test_checkpoint import assert_same

    config = tiny_hf.config
    rope_factors = np.linspace(1.0, 8.0, config.hidden_size // config.num_attention_heads // 2, dtype=np.float32)
    path = write_gguf(tmp_path / "tiny.gguf", "llama", [*tiny_llama_tensors(tiny_hf), ("rope_freqs.weight", rope_factors, T.F32)])
    read = read_checkpoint(path, config.to_dict(), torch.float32, quantized=quantized)
    taken = of_transformers(load_model(path, config, torch.float32, quantized=quantized))
    assert read.quantized.keys() == taken.quantized.keys() and (len(read.quantized) > 0) == quantized
    for name, matrix in taken.quantized.items():
        assert torch.equal(read.quantized[name].dequantize(), matrix.dequantize()), name
    taken.parameters = {name: t for name, t in taken.parameters.items() if name not in taken.quantized}  # meta
    assert_same(read, taken)
    assert not torch.equal(read.inv_freq, tiny_hf.model.rotary_emb.inv_freq)  # rope_freqs applied

    assert read_checkpoint(path, {**config.to_dict(), "model_type": "mistral"}, torch.float32) is None  # transformers' way
    weights = [t for t in tiny_llama_tensors(tiny_hf) if t[0] != "blk.1.ffn_down.weight"]
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight.*missing from the GGUF file"):
        read_checkpoint(write_gguf(tmp_path / "holed.gguf", "llama", weights), config.to_dict(), torch.float32)


def test_embedded_gguf_by_path_decodes_as_the_default(embedded_gguf, smol_llm):
    folder = model_files.resolve_model(embedded_gguf)  # config + tokenizer only: no weights written
    record = gguf_folder.gguf_source(folder)
    assert (record["architecture"], record["file_type"], record["main_type"]) == ("llama", "Q4_1", "Q4_1")
    assert not [p for p in os.listdir(folder) if p.endswith((".safetensors", ".bin"))]
    assert model_files.model_dtype(embedded_gguf) == torch.bfloat16
    # dequantized, as the default's folder was made: the same weights, so the same tokens
    llm = LLM(model=embedded_gguf, dtype="float32", quantization="dequantize", num_gpu_blocks=512, num_cpu_blocks=64)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = llm.engine.encode(llm.engine.apply_chat_template(chat))
    assert ids == smol_llm.engine.encode(smol_llm.engine.apply_chat_template(chat))  # tokenizer + template from the file
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = llm.generate([ids], greedy)[0].outputs[0].token_ids
    assert ours == smol_llm.generate([ids], greedy)[0].outputs[0].token_ids and len(ours) == 12


def test_a_gguf_folder_s_tokenizer_loads_as_its_tokenizer_json_whatever_class_it_names(tmp_path):
    """A qwen2 GGUF's cached folder names Qwen2Tokenizer, which would build its pipeline again
    beside tokenizer.json (~190 MiB for Qwen's vocabulary): the folder loads tokenizer.json as it
    is, with the same ids, special tokens and chat template as the named class."""
    import json

    from transformers import AutoTokenizer

    from benchmarks.qwen_style_tokenizer import qwen_style_tokenizer
    from engine.worker.loading.gguf_folder import GGUF_SOURCE
    from engine.worker.loading.model_loader import load_tokenizer
    from engine.worker.loading.tokenizer_files import tokenizer_at

    qwen_style_tokenizer(load_tokenizer(None)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    named = AutoTokenizer.from_pretrained(tmp_path)
    assert type(named).__name__ == "Qwen2Tokenizer"
    (tmp_path / GGUF_SOURCE).write_text("{}")
    loaded = tokenizer_at(str(tmp_path))
    assert type(loaded).__name__ != "Qwen2Tokenizer"
    for text in ("Hello world!", "  spaces\tand\n\nnewlines 2024", "ünïcödé 中文 🤖", "<|im_start|>user\nhi<|im_end|>"):
        assert loaded(text).input_ids == named(text).input_ids
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert loaded.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        named.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (loaded.eos_token_id, loaded.bos_token, len(loaded)) == (named.eos_token_id, named.bos_token, len(named))
