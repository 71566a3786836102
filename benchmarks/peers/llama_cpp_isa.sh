#!/usr/bin/env bash
# Prints the CMake flags that pick the vector instructions llama.cpp is built for on this CPU
# (or the one described by the cpuinfo file given as $1): GGML_NATIVE, except where the CPU has
# AMX. There llama.cpp's native build dies with SIGILL in its AMX kernel (the kernel hands a
# process AMX only once it asks, and ggml does not), so the vector extensions the CPU has are
# named one by one and AMX is left out.
set -euo pipefail
CPUINFO=${1:-/proc/cpuinfo}
if ! grep -qw amx_tile "$CPUINFO" 2>/dev/null; then
    echo "-DGGML_NATIVE=ON"
    exit 0
fi
flags="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
for pair in avx:GGML_AVX avx2:GGML_AVX2 fma:GGML_FMA f16c:GGML_F16C avx512f:GGML_AVX512 \
            avx512_vbmi:GGML_AVX512_VBMI avx512_vnni:GGML_AVX512_VNNI avx512_bf16:GGML_AVX512_BF16 \
            avx_vnni:GGML_AVX_VNNI; do
    if grep -qw "${pair%%:*}" "$CPUINFO"; then flags="$flags -D${pair##*:}=ON"; fi
done
echo "$flags"
