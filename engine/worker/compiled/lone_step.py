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

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.worker.models.layers.activation import silu_and_mul
from engine.worker.models.layers.attention import attend
from engine.worker.models.layers.linear import Linear
from engine.worker.models.layers.matvec import MatVec
from engine.worker.models.layers.rms_norm import rms_norm
from engine.worker.models.layers.rotary import rotate
from engine.worker.models.weights import frozen

if TYPE_CHECKING:
    from engine.worker.models.llama import LlamaModel


class LoneStep(torch.nn.Module):
    """The decoder's step for one row, on the engine's weights: the embedding and the norms are
    the engine's tensors themselves; each weight matmul is a `MatVec`, its matrix laid out anew
    for one row (from the engine's plain matrix, or from its packed one where that is all it
    keeps). The compiled package is built without weights and handed these when loaded
    (`constants`), so the process holds the one-row layout once and the package none.

    The q and the k/v projections are two `MatVec`s, as are the gate and the up projections and
    the two halves of the output head: two consumers of the same normalized input make the
    compiler (with `realize_reads_threshold=1`, see engine/worker/compiled/export.py) compute it
    once into a buffer rather than again for every block of weights, and two equal halves fuse
    into one loop that streams both."""

    def __init__(self, decoder: LlamaModel) -> None:
        super().__init__()
        self.shape, self.dtype = decoder.shape, decoder.dtype
        linears = [decoder.lm_head, *(getattr(layer, name) for layer in decoder.layers
                                      for name in ("qkv", "o_proj", "gate_up", "down"))]
        if not all(isinstance(linear, Linear) for linear in linears):
            raise ValueError("the lone step multiplies by plain or packed matrices, not quantized ones")
        self.embed, self.norm = frozen(decoder.embed), frozen(decoder.norm.weight)
        q_rows = self.shape.q_size
        self.layers = torch.nn.ModuleList()
        for source in decoder.layers:
            layer = torch.nn.Module()
            layer.input_norm, layer.post_norm = frozen(source.input_norm.weight), frozen(source.post_norm.weight)
            qkv, bias = plain_matrix(source.qkv), source.qkv.bias
            layer.q = MatVec(qkv[:q_rows], None if bias is None else bias[:q_rows].contiguous())
            layer.kv = MatVec(qkv[q_rows:], None if bias is None else bias[q_rows:].contiguous())
            del qkv
            gate_up = plain_matrix(source.gate_up)
            half = gate_up.shape[0] // 2
            layer.gate, layer.up = MatVec(gate_up[:half]), MatVec(gate_up[half:])
            del gate_up
            layer.o_proj, layer.down = MatVec(plain_matrix(source.o_proj)), MatVec(plain_matrix(source.down))
            self.layers.append(layer)
        head = plain_matrix(decoder.lm_head)
        half = head.shape[0] // 2
        self.head = torch.nn.ModuleList([MatVec(head[:half]), MatVec(head[half:])])

    def constants(self) -> dict[str, torch.Tensor]:
        """The weights by the names a compiled package of this step asks for them."""
        return {name: parameter.data for name, parameter in self.named_parameters()}

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


def plain_matrix(linear: Linear) -> torch.Tensor:
    """The `[out, in]` matrix of `linear`: its plain weight, or its packed one unpacked (a
    transient copy, while the one-row layout is made from it)."""
    return linear.weight if linear.weight is not None else linear.packed.to_dense()
