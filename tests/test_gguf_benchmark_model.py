"""`make bench-peers GGUF=...`'s pieces (the GGUF benchmark's files): benchmarks/peers/gguf_models.py's
names and its matrix of models and types, the random models it quantizes (a tiny qwen2 one here),
benchmarks/gguf_matrix.py's rows, and compare.py's --gguf mode running ours on the embedded Q4_1
file with llama.cpp reported missing from an empty build folder. Making the files needs llama.cpp
built (llama_cpp.sh), which a test does not do: a test that needs its converter or llama-quantize
uses the peers' build folder where one is there (PEERS_BUILD names another) and is skipped, saying
so, where not."""
import json
import os
import sys
from pathlib import Path

import pytest
from preloaded_python import run_python

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.peers import gguf_models  # noqa: E402


def test_names_resolve_to_the_embedded_file_and_the_build_folder(tmp_path):
    assert gguf_models.expand("all") == ["q4_1", "1b-q8_0", "1b-q4_k_m"]
    assert gguf_models.expand("q4_1,/x/y.gguf,") == ["q4_1", "/x/y.gguf"]
    assert gguf_models.model_path("q4_1").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_models.model_path("q4_1").is_file()
    assert gguf_models.model_path("1b-q4_k_m", tmp_path) == tmp_path / "random-llama-1b-q4_k_m.gguf"
    assert gguf_models.model_path("/x/y.gguf", tmp_path) == Path("/x/y.gguf")
    assert gguf_models.make(["q4_1"], tmp_path) == [gguf_models.model_path("q4_1")]  # found, nothing made
    with pytest.raises(RuntimeError, match="llama_cpp.sh"):
        gguf_models.make(["1b-q8_0"], tmp_path)  # no llama-quantize there: what to run, before any work
    assert not any(tmp_path.iterdir())
    with pytest.raises(FileNotFoundError):
        gguf_models.make([str(tmp_path / "missing.gguf")], tmp_path)


