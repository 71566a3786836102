"""Llama-family models with random weights built from a config, for benchmarks that need a model of
a given size and nothing downloaded."""
from __future__ import annotations

import time

import torch

# Shapes built from a config with random weights. `architecture`: llama unless named (qwen2: q/k/v
# biases, rope theta 1e6, rms eps 1e-6, as Qwen2.5 is). `vocab_size`: the tokenizer's unless named
# (Qwen2.5's embedding has more rows than its tokenizer has tokens; the converter pads the file's
# token list to it, as Qwen2.5's own GGUF files are padded).
RANDOM_MODELS = {
    "random-llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                            intermediate_size=8192),
    "random-smollm2-360m": dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                                intermediate_size=2560, rope_theta=100000.0, rms_norm_eps=1e-5),
    "random-qwen2-0.5b": dict(architecture="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                              num_key_value_heads=2, intermediate_size=4864, vocab_size=151936),
    "random-llama-tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=128),
    "random-qwen2-tiny": dict(architecture="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=128),
}


def model_config(name: str, tokenizer):
    """The transformers config of RANDOM_MODELS[name] with `tokenizer`'s special ids: LlamaConfig,
    or Qwen2Config for a qwen2 shape."""
    from transformers import LlamaConfig, Qwen2Config

    shape = dict(RANDOM_MODELS[name])
    architecture = shape.pop("architecture", "llama")
    vocab_size = shape.pop("vocab_size", len(tokenizer))
    if vocab_size < len(tokenizer):
        raise ValueError(f"{name}: vocabulary of {vocab_size} rows is smaller than the tokenizer's {len(tokenizer)} tokens")
    common = dict(vocab_size=vocab_size, tie_word_embeddings=True, initializer_range=0.02,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.eos_token_id)
    if architecture == "qwen2":
        return Qwen2Config(max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                           use_sliding_window=False, **common, **shape)
    if architecture == "llama":
        shape.setdefault("rope_theta", 500000.0)
        return LlamaConfig(max_position_embeddings=4096, **common, **shape)
    raise ValueError(f"{name}: architecture {architecture!r} is not one we build (llama, qwen2)")


def build_random_llama(name: str, tokenizer, dtype: torch.dtype, folder: str, device: str = "cpu") -> int:
    """Saves into `folder` a model of RANDOM_MODELS[name]'s shape with random weights (seed 0; normal,
    std 0.02, so they quantize as trained ones do), built directly in `dtype` on `device` (a GPU
    draws the 1B's weights in a second where 16 CPU cores take ~40 s; its draws differ from the
    CPU's), with `tokenizer`. Returns its parameter count."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = model_config(name, tokenizer)
    t0 = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created (and initialized) in dtype: no fp32 copy
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config).eval()
    finally:
        torch.set_default_dtype(previous)
    if config.model_type == "qwen2":
        # transformers initializes biases to zero; trained Qwen2.5 biases are not, and a zero
        # bias would leave that code path untested.
        with torch.no_grad():
            for layer in model.model.layers:
                for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    projection.bias.normal_(0.0, config.initializer_range)
    if device != "cpu":
        torch.cuda.synchronize()
    built = time.perf_counter() - t0
    num_parameters = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    t0 = time.perf_counter()
    model.save_pretrained(folder)  # safetensors
    tokenizer.save_pretrained(folder)
    print(f"{name}: {num_parameters:,} parameters with random weights, built in {built:.1f} s "
          f"({str(dtype).removeprefix('torch.')}, {device}), saved in {time.perf_counter() - t0:.1f} s", flush=True)
    return num_parameters
