"""Compile every Triton kernel for a GPU architecture without a GPU, in the shapes the engine
launches, and print one JSON line per kernel (name, case, shared memory, cubin size).

Triton's wheel carries its NVIDIA toolchain (ptxas), so source → TTIR → TTGIR → LLVM IR → PTX →
cubin runs on any machine. Run as a script (tests/test_triton_compile.py does), never under
TRITON_INTERPRET, which turns @triton.jit functions into interpreted ones:

    python tests/triton_aot.py 90 89
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import triton_attention, triton_cache, triton_layer_ops  # noqa: E402

POINTER = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
# (heads, K/V heads, head size) of what we serve: SmolLM2-135M, Llama-3.2-1B-like, the kernel benchmark.
MODELS = {"smollm2": (9, 3, 64), "llama-1b": (32, 8, 64), "bench": (32, 8, 128)}
# Their hidden and MLP widths, for the layer ops
WIDTHS = {"smollm2": (576, 1536), "llama-1b": (2048, 8192), "bench": (4096, 14336)}


class Launch:
    """A launch's warps and stages where no Tiling names them."""

    def __init__(self, num_warps: int, num_stages: int = 3) -> None:
        self.num_warps, self.num_stages = num_warps, num_stages


def compile_kernel(kernel, signature: dict, constants: dict, arch: int, tiling=None) -> dict:
    signature = signature | {name: "constexpr" for name in constants}
    options = {"num_warps": tiling.num_warps, "num_stages": tiling.num_stages} if tiling else None
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", arch, 32), options=options)
    return {"shared": compiled.metadata.shared, "cubin_bytes": len(compiled.asm["cubin"])}


def attention_cases():
    """(case name, dtype, constexprs, launch tiling) from the plans the engine makes for prefill, decode and split decode."""
    for model, (heads, kv_heads, head_dim) in MODELS.items():
        for dtype in ("bf16", "fp16", "fp32"):
            for phase, q_lens, splits in (("prefill", [300, 1], None), ("decode", [1] * 4, 1),
                                          ("split decode", [1] * 2, 4)):
                plan = triton_attention.plan(q_lens, 4096, heads, kv_heads, head_dim, "cpu", splits)
                yield f"{model} {dtype} {phase}", dtype, dict(
                    NUM_HEADS=heads, REP=heads // kv_heads, HEAD_DIM=head_dim,
                    DIM_P2=triton.next_power_of_2(head_dim), BLOCK_SIZE=16, BLOCK_M=plan.block_m,
                    BLOCK_Q=plan.block_q, TILE_N=plan.tiling.tile_n, CAUSAL=True, SPLIT=plan.splits > 1,
                    PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST=False), plan.tiling


def main(archs: list[int]) -> None:
    for arch in archs:
        seen = set()
        for case, dtype, constants, tiling in attention_cases():
            key = (dtype, tuple(constants.items()), tiling)
            if key in seen:  # phases whose plans tile alike compile alike
                continue
            seen.add(key)
            ptr = POINTER[dtype]
            signature = {"q_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr, "out_ptr": ptr,
                         "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
                         "cu_q_ptr": "*i32", "seqused_k_ptr": "*i32", "block_table_ptr": "*i32",
                         "tile_seq_ptr": "*i32", "tile_start_ptr": "*i32", "scale": "fp32", "split_len": "i32",
                         "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32",
                         "stride_cb": "i64", "stride_ct": "i32", "stride_ch": "i32", "stride_bt": "i32"}
            figures = compile_kernel(triton_attention._attention_kernel, signature, constants, arch, tiling)
            print(json.dumps({"arch": arch, "kernel": "attention", "case": case} | figures), flush=True)
            if constants["SPLIT"]:
                merge = compile_kernel(
                    triton_attention._merge_splits_kernel,
                    {"out_ptr": POINTER[dtype], "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32",
                     "part_sum_ptr": "*fp32", "cu_q_ptr": "*i32", "stride_ot": "i32", "stride_oh": "i32"},
                    dict(NUM_HEADS=constants["NUM_HEADS"], NUM_SPLITS=4, SPLITS_P2=4,
                         HEAD_DIM=constants["HEAD_DIM"], DIM_P2=constants["DIM_P2"]), arch)
                print(json.dumps({"arch": arch, "kernel": "merge_splits", "case": case} | merge), flush=True)
        for dtype in ("bf16", "fp32"):
            for model, (_, kv_heads, head_dim) in MODELS.items():
                ptr = POINTER[dtype]
                store = compile_kernel(
                    triton_cache._store_kv_kernel,
                    {"key_ptr": ptr, "value_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr, "slot_ptr": "*i64",
                     "stride_kt": "i32", "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32",
                     "stride_cb": "i64", "stride_ct": "i32", "stride_ch": "i32"},
                    dict(NUM_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=16,
                         HEADS_P2=triton.next_power_of_2(kv_heads), DIM_P2=triton.next_power_of_2(head_dim)), arch)
                print(json.dumps({"arch": arch, "kernel": "store_kv", "case": f"{model} {dtype}"} | store), flush=True)
            for model, (heads, kv_heads, head_dim) in MODELS.items():
                ptr, (hidden, width) = POINTER[dtype], WIDTHS[model]
                for has_residual in (False, True):
                    block = triton.next_power_of_2(hidden)
                    norm = compile_kernel(
                        triton_layer_ops._add_rms_norm_kernel,
                        {"x_ptr": ptr, "residual_ptr": ptr, "weight_ptr": ptr, "out_ptr": ptr, "stride_x": "i32",
                         "stride_r": "i32", "stride_o": "i32", "n_cols": "i32", "eps": "fp32"},
                        dict(HAS_RESIDUAL=has_residual, BLOCK=block), arch, Launch(max(1, min(8, block // 256))))
                    print(json.dumps({"arch": arch, "kernel": "add_rms_norm",
                                      "case": f"{model} {dtype} residual={has_residual}"} | norm), flush=True)
                rotary = compile_kernel(
                    triton_layer_ops._rotary_store_kernel,
                    {"qkv_ptr": ptr, "positions_ptr": "*i64", "table_ptr": ptr, "k_cache_ptr": ptr,
                     "v_cache_ptr": ptr, "slot_ptr": "*i64", "stride_t": "i32", "stride_p": "i32", "stride_cs": "i32",
                     "stride_cb": "i64", "stride_ct": "i32", "stride_ch": "i32"},
                    dict(NUM_HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                         HALF_P2=triton.next_power_of_2(head_dim // 2), DIM_P2=triton.next_power_of_2(head_dim),
                         BLOCK_SIZE=16), arch, Launch(1))
                print(json.dumps({"arch": arch, "kernel": "rotary_store", "case": f"{model} {dtype}"} | rotary),
                      flush=True)
                gate = compile_kernel(
                    triton_layer_ops._silu_and_mul_kernel,
                    {"gate_up_ptr": ptr, "out_ptr": ptr, "stride_g": "i32", "stride_o": "i32", "width": "i32"},
                    dict(BLOCK=min(1024, triton.next_power_of_2(width))), arch, Launch(4))
                print(json.dumps({"arch": arch, "kernel": "silu_and_mul", "case": f"{model} {dtype}"} | gate),
                      flush=True)
            copy = compile_kernel(triton_cache._copy_blocks_kernel,
                                  {"cache_ptr": POINTER[dtype], "pairs_ptr": "*i64", "block_numel": "i64"},
                                  dict(CHUNK=1024), arch)
            print(json.dumps({"arch": arch, "kernel": "copy_blocks", "case": dtype} | copy), flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [90])
