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


class MatVec(torch.nn.Module):
    """A weight matrix laid out for one row times it, computed by a loop the compiler writes.

    One sequence's decode step multiplies one row by every weight matrix: it streams the weights
    once, and the step is as fast as that stream. The weight `[out, in]` is kept in blocks of
    `width` output features, `[out / width, in, width]`, where `width` features fill one cache
    line: the loop walks each block's lines in order, one multiply-add a line into a vector of
    `width` sums, with no sum across a vector and no library call. On a 2-core AMD EPYC it
    streams a bf16 matrix at ~92% of a plain read's rate, where torch's `linear` reaches ~60%."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        rows, cols = weight.shape
        width = max(1, 64 // weight.element_size())
        padded = -(-rows // width) * width
        weight = F.pad(weight.detach(), (0, 0, 0, padded - rows))
        self.blocks = _frozen(weight.view(padded // width, width, cols).transpose(1, 2).contiguous())
        self.bias, self.rows = _frozen(bias), rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[1, in]` → `[1, out]`; compiled, accumulated in fp32 and rounded once to x's dtype."""
        y = (x.view(-1, 1) * self.blocks).sum(1).view(1, -1)[:, :self.rows]
        return y if self.bias is None else y + self.bias


class DecodeStep(FrozenDecoder):
    """Every weight matmul is a `MatVec`. The q and the k/v projections are two of them, as are
    the gate and the up projections and the two halves of the output head: two consumers of the
    same normalized input make the compiler (with `realize_reads_threshold=1`, see
    engine/worker/compiled_decode.py) compute it once into a buffer rather than again for every
    block of weights, and two equal halves fuse into one loop that streams both."""

    def __init__(self, hf_model, dtype: torch.dtype) -> None:
        super().__init__(hf_model, dtype)
        q_rows = self.num_heads * self.head_dim
        for layer in self.layers:
            plain = {name: getattr(layer, name) for name in ("qkv", "qkv_bias", "o_proj", "gate_up", "down")}
            for name in plain:
                delattr(layer, name)
            qkv, bias, half = plain["qkv"], plain["qkv_bias"], plain["gate_up"].shape[0] // 2
            layer.q = MatVec(qkv[:q_rows], None if bias is None else bias[:q_rows])
            layer.kv = MatVec(qkv[q_rows:], None if bias is None else bias[q_rows:])
            layer.gate, layer.up = MatVec(plain["gate_up"][:half]), MatVec(plain["gate_up"][half:])
            layer.o_proj, layer.down = MatVec(plain["o_proj"]), MatVec(plain["down"])
        half = self.lm_head.shape[0] // 2
        self.head = torch.nn.ModuleList([MatVec(self.lm_head[:half]), MatVec(self.lm_head[half:])])
        del self.lm_head

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
        # Rotate-half rotary as one element-wise expression: the halves swapped by a flip (an
        # index the compiler folds into the loop) and the sign folded into sin.
        signed_sin = sin * torch.where(torch.arange(dim, device=kv.device) < half, -1.0, 1.0)

        def rotate(t: torch.Tensor) -> torch.Tensor:
            swapped = t.view(-1, 2, half).flip(1).reshape(-1, dim)
            return (t * cos + swapped * signed_sin).to(t.dtype)

        hidden = F.embedding(token, self.embed)
        new_kv = []
        for index, layer in enumerate(self.layers):
            x = self.rms_norm(hidden, layer.input_norm)
            q, kv_new = layer.q(x).view(heads, dim), layer.kv(x).view(2 * kv_heads, dim)
            q = rotate(q).view(kv_heads, group, dim).float()
            k = rotate(kv_new[:kv_heads]).view(kv_heads, 1, dim)
            v = kv_new[kv_heads:].view(kv_heads, 1, dim)
            # Products and sums rather than matmuls, and the softmax spelled out over the buffer's
            # keys and the new token's: the compiler fuses them with the mask into a few loops over
            # the buffer (a `bmm` of 3 rows by a few hundred keys is a library call that costs more
            # than the arithmetic; a concatenation is a loop of its own).
            keys, values = kv[index, 0].float()[:, None], kv[index, 1].float()[:, None]
            scores = (q[:, :, None, :] * keys).sum(-1) * scale + mask
            own = (q * k.float()).sum(-1, keepdim=True) * scale
            top = torch.maximum(scores.amax(-1, keepdim=True), own)
            weights, own_weight = torch.exp(scores - top), torch.exp(own - top)
            total = weights.sum(-1, keepdim=True) + own_weight
            attn = ((weights[..., None] * values).sum(-2) + own_weight * v.float()) / total
            hidden = hidden + layer.o_proj(attn.to(self.dtype).reshape(1, heads * dim))
            x = self.rms_norm(hidden, layer.post_norm)
            hidden = hidden + layer.down(F.silu(layer.gate(x)) * layer.up(x))
            new_kv.append(torch.cat([k, v]))
        x = self.rms_norm(hidden, self.norm)
        logits = torch.cat([part(x) for part in self.head], -1).float()
        return logits, torch.stack(new_kv).view(len(self.layers), 2, kv_heads, dim), logits.argmax(-1)
