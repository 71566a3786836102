"""Weight matmuls for the decoder.

On a CPU the GEMM kernel's weight layout is what separates fast from slow. oneDNN wants the
weight in its own blocked layout; given a plain `[out, in]` matrix, it re-lays it out on every
call. Prepacked once (`mkldnn._reorder_linear_weight`, sized for 32 rows), SmolLM2-135M's
projections took, per step, on a 2-core Xeon with AMX (the same run, weights streamed from
memory):

| rows | fp32 plain | fp32 packed | bf16 plain | bf16 packed |
|---|---|---|---|---|
| 1 | 28.5 ms | 33.0 ms | 20.0 ms (`torch.mv`) | 19.9 ms |
| 4 | 48.4 | 38.7 | 24.5 | 17.7 |
| 32 | 91.8 | 62.6 | 31.9 | 22.1 |

So in bf16 the packed copy replaces the plain one. In fp32, one or two rows (a chat or two
decoding) still go through the plain weight (BLAS's matrix-vector path streams it at memory
speed), more rows through the packed copy: fp32 on a CPU holds each weight twice. An AMD EPYC
without AMX showed the same ordering at 32 rows (1.2-1.4x for packed). Elsewhere (CUDA, or a
build without oneDNN) the plain weight and `F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_ROWS = 32     # the batch size oneDNN lays the packed weight out for
PLAIN_FP32_ROWS = 2  # fp32 batches up to this many rows use the plain weight


class Linear:
    """y = x @ weight.T (+ bias) for `x` of shape [rows, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        if (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
                and torch.backends.mkldnn.is_available()):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
            if weight.dtype == torch.bfloat16:
                self.weight = None  # every batch size is as fast or faster packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and (self.weight is None or x.shape[0] > PLAIN_FP32_ROWS):
            if not x.shape[0]:  # oneDNN refuses an empty batch (a step that only fills the cache)
                return x.new_empty((0, self.out_features))
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def numel(self) -> int:
        return self.out_features * self.in_features + (self.bias.numel() if self.bias is not None else 0)
