"""RMSNorm, as every path of the decoder applies it: x / sqrt(mean(x²) + eps) · weight, computed
in fp32 and rounded to the model's dtype once, after the weight (transformers rounds before and
after the weight).

In fp32 that is torch's `rms_norm`. A 16-bit row is spelled two ways, for who runs it:
- a compiled graph (engine/worker/compiled/): the expression itself, which the compiler
  fuses into one loop over the row.
- eager torch (`RMSNorm`): written as the expression, it is ~8 small ops (cast, square, mean, add,
  rsqrt, multiply, cast, multiply), 10 µs for one row on a 2-core EPYC, where the ops themselves
  take well under 1 µs each. `layer_norm` is one fused op that also computes in fp32, and on
  `[x, -x]` it is RMSNorm: the mean of that row is zero and its variance is the mean of x². So
  eager normalises the first half of `layer_norm([x, -x])` (4.9 µs for one row, 13.5 vs 16.3 for
  32), given the weight doubled (`mirrored`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, mirrored: torch.Tensor | None = None) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if mirrored is None:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    both = torch.cat([x, x.neg()], dim=-1)
    return F.layer_norm(both, (mirrored.shape[-1],), mirrored, None, eps)[..., :x.shape[-1]]


class RMSNorm:
    """Eager's: the weight, and for 16-bit rows its doubled copy. A plain object, not a module:
    eager calls it ~60 times a step, and a module's call costs ~20 µs more on a 2-core Zen 1."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps
        # The second half of the doubled row is thrown away: any weight serves there.
        self.mirrored = None if weight.dtype == torch.float32 else torch.cat([weight, weight])
        # The native library's rms_norm_rows (engine/worker/quantized/native_layers.c), set by a
        # model served natively on a CPU in fp32: one call where torch's fp32 rms_norm is ~8 ops.
        self.native = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (self.native is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
                and x.stride(1) == 1):
            out = torch.empty(x.shape)
            self.native.rms_norm_rows(x.data_ptr(), x.shape[0], x.stride(0), self.weight.data_ptr(), x.shape[1],
                                      self.eps, out.data_ptr())
            return out
        return rms_norm(x, self.weight, self.eps, self.mirrored)

    def numel(self) -> int:
        return self.weight.numel()
