#!/usr/bin/env bash
# Builds llama.cpp's llama-server, llama-batched-bench and llama-quantize (from the llama-cpp-python
# sdist, which vendors llama.cpp and its convert_hf_to_gguf.py) and converts the default model to a
# GGUF of the engine's precision, all under benchmarks/peers/.build (ignored). Takes ~10-15 min on
# 2 cores; run it alone.
#
#   bash benchmarks/peers/llama_cpp.sh            # then, as the script prints at the end:
#   benchmarks/peers/.build/llama-server -m benchmarks/peers/.build/smollm2-135m-f32.gguf --port 8080 ...
#   .venv/bin/python benchmarks/serve.py --base-url http://127.0.0.1:8080/v1
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD="$ROOT/benchmarks/peers/.build"
PY="$ROOT/.venv/bin/python"
OUTTYPE=${OUTTYPE:-f32}   # the engine's CPU dtype; OUTTYPE=bf16 for a bf16 comparison
mkdir -p "$BUILD"
cd "$BUILD"
if [ ! -d llama_cpp_python ]; then
    "$PY" -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python -d sdist
    mkdir -p llama_cpp_python
    tar xzf sdist/llama_cpp_python-*.tar.gz -C llama_cpp_python --strip-components=1
fi
SRC="$BUILD/llama_cpp_python/vendor/llama.cpp"
# llama-server for the app's remote-backend comparison; llama-batched-bench for `make bench-peers`
# (all chats in one context, the shared prompt decoded once); llama-quantize for the 1B benchmark
# GGUFs (benchmarks/peers/gguf_models.py: Q8_0 and Q4_K_M from the converter's f32 file).
# Built for this CPU; on one with AMX, for its vector extensions without AMX (llama_cpp_isa.sh).
read -r -a ISA <<< "$(bash "$ROOT/benchmarks/peers/llama_cpp_isa.sh")"
if [ ! -x "$BUILD/llama-server" ] || [ ! -x "$BUILD/llama-batched-bench" ] || [ ! -x "$BUILD/llama-quantize" ]; then
    cmake -S "$SRC" -B "$BUILD/cmake" -DCMAKE_BUILD_TYPE=Release "${ISA[@]}" -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
    cmake --build "$BUILD/cmake" --target llama-server llama-batched-bench llama-quantize -j "$(nproc)" >/dev/null
    cp "$BUILD/cmake/bin/llama-server" "$BUILD/cmake/bin/llama-batched-bench" "$BUILD/cmake/bin/llama-quantize" "$BUILD/"
fi
MODEL_DIR=$("$PY" -c "from engine.worker.loading.model_files import resolve_model; print(resolve_model(None))")
GGUF="$BUILD/smollm2-135m-$OUTTYPE.gguf"
if [ ! -f "$GGUF" ]; then
    # The converter wants sentencepiece, which the project does not: a venv of its own that sees
    # the project's packages (torch, transformers) through a .pth, so .venv stays as it is.
    if [ ! -x "$BUILD/convert-venv/bin/python" ]; then
        "$(readlink -f "$PY")" -m venv "$BUILD/convert-venv"
        SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        echo "$SITE" > "$("$BUILD/convert-venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/project.pth"
        "$BUILD/convert-venv/bin/python" -m pip install --quiet -c "$ROOT/constraints.txt" sentencepiece
    fi
    PYTHONPATH="$SRC/gguf-py" "$BUILD/convert-venv/bin/python" "$SRC/convert_hf_to_gguf.py" "$MODEL_DIR" \
        --outtype "$OUTTYPE" --outfile "$GGUF" >/dev/null
fi
echo "llama-server: $BUILD/llama-server"
echo "llama-quantize: $BUILD/llama-quantize"
echo "model:        $GGUF"
echo "run:          $BUILD/llama-server -m $GGUF --host 127.0.0.1 --port 8080 -c 16384 -np 16 -t $(nproc) --alias SmolLM2-135M-Instruct"
