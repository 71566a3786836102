"""A Llama folder's checkpoint read from its safetensors (engine/worker/loading/checkpoint.py) is what the
transformers model of the same folder gives, to the bit, and its end-of-sequence id what its
tokenizer says; what is not read directly goes through transformers; and an engine core started
on such a folder never imports transformers."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.worker.loading.checkpoint import Checkpoint, of_transformers, read_folder
from engine.worker.loading.model_loader import eos_token_id, load_checkpoint, load_hf_model
from engine.worker.models.layers.shape import DecoderShape


def used(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The weights the decoder reads (a tied head is the embedding, whatever lm_head.weight holds)."""
    return {name: t for name, t in checkpoint.parameters.items()
            if not (checkpoint.tied and name == "lm_head.weight")}


def assert_same(read: Checkpoint, taken: Checkpoint) -> None:
    assert read.tied == taken.tied
    wanted, got = used(taken), used(read)
    assert got.keys() == wanted.keys()
    for name, tensor in wanted.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name
    assert read.inv_freq.dtype == torch.float32
    assert torch.equal(read.inv_freq, taken.inv_freq)
    assert read.attention_scaling == taken.attention_scaling
    assert DecoderShape.of(read.config) == DecoderShape.of(taken.config)
    assert read.config.max_position_embeddings == taken.config.max_position_embeddings


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_folder_reads_as_its_transformers_model(tiny_model_dir, dtype):
    read = read_folder(tiny_model_dir, dtype)
    assert read is not None and read.tied
    assert_same(read, of_transformers(load_hf_model(tiny_model_dir, dtype)[0]))


def copy_with_config(folder, tmp_path, **changes) -> str:
    """The model at `folder` with its config.json's keys changed (None removes a key)."""
    out = tmp_path / "model"
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


LLAMA3 = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("rope", ["llama3 (transformers 5's form)", "llama3 (rope_theta + rope_scaling)",
                                  "default (rope_theta alone)"])
def test_rotary_frequencies_equal_transformers(tiny_model_dir, tmp_path, rope):
    """Llama 3.1/3.2's scaling, and configs written before transformers 5 (rope_theta with an
    optional rope_scaling), give transformers' frequencies to the bit."""
    if rope.startswith("llama3 (transformers"):
        changes = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0} | LLAMA3}
    elif rope.startswith("llama3"):
        changes = {"rope_parameters": None, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3"} | LLAMA3}
    else:
        changes = {"rope_parameters": None, "rope_theta": 20000.0}
    folder = copy_with_config(tiny_model_dir, tmp_path, **changes)
    read = read_folder(folder, torch.float32)
    assert read is not None
    taken = of_transformers(load_hf_model(folder)[0])
    if "llama3" in rope:  # the scaling changed some frequencies and left others
        plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
        assert not torch.equal(taken.inv_freq, plain) and torch.equal(taken.inv_freq[0], plain[0])
    assert_same(read, taken)


def test_a_sharded_folder_reads_every_shard(tiny_model_dir, tmp_path):
    out = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, out)
    tensors = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({name: tensors[name] for name in shard_names}, out / shard)
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    read = read_folder(out, torch.float32)
    assert read is not None
    assert_same(read, of_transformers(load_hf_model(tiny_model_dir)[0]))


def test_a_model_built_consuming_its_checkpoint_computes_alike(tiny_model_dir):
    """`consume`: the matrices leave the checkpoint as the decoder lays them out (so a
    concatenated one is not held beside its parts); the decoder is the same."""
    from engine.worker.models.llama import LlamaModel

    kept, consumed = read_folder(tiny_model_dir, torch.float32), read_folder(tiny_model_dir, torch.float32)
    reference = LlamaModel(kept, torch.float32, torch.device("cpu"))
    model = LlamaModel(consumed, torch.float32, torch.device("cpu"), consume=True)
    assert not any("_proj." in name for name in consumed.parameters)
    assert any("_proj." in name for name in kept.parameters)
    torch.manual_seed(0)
    for ours, theirs in zip(model.layers, reference.layers):
        for name in ("qkv", "o_proj", "gate_up", "down"):
            x = torch.randn(3, getattr(ours, name).in_features)
            torch.testing.assert_close(getattr(ours, name)(x), getattr(theirs, name)(x))


