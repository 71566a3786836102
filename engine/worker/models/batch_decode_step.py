"""A batch of decodes (one new token for each of several sequences) through the whole decoder,
written for a compiler, reading past K/V where it lies in the paged cache.

Eager torch runs a 32-chat decode step as ~1,000 ops, of which the weight matmuls are only half
the time: the rest is dispatch and small ops around attention (gathers, masks, a softmax, rotary,
norms). `BatchDecodeStep` is the same decoder as `LlamaModel.forward`, assembled from the same
layers (models/layers/), for the case that dominates a busy server, every sequence adding one
token, written so AOTInductor can compile it into one graph (engine/worker/compiled_decode.py):
the ops between matmuls fuse into loops, the gathers out of the paged cache become loops that read
the blocks in place, and only the matmuls (weights and attention) remain library calls.

Attention reads the keys in three parts (merged by layers/attention.py): the blocks every sequence
shares first (a common system prompt: read once, for all sequences' queries as one matmul), each
sequence's own blocks after them, and its new token, whose K/V is computed here and returned
rather than stored (a graph that writes into a large input copies it); the caller stores it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.worker.models.decode_step import FrozenDecoder
from engine.worker.models.layers.activation import silu_and_mul
from engine.worker.models.layers.attention import attend
from engine.worker.models.layers.rms_norm import rms_norm
from engine.worker.models.layers.rotary import rotate


class BatchDecodeStep(FrozenDecoder):
    def forward(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                shared_blocks: torch.Tensor, shared_bias: torch.Tensor, own_blocks: torch.Tensor,
                own_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens `[B]`; cos, sin `[B, head_dim]` (each token's position, rows of
        `RotaryTable.table`); kv_cache the engine's `[num_blocks, layers, 2, kv_heads,
        block_size, head_dim]`, of which only past tokens are read; shared_blocks `[S]`, the
        blocks every sequence starts with, and shared_bias `[S * block_size]` added to their
        scores (0, or -inf for keys no one may see); own_blocks `[B, O]`, each sequence's blocks
        after those (any id past its end), and own_bias `[B, O * block_size]` (-inf past each
        sequence's past tokens). Returns fp32 logits `[B, vocab]`, the new tokens' K/V `[B,
        layers, 2, kv_heads, head_dim]` for the caller to store, and the logits' argmax `[B]`."""
        heads, kv_heads, dim = self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim
        group, scale, eps, dtype = self.shape.group, self.shape.scale, self.shape.eps, self.dtype
        batch, block_size = tokens.shape[0], kv_cache.shape[4]
        shared_len, own_len = shared_blocks.shape[0] * block_size, own_blocks.shape[1] * block_size
        hidden = F.embedding(tokens, self.embed)
        cos, sin = cos[:, None], sin[:, None]
        own_bias = own_bias[None, :, None, :]
        new_kv = []
        for index, layer in enumerate(self.layers):
            qkv = F.linear(rms_norm(hidden, layer.input_norm, eps), layer.qkv, layer.qkv_bias)
            qk = rotate(qkv[:, :(heads + kv_heads) * dim].view(batch, heads + kv_heads, dim), cos, sin)
            q = (qk[:, :heads] * scale).view(batch, kv_heads, group, dim).transpose(0, 1)  # [kv_heads, B, group, dim]
            k, v = qk[:, heads:], qkv[:, (heads + kv_heads) * dim:].view(batch, kv_heads, dim)
            cache = kv_cache[:, index]  # [blocks, 2, kv_heads, block_size, dim]
            shared = cache[shared_blocks].permute(1, 2, 0, 3, 4).reshape(2, kv_heads, shared_len, dim)
            own = cache[own_blocks.reshape(-1)].view(batch, -1, 2, kv_heads, block_size, dim)
            own = own.permute(2, 3, 0, 1, 4, 5).reshape(2, kv_heads, batch, own_len, dim)
            # A K/V head's queries from every sequence are the rows of one matmul with the shared keys.
            shared_scores = torch.matmul(q.reshape(kv_heads, batch * group, dim), shared[0].transpose(1, 2))
            attn = attend([
                (shared_scores.view(kv_heads, batch, group, shared_len).float() + shared_bias,
                 lambda weights: torch.matmul(weights.to(dtype).view(kv_heads, batch * group, shared_len),
                                              shared[1]).view(kv_heads, batch, group, dim).float()),
                (torch.matmul(q, own[0].transpose(2, 3)).float() + own_bias,  # [kv_heads, B, group, own_len]
                 lambda weights: torch.matmul(weights.to(dtype), own[1]).float()),
                ((q * k.transpose(0, 1)[:, :, None]).sum(-1, keepdim=True).float(),
                 lambda weights: weights * v.transpose(0, 1)[:, :, None].float())])
            hidden = hidden + F.linear(attn.to(dtype).permute(1, 0, 2, 3).reshape(batch, heads * dim), layer.o_proj)
            gate, up = F.linear(rms_norm(hidden, layer.post_norm, eps), layer.gate_up).chunk(2, -1)
            hidden = hidden + F.linear(silu_and_mul(gate, up), layer.down)
            new_kv.append(torch.stack([k, v], 1))
        logits = F.linear(rms_norm(hidden, self.norm, eps), self.lm_head).float()
        return logits, torch.stack(new_kv, 1), logits.argmax(-1)
