"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) as the engine runs it, eagerly.

One forward pass takes the tokens of every scheduled request flattened into one sequence, with
their positions; attention writes each token's K/V into the paged cache and reads each
request's context back through its block table (kernels.paged_attention). Logits are computed
only for the rows that sample. The layers' maths is models/layers/'s, shared with the compiled
decode steps; weights come from the model's checkpoint (models/weights.py), q/k/v and gate/up
projections fused into one matmul each. On a model whose layer matrices are all kept quantized (a
GGUF file served natively, float32 on a CPU), a step whose every sequence computes one token (a
lone chat's, a batch of decodes) or a small one (a cached prompt's tail) runs its layers in one
native call instead (engine/worker/quantized/native_layers.py), the same arithmetic in C, and
every other step takes its norms from native code (RMSNorm.native).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from engine.worker.loading.checkpoint import Checkpoint, as_checkpoint
from engine.worker.kv_layout import kv_cache_shape, layer_kv
from engine.worker.models.layers.activation import silu_and_mul
from engine.worker.models.layers.linear import Linear, settle_few_row_path
from engine.worker.models.layers.packed_rows import embedding
from engine.worker.models.layers.quantized_linear import QuantizedLinear
from engine.worker.models.layers.rms_norm import RMSNorm
from engine.worker.models.layers.rotary import RotaryTable, rotate
from engine.worker.models.layers.row_attention import RowAttention
from engine.worker.models.layers.shape import DecoderShape
from engine.worker.models.weights import DecoderWeights, Weight
from engine.worker.quantized import native
from engine.worker.quantized.native_layers import NativeLayers
from engine.worker.quantized.matrix import QuantizedMatrix

# A step that is not all decodes runs natively (decodes_natively) when it has at most
# NATIVE_STEP_TOKENS tokens, or when no sequence brings more than NATIVE_QUERY_TOKENS and the step
# at most NATIVE_STEP_ROWS: chats' new turns past a cached prompt.
NATIVE_STEP_TOKENS = 16
NATIVE_QUERY_TOKENS = 32
NATIVE_STEP_ROWS = 1024


@dataclass
class AttentionMetadata:
    """Per-step inputs every layer's attention shares."""
    slot_mapping: torch.Tensor   # [num_tokens] cache slot of each new token
    cu_seqlens_q: torch.Tensor   # [num_seqs + 1] query offsets into the flattened batch
    seqused_k: torch.Tensor      # [num_seqs] context length after this step
    block_table: torch.Tensor    # [num_seqs, max_blocks] int32
    plan: object = None          # the kernels' per-step tiling (kernels.plan_attention), if they use one
    slot_index: object = None    # the slots as the kernels' store wants them (kernels.slot_index), if it does
    # For the native row attention (layers/row_attention.py), each token's table and context
    # (int32, `row_inputs`); None: the kernels' attention
    row_tables: torch.Tensor | None = None
    row_contexts: torch.Tensor | None = None


@dataclass
class LlamaLayer:
    input_norm: RMSNorm
    qkv: Linear | QuantizedLinear
    o_proj: Linear | QuantizedLinear
    post_norm: RMSNorm
    gate_up: Linear | QuantizedLinear
    down: Linear | QuantizedLinear


def linear(weight: Weight, bias: torch.Tensor | None = None, plain_copy: bool = True) -> Linear | QuantizedLinear:
    return QuantizedLinear(weight, bias) if isinstance(weight, list) else Linear(weight, bias, plain_copy)


