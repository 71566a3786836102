"""What the live panel shows, as plain data: plot frames, the header, the block map and the load
generator's line. No Gradio here, so every figure the page draws is testable without a browser.

Every plot's x axis is seconds before the newest sample (<= 0), over the last PLOT_SPAN_S.
"""
from __future__ import annotations

import html
import statistics
from dataclasses import dataclass

from engine import BlockMap, EngineInfo, FirstToken
from ui.panel import block_grid
from ui.panel.load_generator import LoadStatus
from ui.panel.history import Row, StatsHistory, to_frame

PLOT_SPAN_S = 120.0
RECENT_TTFT = 20  # the header's TTFT is the median of this many latest first tokens


@dataclass(frozen=True)
class Plot:
    title: str
    y: str        # the value column
    y_title: str
    percent: bool = False


PLOTS: dict[str, Plot] = {
    "usage": Plot("KV blocks used", "percent", "% of pool", percent=True),
    "requests": Plot("Requests", "count", "requests"),
    "generation": Plot("Generation throughput", "tokens_per_s", "tokens/s"),
    "prompt": Plot("Prompt tokens: computed vs from the prefix cache", "tokens_per_s", "tokens/s"),
    "hit_rate": Plot("Prefix-cache hit rate (30 s window)", "percent", "% of prompt tokens", percent=True),
    "ttft": Plot("Time to first token (recent requests)", "ms", "ms"),
    "preemptions": Plot("Preemptions per sample (1 s)", "count", "preemptions"),
    "swaps": Plot("Blocks swapped", "blocks_per_s", "blocks/s"),
}
PLOT_ROWS = (("usage", "requests", "generation"), ("prompt", "hit_rate", "ttft"), ("preemptions", "swaps"))

# Series names as the legends show them.
_RENAME = {"in use": "device used", "cached": "device cached", "host": "host used",
           "prompt": "computed", "from cache": "from cache", "out": "out to host", "in": "in from host"}


def _recent(rows: list[Row], span_s: float) -> list[Row]:
    return [r | {"series": _RENAME.get(r["series"], r["series"])} for r in rows if r["t"] >= -span_s]


def ttft_rows(first_tokens: tuple[FirstToken, ...], now: float) -> list[Row]:
    return [{"t": f.timestamp - now, "series": "first token", "ms": 1000.0 * f.ttft_s} for f in first_tokens]


def plot_frames(history: StatsHistory, first_tokens: tuple[FirstToken, ...], span_s: float = PLOT_SPAN_S) -> dict:
    """A pandas DataFrame per plot in PLOTS (long form: t, series, the plot's value column), or
    None for a plot with nothing to draw yet: Gradio 6's LinePlot that once gets an empty frame
    draws no line again, while None leaves it blank and ready."""
    latest = history.latest
    now = latest.timestamp if latest is not None else max((f.timestamp for f in first_tokens), default=0.0)
    rows = {
        "usage": history.device_usage_rows() + history.host_usage_rows(),
        "requests": history.queue_rows(),
        "generation": [r for r in history.throughput_rows() if r["series"] == "generation"],
        "prompt": [r for r in history.throughput_rows() if r["series"] == "prompt"] + history.cache_token_rows(),
        "hit_rate": history.hit_rate_rows(),
        "preemptions": history.preemption_rows(),
        "swaps": history.swap_rows(),
        "ttft": ttft_rows(first_tokens, now),
    }
    recent = {name: _recent(rows[name], span_s) for name in PLOTS}
    return {name: to_frame(recent[name], ["t", "series", PLOTS[name].y]) if recent[name] else None
            for name in PLOTS}


def _metric(name: str, text: str) -> str:
    return f'<b data-metric="{name}">{html.escape(text)}</b>'


def header_html(history: StatsHistory, info: EngineInfo, first_tokens: tuple[FirstToken, ...]) -> str:
    """The figures at the top: throughput, device usage, hit rate, preemptions, swaps, TTFT,
    what the engine runs on, and on a CPU-only machine where the "GPU" pool really is."""
    head = history.header()
    s = history.latest
    hit = "—" if head["hit_rate"] is None else f"{100 * head['hit_rate']:.0f}%"
    recent = [f.ttft_s for f in first_tokens[-RECENT_TTFT:]]
    ttft = f"{1000 * statistics.median(recent):.0f} ms" if recent else "—"
    preemptions = head["preemptions_swap"] + head["preemptions_recompute"]
    tokens_per_s, usage = f"{head['tokens_per_s']:.1f}", f"{head['device_usage_percent']:.0f}%"
    count = (lambda field: str(getattr(s, field))) if s is not None else (lambda field: "0")
    lines = [
        " · ".join([
            f"{_metric('tokens-per-s', tokens_per_s)} tokens/s generated",
            f"device KV {_metric('device-usage', usage)} in use",
            f"prefix-cache hit rate {_metric('hit-rate', hit)}",
            f"preemptions {_metric('preemptions', str(preemptions))} "
            f"({head['preemptions_swap']} swap, {head['preemptions_recompute']} recompute)",
        ]),
        " · ".join([
            f"running {_metric('running', count('num_running'))}",
            f"waiting {_metric('waiting', count('num_waiting'))}",
            f"swapped {_metric('swapped', count('num_swapped'))}",
            f"blocks swapped out {_metric('swapped-out', count('total_blocks_swapped_out'))}"
            f" / in {_metric('swapped-in', count('total_blocks_swapped_in'))}",
            f"median TTFT (last {RECENT_TTFT}) {_metric('ttft', ttft)}",
        ]),
        html.escape(f"{info.label} on {info.device} ({info.dtype}, {info.kernels} kernels) · device pool "
                    f"{info.num_device_blocks} blocks × {info.block_size} tokens · host pool {info.num_host_blocks} blocks"),
    ]
    if info.config is not None:  # a PagedChat engine's: how its steps may run
        lines.append(html.escape(f"steps: {', '.join(info.config.step_paths)} · compiled steps "
                                 f"{info.config.compiled_steps} · up to {info.config.scheduler.max_num_seqs} chats, "
                                 f"{info.config.scheduler.max_num_batched_tokens} tokens a step"))
    body = "".join(f"<div>{line}</div>" for line in lines)
    if info.on_cpu:
        body += ('<div class="kv-note" data-note="cpu"><b>No GPU here:</b> the "GPU" (device) pool lives in main '
                 "memory, next to the host swap pool; swapping copies between two areas of the same RAM.</div>")
    return f'<div class="kv-header">{body}</div>'


