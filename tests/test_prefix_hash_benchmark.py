"""benchmarks/prefix_hash.py runs (small) and reports both hashes' figures in its JSON line."""
import json
from pathlib import Path

from preloaded_python import run_python

ROOT = Path(__file__).resolve().parents[1]


def test_the_prefix_hash_benchmark_reports_both_hashes(tiny_model_dir):
    done = run_python(["benchmarks/prefix_hash.py", "--model", tiny_model_dir, "--dtype", "float32", "--blocks", "200",
                       "--prompt-tokens", "64", "--rounds", "1", "--num-gpu-blocks", "32", "--num-cpu-blocks", "8"],
                      ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(figures["us_per_block"]) == set(figures["prefill_ms"]) == {"xxh3", "sha256"}
    assert figures["cpu"] and all(v > 0 for v in figures["us_per_block"].values())
    assert "sha256" in done.stdout.splitlines()[-2]  # the table's last row