class LlamaModel:
    def __init__(self, source: Checkpoint | torch.nn.Module, dtype: torch.dtype, device: torch.device,
                 consume: bool = False, plain_copies: bool = True) -> None:
        """`source`: the model's checkpoint, or a transformers model to take it from. `consume`:
        take the weights out of the checkpoint as they are laid out (DecoderWeights.of), for a
        caller that has no other use for them: the load then holds each weight about once.
        `plain_copies`: fp32 matrices kept plain beside their packed copies (see Linear), for an
        engine whose eager steps run every step; one whose compiled steps will run its decodes
        drops them once those are in (`drop_plain_copies`), and may as well not make them."""
        checkpoint = as_checkpoint(source)
        self.shape = shape = DecoderShape.of(checkpoint.config)
        self.dtype, self.device = dtype, device

        weights = DecoderWeights.of(checkpoint, dtype, device, consume=consume)
        self.embed = weights.embed
        self.norm = RMSNorm(weights.norm, shape.eps)
        self.tied = weights.tied
        self.lm_head = linear(weights.lm_head, plain_copy=plain_copies)
        self.layers = []
        for index, w in enumerate(weights.layers):
            self.layers.append(LlamaLayer(
                input_norm=RMSNorm(w.input_norm, shape.eps), qkv=linear(w.qkv, w.qkv_bias, plain_copies),
                o_proj=linear(w.o_proj, plain_copy=plain_copies), post_norm=RMSNorm(w.post_norm, shape.eps),
                gate_up=linear(w.gate_up, plain_copy=plain_copies), down=linear(w.down, plain_copy=plain_copies)))
            weights.layers[index] = None  # a matrix kept only packed is freed now, not after the last layer
        # Whether a GGUF file's quantized matrices were kept quantized (gguf_file.load_model).
        self.quantized = isinstance(self.embed, QuantizedMatrix) or any(
            isinstance(part, QuantizedLinear) for layer in self.layers for part in vars(layer).values())
        # Which weight layout one decoding chat streams fastest depends on the CPU: timed here, once.
        settle_few_row_path(
            [linear for layer in self.layers for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            + [self.lm_head])
        # A tied head packed for oneDNN is the input embedding too, read where it lies: the
        # matrix (a sixth of SmolLM2's weights) is held once rather than plain beside its copy.
        if self.tied and isinstance(self.lm_head, Linear) and self.lm_head.rows is not None:
            self.embed = self.lm_head.rows
        self.rotary = RotaryTable(checkpoint, dtype, device)
        # A batch of decoding tokens' layers in one native call, where every layer matrix is kept quantized.
        self.native_layers = NativeLayers.of(self) if self.quantized else None
        if self.native_layers is not None:  # ... and the other steps' norms (see RMSNorm.native)
            lib = native.library()
            for norm in [self.norm, *(n for layer in self.layers for n in (layer.input_norm, layer.post_norm))]:
                norm.native = lib
        # A dense float32 model's attention on a CPU, in native code where it builds (else torch's).
        self.row_attention = None if self.quantized else RowAttention.of(dtype, device, shape.num_kv_heads)
        self._kv_views: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        # The layers' small steps as fused kernels where the kernels' backend has them
        # (kernels.fuses_layer_ops); off, torch's ops run them (benchmarks/gpu_step.py compares).
        self.fuse_layer_ops = True

    def drop_plain_copies(self) -> int:
        """Keep only the packed copy of every matrix held both plain and packed (fp32 on a CPU
        whose few-row path streams the plain one faster: see layers/linear.py). Once the compiled
        steps run every step of one or a few rows, the plain copies serve nothing but a rare eager
        step, which the packed ones serve too. Returns the bytes let go (the caller gives them back
        to the kernel: host_allocator.release_freed_memory)."""
        dropped = 0
        for linear in [self.lm_head, *(part for layer in self.layers
                                       for part in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))]:
            if isinstance(linear, Linear) and linear.weight is not None and linear.packed is not None:
                if linear.weight is not self.embed:  # a tied head's plain matrix is the embedding: kept
                    dropped += linear.weight.numel() * linear.weight.element_size()
                linear.weight = None
        return dropped

    @property
    def num_parameters(self) -> int:
        """Every weight counted once (a tied output embedding is the input embedding)."""
        total = self.embed.numel() + self.norm.numel() + (0 if self.tied else self.lm_head.numel())
        for layer in self.layers:
            total += sum(part.numel() for part in vars(layer).values())
        return total

    def kv_block_bytes(self, block_size: int, dtype: torch.dtype | None = None) -> int:
        element = torch.empty((), dtype=dtype or self.dtype).element_size()
        return self.shape.num_layers * 2 * block_size * self.shape.kv_size * element

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        shape = self.shape
        return kv_cache_shape(num_blocks, shape.num_layers, shape.num_kv_heads, block_size, shape.head_dim)

    def decodes_natively(self, num_tokens: int, num_seqs: int, longest: int) -> bool:
        """Whether a step of `num_tokens` tokens over `num_seqs` sequences, the longest bringing
        `longest`, runs its layers in `native_layers`, each token a row attending over its own
        context: a step of decodes (one token a sequence, however many), a small one (a cached
        prompt's last partial block, a short turn), or chats' short turns past a cached prompt
        (whose blocks in common the native attention reads once for 16 rows: 32 chats' 640 rows of
        the 1B Q4_K_M took 0.94-0.96x the eager forward's time). A long prompt takes the eager
        forward, whose attention runs as matmuls where the native one reads each token's keys
        apart. Such a step reads the paged cache in native code only: it needs no attention plan."""
        return self.native_layers is not None and 0 < num_tokens and (
            num_tokens == num_seqs or num_tokens <= NATIVE_STEP_TOKENS
            or (longest <= NATIVE_QUERY_TOKENS and num_tokens <= NATIVE_STEP_ROWS))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: `[num_tokens]`; returns fp32 logits `[len(logits_indices), vocab]`.
        Positions must be below `rotary.length` (see `RotaryTable.ensure`): checking here would
        read them back from the device on every step."""
        if isinstance(self.embed, QuantizedMatrix):
            hidden = self.embed.rows(input_ids).to(self.dtype)
        else:
            hidden = embedding(input_ids, self.embed)
        if self.fuse_layer_ops and kernels.fuses_layer_ops(kv_cache):
            return self._forward_fused(hidden, positions, kv_cache, meta, logits_indices)
        cos_sin = self.rotary.table[positions]  # [num_tokens, 2, head_dim]
        cos, sin = cos_sin[:, None, 0], cos_sin[:, None, 1]
        num_tokens, num_seqs = input_ids.shape[0], meta.seqused_k.shape[0]
        # the longest query's length only where it can decide: a step of decodes, or a GPU step, needs none
        longest = 1 if num_tokens == num_seqs or self.native_layers is None else int(meta.cu_seqlens_q.diff().max())
        if self.decodes_natively(num_tokens, num_seqs, longest):
            tables, contexts = meta.block_table, meta.seqused_k
            if input_ids.shape[0] != contexts.shape[0]:  # a sequence's tokens: each its own row and context
                q_lens = meta.cu_seqlens_q.diff()
                sequence = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
                tables = tables[sequence]
                contexts = (contexts[sequence] - (meta.cu_seqlens_q[1:][sequence] - 1 - torch.arange(len(sequence))))
                contexts = contexts.to(torch.int32)
            return self.native_layers(hidden, cos_sin, kv_cache, meta.slot_mapping, tables, contexts, logits_indices)
        shape = self.shape
        q_size, kv_size, dim = shape.q_size, shape.kv_size, shape.head_dim
        for layer, (k_cache, v_cache) in zip(self.layers, self._layer_views(kv_cache)):
            qkv = layer.qkv(layer.input_norm(hidden))
            # q and k rotate together and in place: one set of small ops per layer instead of
            # two, and k stays next to v, so the cache store writes both at once.
            qk = qkv[:, :q_size + kv_size].view(-1, shape.num_heads + shape.num_kv_heads, dim)
            rotate(qk, cos, sin, out=qk)
            q = qkv[:, :q_size].view(-1, shape.num_heads, dim)
            k = qkv[:, q_size:q_size + kv_size].view(-1, shape.num_kv_heads, dim)
            v = qkv[:, q_size + kv_size:].view(-1, shape.num_kv_heads, dim)
            kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.slot_index)
            if meta.row_contexts is not None:
                attn = self.row_attention(q, k_cache, v_cache, meta.row_tables, meta.row_contexts, shape.scale)
            else:
                attn = kernels.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seqused_k,
                                               meta.block_table, shape.scale, attention_plan=meta.plan)
            hidden = hidden + layer.o_proj(attn.reshape(-1, q_size))
            gate, up = layer.gate_up(layer.post_norm(hidden)).chunk(2, dim=-1)
            hidden = hidden + layer.down(silu_and_mul(gate, up))
        return self.logits(hidden, logits_indices)

    def _forward_fused(self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """`forward` with the layers' small steps as fused kernels (kernels.fuses_layer_ops): the
        residual stream is added into by each RMSNorm rather than by its own op."""
        shape = self.shape
        q_size, dim = shape.q_size, shape.head_dim
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, self._layer_views(kv_cache)):
            x, residual = kernels.add_rms_norm(hidden, residual, layer.input_norm.weight, layer.input_norm.eps)
            qkv = layer.qkv(x)
            kernels.rotary_store(qkv, positions, self.rotary.table, k_cache, v_cache, meta.slot_mapping,
                                 shape.num_heads, shape.num_kv_heads, dim)
            attn = kernels.paged_attention(qkv[:, :q_size].view(-1, shape.num_heads, dim), k_cache, v_cache,
                                           meta.cu_seqlens_q, meta.seqused_k, meta.block_table, shape.scale,
                                           attention_plan=meta.plan)
            x, residual = kernels.add_rms_norm(layer.o_proj(attn.reshape(-1, q_size)), residual,
                                               layer.post_norm.weight, layer.post_norm.eps)
            hidden = layer.down(kernels.silu_and_mul(layer.gate_up(x)))
        x, _ = kernels.add_rms_norm(hidden[logits_indices], residual[logits_indices], self.norm.weight, self.norm.eps)
        return self.lm_head(x).float()

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """fp32 logits of rows `logits_indices` of the last layer's hidden states."""
        return self.lm_head(self.norm(hidden[logits_indices])).float()

    def _layer_views(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (K, V) views of the cache, made once per cache rather than every step."""
        if self._kv_views is None or self._kv_views[0] is not kv_cache:
            self._kv_views = (kv_cache, [layer_kv(kv_cache, i) for i in range(self.shape.num_layers)])
        return self._kv_views[1]
