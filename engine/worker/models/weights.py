"""The decoder's weights as every path computes with them, taken once from a transformers model."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def frozen(t: torch.Tensor | None) -> torch.nn.Parameter | None:
    """A weight as a parameter nothing trains (what a compiler folds into its graph as a constant)."""
    return None if t is None else torch.nn.Parameter(t, requires_grad=False)


@dataclass
class LayerWeights:
    """One decoder layer's plain weights, q/k/v and gate/up concatenated (one matmul each)."""
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class DecoderWeights:
    """The decoder's weights as the engine computes with them, taken from a transformers model.
    A tied output embedding is the input embedding itself (`lm_head is embed`)."""
    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerWeights]

    @classmethod
    def of(cls, hf_model, dtype: torch.dtype, device: torch.device) -> DecoderWeights:
        def take(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=device, dtype=dtype).contiguous()

        inner = hf_model.model
        embed = take(inner.embed_tokens.weight)
        lm_head = hf_model.get_output_embeddings().weight
        layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
            layers.append(LayerWeights(
                input_norm=take(layer.input_layernorm.weight),
                qkv=take(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
                qkv_bias=take(torch.cat(biases)) if biases[0] is not None else None,
                o_proj=take(attn.o_proj.weight),
                post_norm=take(layer.post_attention_layernorm.weight),
                gate_up=take(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                down=take(mlp.down_proj.weight)))
        tied = lm_head.data_ptr() == inner.embed_tokens.weight.data_ptr()
        return cls(embed, take(inner.norm.weight), embed if tied else take(lm_head), layers)
