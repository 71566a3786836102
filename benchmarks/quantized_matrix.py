"""One weight matrix kept in a GGUF format, multiplied on this CPU: our native loops (qmatmul.c)
with the activations in one and in two int8 levels, against torch's fp32 and bf16 matmuls of the
dequantized weight. The default shape is a 1B Llama's ffn_up (8,192 x 2,048); the quants are
random bytes (the speed does not depend on their values), the scales small.

    .venv/bin/python benchmarks/quantized_matrix.py [--formats Q4_K,Q8_0] [--rows 1,32,256]

"2 levels" is the engine's default precision: qmatmul.c's two int8 levels below 8 rows, and
from 8 rows qmatmul_batch.c's int16 loops (the same precision). On a CPU with AMX, torch's
bf16 matmul runs on it (oneDNN); elsewhere it is the slowest column.
Prints a table (ms per product, best of --repeats), then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if not __package__:  # run as a script: the repository root first (benchmarks/kernels.py shadows kernels)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402
from engine.worker.loading import gguf_formats  # noqa: E402
from engine.worker.quantized.matrix import QuantizedMatrix, matmul  # noqa: E402

# Where each format's f16 factors sit in its block: random bytes there could be inf or NaN.
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def random_matrix(name: str, out_features: int, in_features: int, seed: int = 0) -> QuantizedMatrix:
    qtype = GGMLQuantizationType[name]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (out_features * in_features // block_size, type_size), dtype=np.uint8)
    for start in F16_FIELDS[name]:
        scale = rng.uniform(-0.05, 0.05, len(blocks)).astype(np.float16)
        blocks[:, start:start + 2] = scale.view(np.uint8).reshape(-1, 2)
    data = torch.from_numpy(blocks.reshape(out_features, -1))
    return QuantizedMatrix.of(gguf_formats.unpack(data, qtype), name)


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="Q4_K,Q8_0", help=f"comma list of {', '.join(F16_FIELDS)}")
    parser.add_argument("--rows", default="1,32,256")
    parser.add_argument("--out-features", type=int, default=8192)
    parser.add_argument("--in-features", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    cpu = cpu_model()
    print(f"{cpu}, {torch.get_num_threads()} threads; {args.out_features} x {args.in_features}; ms per product, "
          f"best of {args.repeats}")
    print(f"{'format':8} {'rows':>5} {'1 level':>9} {'2 levels':>9} {'fp32':>9} {'bf16':>9}  GFLOP/s of the best")
    results = []
    for name in args.formats.split(","):
        matrix = random_matrix(name, args.out_features, args.in_features)
        dense = matrix.dequantize()
        dense_bf16 = dense.bfloat16()
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.in_features)
            x_bf16 = x.bfloat16()
            ms = {"one_level": best_ms(lambda: matmul(x, [matrix], levels=1), args.repeats),
                  "two_levels": best_ms(lambda: matmul(x, [matrix], levels=2), args.repeats),
                  "fp32": best_ms(lambda: x @ dense.T, args.repeats),
                  "bf16": best_ms(lambda: x_bf16 @ dense_bf16.T, args.repeats)}
            fastest = min(ms, key=ms.get)
            gflops = 2 * rows * args.out_features * args.in_features / ms[fastest] / 1e6
            print(f"{name:8} {rows:>5} " + " ".join(f"{v:>9.3f}" for v in ms.values()) + f"  {fastest} {gflops:,.0f}")
            results.append({"format": name, "rows": rows, "ms": {k: round(v, 4) for k, v in ms.items()}})
    print(json.dumps({"cpu": cpu, "threads": torch.get_num_threads(), "out_features": args.out_features,
                      "in_features": args.in_features, "results": results}))


if __name__ == "__main__":
    main()
