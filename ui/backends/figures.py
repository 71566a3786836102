"""What the panel's cluster view knows of one backend: a scrape of its `/metrics` in common terms
(whatever engine it is), the figures drawn from two scrapes, and the backend's status."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# The figures a backend's row draws, in order; `MetricsSnapshot.missing` explains the absent ones.
FIGURES = ("kv_usage", "running", "waiting", "hit_rate", "preemptions", "throughput", "ttft")


@dataclass(frozen=True)
class MetricsSnapshot:
    """One scrape. Counters are cumulative since the backend started; None: not exported."""
    timestamp: float
    flavor: str                              # "pagedchat", "vllm", "sglang", "llamacpp" or "unknown"
    kv_usage: float | None = None            # device KV cache in use, 0..1
    running: float | None = None             # requests in the running batch
    waiting: float | None = None             # requests queued
    swapped: float | None = None             # requests preempted to host memory (PagedChat)
    prefix_queries: float | None = None      # counter: prompt tokens looked up in the prefix cache
    prefix_hits: float | None = None         # counter: of them, found
    prefix_hit_rate: float | None = None     # gauge the backend computes itself (SGLang), 0..1
    preemptions: float | None = None         # counter
    prompt_tokens: float | None = None       # counter
    generation_tokens: float | None = None   # counter
    generation_throughput: float | None = None  # gauge, tokens/s, where the backend computes it
    ttft_sum: float | None = None            # time-to-first-token histogram's sum (s) and count
    ttft_count: float | None = None
    missing: Mapping[str, str] = field(default_factory=dict)  # figure (FIGURES) -> why it is absent


@dataclass(frozen=True)
class Figures:
    """What a row draws at one moment, from two scrapes (rates over the time between them: the
    monitor takes them a few seconds apart, ui/backends/monitor.py WINDOW_S)."""
    timestamp: float
    kv_usage: float | None = None      # 0..1
    running: float | None = None
    waiting: float | None = None
    hit_rate: float | None = None      # 0..1 of prompt tokens looked up in the interval
    preemptions: float | None = None   # in the interval (the last WINDOW_S seconds)
    throughput: float | None = None    # generated tokens/s
    ttft: float | None = None          # mean seconds, of first tokens in the interval


@dataclass(frozen=True)
class BackendStatus:
    """One backend as the app sees it now."""
    name: str                          # how replies and the panel name it ("127.0.0.1:8001")
    url: str | None                    # None: the in-process engine
    up: bool
    problem: str | None = None         # why it is down, or what it lacks ("no /metrics: ...")
    model: str | None = None
    max_model_len: int | None = None
    flavor: str = "unknown"
    in_flight: int = 0                 # this app's replies on it now
    history: tuple[Figures, ...] = ()  # oldest first
    missing: Mapping[str, str] = field(default_factory=dict)  # figure -> why not drawn
