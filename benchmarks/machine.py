"""What machine a benchmark ran on: its CPU model, written next to every figure."""
from __future__ import annotations


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, with its family and model numbers and the widest
    vector instructions it offers (a virtual machine's CPU may be named only "Intel(R) Xeon(R)
    Processor", and which instructions it passes through decides the kernels): e.g. "Intel(R)
    Xeon(R) Processor (family 6 model 207; AVX-512 VNNI, no AMX)". "unknown CPU" where there is
    no /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            fields = {}
            for line in f:
                if not line.strip():
                    break  # the first processor's fields are enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return "unknown CPU"
    if "model name" not in fields:
        return "unknown CPU"
    flags = set(fields.get("flags", "").split())
    if "amx_bf16" in flags:
        isa = "AMX"
    elif "avx512_bf16" in flags:
        isa = "AVX-512 BF16, no AMX"
    elif "avx512_vnni" in flags:
        isa = "AVX-512 VNNI, no BF16, no AMX"
    elif "avx512f" in flags:
        isa = "AVX-512, no VNNI"
    elif "avx2" in flags:
        isa = "AVX2, no AVX-512"
    else:
        isa = "no AVX2"
    return f"{fields['model name']} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}; {isa})"
