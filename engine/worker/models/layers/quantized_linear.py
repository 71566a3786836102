"""Weight matmuls over quantized matrices kept as a GGUF file has them (engine/worker/quantized)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.worker.quantized import native
from engine.worker.quantized.matrix import QuantizedMatrix, matmul, parts


class QuantizedLinear:
    """y = x @ [W1; W2; ...].T (+ bias) for `x` of shape [rows, in_features]: the parts' outputs
    side by side (a fused q/k/v whose parts are in different formats), computed in float32 by the
    native loops and returned in x's dtype."""

    def __init__(self, matrices: Sequence[QuantizedMatrix], bias: torch.Tensor | None = None) -> None:
        self.parts = list(matrices)
        self.in_features = self.parts[0].in_features
        self.out_features = sum(part.out_features for part in self.parts)
        self.bias = bias
        # Taken once: a decode step makes ~100 of these calls.
        self.part_array = parts(self.parts)
        self._lib = native.library()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul(x, self.parts, lib=self._lib, part_array=self.part_array)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)

    def numel(self) -> int:
        return self.out_features * self.in_features + (self.bias.numel() if self.bias is not None else 0)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)