def test_gguf_comparison_runs_ours_on_the_file_and_reports_llama_cpp_not_set_up(tmp_path):
    done = run_python(["benchmarks/peers/compare.py", "--gguf", "q4_1", "--dtype", "float32", "--output-tokens", "2",
                       "--rounds", "1", "--chats", "2", "--build", str(tmp_path)], ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    row = figures["gguf"]["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert row["type"] == "Q4_1" and row["size_bytes"] > 0 and row["single_bound_tok_s"] > 0
    assert row["engine_tok_s"] > 0 and row["engine_single_tok_s"] > 0 and row["engine_dtype"] == "float32"
    assert "llama_cpp.sh" in row["missing"]["llamacpp"] and "engine_over_llamacpp" not in row
    workload = json.loads((tmp_path / "workload-SmolLM2-135M-Instruct.Q4_1.json").read_text())
    assert len(workload["prompts"]) == 2
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in done.stdout and "Q4_1" in done.stdout  # the table names the file


def test_the_same_prompt_work_is_each_chats_tokens_past_the_common_prefix():
    """compare.py's llama.cpp run on ours' prompt work: per chat, the tokens past the prompts'
    common prefix, which our prefix cache holds (its full blocks, and the block after them copied
    from a cached one that begins with the same tokens); at least one token each."""
    from benchmarks.peers.compare import own_prompt_tokens

    shared = list(range(100, 140))  # 40 common tokens: two full blocks and 8 of the third
    assert own_prompt_tokens([shared + [1] * 10, shared + [2] * 20]) == (10 + 20) // 2
    assert own_prompt_tokens([shared[:15] + [3], shared[:15] + [4, 5, 6]]) == 2  # no full block: still shared
    assert own_prompt_tokens([shared[:32] + [7] * 4, shared[:32] + [8] * 6]) == 5
    assert own_prompt_tokens([shared, shared]) == 1  # the same prompt: its last token


def test_the_matrix_is_every_model_with_every_type_and_globs_select_from_it(tmp_path):
    names = gguf_models.expand("matrix")
    assert len(names) == len(gguf_models.MATRIX_MODELS) * len(gguf_models.MATRIX_TYPES) == 32
    assert {"qwen-0.5b-q4_k_m", "smollm2-360m-iq4_xs", "llama-1b-q2_k", "smollm2-135m-q3_k_m"} <= set(names)
    assert gguf_models.expand("qwen-0.5b-*") == [f"qwen-0.5b-{t.lower()}" for t in gguf_models.MATRIX_TYPES]
    assert gguf_models.expand("*-iq4_xs,smollm2-135m-q8_0,*-iq4_xs") == [
        "smollm2-135m-iq4_xs", "qwen-0.5b-iq4_xs", "smollm2-360m-iq4_xs", "llama-1b-iq4_xs", "smollm2-135m-q8_0"]
    with pytest.raises(ValueError, match="matches none"):
        gguf_models.expand("qwen-7b-*")
    assert gguf_models.parse_name("smollm2-360m-iq4_xs") == ("smollm2-360m", "IQ4_XS")
    assert gguf_models.parse_name("1b-q8_0") == ("llama-1b", "Q8_0")
    assert gguf_models.parse_name("qwen-0.5b-q4_1") is None  # not a matrix type: a path
    # the 1B's names keep their files; each model's files are named by its stem
    assert gguf_models.model_path("1b-q8_0", tmp_path) == gguf_models.model_path("llama-1b-q8_0", tmp_path) \
        == tmp_path / "random-llama-1b-q8_0.gguf"
    assert gguf_models.model_path("qwen-0.5b-q3_k_m", tmp_path) == tmp_path / "random-qwen2-0.5b-q3_k_m.gguf"
    assert gguf_models.model_path("smollm2-135m-iq4_xs", tmp_path) == tmp_path / "smollm2-135m-iq4_xs.gguf"
    with pytest.raises(RuntimeError, match="llama_cpp.sh"):
        gguf_models.make(["qwen-0.5b-q2_k"], tmp_path)
    assert not any(tmp_path.iterdir())


def tiny_qwen2(folder: Path):
    import torch

    from benchmarks.qwen_style_tokenizer import qwen_style_tokenizer
    from benchmarks.random_llama import build_random_llama
    from engine.worker.loading.model_loader import load_tokenizer

    tokenizer = qwen_style_tokenizer(load_tokenizer(None))
    return build_random_llama("random-qwen2-tiny", tokenizer, torch.bfloat16, str(folder)), tokenizer


def test_a_tiny_random_qwen2_has_biases_and_qwen_s_tokenizer_and_converts_to_gguf(tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig

    parameters, tokenizer = tiny_qwen2(tmp_path / "qwen")
    config = AutoConfig.from_pretrained(tmp_path / "qwen")
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.vocab_size) == ("qwen2", 64, 2, 49152)
    assert config.tie_word_embeddings and config.rms_norm_eps == 1e-6
    with safe_open(str(tmp_path / "qwen" / "model.safetensors"), "pt") as weights:
        bias = weights.get_tensor("model.layers.1.self_attn.k_proj.bias").float()
        assert bias.shape == (32,) and 0.01 < bias.std() < 0.03  # random like a trained one, not zero
        assert 0.015 < weights.get_tensor("model.layers.0.mlp.up_proj.weight").float().std() < 0.025
    assert tokenizer.bos_token is None and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")
    assert tokenizer.tokenize("it's 2024")[:2] == ["it", "'s"]  # Qwen2's split: digits one by one
    assert tokenizer.tokenize("2024") == ["2", "0", "2", "4"]

    build = Path(os.environ.get("PEERS_BUILD", gguf_models.BUILD))
    try:
        gguf_models.check_tools(build)
    except RuntimeError as missing:
        pytest.skip(f"converting needs the peers' build folder ({build}): {missing}")
    target = gguf_models.convert(tmp_path / "qwen", "bf16", tmp_path / "qwen-bf16.gguf", build, pre="qwen2")
    from engine.worker.loading.gguf_file import field_value, open_reader

    reader = open_reader(target)
    assert field_value(reader, "general.architecture") == "qwen2"
    assert field_value(reader, "tokenizer.ggml.pre") == "qwen2"
    assert len(field_value(reader, "tokenizer.ggml.tokens")) == 49152
    assert "blk.0.attn_q.bias" in {t.name for t in reader.tensors}


def refused_gguf(path: Path) -> Path:
    """A one-tensor llama GGUF in IQ2_XXS, a type the engine's reader does not read."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    type_size = GGML_QUANT_SIZES[GGMLQuantizationType.IQ2_XXS][1]
    writer.add_tensor("token_embd.weight", np.zeros((4, type_size), dtype=np.uint8),
                      raw_dtype=GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_matrix_report_serves_a_file_and_reports_a_refused_one_by_its_type(tmp_path):
    refused = refused_gguf(tmp_path / "refused-iq2_xxs.gguf")
    done = run_python(["benchmarks/gguf_matrix.py", f"q4_1,{refused}", "--prompts", "1", "--positions", "12",
                       "--max-tokens", "2"], ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["benchmark"] == "gguf_matrix" and figures["cpu"]
    served, refused_row = figures["results"]
    assert served["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and served["loads"] and served["reply_tokens"] == 2
    assert served["tensor_types"]["Q4_1"] > 0 and served["size_bytes"] > 0
    assert served["positions"] == 12 and 0 <= served["top1"] <= 1 and served["greedy_prompts"] == 1
    assert served["types_not_read"] == []
    assert refused_row["tensor_types"] == {"IQ2_XXS": 1} and refused_row["types_not_read"] == ["IQ2_XXS"]
    assert not refused_row["loads"]
    assert "IQ2_XXS" in refused_row["error"] and "top1" not in refused_row
    assert "refused" in done.stdout and "SmolLM2-135M-Instruct.Q4_1.gguf" in done.stdout
