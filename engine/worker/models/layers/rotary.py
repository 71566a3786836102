"""Rotary position embeddings, rotate-half style (Llama's), as transformers computes them.

A head's vector x at position p becomes x·cos + rotate_half(x)·sin, where rotate_half(x) is
[-x₂, x₁] for x's halves x₁, x₂, and cos, sin hold the angles p·θᵢ for each frequency θᵢ, twice
over. Here the rotation's sign lives in the table: its sin row is [-sin, sin], and the rotation is
x·cos + [x₂, x₁]·signed_sin, the halves swapped by a flip (an index a compiler folds into its
loop, where a concatenation of a negated half is a loop of its own). Negation is exact, so this
is transformers' arithmetic to the bit.
"""
from __future__ import annotations

import torch

from engine.worker.loading.checkpoint import Checkpoint


class RotaryTable:
    """cos and signed sin by position, `[length, 2, head_dim]` in the model's dtype, computed in
    fp32 as transformers does and grown on demand. Built when first needed: for the length `ensure`
    asks for (an engine's runner asks for its max_model_len before any step), else on first reading
    for the model's max_position_embeddings. (Qwen2.5-0.5B's 32,768 positions of 64-wide heads take
    16 MiB in fp32; an engine of 4,096 positions needs 2.)"""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq = checkpoint.inv_freq.to(device)
        self.scaling = checkpoint.attention_scaling
        self.dtype, self.device = dtype, device
        self._default_length = getattr(checkpoint.config, "max_position_embeddings", 4096)
        self._table: torch.Tensor | None = None

    @property
    def table(self) -> torch.Tensor:
        if self._table is None:
            self._table = self._make(self._default_length)
        return self._table

    def _make(self, length: int) -> torch.Tensor:
        positions = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        sign = torch.ones(emb.shape[-1], device=self.device)
        sign[:emb.shape[-1] // 2] = -1.0
        return (torch.stack([emb.cos(), emb.sin() * sign], dim=1) * self.scaling).to(self.dtype)

    @property
    def length(self) -> int:
        return self.table.shape[0]

    def ensure(self, length: int) -> None:
        """Make the table cover positions 0..length-1 (never shrinks it)."""
        if self._table is None or length > self.length:
            self._table = self._make(length)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x rotated over its last dimension (`head_dim`), cos and signed_sin broadcast against it;
    written into `out` when given (x itself may be `out`)."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return torch.add(x * cos, swapped * signed_sin, out=out)
