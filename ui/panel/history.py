"""A bounded history of engine stats samples, turned into plot rows for the live panel.

The panel samples `SchedulerStats` about once a second while the engine steps every few ms, so
every rate here comes from the cumulative counters of two samples and their timestamps, never
from the per-step fields (which only describe the last step before the sample).

Rows are plain dicts in long form (one row per point and series: `t`, `series`, a value
column), with `t` in seconds relative to the newest sample (so <= 0). Gradio 6's `gr.LinePlot`
needs a pandas DataFrame (a dict is taken as a component update), so pass rows through
`to_frame` first, e.g. `gr.LinePlot(to_frame(h.throughput_rows()), x="t", y="tokens_per_s",
color="series")`.

Only the immutable snapshot type `engine.SchedulerStats` is used.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from engine import SchedulerStats

Row = dict[str, Any]


def _delta(before: int, after: int) -> int:
    """Growth of a cumulative counter; a counter that went down was reset (a new engine)."""
    return after - before if after >= before else after


def _percent(part: int, total: int) -> float:
    return 100.0 * part / total if total > 0 else 0.0


def to_frame(rows: list[Row], columns: list[str] | None = None):
    """Rows as a pandas DataFrame for gr.LinePlot (keeps the columns when there are no rows)."""
    import pandas as pd

    if not rows and columns:
        # Typed, so a plot first drawn empty still treats 'series' as categories and t as numbers.
        return pd.DataFrame({c: pd.Series(dtype=str if c == "series" else float) for c in columns})
    return pd.DataFrame(rows, columns=columns)


class StatsHistory:
    """The last `capacity` samples (oldest dropped first), in the order added."""

    def __init__(self, capacity: int = 600, window_s: float = 30.0) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.window_s = window_s
        self._samples: deque[SchedulerStats] = deque(maxlen=capacity)

    # ---- the buffer ---------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._samples.maxlen  # type: ignore[return-value]

    def add(self, stats: SchedulerStats) -> None:
        self._samples.append(stats)

    def clear(self) -> None:
        self._samples.clear()

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def samples(self) -> tuple[SchedulerStats, ...]:
        return tuple(self._samples)

    @property
    def latest(self) -> SchedulerStats | None:
        return self._samples[-1] if self._samples else None

    def _t(self, s: SchedulerStats) -> float:
        return s.timestamp - self._samples[-1].timestamp

    def _intervals(self) -> Iterator[tuple[SchedulerStats, SchedulerStats, float]]:
        """(earlier, later, seconds) between samples with increasing timestamps. A sample with
        no later timestamp than the previous one starts no interval: its counts fall into the
        next interval that has a duration, so nothing is lost and nothing divides by zero."""
        prev = None
        for s in self._samples:
            if prev is not None and s.timestamp > prev.timestamp:
                yield prev, s, s.timestamp - prev.timestamp
                prev = s
            elif prev is None:
                prev = s

    def _window_start(self, index: int, window_s: float) -> SchedulerStats:
        """The oldest sample within `window_s` seconds before sample `index` (itself at least)."""
        samples = self._samples
        end = samples[index].timestamp
        start = index
        while start > 0 and samples[start - 1].timestamp >= end - window_s:
            start -= 1
        return samples[start]

    # ---- gauges -------------------------------------------------------------------------
    def device_usage_rows(self) -> list[Row]:
        """Device KV blocks in %: 'in use' (referenced) and 'cached' (free, reusable prefix)."""
        rows: list[Row] = []
        for s in self._samples:
            t = self._t(s)
            rows.append({"t": t, "series": "in use", "percent": _percent(s.device_blocks_used, s.device_blocks_total)})
            rows.append({"t": t, "series": "cached", "percent": _percent(s.device_blocks_cached, s.device_blocks_total)})
        return rows

    def host_usage_rows(self) -> list[Row]:
        return [{"t": self._t(s), "series": "host", "percent": _percent(s.host_blocks_used, s.host_blocks_total)}
                for s in self._samples]

    def queue_rows(self) -> list[Row]:
        rows: list[Row] = []
        for s in self._samples:
            t = self._t(s)
            rows += [{"t": t, "series": "running", "count": s.num_running},
                     {"t": t, "series": "waiting", "count": s.num_waiting},
                     {"t": t, "series": "swapped", "count": s.num_swapped}]
        return rows

    # ---- per interval -------------------------------------------------------------------
    def preemption_rows(self) -> list[Row]:
        """Preemptions since the previous sample, by swap and by recompute (none for the first)."""
        rows: list[Row] = []
        samples = self._samples
        for prev, s in zip(samples, list(samples)[1:]):
            t = self._t(s)
            rows.append({"t": t, "series": "swap",
                         "count": _delta(prev.num_preemptions_swap, s.num_preemptions_swap)})
            rows.append({"t": t, "series": "recompute",
                         "count": _delta(prev.num_preemptions_recompute, s.num_preemptions_recompute)})
        return rows

    def swap_rows(self) -> list[Row]:
        """Blocks swapped out to and in from the host, per second."""
        return self._rates("blocks_per_s", {"out": "total_blocks_swapped_out", "in": "total_blocks_swapped_in"})

    def throughput_rows(self) -> list[Row]:
        """Tokens computed per second: 'generation' (decode) and 'prompt' (prefill)."""
        return self._rates("tokens_per_s", {"generation": "total_generated_tokens", "prompt": "total_prompt_tokens"})

    def cache_token_rows(self) -> list[Row]:
        """Prompt tokens served from the prefix cache per second."""
        return self._rates("tokens_per_s", {"from cache": "prefix_cache_hits"})

    def _rates(self, column: str, counters: dict[str, str]) -> list[Row]:
        """Per-second rates of cumulative counters: a row per series (name: stats field) per interval."""
        return [{"t": self._t(s), "series": series, column: _delta(getattr(prev, field), getattr(s, field)) / dt}
                for prev, s, dt in self._intervals() for series, field in counters.items()]

    # ---- windows ------------------------------------------------------------------------
    def windowed_hit_rate(self, index: int = -1, window_s: float | None = None) -> float | None:
        """Prefix-cache hit tokens over queried tokens between the oldest sample within the
        window and sample `index`; None when nothing was queried in the window."""
        if not self._samples:
            return None
        index %= len(self._samples)
        window = self.window_s if window_s is None else window_s
        base, s = self._window_start(index, window), self._samples[index]
        if base is s:
            return None
        queries = _delta(base.prefix_cache_queries, s.prefix_cache_queries)
        if queries <= 0:
            return None
        hits = _delta(base.prefix_cache_hits, s.prefix_cache_hits)
        return hits / queries

    def hit_rate_rows(self, window_s: float | None = None) -> list[Row]:
        """The windowed hit rate in % at each sample (no row while nothing was queried)."""
        rows: list[Row] = []
        for i, s in enumerate(self._samples):
            rate = self.windowed_hit_rate(i, window_s)
            if rate is not None:
                rows.append({"t": self._t(s), "series": "hit rate", "percent": 100.0 * rate})
        return rows

    def windowed_generation_rate(self, window_s: float | None = None) -> float:
        """Generated tokens per second over the window ending at the newest sample."""
        if len(self._samples) < 2:
            return 0.0
        window = self.window_s if window_s is None else window_s
        base, s = self._window_start(len(self._samples) - 1, window), self._samples[-1]
        dt = s.timestamp - base.timestamp
        if dt <= 0:
            return 0.0
        return _delta(base.total_generated_tokens, s.total_generated_tokens) / dt

    def header(self) -> dict[str, Any]:
        """Current figures for the panel's header line."""
        s = self.latest
        if s is None:
            return {"tokens_per_s": 0.0, "device_usage_percent": 0.0, "hit_rate": None,
                    "preemptions_swap": 0, "preemptions_recompute": 0}
        return {"tokens_per_s": self.windowed_generation_rate(),
                "device_usage_percent": _percent(s.device_blocks_used, s.device_blocks_total),
                "hit_rate": self.windowed_hit_rate(),
                "preemptions_swap": s.num_preemptions_swap,
                "preemptions_recompute": s.num_preemptions_recompute}
