"""A backend's `/metrics` in common terms, whichever engine wrote it: vLLM (v1), SGLang, llama.cpp's
llama-server (`--metrics`) or PagedChat's own `python -m engine.serve`. `read_metrics` turns one
scrape into a `MetricsSnapshot`; `figures` turns two into the `Figures` a row draws.

Engines name the same ideas differently, and not every engine has every idea: a snapshot says
which figures its engine cannot give, and why (`MetricsSnapshot.missing`), so the panel can say so
rather than draw a zero.

Names below are sample names as the text writes them: a counter's with `_total`, a histogram's
`_sum` and `_count`. (The parser strips `_total` from a counter's family name, not from its
samples; and it appends `_total` to a counter declared without one, as llama.cpp once declared
some. Looking samples up by name takes counters and gauges alike.)
"""
from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from ui.backends.figures import FIGURES, Figures, MetricsSnapshot

ENGINES = {"pagedchat": "PagedChat", "vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp's server"}
# The first prefix present names the flavor: PagedChat writes vLLM's names too, and `pagedchat:` ones.
PREFIXES = ("pagedchat:", "vllm:", "sglang:", "llamacpp:")

# Snapshot field -> the samples that carry it, the newer name first where an engine renamed one.
_VLLM = {  # vllm/v1/metrics/loggers.py; gpu_* are the names before v0.9's renames, swapped v0's
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "swapped": ("vllm:num_requests_swapped",),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "prefix_hit_rate": ("vllm:gpu_prefix_cache_hit_rate",),
    "preemptions": ("vllm:num_preemptions_total",),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
    "ttft_sum": ("vllm:time_to_first_token_seconds_sum",),
    "ttft_count": ("vllm:time_to_first_token_seconds_count",),
}
SOURCES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": _VLLM,
    "pagedchat": {**_VLLM, "swapped": ("pagedchat:num_requests_swapped",)},  # engine/api/metrics.py
    "sglang": {  # python/sglang/srt/metrics/collector.py
        "kv_usage": ("sglang:token_usage",),
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "prefix_queries": ("sglang:prompt_tokens_total",),  # every prompt token is looked up
        "prefix_hits": ("sglang:cached_tokens_total",),
        "prefix_hit_rate": ("sglang:cache_hit_rate",),
        "preemptions": ("sglang:num_retracted_requests_total",),
        "prompt_tokens": ("sglang:prompt_tokens_total",),
        "generation_tokens": ("sglang:generation_tokens_total",),
        "generation_throughput": ("sglang:gen_throughput",),
        "ttft_sum": ("sglang:time_to_first_token_seconds_sum",),
        "ttft_count": ("sglang:time_to_first_token_seconds_count",),
    },
    "llamacpp": {  # tools/server (examples/server before mid-2025): the /metrics handler
        "kv_usage": ("llamacpp:kv_cache_usage_ratio",),
        "running": ("llamacpp:requests_processing",),
        "waiting": ("llamacpp:requests_deferred",),
        "prefix_hits": ("llamacpp:prompt_tokens_cached_total",),
        "prompt_tokens": ("llamacpp:prompt_tokens_total",),
        "generation_tokens": ("llamacpp:tokens_predicted_total",),
        "generation_throughput": ("llamacpp:predicted_tokens_seconds",),
    },
}
# Shares of 0..1 are averaged over label sets (data-parallel engines, DP ranks); counts are summed.
_MEANS = {"kv_usage", "prefix_hit_rate"}

# Figure -> the groups of fields it can be drawn from: any one group wholly present will do.
_DRAWN_FROM = {
    "kv_usage": (("kv_usage",),),
    "running": (("running",),),
    "waiting": (("waiting",),),
    "hit_rate": (("prefix_queries", "prefix_hits"), ("prefix_hit_rate",)),
    "preemptions": (("preemptions",),),
    "throughput": (("generation_tokens",), ("generation_throughput",)),
    "ttft": (("ttft_sum", "ttft_count"),),
}
# Why an engine lacks a figure, where "exports none of <names>" would not say enough.
_REASONS = {
    ("llamacpp", "kv_usage"): "this llama.cpp server exports no KV-cache usage (newer builds dropped "
                              "llamacpp:kv_cache_usage_ratio)",
    ("llamacpp", "hit_rate"): "llama.cpp's server exports no prefix-cache counters "
                              "(llamacpp:prompt_tokens_cached_total is in newer builds only)",
    ("llamacpp", "preemptions"): "llama.cpp's server does not preempt (no such metric)",
    ("llamacpp", "ttft"): "llama.cpp's server exports no time-to-first-token histogram",
    ("sglang", "preemptions"): "this SGLang exports no retraction counter (sglang:num_retracted_requests_total "
                               "is in newer versions only)",
}


