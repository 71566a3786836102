"""The engine's settings on a Space, from the container's share of the machine (ui/space.py)."""
from __future__ import annotations

import pytest

from ui.space import GiB, SpaceHardware, memory_bytes, on_space, space_hardware


@pytest.mark.parametrize("value, expected", [
    ("16Gi", 16 * GiB), ("15.5Gi", int(15.5 * GiB)), ("512Mi", 512 << 20), ("16G", 16 * 10**9),
    ("1073741824", GiB), (" 2Gi ", 2 * GiB), ("", None), ("lots", None), ("-1Gi", None), ("16 parsecs", None),
])
def test_memory_sizes_read_as_kubernetes_writes_them(value, expected):
    assert memory_bytes(value) == expected


def test_cpu_basic_keeps_the_engines_pools_and_takes_its_two_cores():
    assert space_hardware({"CPU_CORES": "2", "MEMORY": "16Gi"}) == SpaceHardware(2, 1.0, 1.0)


def test_a_small_container_gets_an_eighth_of_its_memory_per_pool():
    assert space_hardware({"CPU_CORES": "1", "MEMORY": "4Gi"}) == SpaceHardware(1, 0.5, 0.5)


@pytest.mark.parametrize("cores", ["", "0", "two", "-2", "1.5"])
def test_unreadable_values_keep_the_defaults(cores):
    assert space_hardware({"CPU_CORES": cores, "MEMORY": "a lot"}) == SpaceHardware(None, 1.0, 1.0)


def test_a_space_is_known_by_its_id():
    assert on_space({"SPACE_ID": "ada/pagedchat"}) and not on_space({}) and not on_space({"SPACE_ID": ""})
