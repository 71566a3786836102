"""A batch of decoding tokens through every decoder layer in one native call (native_layers.c).

A chat decoding alone on a CPU, its weight matrices kept quantized, spent as long in eager torch's
small ops and the Python around each matmul as in the matmuls themselves (SmolLM2-135M Q4_1 on a
2-core EPYC: 11.4 of 24.3 ms a token outside them), and a batch of 32 decoding chats ~19% of its
step in them (rotary, the cache store, residuals, silu-and-mul, norms, attention's small ops).
`NativeLayers` runs the layers' whole arithmetic for a step whose every sequence computes one
token in C instead, in one OpenMP region, and the final norm and the output head there too when
the head is quantized (a 1B Q4_K_M's Q6_K head, 79 MiB, streamed in the same region rather than
after a Python call of its own: a lone chat's step ~1 ms shorter); the embedding stays in torch.
It serves float32 models whose every layer matrix is quantized (`NativeLayers.of` says None
otherwise, and the eager forward runs).
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from engine.worker.kv_layout import layer_kv
from engine.worker.models.layers.quantized_linear import QuantizedLinear
from engine.worker.quantized import native
from engine.worker.quantized.matrix import LANES, LEVELS, ActivationScratch
from engine.worker.quantized.native_abi import Layer, Step

if TYPE_CHECKING:
    from engine.worker.models.llama import LlamaModel

class NativeLayers:
    """`model`'s layers for a batch of decoding tokens, natively; see the module's docstring."""

    @classmethod
    def of(cls, model: LlamaModel) -> NativeLayers | None:
        shape = model.shape
        linears = [part for layer in model.layers for part in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        if (model.device.type != "cpu" or model.dtype != torch.float32 or not linears
                or not all(isinstance(linear, QuantizedLinear) for linear in linears)
                or any(layer.o_proj.bias is not None or layer.gate_up.bias is not None or layer.down.bias is not None
                       for layer in model.layers)
                or shape.num_heads % shape.num_kv_heads or shape.head_dim % 2):
            return None
        lib = native.library()
        return None if lib is None else cls(model, lib)

    def __init__(self, model: LlamaModel, lib: ctypes.CDLL) -> None:
        self.model, self._lib = model, lib
        shape = model.shape
        self._ffn = model.layers[0].down.in_features
        # What the C structs point at, kept alive here.
        self._norms = [(layer.input_norm.weight.float().contiguous(), layer.post_norm.weight.float().contiguous())
                       for layer in model.layers]
        self._biases = [None if layer.qkv.bias is None else layer.qkv.bias.float().contiguous()
                        for layer in model.layers]
        self._widest = max(shape.hidden_size, shape.q_size, self._ffn)  # a matmul's input
        self._widths = {"x": shape.hidden_size, "qkv": shape.q_size + 2 * shape.kv_size, "attn": shape.q_size,
                        "delta": shape.hidden_size, "gate_up": 2 * self._ffn}
        self._layers: tuple[torch.Tensor, ctypes.Array] | None = None
        self._step = Step(hidden=shape.hidden_size, heads=shape.num_heads, kv_heads=shape.num_kv_heads,
                           head_dim=shape.head_dim, ffn=self._ffn, levels=LEVELS, eps=shape.eps, scale=shape.scale)
        head = model.lm_head
        self._head = head if isinstance(head, QuantizedLinear) and head.bias is None else None
        self._final_norm = model.norm.weight.float().contiguous()
        self._room: tuple[int, list[object]] = (0, [])
        self._make_room(1)

    def _make_room(self, rows: int) -> None:
        """Scratch and buffers for `rows` tokens (kept, and grown only for a larger batch)."""
        if rows <= self._room[0]:
            return
        step, kept = self._step, []
        scratch = ActivationScratch(LEVELS, rows, self._widest)
        step.scratch = scratch.struct
        kept.append(scratch)
        softmax = torch.empty(rows, 2 * self.model.shape.num_heads)
        step.softmax = softmax.data_ptr()
        kept.append(softmax)
        for name, width in self._widths.items():
            buffer = torch.empty(rows, width + LANES)  # a part's last block writes up to LANES columns past its end
            setattr(step, name, buffer.data_ptr())
            setattr(step, f"{name}_stride", buffer.stride(0))
            kept.append(buffer)
        self._room = (rows, kept)

    def _layer_array(self, kv_cache: torch.Tensor) -> ctypes.Array:
        """The layers as C structs, with their views of `kv_cache` (made once per cache)."""
        if self._layers is None or self._layers[0] is not kv_cache:
            array = (Layer * len(self.model.layers))()
            for i, (entry, layer) in enumerate(zip(array, self.model.layers)):
                k_cache, v_cache = layer_kv(kv_cache, i)
                input_norm, post_norm = self._norms[i]
                bias = self._biases[i]
                entry.input_norm, entry.post_norm = input_norm.data_ptr(), post_norm.data_ptr()
                entry.qkv_bias = None if bias is None else bias.data_ptr()
                for name, linear in (("qkv", layer.qkv), ("o", layer.o_proj), ("gate_up", layer.gate_up),
                                     ("down", layer.down)):
                    setattr(entry, name, ctypes.addressof(linear.part_array))
                    setattr(entry, f"{name}_parts", len(linear.parts))
                entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            self._step.block_size = kv_cache.shape[-2]
            self._step.block_stride = kv_cache.stride(0)
            self._layers = (kv_cache, array)
        return self._layers[1]

    @property
    def shared_blocks(self) -> int:
        """The leading blocks the last step's sequences all held alike (a shared prompt's), whose
        K and V it read once for every 16 of them rather than once per sequence."""
        return self._step.shared_blocks

    def __call__(self, hidden: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                 block_table: torch.Tensor, contexts: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """hidden `[rows, hidden_size]` float32 (the tokens' embeddings, a row each; overwritten),
        cos_sin `[rows, 2, head_dim]` (their positions' rows of the rotary table), their cache
        `slots` `[rows]`, their sequences' `block_table` rows `[rows, max_blocks]` and their
        `contexts` `[rows]` (int32: the keys each attends over, its own included; tokens of one
        sequence are rows with the same table, each its own context, their K/V all stored before
        any attends): the float32 logits of rows `logits_indices` (increasing),
        `[len(logits_indices), vocab]`."""
        rows = hidden.shape[0]
        assert hidden.dtype == torch.float32 and block_table.dtype == contexts.dtype == torch.int32
        assert cos_sin.shape[0] == slots.shape[0] == block_table.shape[0] == contexts.shape[0] == rows
        layers = self._layer_array(kv_cache)
        # A prompt step's room (~126 KB a row for the 1B) is given back after it: decode batches
        # keep theirs, every step alike.
        kept = self._room if rows > self._room[0] and logits_indices.shape[0] < rows else None
        self._make_room(rows)
        hidden, cos_sin = hidden.contiguous(), cos_sin.float().contiguous()
        slots, contexts = slots.to(torch.int64).contiguous(), contexts.contiguous()
        if block_table.stride(1) != 1:
            block_table = block_table.contiguous()
        step = self._step
        step.rows, step.cos_sin, step.slots, step.contexts = rows, cos_sin.data_ptr(), slots.data_ptr(), contexts.data_ptr()
        step.block_tables, step.table_stride = block_table.data_ptr(), block_table.stride(0)
        # In a step of decodes every row wants its logits (but for a sequence mid-prompt, a
        # one-token chunk): the head runs here only when all do, and then row i's are logits row
        # i; a prompt's tokens want only their last's.
        head = self._head if logits_indices.shape[0] == rows else None
        logits = None
        if head is None:
            step.head = None
        else:
            logits = torch.empty(rows, head.out_features + LANES)  # the last part's padding
            step.final_norm, step.head, step.head_parts = self._final_norm.data_ptr(), ctypes.addressof(head.part_array), len(head.parts)
            step.logits, step.logits_stride = logits.data_ptr(), logits.stride(0)
        self._lib.layers_step(hidden.data_ptr(), ctypes.addressof(layers), len(self.model.layers), ctypes.byref(step))
        if kept is not None:
            self._room = (0, [])
            self._make_room(kept[0])
        if logits is not None:
            return logits[:, :head.out_features]
        return self.model.logits(hidden, logits_indices)
