"""`make bench-peers GGUF=...`'s pieces (the GGUF benchmark's files): benchmarks/peers/gguf_models.py's
names, and compare.py's --gguf mode running ours on the embedded Q4_1 file with llama.cpp reported
missing from an empty build folder. Making the 1B files needs llama.cpp built (llama_cpp.sh), which
a test does not do; only that the script says so."""
import json
import sys
from pathlib import Path

import pytest
from preloaded_python import run_python

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.peers import gguf_models  # noqa: E402


def test_names_resolve_to_the_embedded_file_and_the_build_folder(tmp_path):
    assert gguf_models.expand("all") == ["q4_1", "1b-q8_0", "1b-q4_k_m"]
    assert gguf_models.expand("q4_1,/x/y.gguf,") == ["q4_1", "/x/y.gguf"]
    assert gguf_models.model_path("q4_1").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_models.model_path("q4_1").is_file()
    assert gguf_models.model_path("1b-q4_k_m", tmp_path) == tmp_path / "random-llama-1b-q4_k_m.gguf"
    assert gguf_models.model_path("/x/y.gguf", tmp_path) == Path("/x/y.gguf")
    assert gguf_models.make(["q4_1"], tmp_path) == [gguf_models.model_path("q4_1")]  # found, nothing made
    with pytest.raises(RuntimeError, match="llama_cpp.sh"):
        gguf_models.make(["1b-q8_0"], tmp_path)  # no llama-quantize there: what to run, before any work
    assert not any(tmp_path.iterdir())
    with pytest.raises(FileNotFoundError):
        gguf_models.make([str(tmp_path / "missing.gguf")], tmp_path)


def test_gguf_comparison_runs_ours_on_the_file_and_reports_llama_cpp_not_set_up(tmp_path):
    done = run_python(["benchmarks/peers/compare.py", "--gguf", "q4_1", "--dtype", "float32", "--output-tokens", "2",
                       "--rounds", "1", "--chats", "2", "--build", str(tmp_path)], ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    row = figures["gguf"]["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert row["type"] == "Q4_1" and row["size_bytes"] > 0 and row["single_bound_tok_s"] > 0
    assert row["engine_tok_s"] > 0 and row["engine_single_tok_s"] > 0 and row["engine_dtype"] == "float32"
    assert "llama_cpp.sh" in row["missing"]["llamacpp"] and "engine_over_llamacpp" not in row
    workload = json.loads((tmp_path / "workload-SmolLM2-135M-Instruct.Q4_1.json").read_text())
    assert len(workload["prompts"]) == 2
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in done.stdout and "Q4_1" in done.stdout  # the table names the file


def test_the_same_prompt_work_is_each_chats_tokens_past_the_common_prefix():
    """compare.py's llama.cpp run on ours' prompt work: per chat, the tokens past the prompts'
    common prefix, which our prefix cache holds (its full blocks, and the block after them copied
    from a cached one that begins with the same tokens); at least one token each."""
    from benchmarks.peers.compare import own_prompt_tokens

    shared = list(range(100, 140))  # 40 common tokens: two full blocks and 8 of the third
    assert own_prompt_tokens([shared + [1] * 10, shared + [2] * 20]) == (10 + 20) // 2
    assert own_prompt_tokens([shared[:15] + [3], shared[:15] + [4, 5, 6]]) == 2  # no full block: still shared
    assert own_prompt_tokens([shared[:32] + [7] * 4, shared[:32] + [8] * 6]) == 5
    assert own_prompt_tokens([shared, shared]) == 1  # the same prompt: its last token
