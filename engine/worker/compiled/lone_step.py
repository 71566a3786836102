"""One new token of one sequence through the whole decoder, written for a compiler.

`LlamaModel.forward` serves any batch through the paged cache, one eager op at a time: for a
single chat on a CPU that is ~30 small ops a layer around four weight matmuls, and the ops, not
the arithmetic, take a third of the step. This module is the same decoder, assembled from the same
layers (models/layers/), for the one case that dominates what a lone user waits for, a decode step
of one sequence, written so AOTInductor can compile it into one graph (see
engine/worker/compiled/). What differs is how it reads K/V and lays out weights: the
sequence's K/V comes in one contiguous buffer for all layers instead of through block tables, the
new token's K/V goes out as an output instead of being stored in place (a graph that mutates a
large input copies it), the context length is a tensor so that one compiled graph serves every
length, and every weight matmul is a `MatVec`. The compiler keeps fused element-wise chains in
fp32 where eager torch rounds after each op: the same numerics up to rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.worker.loading.checkpoint import Checkpoint, as_checkpoint
from engine.worker.models.layers.activation import silu_and_mul
from engine.worker.models.layers.attention import attend
from engine.worker.models.layers.matvec import MatVec
from engine.worker.models.layers.rms_norm import rms_norm
from engine.worker.models.layers.rotary import rotate
from engine.worker.models.layers.shape import DecoderShape
from engine.worker.models.weights import DecoderWeights, frozen


class FrozenDecoder(torch.nn.Module):
    """The decoder's weights as frozen parameters (what the compiler folds into its graph as
    constants) and its RMSNorm; the decode graphs below are written on it."""

    def __init__(self, source: Checkpoint | torch.nn.Module, dtype: torch.dtype) -> None:
        """`source`: the model's checkpoint, or a transformers model to take it from."""
        super().__init__()
        checkpoint = as_checkpoint(source)
        self.shape, self.dtype = DecoderShape.of(checkpoint.config), dtype
        weights = DecoderWeights.of(checkpoint, dtype, torch.device("cpu"))
        self.embed, self.norm = frozen(weights.embed), frozen(weights.norm)
        self.lm_head = self.embed if weights.lm_head is weights.embed else frozen(weights.lm_head)
        self.layers = torch.nn.ModuleList()
        for w in weights.layers:
            layer = torch.nn.Module()
            for name in ("input_norm", "qkv", "qkv_bias", "o_proj", "post_norm", "gate_up", "down"):
                setattr(layer, name, frozen(getattr(w, name)))
            self.layers.append(layer)


class LoneStep(FrozenDecoder):
    """Every weight matmul is a `MatVec`. The q and the k/v projections are two of them, as are
    the gate and the up projections and the two halves of the output head: two consumers of the
    same normalized input make the compiler (with `realize_reads_threshold=1`, see
    engine/worker/compiled/) compute it once into a buffer rather than again for every
    block of weights, and two equal halves fuse into one loop that streams both."""

    def __init__(self, source: Checkpoint | torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__(source, dtype)
        q_rows = self.shape.q_size
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
        """token `[1]`; cos, sin `[1, head_dim]` (the token's position, a row of
        `RotaryTable.table`); kv `[layers, 2, kv_heads, capacity, head_dim]`, the sequence's K and
        V with its first `length` (a 0-d int64 tensor) positions filled. Returns fp32 logits
        `[1, vocab]`, the token's own K/V, `[layers, 2, kv_heads, head_dim]`, for the caller to
        store, and the logits' argmax `[1]` (what greedy sampling picks: a pass over the vocabulary
        outside the graph costs more, run with caches cold from streaming the weights)."""
        heads, kv_heads, dim = self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim
        group, scale, eps = self.shape.group, self.shape.scale, self.shape.eps
        capacity = kv.shape[3]
        mask = torch.where(torch.arange(capacity, device=kv.device) < length, 0.0, float("-inf"))
        hidden = F.embedding(token, self.embed)
        new_kv = []
        for index, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, eps)
            q, kv_new = layer.q(x).view(heads, dim), layer.kv(x).view(2 * kv_heads, dim)
            q = rotate(q, cos, sin).view(kv_heads, group, dim).float()
            k = rotate(kv_new[:kv_heads], cos, sin).view(kv_heads, 1, dim)
            v = kv_new[kv_heads:].view(kv_heads, 1, dim)
            # Products and sums rather than matmuls, over the buffer's keys and the new token's:
            # the compiler fuses them with the mask and the merge into a few loops over the buffer
            # (a `bmm` of 3 rows by a few hundred keys is a library call that costs more than the
            # arithmetic).
            keys, values = kv[index, 0].float()[:, None], kv[index, 1].float()[:, None]
            attn = attend([((q[:, :, None, :] * keys).sum(-1) * scale + mask,
                            lambda weights: (weights[..., None] * values).sum(-2)),
                           ((q * k.float()).sum(-1, keepdim=True) * scale,
                            lambda weights: weights * v.float())])
            hidden = hidden + layer.o_proj(attn.to(self.dtype).reshape(1, heads * dim))
            x = rms_norm(hidden, layer.post_norm, eps)
            hidden = hidden + layer.down(silu_and_mul(layer.gate(x), layer.up(x)))
            new_kv.append(torch.cat([k, v]))
        x = rms_norm(hidden, self.norm, eps)
        logits = torch.cat([part(x) for part in self.head], -1).float()
        return logits, torch.stack(new_kv).view(len(self.layers), 2, kv_heads, dim), logits.argmax(-1)
