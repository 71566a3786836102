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
length, and every weight matmul is one row's product (`PackedRows` on the engine's packed weight
where it can be read in place, a `MatVec` of its own layout elsewhere). The compiler keeps fused
element-wise chains in fp32 where eager torch rounds after each op: the same numerics up to
rounding.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.worker.models.layers.activation import silu_and_mul
from engine.worker.models.layers.attention import attend
from engine.worker.models.layers.linear import Linear
from engine.worker.models.layers.matvec import MatVec
from engine.worker.models.layers.packed_rows import PackedRows, embedding
from engine.worker.models.layers.rms_norm import rms_norm
from engine.worker.models.layers.rotary import rotate
from engine.worker.models.weights import frozen

if TYPE_CHECKING:
    from engine.worker.models.llama import LlamaModel


class LoneStep(torch.nn.Module):
    """The decoder's step for one row, on the engine's weights: the embedding and the norms are
    the engine's tensors themselves; each weight matmul reads the engine's packed weight in place
    (`PackedRows`), or, where oneDNN lays it out otherwise, a `MatVec` of its matrix laid out anew
    for one row. The compiled package is built without weights and handed these when loaded
    (`constants`): the process holds each weight once where the packed one is read, and the
    package none. That layout streams a little slower for one row than `MatVec`'s, whose loops
    the compiler fuses with the ops around them (one chat ~10% slower in bf16 on a 2-core EPYC);
    a second copy of every weight costs more: a 1B model in bf16 is 2 GB.

    A packed matrix is one product, a call into packed_rows.c (each call its own parallel region:
    fewer, larger calls keep both threads streaming). A `MatVec` matrix is two: q apart from k/v,
    gate from up, the head's two halves. Two consumers of the same normalized input make the
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
            layer.qkv = torch.nn.ModuleList(one_row(source.qkv, q_rows))
            layer.gate_up = torch.nn.ModuleList(one_row(source.gate_up, source.gate_up.out_features // 2))
            (layer.o_proj,), (layer.down,) = one_row(source.o_proj), one_row(source.down)
            self.layers.append(layer)
        self.head = torch.nn.ModuleList(one_row(decoder.lm_head, decoder.lm_head.out_features // 2))

    def constants(self) -> dict[str, torch.Tensor]:
        """The weights by the names a compiled package of this step asks for them: a tensor under
        two names (a tied head's packed rows, which are the embedding too) by its first only, as
        the package's graph holds it once."""
        named, held = {}, set()
        for name, parameter in self.named_parameters():
            if (parameter.data_ptr(), parameter.shape) not in held:
                held.add((parameter.data_ptr(), parameter.shape))
                named[name] = parameter.data
        return named

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
        hidden = embedding(token, self.embed)
        new_kv = []
        for index, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, eps)
            qkv = torch.cat([part(x) for part in layer.qkv], -1)
            q, kv_new = qkv[:, :heads * dim].view(heads, dim), qkv[:, heads * dim:].view(2 * kv_heads, dim)
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
            gate_up = torch.cat([part(x) for part in layer.gate_up], -1)
            half = gate_up.shape[1] // 2
            hidden = hidden + layer.down(silu_and_mul(gate_up[:, :half], gate_up[:, half:]))
            new_kv.append(torch.cat([k, v]))
        x = rms_norm(hidden, self.norm, eps)
        logits = torch.cat([part(x) for part in self.head], -1).float()
        return logits, torch.stack(new_kv).view(len(self.layers), 2, kv_heads, dim), logits.argmax(-1)


def plain_matrix(linear: Linear) -> torch.Tensor:
    """The `[out, in]` matrix of `linear`: its plain weight, or its packed one unpacked (a
    transient copy, while the one-row layout is made from it)."""
    return linear.weight if linear.weight is not None else linear.packed.to_dense()


def one_row(linear: Linear, split: int | None = None) -> list[torch.nn.Module]:
    """One row times `linear`: one product on its packed weight itself where packed_rows.py reads
    it in place, or else on `MatVec`'s layout of its matrix, a copy of its own, as one part or as
    two (its first `split` output features, then the rest). The parts' outputs, concatenated, are
    the product."""
    if linear.rows is not None:
        return [PackedRows(linear.rows, linear.bias)]
    plain = plain_matrix(linear)
    edges = [0, linear.out_features] if split is None else [0, split, linear.out_features]
    return [MatVec(plain[start:end], None if linear.bias is None else linear.bias[start:end].contiguous())
            for start, end in zip(edges, edges[1:])]
