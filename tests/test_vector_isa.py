"""engine/worker/compiled/vector_isa.py names the CPU's vector instructions as inductor does
(without importing it): the name keys the compiled packages, so any difference would rebuild them."""
from __future__ import annotations

import warnings

import pytest

from engine.worker.compiled.vector_isa import vector_isa


@pytest.mark.parametrize("capability", [None, "avx512", "avx2", "default", "zvector", "something-else"])
def test_the_name_is_inductors(capability, monkeypatch):
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if capability is None:
        monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    else:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    with warnings.catch_warnings():  # one it has no such instructions for: inductor warns, then takes its best
        warnings.simplefilter("ignore")
        inductors = str(pick_vec_isa())
    assert vector_isa() == inductors
