"""The CPU's vector instruction set by the name AOTInductor compiles for
(`str(torch._inductor.cpu_vec_isa.pick_vec_isa())`), worked out from the same CPU flags without
importing inductor: a serving process only loads packages, and this name is part of their key.

Inductor also compiles a probe for each instruction set before it takes it; here a compiler is
assumed to build whatever the CPU runs (any g++ of the last years does), which is what lets a
process with no compiler still find the packages built for it."""
from __future__ import annotations

import os
import platform
import sys

import torch

INVALID = "INVALID_VEC_ISA"

# Inductor's x86 choices, best first, each named by the CPU flags it needs.
_X86 = ("avx512 avx512_vnni amx_tile", "avx512 avx512_vnni", "avx512", "avx2")

# $ATEN_CPU_CAPABILITY -> the part of a name it asks for (None: no vectorizing at all).
_CAPABILITY = {"default": None, "zvector": "zvector", "vsx": "vsx", "avx2": "avx2", "avx512": "avx512"}


def _x86_choices() -> list[str]:
    flags = {"avx2": torch.cpu._is_avx2_supported(), "avx512": torch.cpu._is_avx512_supported(),
             "avx512_vnni": torch.cpu._is_avx512_supported() and torch.cpu._is_vnni_supported(),
             "amx_tile": torch.cpu._is_amx_tile_supported()}
    choices = [name for name in _X86 if all(flags[flag] for flag in name.split())]
    # AMX counts only once the kernel lets this process use its tiles, as inductor asks it to.
    if choices and "amx_tile" in choices[0] and not torch.cpu._init_amx():
        choices.pop(0)
    return choices


def _choices() -> list[str]:
    """What inductor finds this machine can vectorize with, best first."""
    if os.environ.get("TORCHINDUCTOR_VEC_ISA_OK") == "0":  # inductor's switch: every probe fails
        return []
    machine = platform.machine()
    if sys.platform == "darwin" and platform.processor() == "arm":
        return ["asimd"]
    if sys.platform not in ("linux", "win32"):
        return []
    if machine in ("x86_64", "AMD64"):
        return _x86_choices()
    if machine == "aarch64":
        return ["asimd"]  # NEON and SVE alike
    if machine == "ppc64le":
        return ["vsx"]
    if machine == "s390x":
        with open("/proc/cpuinfo") as cpuinfo:
            features = [line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("features")]
        return ["zvector"] if any("vxe" in flags for flags in features) else []
    return []


def vector_isa() -> str:
    """The instruction set inductor would compile a package for on this machine, by its name."""
    choices = _choices()
    if not choices:
        return INVALID
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability in _CAPABILITY:
        wanted = _CAPABILITY[capability]
        if wanted is None:
            return INVALID
        for name in choices:
            if wanted in name:
                return name
    return choices[0]
