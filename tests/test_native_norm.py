"""RMSNorm.native (engine/worker/quantized/native_layers.c's rms_norm_rows): the norms of a model
served natively in fp32 on a CPU are one native call each and compute torch's fp32 rms_norm."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.worker.models.layers.rms_norm import RMSNorm
from engine.worker.quantized import native


@pytest.mark.parametrize("rows, width", [(1, 64), (3, 576), (32, 576), (300, 1024)])  # 300 x 1024: the threaded rows
def test_the_native_norm_is_torchs_rms_norm(rows, width):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.rand(width, generator=generator) + 0.5
    norm = RMSNorm(weight, 1e-5)
    norm.native = native.library()
    assert norm.native is not None
    wide = 3 * torch.randn(rows, width + 40, generator=generator)
    x = wide[:, 7:7 + width]  # a view whose rows are further apart than its width
    ours = norm(x)
    assert ours.shape == (rows, width) and ours.is_contiguous()
    torch.testing.assert_close(ours, F.rms_norm(x, (width,), weight, 1e-5), rtol=2e-6, atol=1e-6)


def test_other_inputs_keep_torchs_path():
    norm = RMSNorm(torch.ones(8), 1e-6)
    norm.native = native.library()
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(norm(x).float(), F.rms_norm(x.float(), (8,), None, 1e-6), rtol=1e-2, atol=1e-2)
