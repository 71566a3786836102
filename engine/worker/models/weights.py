"""The decoder's weights as every path computes with them, taken once from its checkpoint
(engine/worker/loading/checkpoint.py).

A projection's weight is a plain matrix, or, for a GGUF file served with its quantized weights
(gguf_file.load_model(quantized=True)), the list of its quantized parts (q, k and v; gate and
up), which the native matmul writes side by side."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.worker.loading.checkpoint import Checkpoint
from engine.worker.quantized.matrix import QuantizedMatrix

Weight = torch.Tensor | list[QuantizedMatrix]


def frozen(t: torch.Tensor | None) -> torch.nn.Parameter | None:
    """A weight as a parameter nothing trains (what a compiler folds into its graph as a constant)."""
    return None if t is None else torch.nn.Parameter(t, requires_grad=False)


@dataclass
class LayerWeights:
    """One decoder layer's plain weights, q/k/v and gate/up concatenated (one matmul each)."""
    input_norm: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    o_proj: Weight
    post_norm: torch.Tensor
    gate_up: Weight
    down: Weight


@dataclass
class DecoderWeights:
    """The decoder's weights as the engine computes with them, taken from its checkpoint.
    A tied output embedding is the input embedding itself (`lm_head is embed`, or for a quantized
    one `lm_head == [embed]`)."""
    embed: torch.Tensor | QuantizedMatrix
    norm: torch.Tensor
    lm_head: Weight
    layers: list[LayerWeights]

    @property
    def tied(self) -> bool:
        return self.lm_head is self.embed or (isinstance(self.lm_head, list) and self.lm_head[0] is self.embed)

    @classmethod
    def of(cls, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device,
           consume: bool = False) -> DecoderWeights:
        """`consume`: take each weight out of the checkpoint as it is laid out, so that a matrix
        concatenated with others is held once, not beside its parts, while the rest load."""
        quantized, parameters = checkpoint.quantized, checkpoint.parameters
        get = parameters.pop if consume else parameters.get

        def take(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=device, dtype=dtype).contiguous()

        def projection(*names: str) -> Weight:
            """The named matrices concatenated by rows: their quantized parts when all are kept so."""
            weights = [f"{name}.weight" for name in names]
            if all(weight in quantized for weight in weights):
                return [quantized[weight] for weight in weights]
            return take(torch.cat([quantized[w].dequantize() if w in quantized else get(w) for w in weights]))

        def bias(*names: str) -> torch.Tensor | None:
            biases = [get(f"{name}.bias", None) for name in names]
            return take(torch.cat(biases)) if biases[0] is not None else None

        embed = quantized.get("model.embed_tokens.weight")
        if embed is None:
            embed = take(parameters["model.embed_tokens.weight"])
        if "lm_head.weight" in quantized:
            lm_head = [quantized["lm_head.weight"]]
        elif checkpoint.tied:
            lm_head = [embed] if isinstance(embed, QuantizedMatrix) else embed
        else:
            lm_head = take(parameters["lm_head.weight"])
        layers = []
        for i in range(checkpoint.num_layers):
            prefix = f"model.layers.{i}"
            attn = [f"{prefix}.self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj")]
            mlp = [f"{prefix}.mlp.{name}" for name in ("gate_proj", "up_proj")]
            layers.append(LayerWeights(
                input_norm=take(parameters[f"{prefix}.input_layernorm.weight"]),
                qkv=projection(*attn), qkv_bias=bias(*attn), o_proj=projection(f"{prefix}.self_attn.o_proj"),
                post_norm=take(parameters[f"{prefix}.post_attention_layernorm.weight"]),
                gate_up=projection(*mlp), down=projection(f"{prefix}.mlp.down_proj")))
        return cls(embed, take(parameters["model.norm.weight"]), lm_head, layers)

