"""The cluster view: one row per backend (the in-process engine or a remote OpenAI-compatible
server) with who it is, whether it is up, and a sparkline per figure over its recent history.

Plain HTML and inline SVG, no Gradio: the panel redraws it every second for every open browser, so
it stays small, one <polyline> per series and no element per point. Its styles are CLUSTER_CSS,
placed on the page once (as PANEL_CSS is). Everything a backend reports (its name, model, problem,
even its flavor) is untrusted text and is escaped.
"""
from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ui.backends.monitor import WINDOW_S
from ui.backends.figures import BackendStatus, Figures

SPAN_S = 120.0              # a sparkline's x axis: the last SPAN_S seconds before `now`
WIDTH, HEIGHT = 120, 32     # the SVG's user units; it stretches to its cell's width

FLAVORS = {"pagedchat": "PagedChat", "vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp",
           "unknown": "unknown engine"}

# The same colours as the single-engine panel's plots (ui/panel/page.py COLORS).
SERIES_COLORS = {"kv_usage": "#2563eb", "running": "#16a34a", "waiting": "#eab308", "hit_rate": "#0d9488",
                 "preemptions": "#dc2626", "throughput": "#2563eb", "ttft": "#64748b"}


def _percent(values: Sequence[float | None]) -> str:
    return f"{100 * values[0]:.0f}%"


