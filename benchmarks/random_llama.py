"""Llama models with random weights built from a config, for benchmarks that need a model of a
given size and nothing downloaded."""
from __future__ import annotations

import time

import torch

# Llama shapes built from a config with random weights (vocabulary: the tokenizer's).
RANDOM_MODELS = {
    "random-llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                            intermediate_size=8192),
    "random-llama-tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=128),
}


def build_random_llama(name: str, tokenizer, dtype: torch.dtype, folder: str) -> int:
    """Saves into `folder` a Llama of RANDOM_MODELS[name]'s shape with random weights (seed 0), built
    directly in `dtype` on the CPU, with `tokenizer`. Returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=4096, rope_theta=500000.0,
                         tie_word_embeddings=True, initializer_range=0.02, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                         **RANDOM_MODELS[name])
    t0 = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created (and initialized) in dtype: no fp32 copy
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    built = time.perf_counter() - t0
    num_parameters = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    t0 = time.perf_counter()
    model.save_pretrained(folder)  # safetensors
    tokenizer.save_pretrained(folder)
    print(f"{name}: {num_parameters:,} parameters with random weights, built in {built:.1f} s "
          f"({str(dtype).removeprefix('torch.')}), saved in {time.perf_counter() - t0:.1f} s", flush=True)
    return num_parameters
