"""The engine's one configuration (engine/core/config.py's EngineConfig): what it decides at start
from its options and the machine, as `python -m engine.serve --print-config` prints it from a
real engine core process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_print_config_shows_what_the_options_and_the_machine_decided(tiny_model_dir):
    command = [sys.executable, "-m", "engine.serve", "--print-config", "--model", tiny_model_dir, "--dtype", "float32",
               "--num-gpu-blocks", "40", "--num-cpu-blocks", "8", "--max-num-batched-tokens", "512",
               "--max-model-len", "256", "--max-num-seqs", "12"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PAGEDCHAT_COMPILE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads(done.stdout)
    assert (config["model"], config["device"], config["dtype"]) == (tiny_model_dir, "cpu", "float32")
    assert config["quantization"] == "dequantize" and "dense" in config["weights"]
    assert config["scheduler"] | {"max_step_ms": None} == config["scheduler"] | {
        "num_device_blocks": 40, "num_host_blocks": 8, "block_size": 16, "max_num_seqs": 12,
        "max_num_batched_tokens": 512, "max_model_len": 256, "max_step_ms": None}
    assert config["scheduler"]["max_step_ms"] > 0  # the step-time target, on by default
    # the tiny model's K and V: 2 layers x 2 (K, V) x 16 tokens x 2 heads x 16 dims x 4 bytes
    assert config["kv_block_bytes"] == 2 * 2 * 16 * 2 * 16 * 4
    # a dense fp32 model on a CPU with compiled steps asked for: both compiled steps, then eager
    assert config["step_paths"][:2] == ["lone", "flat"] and config["step_paths"][-1] == "eager"
    assert config["compiled_steps"].startswith("on (lone, flat)")
