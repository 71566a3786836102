"""Weight matmuls for the decoder.

One plain `[out, in]` copy of each weight serves every batch size; what changes with the number
of rows is the kernel. A single row (one chat decoding) reads every weight once per token, so
the step is bounded by memory bandwidth, and on a CPU the GEMM kernels' per-call set-up is what
separates them: measured on SmolLM2-135M's projections streamed from main memory (2-core Xeon,
every layer's weights per step), a bf16 row through `torch.mv` took 21 ms per step against
35 ms through oneDNN's GEMM (prepacked or not), and an fp32 row through `F.linear` 30 ms against
40 ms through oneDNN's prepacked weights. From a few rows on, `F.linear` and prepacked oneDNN
were level (fp32 at 32 rows: 96 against 98 ms; bf16: 44 against 44 ms), so the plain layout
costs nothing there and needs no second copy of the weights (a tied output embedding stays the
input embedding's memory).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """y = x @ weight.T (+ bias) for `x` of shape [rows, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias
        # The matrix-vector kernel wins for one bf16 row on a CPU (see above); elsewhere GEMM.
        self._mv = weight.device.type == "cpu" and weight.dtype == torch.bfloat16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._mv and x.shape[0] == 1:
            y = torch.mv(self.weight, x[0])[None]
            return y + self.bias if self.bias is not None else y
        return F.linear(x, self.weight, self.bias)

    def numel(self) -> int:
        return self.out_features * self.in_features + (self.bias.numel() if self.bias is not None else 0)
