"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) as the engine runs it.

One forward pass takes the tokens of every scheduled request flattened into one sequence, with
their positions; attention writes each token's K/V into the paged cache and reads each
request's context back through its block table. Logits are computed only for the rows that
sample. Weights come from the transformers model (same numerics: fp32 RMSNorm, rotate-half
rotary embeddings, SiLU-gated MLP); q/k/v and gate/up projections are fused into one matmul each.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from engine.worker.models.linear import Linear, settle_few_row_path
from engine.worker.models.rms_norm import RMSNorm


@dataclass
class AttentionMetadata:
    """Per-step inputs every layer's attention shares."""
    slot_mapping: torch.Tensor   # [num_tokens] cache slot of each new token
    cu_seqlens_q: torch.Tensor   # [num_seqs + 1] query offsets into the flattened batch
    seqused_k: torch.Tensor      # [num_seqs] context length after this step
    block_table: torch.Tensor    # [num_seqs, max_blocks] int32
    plan: object = None          # the kernels' per-step tiling (kernels.plan_attention), if they use one
    slot_index: object = None    # the slots as the kernels' store wants them (kernels.slot_index), if it does


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


@dataclass
class LlamaLayer:
    input_norm: RMSNorm
    qkv: Linear
    o_proj: Linear
    post_norm: RMSNorm
    gate_up: Linear
    down: Linear


class LlamaModel:
    def __init__(self, hf_model, dtype: torch.dtype, device: torch.device) -> None:
        config = hf_model.config
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.hidden_size = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.vocab_size = config.vocab_size
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.dtype, self.device = dtype, device

        weights = DecoderWeights.of(hf_model, dtype, device)
        self.embed = weights.embed
        self.norm = RMSNorm(weights.norm, self.eps)
        self.tied = weights.lm_head is weights.embed
        self.lm_head = Linear(weights.lm_head)
        self.layers = [LlamaLayer(input_norm=RMSNorm(w.input_norm, self.eps), qkv=Linear(w.qkv, w.qkv_bias),
                                  o_proj=Linear(w.o_proj), post_norm=RMSNorm(w.post_norm, self.eps),
                                  gate_up=Linear(w.gate_up), down=Linear(w.down))
                       for w in weights.layers]
        # Which weight layout one decoding chat streams fastest depends on the CPU: timed here, once.
        settle_few_row_path(
            [linear for layer in self.layers for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            + [self.lm_head])
        rotary = hf_model.model.rotary_emb
        self._inv_freq = rotary.inv_freq.detach().float().to(device)
        self._rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self._cos_sin = self._make_rope_table(getattr(config, "max_position_embeddings", 4096))
        self._kv_views: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def _make_rope_table(self, length: int) -> torch.Tensor:
        """cos and sin for positions 0..length-1, `[length, 2, head_dim]`, as transformers
        computes them (fp32, then cast)."""
        positions = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = torch.outer(positions, self._inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        table = torch.stack([emb.cos(), emb.sin()], dim=1) * self._rope_scaling
        return table.to(self.dtype)

    @property
    def rope_table(self) -> torch.Tensor:
        """cos and sin by position, `[rope_length, 2, head_dim]`."""
        return self._cos_sin

    @property
    def rope_length(self) -> int:
        return self._cos_sin.shape[0]

    def ensure_rope(self, length: int) -> None:
        """Make the rotary table cover positions 0..length-1 (never shrinks it)."""
        if length > self._cos_sin.shape[0]:
            self._cos_sin = self._make_rope_table(length)

    @property
    def num_parameters(self) -> int:
        """Every weight counted once (a tied output embedding is the input embedding)."""
        total = self.embed.numel() + self.norm.numel() + (0 if self.tied else self.lm_head.numel())
        for layer in self.layers:
            total += sum(part.numel() for part in vars(layer).values())
        return total

    def kv_block_bytes(self, block_size: int, dtype: torch.dtype | None = None) -> int:
        element = torch.empty((), dtype=dtype or self.dtype).element_size()
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * element

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Head-major inside a block (see kernels/reference.py); `layer_kv` gives a layer's views."""
        return (num_blocks, self.num_layers, 2, self.num_kv_heads, block_size, self.head_dim)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: `[num_tokens]`; returns fp32 logits `[len(logits_indices), vocab]`.
        Positions must be below `rope_length` (see `ensure_rope`): checking here would read them
        back from the device on every step."""
        cos_sin = self._cos_sin[positions]  # [num_tokens, 2, head_dim]
        cos, sin = cos_sin[:, None, 0], cos_sin[:, None, 1]
        hidden = F.embedding(input_ids, self.embed)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        num_qk_heads = self.num_heads + self.num_kv_heads
        for layer, (k_cache, v_cache) in zip(self.layers, self._layer_views(kv_cache)):
            x = layer.input_norm(hidden)
            qkv = layer.qkv(x)
            # q and k rotate together and in place: one set of small ops per layer instead of
            # two, and k stays next to v, so the cache store writes both at once.
            _rotate_(qkv[:, :q_size + kv_size].view(-1, num_qk_heads, self.head_dim), cos, sin)
            q = qkv[:, :q_size].view(-1, self.num_heads, self.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(-1, self.num_kv_heads, self.head_dim)
            v = qkv[:, q_size + kv_size:].view(-1, self.num_kv_heads, self.head_dim)
            kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.slot_index)
            attn = kernels.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seqused_k,
                                           meta.block_table, self.scale, attention_plan=meta.plan)
            hidden = hidden + layer.o_proj(attn.reshape(-1, q_size))
            x = layer.post_norm(hidden)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            hidden = hidden + layer.down(F.silu(gate).mul_(up))
        last = self.norm(hidden[logits_indices])
        return self.lm_head(last).float()

    def _layer_views(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (K, V) views of the cache, made once per cache rather than every step."""
        if self._kv_views is None or self._kv_views[0] is not kv_cache:
            self._kv_views = (kv_cache, [layer_kv(kv_cache, i) for i in range(self.num_layers)])
        return self._kv_views[1]


def layer_kv(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V caches as the kernels take them, `[num_blocks, block_size, num_kv_heads,
    head_dim]` views of the engine's cache (`LlamaModel.kv_cache_shape`)."""
    return kv_cache[:, layer, 0].transpose(1, 2), kv_cache[:, layer, 1].transpose(1, 2)


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding, rotate-half style, written over `x` (same arithmetic as transformers)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    torch.add(x * cos, rotated * sin, out=x)
