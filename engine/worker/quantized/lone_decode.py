"""A lone token through every decoder layer in one native call (decode_layers.c).

A chat decoding alone on a CPU, its weight matrices kept quantized, spends as long in eager
torch's small ops and the Python around each matmul as in the matmuls themselves (SmolLM2-135M
Q4_1 on a 2-core EPYC: 11.4 of 24.3 ms a token outside them). `LoneDecode` runs the layers' whole
arithmetic for one token in C instead, in one OpenMP region; the embedding, the final norm and the
output head stay in torch. It serves float32 models whose every layer matrix is quantized
(`LoneDecode.of` says None otherwise, and the eager forward runs); a step of one token of one
sequence is the only one it takes.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from engine.worker.models.layers.quantized_linear import QuantizedLinear
from engine.worker.quantized import native
from engine.worker.quantized.matrix import LANES, LEVELS, Scratch

if TYPE_CHECKING:
    from engine.worker.models.llama import LlamaModel

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Layer(ctypes.Structure):
    """decode_layers.c's Layer."""
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _P), ("qkv_parts", _I), ("qkv_bias", _P),
                ("o", _P), ("o_parts", _I), ("gate_up", _P), ("gate_up_parts", _I), ("down", _P),
                ("down_parts", _I), ("k_cache", _P), ("v_cache", _P)]


class _Step(ctypes.Structure):
    """decode_layers.c's Step."""
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("ffn", _I), ("levels", _I),
                ("eps", _F), ("scale", _F), ("block_size", _I), ("block_stride", _I), ("cos_sin", _P), ("slot", _I),
                ("block_table", _P), ("context", _I), ("scratch", native.Scratch), ("x", _P), ("qkv", _P),
                ("attn", _P), ("delta", _P), ("gate_up", _P)]


class LoneDecode:
    """`model`'s layers for one token at a time, natively; see the module's docstring."""

    @classmethod
    def of(cls, model: LlamaModel) -> LoneDecode | None:
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
        widest = max(shape.hidden_size, shape.q_size, self._ffn)
        room = LANES  # a part's last block writes up to LANES columns past its end
        self._scratch = Scratch(LEVELS, 1, widest)
        self._x = torch.empty(widest + room)
        self._qkv = torch.empty(shape.q_size + 2 * shape.kv_size + room)
        self._attn = torch.empty(shape.q_size + room)
        self._delta = torch.empty(shape.hidden_size + room)
        self._gate_up = torch.empty(2 * self._ffn + room)
        self._layers: tuple[torch.Tensor, ctypes.Array] | None = None
        self._step = _Step(hidden=shape.hidden_size, heads=shape.num_heads, kv_heads=shape.num_kv_heads,
                           head_dim=shape.head_dim, ffn=self._ffn, levels=LEVELS, eps=shape.eps,
                           scale=shape.scale, scratch=self._scratch.struct, x=self._x.data_ptr(),
                           qkv=self._qkv.data_ptr(), attn=self._attn.data_ptr(), delta=self._delta.data_ptr(),
                           gate_up=self._gate_up.data_ptr())

    def _layer_array(self, kv_cache: torch.Tensor) -> ctypes.Array:
        """The layers as C structs, with their views of `kv_cache` (made once per cache)."""
        if self._layers is None or self._layers[0] is not kv_cache:
            from engine.worker.models.llama import layer_kv

            array = (_Layer * len(self.model.layers))()
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

    def __call__(self, hidden: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor, slot: int,
                 block_table: torch.Tensor, context: int) -> torch.Tensor:
        """hidden `[1, hidden_size]` float32 (the token's embedding; overwritten), cos_sin
        `[2, head_dim]` (its position's row of the rotary table), its cache `slot`, its sequence's
        `block_table` row (int32) and `context` (keys after this token's): the hidden state after
        the last layer, `[1, hidden_size]`."""
        layers = self._layer_array(kv_cache)
        hidden = hidden.contiguous()
        cos_sin, block_table = cos_sin.contiguous(), block_table.contiguous()
        step = self._step
        step.cos_sin, step.slot, step.block_table, step.context = (cos_sin.data_ptr(), slot, block_table.data_ptr(),
                                                                   context)
        self._lib.decode_layers(hidden.data_ptr(), ctypes.addressof(layers), len(self.model.layers), ctypes.byref(step))
        return hidden