_LEGEND = (("free", block_grid.FREE_COLOR, "free"), ("cached", block_grid.CACHED_COLOR, "cached (free, reusable prefix)"),
           ("used", "linear-gradient(90deg, hsl(120,65%,50%), hsl(240,65%,50%))", "in use (colour: conversation)"),
           ("shared", block_grid.SHARED_COLOR, "shared by several requests"))
PRIVATE_NOTE = "Owners and hashes are shown to the operator only."


def _cell_size(cells: int) -> tuple[int, int]:
    """(columns, pixels) so a grid stays about 900 px wide and readable up to block_grid's cap."""
    size = 14 if cells <= 256 else 10 if cells <= 1024 else 7
    return max(16, 900 // (size + 1)), size


def _pool_html(name: str, label: str, blocks, block_size: int, max_cells: int, show_private: bool,
               marked: str | None = None) -> str:
    counts = block_grid.summary_of(blocks)
    head = (f"<div class='kv-pool-title'><b>{html.escape(label)}</b>: {counts['total']} blocks × {block_size} "
            f"tokens · in use {counts['used']} · shared {counts['shared']} · cached {counts['cached']} · "
            f"free {counts['free']}</div>")
    data = " ".join(f'data-{state}="{counts[state]}"' for state in (*block_grid.STATES, "total"))
    if not blocks:
        return f'<div class="kv-pool" data-pool="{name}" {data}>{head}<div>(empty: no pool of this kind)</div></div>'
    cells = block_grid.block_cells(blocks, max_cells, show_private=show_private, marked=marked)
    columns, size = _cell_size(len(cells))
    note = "" if len(cells) == len(blocks) else (f"<div class='kv-pool-note'>each cell is {len(blocks) // len(cells)}"
                                                 "+ consecutive blocks, coloured by their most common state</div>")
    return (f'<div class="kv-pool" data-pool="{name}" {data}>{head}{note}'
            f"{block_grid.render_html(cells, columns, size)}</div>")


def no_block_map_html(name: str, down: str | None = None) -> str:
    """Where a backend has no map to show: it is down (`down` says why), or it is not a PagedChat
    server (only those publish theirs, at /v1/kv_cache)."""
    if down is not None:
        return f"<div class='kv-map kv-none'>{html.escape(name)} is down: {html.escape(down)}</div>"
    return (f"<div class='kv-map kv-none'>{html.escape(name)} publishes no block map: only PagedChat servers "
            "serve one (<code>GET /v1/kv_cache</code>); vLLM, SGLang and llama.cpp export pool usage alone, "
            "drawn in its row above.</div>")


def block_map_html(block_map: BlockMap, info: EngineInfo, max_cells: int = 2048, *, show_private: bool = False,
                   marked: str | None = None) -> str:
    """The legend and both pools as grids of cells; hovering a cell names its block, and with
    `show_private` (the operator's view only) its owners and hash (see ui/panel/block_grid.py)."""
    legend = "".join(f"<span class='kv-key'><i style='background:{color}'></i>{html.escape(text)}</span>"
                     for _, color, text in _LEGEND)
    if not show_private:
        legend += f"<span class='kv-key' data-note='private'>{html.escape(PRIVATE_NOTE)}</span>"
    if marked is not None:
        legend += "<span class='kv-key' data-note='marked'><i class='kv-marked'></i>outlined: your chat's blocks</span>"
    device = 'Device pool ("GPU", in main memory)' if info.on_cpu else f"Device pool ({info.device})"
    grid = (block_map.block_size, max_cells, show_private, marked)
    return (f"<div class='kv-map'><div class='kv-legend'>{legend}</div>"
            f"{_pool_html('device', device, block_map.device, *grid)}"
            f"{_pool_html('host', 'Host pool (CPU swap space)', block_map.host, *grid)}"
            "</div>")


def load_status_html(status: LoadStatus) -> str:
    if not status.running:
        state = "stopped" if status.users else "not started"
        return f'<div class="kv-load" data-running="false">Load generator {state}.</div>'
    error = f" · last error: {html.escape(status.last_error)}" if status.last_error else ""
    return (f'<div class="kv-load" data-running="true">Load generator running: <b>{status.users}</b> users · '
            f'<b data-metric="replies">{status.replies}</b> replies · {status.refused} refused · '
            f"{status.errors} errors{error}</div>")


PANEL_CSS = """
.kv-header div { margin: 2px 0; }
.kv-marked { outline: 2px solid #111827; outline-offset: -1px; }
.kv-note { color: #92400e; }
.kv-legend { display: flex; gap: 16px; flex-wrap: wrap; margin-bottom: 6px; }
.kv-key i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: middle; }
.kv-pool { margin: 8px 0 12px; }
.kv-pool-title { margin-bottom: 4px; }
.kv-pool-note { font-size: 0.85em; opacity: 0.8; }
.kv-cell { border-radius: 2px; }
"""
