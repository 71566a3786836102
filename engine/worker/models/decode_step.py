"""One new token of one sequence through the whole decoder, written for a compiler.

`LlamaModel.forward` serves any batch through the paged cache, one eager op at a time: for a
single chat on a CPU that is ~30 small ops a layer around four weight matmuls, and the ops, not
the arithmetic, take a third of the step. This module is the same decoder for the one case that
dominates what a lone user waits for, a decode step of one sequence, written so AOTInductor can
compile it into one graph (see engine/worker/compiled_decode.py): the sequence's K/V comes in one
contiguous buffer for all layers instead of through block tables, the new token's K/V goes out
as an output instead of being stored in place (a graph that mutates a large input copies it),
and the context length is a tensor so that one compiled graph serves every length.

Same numerics as `LlamaModel` (fp32 RMSNorm rounded once to 16 bits after the weight, rotate-half
rotary, fp32 softmax, SiLU-gated MLP), up to rounding: the compiler keeps fused element-wise
chains in fp32 where eager torch rounds after each op.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.worker.models.llama import DecoderWeights


def _frozen(t: torch.Tensor | None) -> torch.nn.Parameter | None:
    return None if t is None else torch.nn.Parameter(t, requires_grad=False)


class FrozenDecoder(torch.nn.Module):
    """The decoder's weights as frozen parameters (what the compiler folds into its graph as
    constants) and the decoder's RMSNorm; the decode graphs below are written on it."""

    def __init__(self, hf_model, dtype: torch.dtype) -> None:
        super().__init__()
        config = hf_model.config
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps, self.dtype = config.rms_norm_eps, dtype
        weights = DecoderWeights.of(hf_model, dtype, torch.device("cpu"))
        self.embed, self.norm = _frozen(weights.embed), _frozen(weights.norm)
        self.lm_head = self.embed if weights.lm_head is weights.embed else _frozen(weights.lm_head)
        self.layers = torch.nn.ModuleList()
        for w in weights.layers:
            layer = torch.nn.Module()
            for name in ("input_norm", "qkv", "qkv_bias", "o_proj", "post_norm", "gate_up", "down"):
                setattr(layer, name, _frozen(getattr(w, name)))
            self.layers.append(layer)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * weight.float()).to(x.dtype)


class DecodeStep(FrozenDecoder):
    def __init__(self, hf_model, dtype: torch.dtype, matmuls_as_sums: bool = False) -> None:
        """`matmuls_as_sums` (fp32 only): each weight matmul written as a product and a sum over
        the input features, which the compiler turns into its own matrix-vector loop, instead
        of a `linear` it hands to a library (in bf16, freezing would store the weights converted
        to fp32, twice the bytes to stream)."""
        super().__init__(hf_model, dtype)
        self.matmuls_as_sums = matmuls_as_sums

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.matmuls_as_sums:
            return F.linear(x, weight, bias)
        y = (x[..., None, :] * weight).sum(-1)
        return y if bias is None else y + bias

    def forward(self, token: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """token `[1]`; cos, sin `[1, head_dim]` (the token's position); kv `[layers, 2,
        kv_heads, capacity, head_dim]`, the sequence's K and V with its first `length` (a 0-d
        int64 tensor) positions filled. Returns fp32 logits `[1, vocab]`, the token's own K/V,
        `[layers, 2, kv_heads, head_dim]`, for the caller to store, and the logits' argmax `[1]`
        (what greedy sampling picks: a pass over the vocabulary outside the graph costs more, run
        with caches cold from streaming the weights)."""
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        group, half, scale = heads // kv_heads, dim // 2, dim ** -0.5
        capacity = kv.shape[3]
        mask = torch.where(torch.arange(capacity, device=kv.device) < length, 0.0, float("-inf"))
        hidden = F.embedding(token, self.embed)
        new_kv = []
        for index, layer in enumerate(self.layers):
            qkv = self._linear(self.rms_norm(hidden, layer.input_norm), layer.qkv, layer.qkv_bias)
            qk = qkv[:, :(heads + kv_heads) * dim].view(heads + kv_heads, dim)
            qk = qk * cos + torch.cat([-qk[:, half:], qk[:, :half]], -1) * sin
            q = qk[:heads].view(kv_heads, group, dim).float()
            k = qk[heads:].view(kv_heads, 1, dim)
            v = qkv[:, (heads + kv_heads) * dim:].view(kv_heads, 1, dim)
            # Products and sums rather than matmuls: the compiler fuses them with the mask and the
            # softmax into loops over the buffer (a `bmm` of 3 rows by a few hundred keys is a
            # library call that costs more than the arithmetic).
            keys, values = kv[index, 0].float()[:, None], kv[index, 1].float()[:, None]
            scores = (q[:, :, None, :] * keys).sum(-1) * scale + mask
            own = (q * k.float()).sum(-1, keepdim=True) * scale
            probs = torch.softmax(torch.cat([scores, own], -1), -1)
            attn = (probs[..., :capacity, None] * values).sum(-2) + probs[..., capacity:] * v.float()
            hidden = hidden + self._linear(attn.to(self.dtype).reshape(1, heads * dim), layer.o_proj)
            gate, up = self._linear(self.rms_norm(hidden, layer.post_norm), layer.gate_up).chunk(2, -1)
            hidden = hidden + self._linear(F.silu(gate) * up, layer.down)
            new_kv.append(torch.cat([k, v]))
        logits = self._linear(self.rms_norm(hidden, self.norm), self.lm_head).float()
        return logits, torch.stack(new_kv).view(len(self.layers), 2, kv_heads, dim), logits.argmax(-1)