def _count(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() or abs(value) >= 10 else f"{value:.1f}"


def _requests(values: Sequence[float | None]) -> str:
    return " / ".join("—" if v is None else _count(v) for v in values)


def _seconds(values: Sequence[float | None]) -> str:
    return f"{values[0]:.2f} s" if values[0] < 10 else f"{values[0]:.1f} s"


@dataclass(frozen=True)
class Chart:
    key: str                      # data-chart, for tests and browsers
    label: str
    series: tuple[str, ...]       # Figures fields (all in FIGURES)
    format: Callable[[Sequence[float | None]], str]  # the current value(s) as text
    scale: float = 1.0            # drawn value = figure × scale
    y_max: float | None = None    # a fixed top of the scale (percentages); else from the data
    unit: str = ""                # of the scale's label


CHARTS = (
    Chart("kv_usage", "KV cache used", ("kv_usage",), _percent, scale=100.0, y_max=100.0, unit="%"),
    Chart("requests", "running / waiting", ("running", "waiting"), _requests),
    Chart("hit_rate", "prefix-cache hit rate", ("hit_rate",), _percent, scale=100.0, y_max=100.0, unit="%"),
    Chart("preemptions", f"preemptions (last {WINDOW_S:g} s)", ("preemptions",), lambda v: _count(v[0])),
    Chart("throughput", "generation", ("throughput",), lambda v: f"{v[0]:.1f} tok/s", unit=" tok/s"),
    Chart("ttft", "time to first token", ("ttft",), _seconds, unit=" s"),
)


def _value(figures: Figures, field: str) -> float | None:
    """A figure, or None where it is absent or not a number a chart can place (NaN, infinity)."""
    value = getattr(figures, field)
    return float(value) if value is not None and math.isfinite(value) else None


def _nice_ceiling(value: float) -> float:
    """The smallest 1, 2 or 5 × 10^k at or above `value`: a scale a reader takes in at a glance."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= value * (1 - 1e-9))


def _points(samples: list[tuple[float, float]], start: float, y_max: float) -> str:
    """SVG coordinates, the newest at the right edge; 1 unit of margin so a line at 0 or at the
    top is not clipped by the box."""
    def x(t: float) -> float:
        return min(max((t - start) / SPAN_S, 0.0), 1.0) * WIDTH

    def y(v: float) -> float:
        return (HEIGHT - 1) - min(max(v / y_max, 0.0), 1.0) * (HEIGHT - 2)

    return " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in samples)


def _reason_html(text: str) -> str:
    safe = html.escape(text, quote=True)
    return f'<div class="cl-reason" title="{safe}">{safe}</div>'


def _chart_html(chart: Chart, status: BackendStatus, now: float | None) -> str:
    missing = {s: status.missing[s] for s in chart.series if s in status.missing}
    head = f'<div class="cl-label">{_label_html(chart)}</div>'
    if len(missing) == len(chart.series):
        why = "; ".join(dict.fromkeys(missing.values()))
        safe = html.escape(why, quote=True)
        return (f'<div class="cl-chart cl-missing" data-chart="{chart.key}" title="not exported: {safe}">{head}'
                f'<div class="cl-value">not exported</div>{_reason_html(why)}</div>')
    start = (now if now is not None else 0.0) - SPAN_S
    drawn = [s for s in chart.series if s not in missing]
    samples = {s: [(f.timestamp, v * chart.scale) for f in status.history if f.timestamp >= start
                   for v in (_value(f, s),) if v is not None] for s in drawn}
    notes = "".join(_reason_html(f"{s}: not exported: {why}") for s, why in missing.items())
    if not any(samples.values()):
        return (f'<div class="cl-chart cl-empty" data-chart="{chart.key}">{head}'
                f'<div class="cl-value">—</div><div class="cl-reason">no data yet</div>{notes}</div>')
    # The current value of each series: its newest number in the window (a TTFT has none in a
    # second without first tokens; the last one stands until the next).
    current = [samples[s][-1][1] / chart.scale if samples.get(s) else None for s in chart.series]
    all_values = [v for points in samples.values() for _, v in points]
    y_max = chart.y_max if chart.y_max is not None else _nice_ceiling(max(all_values))
    lines = "".join(f'<polyline class="cl-line cl-s-{s}" data-series="{s}" points="{_points(points, start, y_max)}"/>'
                    for s, points in samples.items() if points)
    svg = (f'<svg class="cl-spark" viewBox="0 0 {WIDTH} {HEIGHT}" preserveAspectRatio="none" '
           f'data-y-max="{y_max:g}" aria-hidden="true">{lines}</svg>')
    return (f'<div class="cl-chart" data-chart="{chart.key}">{head}'
            f'<div class="cl-value" data-value="{chart.key}">{html.escape(chart.format(current))}</div>'
            f'{svg}<div class="cl-scale" title="the scale of the last {SPAN_S:.0f} s">0–{y_max:g}{chart.unit}</div>'
            f'{notes}</div>')


def _label_html(chart: Chart) -> str:
    if len(chart.series) == 1:
        return html.escape(chart.label)
    return " / ".join(f'<span class="cl-k-{s}">{html.escape(s)}</span>' for s in chart.series)


def _identity_html(status: BackendStatus) -> str:
    name = html.escape(status.name, quote=True)
    where = html.escape(status.url, quote=True) if status.url else "in-process engine"
    flavor = html.escape(FLAVORS.get(status.flavor, status.flavor))
    model = html.escape(status.model) if status.model else "model unknown"
    # max_model_len comes from the backend's /v1/models too: escaped in case it is not the int it should be
    length = f" · {html.escape(str(status.max_model_len))} tokens max" if status.max_model_len else ""
    badge = ('<span class="cl-badge cl-badge-up">up</span>' if status.up
             else '<span class="cl-badge cl-badge-down">down</span>')
    problem = ""
    if status.problem:
        safe = html.escape(status.problem, quote=True)
        problem = f'<div class="cl-problem" title="{safe}">{safe}</div>'
    return (f'<div class="cl-id"><div class="cl-name" title="{where}">{name}</div>'
            f'<div class="cl-meta"><span class="cl-model">{model}</span> · <span class="cl-flavor">{flavor}</span>'
            f'{length}</div>'
            f'<div class="cl-state">{badge} <b data-metric="in-flight">{int(status.in_flight)}</b> '
            f'{"reply" if status.in_flight == 1 else "replies"} in flight from this app</div>{problem}</div>')


def _newest(backends: Sequence[BackendStatus]) -> float | None:
    return max((b.history[-1].timestamp for b in backends if b.history), default=None)


def cluster_html(backends: Sequence[BackendStatus], now: float | None = None) -> str:
    """One row per backend, in the order given. `now` is the charts' right edge (time.time());
    by default the newest sample of any backend, so every row shares one time axis."""
    if now is None:
        now = _newest(backends)
    if not backends:
        return '<div class="cl-cluster" data-backends="0"><div class="cl-none">No backends.</div></div>'
    rows = []
    for status in backends:
        charts = "".join(_chart_html(chart, status, now) for chart in CHARTS)
        state = "up" if status.up else "down"
        rows.append(f'<div class="cl-row cl-{state}" data-backend="{html.escape(status.name, quote=True)}" '
                    f'data-up="{str(status.up).lower()}">{_identity_html(status)}{charts}</div>')
    return f'<div class="cl-cluster" data-backends="{len(backends)}">{"".join(rows)}</div>'


_SERIES_CSS = "\n".join(f".cl-s-{s} {{ stroke: {c}; }} .cl-k-{s} {{ color: {c}; font-weight: 600; }}"
                        for s, c in SERIES_COLORS.items())

# Neutral greys with transparency and inherited text colour: readable on Gradio's light and dark themes.
CLUSTER_CSS = """
.cl-cluster { display: flex; flex-direction: column; gap: 8px; }
.cl-row { display: grid; grid-template-columns: repeat(auto-fit, minmax(150px, 1fr)); gap: 6px;
          padding: 8px; border: 1px solid rgba(128, 128, 128, 0.35); border-radius: 6px; }
.cl-row.cl-down { border-color: rgba(220, 38, 38, 0.6); }
.cl-row.cl-down .cl-chart { opacity: 0.55; }
.cl-id { min-width: 0; overflow-wrap: anywhere; }
.cl-name { font-weight: 700; }
.cl-meta, .cl-state { font-size: 0.85em; }
.cl-meta { opacity: 0.8; }
.cl-badge { display: inline-block; padding: 0 6px; border-radius: 8px; color: #fff; font-size: 0.85em;
            font-weight: 600; }
.cl-badge-up { background: #16a34a; }
.cl-badge-down { background: #dc2626; }
.cl-problem { font-size: 0.8em; color: #dc2626; overflow-wrap: anywhere; }
.cl-up .cl-problem { color: inherit; opacity: 0.75; }
.cl-chart { min-width: 0; min-height: 64px; padding: 2px 4px; border-left: 1px solid rgba(128, 128, 128, 0.25); }
.cl-label { font-size: 0.8em; opacity: 0.8; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.cl-value { font-weight: 700; font-variant-numeric: tabular-nums; }
.cl-missing .cl-value, .cl-empty .cl-value { font-weight: 400; opacity: 0.7; }
.cl-reason, .cl-scale { font-size: 0.75em; opacity: 0.65; overflow: hidden; }
.cl-scale { white-space: nowrap; text-overflow: ellipsis; }
.cl-reason { display: -webkit-box; -webkit-line-clamp: 3; -webkit-box-orient: vertical; overflow-wrap: anywhere; }
.cl-spark { display: block; width: 100%; height: 32px; background: rgba(128, 128, 128, 0.08); border-radius: 2px; }
.cl-line { fill: none; stroke-width: 1.5; vector-effect: non-scaling-stroke; stroke-linejoin: round; }
.cl-none { opacity: 0.7; }
""" + _SERIES_CSS + "\n"
