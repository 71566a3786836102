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

and on a 2-core AMD EPYC (Zen 5): 1 row fp32 plain 33.2 ms, packed 15.0; bf16 plain 11.9,
packed 6.3. So in bf16 the packed copy replaces the plain one everywhere. In fp32, which layout
streams a single row faster depends on the CPU (BLAS's matrix-vector path on the Xeon, oneDNN on
the EPYC): `settle_few_row_path` times both on the model's own weights once, at load, and drops
the plain copy where packed wins (on the Xeon fp32 holds each weight twice). Elsewhere (CUDA, or
a build without oneDNN, or bf16 on a CPU without AVX-512, which oneDNN does not pack for) the
plain weight and `F.linear`.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.worker.models.layers.packed_rows import rows_of

PACK_ROWS = 32     # the batch size oneDNN lays the packed weight out for
PLAIN_FP32_ROWS = 2  # fp32 batches up to this many rows may use the plain weight
# The op overload itself (~120 calls a decode step): calling it skips the packet's lookup each time.
_PACKED_LINEAR = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None


class Linear:
    """y = x @ weight.T (+ bias) for `x` of shape [rows, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, plain_copy: bool = True) -> None:
        """`plain_copy`: an fp32 weight is kept plain beside its packed copy, for the few-row path
        to choose between (`settle_few_row_path`); without, packed only (where oneDNN packs it)."""
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.packed = packed_for_onednn(weight)
        # The packed copy as blocks one row's product and an embedding lookup read in place
        # (packed_rows.py), where oneDNN laid it out so: checked now, while the plain one is here.
        self.rows = rows_of(self.packed, weight)
        if self.packed is not None and (weight.dtype == torch.bfloat16 or not plain_copy):
            self.weight = None  # bf16: every batch size is as fast or faster packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and (self.weight is None or x.shape[0] > PLAIN_FP32_ROWS):
            return self.packed_matmul(x)
        return F.linear(x, self.weight, self.bias)

    def packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if not x.shape[0]:  # oneDNN refuses an empty batch (a step that only fills the cache)
            return x.new_empty((0, self.out_features))
        return _PACKED_LINEAR(x, self.packed, self.bias, "none", [], "")

    def numel(self) -> int:
        return self.out_features * self.in_features + (self.bias.numel() if self.bias is not None else 0)

    @property
    def batch_weight(self) -> torch.Tensor:
        """What a batch of rows is multiplied by: the packed copy where there is one. A compiled
        step holds this very tensor (see `batch_matmul`), so the engine keeps one copy for both."""
        return self.packed if self.packed is not None else self.weight


def packed_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` in oneDNN's layout, or None where oneDNN does not pack it here (not a CPU, not
    fp32 or bf16, or bf16 on a CPU without AVX-512 or AVX-NE-CONVERT)."""
    if (weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16)
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
    except RuntimeError:
        return None


def batch_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> torch.Tensor:
    """x @ weight.T (+ bias) for a `Linear.batch_weight`, `packed` for oneDNN or plain; written for
    a compiler too (`packed` is said, not read off the weight: a traced weight does not tell)."""
    if packed:
        return _PACKED_LINEAR(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def settle_few_row_path(linears: Sequence[object], rounds: int = 3) -> str:
    """For weights kept both plain and packed (fp32 on a CPU), time one row through every one of
    `linears` each way, in the model's order so the weights stream from memory as in a decode
    step, and keep only the packed copy when it is faster. Returns "plain", "packed" or "fixed"
    (nothing to choose). Costs a few model-sized passes (~0.1-0.2 s for a 135M model). Other
    kinds of layer among `linears` (quantized ones) are left as they are."""
    both = [linear for linear in linears
            if isinstance(linear, Linear) and linear.weight is not None and linear.packed is not None]
    if not both:
        return "fixed"
    rows = {n: torch.randn(1, n, dtype=both[0].weight.dtype) for n in {linear.in_features for linear in both}}

    def best(matmul) -> float:
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for linear in both:
                matmul(linear, rows[linear.in_features])
            times.append(time.perf_counter() - start)
        return min(times)

    with torch.inference_mode():
        plain = best(lambda linear, x: F.linear(x, linear.weight, linear.bias))
        packed = best(Linear.packed_matmul)
    if packed < plain:
        for linear in both:
            linear.weight = None
        return "packed"
    return "plain"
