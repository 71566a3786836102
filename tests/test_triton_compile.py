"""Every Triton kernel compiles, ahead of time and without a GPU, for the GPUs we run on: sm_90
(H100, H200) and sm_89 (L4, the Space's suggested hardware), in the shapes and dtypes the engine
launches, and fits the device's shared memory. The interpreter tests check what the kernels
compute; this checks what only compiled mode sees (typing, lowering, register and shared-memory
use), so a first GPU run does not start with a compile error."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).parent / "triton_aot.py"
# Opt-in shared memory per block (bytes): sm_90 227 KiB, sm_89 99 KiB.
SHARED_LIMIT = {90: 232_448, 89: 101_376}


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # Without source-line debug info: a quarter less CPU (72 -> 54 s for sm_89 on a 2-core EPYC),
    # the same shared memory for all 44 kernels (line info adds debug sections, not code).
    env["TRITON_DISABLE_LINE_INFO"] = "1"
    done = subprocess.run([sys.executable, str(SCRIPT), "90", "89"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_compiles_for_both_architectures(compiled):
    kinds = {(r["arch"], r["kernel"]) for r in compiled}
    assert kinds == {(arch, kernel) for arch in (90, 89)
                     for kernel in ("attention", "merge_splits", "store_kv", "copy_blocks", "add_rms_norm",
                                    "rotary_store", "silu_and_mul")}
    for arch in (90, 89):
        cases = {r["case"] for r in compiled if r["arch"] == arch and r["kernel"] == "attention"}
        for model in ("smollm2", "llama-1b", "bench"):
            for dtype in ("bf16", "fp16", "fp32"):
                assert any(c.startswith(f"{model} {dtype}") for c in cases), (arch, model, dtype)
            assert f"{model} bf16 split decode" in cases
    assert all(r["cubin_bytes"] > 0 for r in compiled)


def test_every_kernel_fits_the_shared_memory(compiled):
    for r in compiled:
        assert r["shared"] <= SHARED_LIMIT[r["arch"]], r
