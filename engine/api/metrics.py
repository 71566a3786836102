"""Prometheus metrics of one engine client, under vLLM v1's names, types and `model_name` label
where vLLM has the metric (so its Grafana dashboards work unchanged), and under `pagedchat:` for
what vLLM v1 does not export: swapped requests, the host (CPU) pool, preemptions by swap and by
recompute, blocks swapped each way.

Two sources. Gauges and the engine's own cumulative counters are read from `client.stats()` at
each scrape (a snapshot: scraping never waits for the engine). Per-request figures (tokens,
time to first token, inter-token latency, end-to-end latency, how requests finished) are
counted as the engine client routes each delta, for every request: the chat app's and the
API's alike.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.runtime.streaming_client import StreamingClient
from engine.outputs import Delta

# vLLM v1's buckets (vllm/v1/metrics/loggers.py), so dashboards' quantiles mean the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineMetrics:
    """The metrics of `client` in a registry of their own; `render()` is the /metrics body."""

    def __init__(self, client: StreamingClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                                     registry=self.registry).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                                         registry=self.registry).labels(model_name)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*labels, "finished_reason"], registry=self.registry)
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.registry.register(_StatsCollector(client, model_name))
        # (request, sample) -> when its latest token came; touched only on the engine loop thread.
        self._last_token: dict[tuple[str, int], float] = {}
        client.add_listener(self._on_delta)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _on_delta(self, delta: Delta, now: float) -> None:
        """On the engine loop thread: count the delta's tokens and, at its end, the request."""
        key = (delta.request_id, delta.index)
        if delta.token_ids:
            self.generation_tokens.inc(len(delta.token_ids))
            previous = self._last_token.get(key)
            self._last_token[key] = now
            if previous is not None:
                self.itl.observe((now - previous) / len(delta.token_ids))
        if delta.finish_reason is None:
            return
        self._last_token.pop(key, None)
        self.request_success[delta.finish_reason].inc()
        usage = delta.usage
        if usage is not None and delta.index == 0:  # one request's prompt, once, whatever its n
            self.prompt_tokens.inc(usage.prompt_tokens)
            if usage.completion_tokens:
                self.ttft.observe(usage.ttft_s)
            self.e2e.observe(usage.duration_s)


class _StatsCollector:
    """Read at each scrape from the engine's latest stats snapshot."""

    def __init__(self, client: StreamingClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.client.stats()
        labels = [self.model_name]

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        metrics = (
            (gauge, "vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running),
            (gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
            (gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             stats.device_blocks_used / max(stats.device_blocks_total, 1)),
            (counter, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             stats.prefix_cache_queries),
            (counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             stats.prefix_cache_hits),
            (counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             stats.num_preemptions_swap + stats.num_preemptions_recompute),
            (gauge, "pagedchat:num_requests_swapped", "Requests preempted by swapping, their KV blocks in the host pool.",
             stats.num_swapped),
            (gauge, "pagedchat:host_kv_cache_usage_perc", "Host (CPU swap) KV pool usage. 1 means 100 percent usage.",
             stats.host_blocks_used / max(stats.host_blocks_total, 1)),
            (gauge, "pagedchat:kv_cache_cached_blocks", "Device blocks free but still holding a reusable prefix.",
             stats.device_blocks_cached),
            (counter, "pagedchat:num_preemptions_swap", "Preemptions that swapped the victim's blocks to the host pool.",
             stats.num_preemptions_swap),
            (counter, "pagedchat:num_preemptions_recompute", "Preemptions that freed the victim's blocks, to recompute.",
             stats.num_preemptions_recompute),
            (counter, "pagedchat:blocks_swapped_out", "KV blocks copied from the device pool to the host pool.",
             stats.total_blocks_swapped_out),
            (counter, "pagedchat:blocks_swapped_in", "KV blocks copied from the host pool back to the device pool.",
             stats.total_blocks_swapped_in),
            (gauge, "pagedchat:compiled_decode_pending",
             "1 while a compiled decode step is still being built or loaded (the engine decodes eagerly meanwhile).",
             float(self.client.compiled_pending())),
            (counter, "pagedchat:engine_core_restarts", "Engine core processes started again after one died.",
             getattr(self.client, "restarts", 0)),
        )
        for kind, name, documentation, value in metrics:
            family = kind(name, documentation, labels=["model_name"])
            family.add_metric(labels, value)
            yield family
