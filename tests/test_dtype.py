"""dtype="auto": 16-bit where the device computes it natively and the model was published in 16
bits, fp32 otherwise; explicit dtypes as asked."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.worker import memory
from engine.worker.loading import embedded_model, model_files
from engine.worker.memory import cpu_computes_bf16, resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def cpuinfo(tmp_path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu sse2 avx2 {flags}\n\n"
                    f"processor\t: 1\nflags\t\t: fpu sse2 avx2 {flags}\n")
    return str(path)


@pytest.mark.parametrize("flags, native", [("avx512f avx512_bf16", True), ("amx_tile amx_bf16", True),
                                           ("avx512f avx512bw", False), ("", False)])
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, flags, native):
    assert cpu_computes_bf16(cpuinfo(tmp_path, flags)) is native
    assert cpu_computes_bf16(str(tmp_path / "absent")) is False  # not Linux: no claim


@pytest.mark.parametrize("native, model, expected", [
    (True, torch.bfloat16, torch.bfloat16), (True, torch.float16, torch.bfloat16),
    (True, torch.float32, torch.float32),    # stored in fp32: kept
    (True, None, torch.float32),
    (False, torch.bfloat16, torch.float32),  # bf16 in software would be slower than fp32
])
def test_auto_on_a_cpu(monkeypatch, native, model, expected):
    monkeypatch.setattr(memory, "cpu_computes_bf16", lambda: native)
    assert resolve_dtype("auto", CPU, model) == expected
    assert resolve_dtype(None, CPU, model) == expected


def test_auto_on_a_gpu_and_explicit_dtypes(monkeypatch):
    monkeypatch.setattr(memory, "cpu_computes_bf16", lambda: False)
    assert resolve_dtype("auto", CUDA, torch.float32) == torch.bfloat16
    assert resolve_dtype("float32", CPU, torch.bfloat16) == torch.float32
    assert resolve_dtype(torch.bfloat16, CPU) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float64", CPU)


def test_the_embedded_model_records_its_published_dtype(tmp_path, monkeypatch, tiny_model_dir):
    """A folder converted before the config named it gets it; auto then follows it."""
    folder = tmp_path / "models" / embedded_model.DEFAULT_MODEL_NAME
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((Path(tiny_model_dir) / name).read_bytes())
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    monkeypatch.setenv("PAGEDCHAT_CACHE", str(tmp_path))
    monkeypatch.delenv("MODEL", raising=False)
    assert embedded_model.ensure_default_model() == folder
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert model_files.model_dtype(str(folder)) == torch.bfloat16
    assert model_files.model_dtype(tiny_model_dir) == torch.float32