class MetricsReadError(ValueError):
    """The text is not Prometheus exposition format."""


def read_metrics(text: str, timestamp: float) -> MetricsSnapshot:
    """One scrape of a backend's `/metrics`, taken at `timestamp` (seconds, any clock the caller
    keeps steady), in common terms. Raises MetricsReadError for text that is not Prometheus's."""
    samples = _samples(text)
    flavor = next((prefix[:-1] for prefix in PREFIXES if any(name.startswith(prefix) for name in samples)),
                  "unknown")
    values = {field: _value(samples, names, field in _MEANS) for field, names in SOURCES.get(flavor, {}).items()}
    if flavor == "llamacpp" and values["prefix_hits"] is not None and values["prompt_tokens"] is not None:
        # Its prompt_tokens_total leaves the cached tokens out: every prompt token is one or the other.
        values["prefix_queries"] = values["prefix_hits"] + values["prompt_tokens"]
    missing = {figure: _why_missing(flavor, figure) for figure in FIGURES
               if not any(all(values.get(f) is not None for f in group) for group in _DRAWN_FROM[figure])}
    return MetricsSnapshot(timestamp, flavor, missing=missing, **values)


def figures(older: MetricsSnapshot | None, newer: MetricsSnapshot) -> Figures:
    """What a row draws at `newer`: its gauges, and what the counters did since `older`. Without
    `older`, or over no time, only gauges (a backend's own hit-rate and throughput gauges among
    them); so too for a figure whose counters either scrape lacks."""
    hit_rate, throughput = newer.prefix_hit_rate, newer.generation_throughput
    preemptions = ttft = None
    seconds = newer.timestamp - older.timestamp if older is not None else 0.0
    if seconds > 0:
        queries, hits = _delta(older, newer, "prefix_queries"), _delta(older, newer, "prefix_hits")
        if queries is not None and hits is not None:
            hit_rate = hits / queries if queries else None  # no lookups, no rate
        generated = _delta(older, newer, "generation_tokens")
        if generated is not None:
            throughput = generated / seconds
        count, total = _delta(older, newer, "ttft_count"), _delta(older, newer, "ttft_sum")
        if count is not None and total is not None:
            ttft = total / count if count else None  # no first token in the interval
        preemptions = _delta(older, newer, "preemptions")
    return Figures(newer.timestamp, kv_usage=newer.kv_usage, running=newer.running, waiting=newer.waiting,
                   hit_rate=hit_rate, preemptions=preemptions, throughput=throughput, ttft=ttft)


def _samples(text: str) -> dict[str, list[float]]:
    """Sample name -> its values, one per label set; NaN (an engine's 0/0) counts as absent."""
    samples: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not math.isnan(sample.value):
                    samples.setdefault(sample.name, []).append(sample.value)
    except ValueError as error:  # the parser's only complaint, whatever is wrong
        raise MetricsReadError(f"not Prometheus exposition text: {str(error) or 'a malformed line'}") from None
    return samples


def _value(samples: dict[str, list[float]], names: tuple[str, ...], mean: bool) -> float | None:
    """The first of `names` the text has, over its label sets; None: none of them."""
    values = next((samples[name] for name in names if name in samples), None)
    if values is None:
        return None
    return sum(values) / len(values) if mean else float(sum(values))


def _delta(older: MetricsSnapshot, newer: MetricsSnapshot, counter: str) -> float | None:
    """How much a counter grew; one that went down was restarted with its backend, so the
    interval counts from zero."""
    before, after = getattr(older, counter), getattr(newer, counter)
    if before is None or after is None:
        return None
    return after - before if after >= before else after


def _why_missing(flavor: str, figure: str) -> str:
    fields = [field for group in _DRAWN_FROM[figure] for field in group]
    if flavor == "unknown":
        looked_for = [name for source in SOURCES.values() for field in fields for name in source.get(field, ())]
        return f"no known engine's metrics; looked for {', '.join(dict.fromkeys(looked_for))}"
    if (flavor, figure) in _REASONS:
        return _REASONS[flavor, figure]
    names = [name for field in fields for name in SOURCES[flavor].get(field, ())]
    if not names:
        return f"{ENGINES[flavor]} exports no such metric"
    return f"{ENGINES[flavor]} exports none of {', '.join(dict.fromkeys(names))}"
