"""One step of any mix of prompt chunks and decodes through the whole decoder, written for a
compiler, reading past K/V where it lies in the paged cache.

A busy server's steps are mostly decodes (one new token for each running chat), but every arrival
brings a prompt chunk (its new turn past what the prefix cache holds) into a step beside them.
`FlatStep` runs such a step as one batch, as vLLM does: every new token, a decode's or a prompt's,
is a row of the same weight matmuls, so an arrival costs its own tokens' rows and no second pass
over the weights. Only attention tells the rows apart, and it takes them in two groups:

- decode rows (a sequence with one new token): each reads its own past keys where they lie in
  the cache and its own new key, one query row per sequence, as in a batch of decodes;
- prompt chunks (a sequence with several new tokens): their rows are laid out per sequence,
  padded to the longest chunk, and each reads its sequence's past keys and the chunk's own new
  keys up to itself (causal). Chats' chunks are short (a new turn: tens of tokens), so the
  padding costs little, where padding the decodes to the longest chunk would cost a chunk's
  length in attention rows for every decoding chat.

Both groups also read, once for all of their rows, the blocks every sequence of the step shares
before any of its new tokens (a common system prompt). The parts are merged as one softmax
(layers/attention.py). New K/V is computed here and returned rather than stored (a graph that
writes into a large input copies it); the caller stores it. Logits are computed only for the rows
that sample.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.worker.models.layers.activation import silu_and_mul
from engine.worker.models.layers.attention import attend
from engine.worker.models.layers.linear import Linear, batch_matmul
from engine.worker.models.layers.packed_rows import embedding
from engine.worker.models.layers.rms_norm import rms_norm
from engine.worker.models.layers.rotary import rotate
from engine.worker.models.weights import frozen

if TYPE_CHECKING:
    from engine.worker.models.llama import LlamaModel


class FlatStep(torch.nn.Module):
    """The step over the engine's own weights: each is the very tensor the engine's eager path
    multiplies by (for a matmul, `Linear.batch_weight`), held, not copied. Its compiled package is
    built without them and handed them when loaded (`constants`), so serving it costs no memory
    for weights."""

    def __init__(self, decoder: LlamaModel) -> None:
        super().__init__()
        self.shape, self.dtype = decoder.shape, decoder.dtype
        linears = [decoder.lm_head, *(getattr(layer, name) for layer in decoder.layers
                                      for name in ("qkv", "o_proj", "gate_up", "down"))]
        if not all(isinstance(linear, Linear) for linear in linears):
            raise ValueError("the flat step multiplies by plain or packed matrices, not quantized ones")
        self.packed = linears[0].batch_weight.is_mkldnn  # oneDNN packs all of a model's matrices or none
        if any(linear.batch_weight.is_mkldnn != self.packed for linear in linears):
            raise ValueError("the flat step takes a model's matrices all packed for oneDNN or all plain")
        self.embed, self.norm = frozen(decoder.embed), frozen(decoder.norm.weight)
        self.lm_head = frozen(decoder.lm_head.batch_weight)
        self.layers = torch.nn.ModuleList()
        for source in decoder.layers:
            layer = torch.nn.Module()
            layer.input_norm, layer.post_norm = frozen(source.input_norm.weight), frozen(source.post_norm.weight)
            layer.qkv, layer.qkv_bias = frozen(source.qkv.batch_weight), frozen(source.qkv.bias)
            for name in ("o_proj", "gate_up", "down"):
                setattr(layer, name, frozen(getattr(source, name).batch_weight))
            self.layers.append(layer)

    def constants(self) -> dict[str, torch.Tensor]:
        """The weights by the names a compiled package of this step asks for them."""
        return {name: parameter.data for name, parameter in self.named_parameters()}

    def forward(self, decode_tokens: torch.Tensor, prompt_tokens: torch.Tensor, decode_rotary: torch.Tensor,
                prompt_rotary: torch.Tensor, kv_cache: torch.Tensor, shared_blocks: torch.Tensor,
                shared_bias: torch.Tensor, decode_blocks: torch.Tensor, decode_bias: torch.Tensor,
                prompt_blocks: torch.Tensor, prompt_bias: torch.Tensor, chunk_rows: torch.Tensor,
                chunk_bias: torch.Tensor, prompt_rows: torch.Tensor,
                logits_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's rows are D decode tokens, then Tp prompt tokens (P chunks, one after another).

        decode_tokens `[D]`, prompt_tokens `[Tp]`; decode_rotary `[D, 2, head_dim]`, prompt_rotary
        `[Tp, 2, head_dim]` (each token's position's rows of `RotaryTable.table`); kv_cache the
        engine's `[num_blocks, layers, 2, kv_heads, block_size, head_dim]`, of which only past
        tokens are read; shared_blocks `[S]`, the blocks every sequence starts with, before any of
        its new tokens, and shared_bias `[S * block_size]` added to their scores (0, or -inf for
        keys no one may see); decode_blocks `[D, Od]`, each decoding sequence's blocks after those
        (any id past its end), decode_bias `[D, Od * block_size]` (-inf past its past tokens);
        prompt_blocks `[P, Op]` and prompt_bias `[P, Op * block_size]` the same for each chunk's
        sequence (-inf from the chunk's first position on); chunk_rows `[P, Q]`, each chunk's
        prompt-token indices padded to the longest chunk (padding: any index), chunk_bias
        `[P, Q, Q]` the chunk's causal mask (0 where query i sees new key j, -inf elsewhere; every
        row sees at least one key); prompt_rows `[Tp]`, each prompt token's index in the padded
        `[P * Q]` layout; logits_rows `[R]`, the rows (of D + Tp) whose logits are wanted.

        Returns fp32 logits `[R, vocab]`, every row's new K/V `[D + Tp, layers, 2, kv_heads,
        head_dim]` for the caller to store, and the logits' argmax `[R]`."""
        heads, kv_heads, dim = self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim
        group, scale, eps, dtype, packed = self.shape.group, self.shape.scale, self.shape.eps, self.dtype, self.packed
        decodes, block_size = decode_tokens.shape[0], kv_cache.shape[4]
        chunks, width = chunk_rows.shape
        shared_len = shared_blocks.shape[0] * block_size
        decode_len, prompt_len = decode_blocks.shape[1] * block_size, prompt_blocks.shape[1] * block_size
        hidden = embedding(torch.cat([decode_tokens, prompt_tokens]), self.embed)
        rows = hidden.shape[0]
        rotary = torch.cat([decode_rotary, prompt_rotary])
        cos, sin = rotary[:, None, 0], rotary[:, None, 1]
        decode_bias = decode_bias[None, :, None, :]
        prompt_bias = prompt_bias[None, :, None, :]
        # A query's `group` heads are rows of its K/V head's matmul: the chunk's mask for each of them.
        chunk_bias = chunk_bias[:, :, None, :].expand(chunks, width, group, width).reshape(chunks, width * group, width)
        new_kv = []
        for index, layer in enumerate(self.layers):
            qkv = batch_matmul(rms_norm(hidden, layer.input_norm, eps), layer.qkv, layer.qkv_bias, packed)
            qk = rotate(qkv[:, :(heads + kv_heads) * dim].view(rows, heads + kv_heads, dim), cos, sin)
            q = (qk[:, :heads] * scale).view(rows, kv_heads, group, dim).transpose(0, 1)  # [kv_heads, rows, group, dim]
            k, v = qk[:, heads:], qkv[:, (heads + kv_heads) * dim:].view(rows, kv_heads, dim)
            cache = kv_cache[:, index]  # [blocks, 2, kv_heads, block_size, dim]
            shared = cache[shared_blocks].permute(1, 2, 0, 3, 4).reshape(2, kv_heads, shared_len, dim)
            # Every row's queries against the shared keys: one matmul per K/V head.
            shared_scores = torch.matmul(q.reshape(kv_heads, rows * group, dim), shared[0].transpose(1, 2))
            shared_scores = shared_scores.view(kv_heads, rows, group, shared_len).float() + shared_bias

            # Decode rows: their own past blocks and their own new key.
            q_dec, k_dec, v_dec = q[:, :decodes], k[:decodes].transpose(0, 1), v[:decodes].transpose(0, 1)
            # Products and sums over the blocks where they lie, which the compiler fuses into loops
            # that read the cache in place: as matmuls, each row's keys would first be gathered
            # into a copy (a row's context read twice and written once; 32 chats' 32-row step
            # took 0.75-0.84 of its time without those copies).
            own = cache[decode_blocks].permute(2, 3, 0, 1, 4, 5).reshape(2, kv_heads, decodes, decode_len, dim)
            own_k, own_v = own[0].float(), own[1].float()
            decoded = attend([
                (shared_scores[:, :decodes],
                 lambda weights: torch.matmul(weights.to(dtype).view(kv_heads, decodes * group, shared_len),
                                              shared[1]).view(kv_heads, decodes, group, dim).float()),
                ((q_dec.float()[:, :, :, None, :] * own_k[:, :, None]).sum(-1) + decode_bias,  # [kv_heads, D, group, Od*bs]
                 lambda weights: (weights[..., None] * own_v[:, :, None]).sum(-2)),
                ((q_dec * k_dec[:, :, None]).sum(-1, keepdim=True).float(),
                 lambda weights: weights * v_dec[:, :, None].float())])

            # Prompt chunks, padded to the longest: their sequences' past blocks and the chunk itself.
            q_chunk = q[:, decodes:][:, chunk_rows].reshape(kv_heads, chunks, width * group, dim)
            k_chunk = k[decodes:][chunk_rows].permute(2, 0, 1, 3)  # [kv_heads, P, Q, dim]
            v_chunk = v[decodes:][chunk_rows].permute(2, 0, 1, 3)
            past = cache[prompt_blocks.reshape(-1)].view(chunks, -1, 2, kv_heads, block_size, dim)
            past = past.permute(2, 3, 0, 1, 4, 5).reshape(2, kv_heads, chunks, prompt_len, dim)
            chunked = attend([
                (shared_scores[:, decodes:][:, chunk_rows].reshape(kv_heads, chunks, width * group, shared_len),
                 lambda weights: torch.matmul(weights.to(dtype).view(kv_heads, chunks * width * group, shared_len),
                                              shared[1]).view(kv_heads, chunks, width * group, dim).float()),
                (torch.matmul(q_chunk, past[0].transpose(2, 3)).float() + prompt_bias,  # [kv_heads, P, Q*group, Op*bs]
                 lambda weights: torch.matmul(weights.to(dtype), past[1]).float()),
                (torch.matmul(q_chunk, k_chunk.transpose(2, 3)).float() + chunk_bias,  # [kv_heads, P, Q*group, Q]
                 lambda weights: torch.matmul(weights.to(dtype), v_chunk).float())])
            chunked = chunked.view(kv_heads, chunks * width, group, dim)[:, prompt_rows]

            attn = torch.cat([decoded, chunked], 1)  # [kv_heads, rows, group, dim]
            attn = attn.to(dtype).permute(1, 0, 2, 3).reshape(rows, heads * dim)
            hidden = hidden + batch_matmul(attn, layer.o_proj, None, packed)
            gate, up = batch_matmul(rms_norm(hidden, layer.post_norm, eps), layer.gate_up, None, packed).chunk(2, -1)
            hidden = hidden + batch_matmul(silu_and_mul(gate, up), layer.down, None, packed)
            new_kv.append(torch.stack([k, v], 1))
        logits = batch_matmul(rms_norm(hidden[logits_rows], self.norm, eps), self.lm_head, None, packed).float()
        return logits, torch.stack(new_kv, 1), logits.argmax(-1)
