"""Kernel benchmarks, for a GPU: paged decode attention against the device's copy bandwidth,
paged prefill attention against torch's scaled_dot_product_attention on the same data laid out
contiguously, and swap throughput each way against a plain pinned copy.

    .venv/bin/python benchmarks/kernels.py           # on CUDA, the issue's shapes (bf16)
    .venv/bin/python benchmarks/kernels.py --small   # tiny shapes anywhere (the CPU runs Triton's
                                                     # interpreter): checks the script, times nothing useful

Prints a table, then one JSON line of the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# This file is named kernels.py, like the package it measures: import from the repository root.
sys.path[0] = str(Path(__file__).resolve().parent.parent)
if "--small" in sys.argv and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.triton_attention import paged_attention, plan  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds per call, synchronising the device around each call."""
    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paged_batch(num_seqs, q_len, k_len, heads, kv_heads, head_dim, block_size, dtype, device):
    """Sequences of `k_len` keys in shuffled blocks, `q_len` new queries each (the last ones)."""
    blocks_per_seq = -(-k_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    cache = torch.randn(num_blocks, 1, 2, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    table = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq).to(torch.int32)
    q = torch.randn(num_seqs * q_len, heads, head_dim, dtype=dtype, device=device)
    cu = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32, device=device)
    lens = torch.full((num_seqs,), k_len, dtype=torch.int32, device=device)
    return q, cache[:, 0, 0], cache[:, 0, 1], cu, lens, table


def copy_bandwidth(nbytes: int, device, repeats: int) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), repeats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    if args.small:
        batch, context, heads, kv_heads, head_dim, prefill, swap_n, repeats = 2, 64, 4, 2, 64, 32, 4, 2
    else:
        batch, context, heads, kv_heads, head_dim, prefill, swap_n, repeats = 64, 4096, 32, 8, 128, 2048, 512, 20
    scale = head_dim ** -0.5
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    rows = []

    # Decode: reads every key and value once; compare with what a plain copy moves.
    q, k_cache, v_cache, cu, lens, table = paged_batch(batch, 1, context, heads, kv_heads, head_dim, 16, dtype, device)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * k_cache.element_size()
    # The engine plans a step's tiling once on the host and shares it across layers: so here.
    decode_plan = plan([1] * batch, context, heads, kv_heads, head_dim, device)
    decode_s = timed(lambda: paged_attention(q, k_cache, v_cache, cu, lens, table, scale,
                                             attention_plan=decode_plan), repeats)
    copy_bps = copy_bandwidth(kv_bytes, device, repeats)
    decode_bps = kv_bytes / decode_s
    rows.append((f"decode attention {batch} x {context}, {heads}/{kv_heads} heads, d={head_dim}, "
                 f"{decode_plan.splits} split(s)",
                 f"{decode_s * 1e3:.3f} ms", f"{decode_bps / 1e9:.0f} GB/s = {decode_bps / copy_bps:.0%} of copy"))
    rows.append(("device copy (read + write)", "", f"{copy_bps / 1e9:.0f} GB/s"))

    # Prefill: the same data as paged blocks and as contiguous tensors for SDPA.
    q, k_cache, v_cache, cu, lens, table = paged_batch(4, prefill, prefill, heads, kv_heads, head_dim, 16, dtype,
                                                       device)
    prefill_plan = plan([prefill] * 4, prefill, heads, kv_heads, head_dim, device)
    paged_s = timed(lambda: paged_attention(q, k_cache, v_cache, cu, lens, table, scale,
                                            attention_plan=prefill_plan), max(2, repeats // 4))
    k = k_cache[table.long()].reshape(4, prefill, kv_heads, head_dim).transpose(1, 2)
    v = v_cache[table.long()].reshape(4, prefill, kv_heads, head_dim).transpose(1, 2)
    qd = q.view(4, prefill, heads, head_dim).transpose(1, 2)
    sdpa_s = timed(lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True, scale=scale, enable_gqa=True),
                   max(2, repeats // 4))
    rows.append((f"prefill attention 4 x {prefill}, paged (ours)", f"{paged_s * 1e3:.3f} ms",
                 f"{sdpa_s / paged_s:.2f}x SDPA's speed"))
    rows.append((f"prefill attention 4 x {prefill}, SDPA contiguous", f"{sdpa_s * 1e3:.3f} ms", ""))

    # Swap: whole blocks of a 16-layer cache between the device pool and the pinned host pool.
    shape = (2 * swap_n, 16, 2, 16, kv_heads, head_dim)
    device_pool = torch.randn(shape, dtype=dtype, device=device)
    host_pool = torch.empty(shape, dtype=dtype, pin_memory=device == "cuda")
    order = torch.randperm(2 * swap_n)[:swap_n]
    pairs = torch.stack([order, torch.arange(swap_n)], dim=1)  # scattered device blocks -> host blocks
    nbytes = swap_n * device_pool[0].numel() * device_pool.element_size()
    out_s = timed(lambda: reference.swap_blocks(device_pool, host_pool, pairs), repeats)
    in_s = timed(lambda: reference.swap_blocks(host_pool, device_pool, pairs.flip(1)), repeats)
    plain_s = timed(lambda: host_pool[:swap_n].copy_(device_pool[:swap_n], non_blocking=True), repeats)
    rows.append((f"swap out, {swap_n} blocks of {device_pool[0].numel() * 2 >> 10} KiB", f"{out_s * 1e3:.3f} ms",
                 f"{nbytes / out_s / 1e9:.1f} GB/s"))
    rows.append((f"swap in, {swap_n} blocks", f"{in_s * 1e3:.3f} ms", f"{nbytes / in_s / 1e9:.1f} GB/s"))
    rows.append(("plain pinned copy, same bytes", f"{plain_s * 1e3:.3f} ms", f"{nbytes / plain_s / 1e9:.1f} GB/s"))

    print(f"{name}, bf16\n")
    for label, t, figure in rows:
        print(f"{label:<52} {t:>12}  {figure}")
    print(json.dumps({"device": name, "small": args.small, "decode_attention_gbs": round(decode_bps / 1e9, 2),
                      "copy_gbs": round(copy_bps / 1e9, 2), "decode_bandwidth_share": round(decode_bps / copy_bps, 4),
                      "decode_splits": decode_plan.splits,
                      "prefill_ms": round(paged_s * 1e3, 3), "sdpa_prefill_ms": round(sdpa_s * 1e3, 3),
                      "prefill_vs_sdpa": round(sdpa_s / paged_s, 3),
                      "swap_out_gbs": round(nbytes / out_s / 1e9, 2), "swap_in_gbs": round(nbytes / in_s / 1e9, 2),
                      "pinned_copy_gbs": round(nbytes / plain_s / 1e9, 2)}))


if __name__ == "__main__":
    main()
