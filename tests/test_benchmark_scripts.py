"""The benchmark scripts still run and end with their JSON line (figures are not asserted:
speed is shown by the benchmarks themselves, in BENCHMARKS.md)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def last_json_line(args):
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_scheduler_overhead_script():
    figures = last_json_line(["benchmarks/scheduler_overhead.py", "--steps", "5", "--requests", "8"])
    assert figures["ms_per_step"] > 0 and figures["requests"] == 8


def test_kernels_script_small():
    figures = last_json_line(["benchmarks/kernels.py", "--small"])
    assert figures["small"] is True
    assert {"decode_attention_gbs", "copy_gbs", "prefill_vs_sdpa", "swap_out_gbs", "swap_in_gbs"} <= set(figures)
