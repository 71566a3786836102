"""Kernel benchmarks, for a GPU: paged decode attention against the device's copy bandwidth,
paged prefill attention against torch's scaled_dot_product_attention on the same data laid out
contiguously, and swap throughput each way against a plain pinned copy.

    .venv/bin/python benchmarks/kernels.py           # on CUDA, the issue's shapes (bf16)
    .venv/bin/python benchmarks/kernels.py --small   # tiny shapes anywhere (the CPU runs Triton's
                                                     # interpreter): checks the script, times nothing useful
    .venv/bin/python benchmarks/kernels.py --sweep   # also times every launch shape (Tiling) of the
                                                     # attention kernel on both workloads, checking each

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
from kernels.triton_attention import DECODE_TILING, PREFILL_TILING, Tiling, paged_attention, plan  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Seconds per call. On CUDA: the mean of `repeats` calls queued back to back between two
    events, the GPU's time (the engine replays its decode launches from CUDA graphs, so Python's
    cost per launch is not the kernel's). Elsewhere: the median of synchronous calls."""
    fn()
    if torch.cuda.is_available():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
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


def contiguous_kv(k_cache, v_cache, table, num_seqs: int, k_len: int):
    """The paged K/V of `paged_batch` gathered into [seqs, kv_heads, keys, dim], as SDPA takes them."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k = k_cache[table.long()].reshape(num_seqs, -1, kv_heads, head_dim)[:, :k_len].transpose(1, 2)
    v = v_cache[table.long()].reshape(num_seqs, -1, kv_heads, head_dim)[:, :k_len].transpose(1, 2)
    return k, v


def sweep(name: str, q_len: int, batch, scale: float, repeats: int, tilings: list[Tiling],
          splits: list[int]) -> list[dict]:
    """Each launch shape on one workload: its time, and its largest difference from SDPA (every
    shape must compute the same attention)."""
    q, k_cache, v_cache, cu, lens, table = batch
    num_seqs, k_len, heads, kv_heads, head_dim = len(lens), int(lens[0]), q.shape[1], k_cache.shape[2], q.shape[2]
    k, v = contiguous_kv(k_cache, v_cache, table, num_seqs, k_len)
    qd = q.view(num_seqs, q_len, heads, head_dim).transpose(1, 2)
    want = F.scaled_dot_product_attention(qd, k, v, is_causal=q_len > 1, scale=scale, enable_gqa=True)
    want = want.transpose(1, 2).reshape(-1, heads, head_dim).float()
    results = []
    for tiling in tilings:
        for num_splits in splits:
            step = plan([q_len] * num_seqs, k_len, heads, kv_heads, head_dim, q.device, num_splits, tiling)
            got = paged_attention(q, k_cache, v_cache, cu, lens, table, scale, attention_plan=step)
            error = (got.float() - want).abs().max().item()
            seconds = timed(lambda: paged_attention(q, k_cache, v_cache, cu, lens, table, scale, attention_plan=step),
                            repeats)
            results.append({"workload": name, "q_tokens": tiling.q_tokens, "tile_n": tiling.tile_n,
                            "num_warps": tiling.num_warps, "num_stages": tiling.num_stages,
                            "splits": step.splits, "ms": round(seconds * 1e3, 4), "max_error": round(error, 4)})
            print(json.dumps(results[-1]), flush=True)  # as it goes: a sweep cut short keeps what it timed
    return results


def run_sweeps(decode_batch, prefill_batch, scale: float, repeats: int, kv_bytes: int, sdpa_s: float,
               small: bool) -> dict:
    if small:  # the interpreter: two shapes each, to check the sweep itself
        decode_shapes, prefill_shapes = [Tiling(1), Tiling(1, 64, 8, 2)], [Tiling(4), Tiling(16, 64, 8, 2)]
    else:
        decode_shapes = [Tiling(1, t, w, st) for t in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
        prefill_shapes = [Tiling(q, t, w, st) for q in (4, 8, 16, 32) for t in (32, 64) for w in (4, 8)
                          for st in (2, 3)]
    decode = sweep("decode", 1, decode_batch, scale, repeats, decode_shapes, [1, 2])
    prefill = sweep("prefill", int(prefill_batch[4][0]), prefill_batch, scale, max(2, repeats // 4), prefill_shapes,
                    [1])
    print("\nlaunch shapes (Tiling): decode GB/s, prefill x SDPA; max error against SDPA")
    for r in decode + prefill:
        figure = (f"{kv_bytes / (r['ms'] / 1e3) / 1e9:7.0f} GB/s" if r["workload"] == "decode"
                  else f"{sdpa_s / (r['ms'] / 1e3):7.2f}x SDPA")
        print(f"{r['workload']:<8} q_tokens {r['q_tokens']:>2} tile_n {r['tile_n']:>3} warps {r['num_warps']} "
              f"stages {r['num_stages']} splits {r['splits']}  {r['ms']:9.4f} ms  {figure}  error {r['max_error']}")
    fastest = {w: min((r for r in decode + prefill if r["workload"] == w), key=lambda r: r["ms"])
               for w in ("decode", "prefill")}
    worst = max(r["max_error"] for r in decode + prefill)
    print(f"fastest decode: {fastest['decode']}\nfastest prefill: {fastest['prefill']}\nlargest error: {worst}")
    return {"sweep_fastest": fastest, "sweep_max_error": worst}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also time every launch shape of the attention kernel")
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
    decode_batch = paged_batch(batch, 1, context, heads, kv_heads, head_dim, 16, dtype, device)
    q, k_cache, v_cache, cu, lens, table = decode_batch
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
    prefill_batch = paged_batch(4, prefill, prefill, heads, kv_heads, head_dim, 16, dtype, device)
    q, k_cache, v_cache, cu, lens, table = prefill_batch
    prefill_plan = plan([prefill] * 4, prefill, heads, kv_heads, head_dim, device)
    paged_s = timed(lambda: paged_attention(q, k_cache, v_cache, cu, lens, table, scale,
                                            attention_plan=prefill_plan), max(2, repeats // 4))
    k, v = contiguous_kv(k_cache, v_cache, table, 4, prefill)
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
    swept = run_sweeps(decode_batch, prefill_batch, scale, repeats, kv_bytes, sdpa_s, args.small) if args.sweep else {}
    print(json.dumps(swept | {"device": name, "small": args.small, "decode_attention_gbs": round(decode_bps / 1e9, 2),
                      "copy_gbs": round(copy_bps / 1e9, 2), "decode_bandwidth_share": round(decode_bps / copy_bps, 4),
                      "decode_splits": decode_plan.splits, "decode_tiling": vars(DECODE_TILING),
                      "prefill_tiling": vars(PREFILL_TILING),
                      "prefill_ms": round(paged_s * 1e3, 3), "sdpa_prefill_ms": round(sdpa_s * 1e3, 3),
                      "prefill_vs_sdpa": round(sdpa_s / paged_s, 3),
                      "swap_out_gbs": round(nbytes / out_s / 1e9, 2), "swap_in_gbs": round(nbytes / in_s / 1e9, 2),
                      "pinned_copy_gbs": round(nbytes / plain_s / 1e9, 2)}))


if __name__ == "__main__":
    main()
