"""RMSNorm, as every path of the decoder applies it: x / sqrt(mean(x²) + eps) · weight, computed
in fp32 and rounded to the model's dtype once, after the weight (transformers rounds before and
after the weight).

In fp32 that is torch's `rms_norm`. A 16-bit row is spelled two ways, for who runs it:
- eager torch: written as the expression, it is ~8 small ops (cast, square, mean, add, rsqrt,
  multiply, cast, multiply), 10 µs for one row on a 2-core EPYC, where the ops themselves take
  well under 1 µs each. `layer_norm` is one fused op that also computes in fp32, and on `[x, -x]`
  it is RMSNorm: the mean of that row is zero and its variance is the mean of x². So eager
  normalises the first half of `layer_norm([x, -x])` (4.9 µs for one row, 13.5 vs 16.3 for 32).
- a compiled graph (torch.export, for engine/worker/compiled_decode.py): the expression itself,
  which the compiler fuses into one loop over the row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.worker.models.weights import frozen


class RMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = frozen(weight), eps
        self.size = weight.shape[-1]
        # Eager's doubled row: its second half is thrown away, and any weight serves there.
        self.mirrored = None if weight.dtype == torch.float32 else torch.cat([weight, weight])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.size,), self.weight, self.eps)
        if torch.compiler.is_compiling():
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)
        both = torch.cat([x, x.neg()], dim=-1)
        return F.layer_norm(both, (2 * self.size,), self.mirrored, None, self.eps)[..., :self.size]

    def numel(self) -> int:
        return self.weight.numel()
