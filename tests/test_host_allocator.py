"""glibc's thresholds, raised: a large activation comes from the heap, which keeps its pages
when it is freed, instead of a mapping of its own that is unmapped on free and faulted in again
page by page next time. Checked in a fresh process (an engine made earlier in the test session
has raised them already)."""
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

SCRIPT = """
import torch
from engine.worker.host_allocator import keep_freed_memory

def on_the_heap(tensor):
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = (int(part, 16) for part in line.split()[0].split("-"))
            return start <= tensor.data_ptr() < end
    return False

# 48 MiB: above glibc's default mmap threshold (at most 32 MiB).
print(on_the_heap(torch.empty(48 << 18)), keep_freed_memory(), on_the_heap(torch.empty(48 << 18)))
"""


def test_a_large_activation_comes_from_the_heap_once_thresholds_are_raised():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["False", "True", "True"]