@pytest.mark.parametrize("change", ["another family", "yarn scaling", "no vocab_size", "a missing weight"])
def test_what_it_does_not_read_goes_through_transformers(tiny_model_dir, tmp_path, change):
    """read_folder declines (None) rather than guess, and load_checkpoint then takes the
    transformers model's checkpoint."""
    if change == "another family":
        folder = copy_with_config(tiny_model_dir, tmp_path, model_type="mistral", architectures=["MistralForCausalLM"])
    elif change == "yarn scaling":
        folder = copy_with_config(tiny_model_dir, tmp_path, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256})
    elif change == "no vocab_size":
        folder = copy_with_config(tiny_model_dir, tmp_path, vocab_size=None)
    else:
        folder = copy_with_config(tiny_model_dir, tmp_path)
        tensors = load_file(f"{folder}/model.safetensors")
        del tensors["model.layers.1.mlp.down_proj.weight"]
        save_file(tensors, f"{folder}/model.safetensors")
    assert read_folder(folder, torch.float32) is None
    if change in ("another family", "yarn scaling"):  # transformers serves these
        checkpoint = load_checkpoint(folder)
        assert hasattr(checkpoint.config, "to_dict")  # a transformers config: its model's checkpoint
        assert_same(checkpoint, of_transformers(load_hf_model(folder)[0]))


@pytest.mark.parametrize("model", ["tiny folder", "embedded default", "GGUF file"])
def test_the_eos_id_read_without_transformers_is_the_tokenizers(model, tiny_model_dir, tmp_path):
    from engine.worker.loading.embedded_model import embedded_gguf_path
    from engine.worker.loading.model_files import resolve_model
    from engine.worker.loading.model_loader import load_tokenizer
    name = {"tiny folder": tiny_model_dir, "embedded default": None, "GGUF file": embedded_gguf_path()}[model]
    assert eos_token_id(name) == load_tokenizer(name).eos_token_id == 2
    # a folder whose special_tokens_map.json names another end token: the tokenizer decides
    folder = tmp_path / "mapped"
    shutil.copytree(resolve_model(name), folder)
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_start|>"}))
    assert eos_token_id(str(folder)) == load_tokenizer(str(folder)).eos_token_id


MODELLING = ("torch._dynamo", "triton", "transformers.models.llama.modeling_llama")  # what a model class imports


@pytest.mark.parametrize("model", ["folder", "GGUF file"])
def test_a_core_never_imports_the_modelling_stack(tiny_model_dir, embedded_gguf, model):
    """The point of reading folders and Llama GGUF files directly: an engine core (what
    engine/runtime/core_process.py runs) starts and decodes without transformers' modelling stack, which
    pulls in torch._dynamo, triton and torch.distributed.tensor (~160 MiB resident, ~3 s of
    CPU); on a folder, without transformers at all (a GGUF's reader is transformers' GGUF module)."""
    from engine.worker.loading.model_files import resolve_model
    name, options = (tiny_model_dir, "") if model == "folder" else (embedded_gguf, ", quantization='native'")
    resolve_model(name)  # a GGUF's cached folder written here: the core only reads it
    unwanted = ("transformers",) if model == "folder" else MODELLING
    script = f"""
import sys
from engine.core.sampling_params import SamplingParams
from engine.runtime.engine_core import EngineCore
core = EngineCore({name!r}, num_gpu_blocks=32, num_cpu_blocks=0, compile_decode=False{options})
core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
tokens = []
while core.has_unfinished():
    tokens += [t for out in core.step() for t in out.token_ids]
print(len(tokens), core.eos_token_id, [m for m in {unwanted!r} + ("torch._dynamo",) if m in sys.modules])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "4 2 []"


def test_a_qwen2_folder_reads_as_its_transformers_model(tmp_path):
    """Qwen2 is read like Llama plus its q, k and v biases: the same weights, biases and rotary
    table as transformers' Qwen2 model gives, without building it."""
    from benchmarks.qwen_style_tokenizer import qwen_style_tokenizer
    from benchmarks.random_llama import build_random_llama
    from engine.worker.loading.model_loader import load_tokenizer

    folder = tmp_path / "qwen"
    build_random_llama("random-qwen2-tiny", qwen_style_tokenizer(load_tokenizer(None)), torch.float32, str(folder))
    read = read_folder(folder, torch.float32)
    assert read is not None and read.config.qkv_bias
    assert "model.layers.1.self_attn.k_proj.bias" in read.parameters
    assert_same(read, of_transformers(load_hf_model(str(folder), torch.float32)[0]))
    assert read_folder(copy_with_config(folder, tmp_path, use_sliding_window=True), torch.float32) is None
