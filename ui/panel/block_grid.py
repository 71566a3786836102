"""Cell data for drawing the KV block pools as a grid of small squares.

Works from the immutable `engine.BlockMap` snapshot only. Each block is a cell with a
state class ("free", "cached", "used", or "shared": used with ref_count > 1), a colour and a
hover title, which also says when the block holds a preset system prompt (the chat page's
memory strip counts those as shared even while one chat alone holds them). A pool with more
blocks than `max_cells` is drawn with consecutive blocks merged into one cell, coloured by its
most common state, whose title gives the counts per state.

A block's owners (request ids, which name conversations) and its prefix-cache hash are private:
a visitor could probe other users' conversations with them, so only cells built for the operator
(`show_private`) carry them, and then in the title alone.
"""
from __future__ import annotations

import html
import math
import zlib
from collections import Counter
from dataclasses import dataclass

from engine import BlockInfo, BlockState

STATES = ("free", "cached", "used", "shared")
FREE_COLOR = "#e5e7eb"     # light grey
CACHED_COLOR = "#bae6fd"   # light blue
SHARED_COLOR = "#f97316"   # orange
# Used blocks are tinted by owner with a hue kept away from the shared orange (about 15-50).
_HUE_START, _HUE_SPAN = 55, 315
_TIE_ORDER = {"shared": 0, "used": 1, "cached": 2, "free": 3}  # most informative wins a tie


@dataclass(frozen=True, slots=True)
class Cell:
    first_block: int             # block id of the first block in the cell
    num_blocks: int              # 1, or more when aggregated
    state: str                   # one of STATES (the most common one when aggregated)
    color: str
    title: str
    counts: tuple[tuple[str, int], ...]  # (state, blocks) for every state, in STATES order
    marked: bool = False         # it holds a block of the conversation the page marks


def state_of(info: BlockInfo) -> str:
    if info.state is BlockState.USED:
        return "shared" if info.ref_count > 1 else "used"
    return info.state.value


def owner_key(request_id: str) -> str:
    """The conversation a request belongs to, which sets its colour: request ids are
    '<conversation>/<turn>' (the chat and the load generator name them so), and forked
    samples ('<id>#1') belong to their parent's conversation."""
    return request_id.split("#", 1)[0].split("/", 1)[0]


def owner_color(request_id: str) -> str:
    """A stable colour per owner (crc32, not the per-process salted hash())."""
    hue = (_HUE_START + zlib.crc32(owner_key(request_id).encode("utf-8")) % _HUE_SPAN) % 360
    return f"hsl({hue}, 65%, 50%)"


def _color(state: str, owners: tuple[str, ...] | list[str]) -> str:
    if state == "free":
        return FREE_COLOR
    if state == "cached":
        return CACHED_COLOR
    if state == "shared":
        return SHARED_COLOR
    return owner_color(owners[0]) if owners else owner_color("")


def _block_title(info: BlockInfo, state: str, show_private: bool) -> str:
    parts = [f"block {info.block_id}: {state}", f"refs {info.ref_count}", f"tokens {info.num_tokens}"]
    if info.shared_prefix:  # public text, the same for everyone: no reason to hide it from a visitor
        parts.append("preset system prompt")
    if show_private and info.owners:
        parts.append("owners " + ", ".join(info.owners))
    if show_private and info.block_hash is not None:
        short = f"{info.block_hash & 0xFFFFFFFFFFFFFFFF:016x}"[:8]  # hashes may be negative
        parts.append(f"hash {short}")
    return "; ".join(parts)


def block_cells(blocks: tuple[BlockInfo, ...] | list[BlockInfo], max_cells: int = 2048, *,
                show_private: bool = False, marked: str | None = None) -> list[Cell]:
    """One cell per block, or per run of ceil(len / max_cells) consecutive blocks. A block's
    title names its owners and hash only with `show_private`; a run's gives counts per state.
    `marked`: a conversation ("chat12", see `owner_key`) whose cells are marked (a chat's own
    page links here with its id; the mark says where its blocks are, never whose they are)."""

    def holds(info: BlockInfo) -> bool:
        return marked is not None and any(owner_key(owner) == marked for owner in info.owners)

    if max_cells < 1:
        raise ValueError("max_cells must be at least 1")
    n = len(blocks)
    if n <= max_cells:
        cells = []
        for info in blocks:
            state = state_of(info)
            counts = tuple((s, int(s == state)) for s in STATES)
            title = _block_title(info, state, show_private)
            cells.append(Cell(info.block_id, 1, state, _color(state, info.owners), title, counts, holds(info)))
        return cells
    group = math.ceil(n / max_cells)
    cells = []
    for start in range(0, n, group):
        chunk = blocks[start:start + group]
        states = [state_of(b) for b in chunk]
        tally = Counter(states)
        state = min(tally, key=lambda s: (-tally[s], _TIE_ORDER[s]))
        owners: Counter[str] = Counter(owner_key(b.owners[0]) for b, s in zip(chunk, states) if s == "used" and b.owners)
        color = _color(state, [owners.most_common(1)[0][0]] if owners else [])
        counts = tuple((s, tally.get(s, 0)) for s in STATES)
        title = (f"blocks {chunk[0].block_id}-{chunk[-1].block_id}: "
                 + ", ".join(f"{s} {c}" for s, c in counts if c))
        cells.append(Cell(chunk[0].block_id, len(chunk), state, color, title, counts, any(map(holds, chunk))))
    return cells


def summary_of(blocks: tuple[BlockInfo, ...] | list[BlockInfo]) -> dict[str, int]:
    """Blocks per state, plus 'total'; the states add up to the total."""
    tally = Counter(state_of(b) for b in blocks)
    return {s: tally.get(s, 0) for s in STATES} | {"total": len(blocks)}


def render_html(cells: list[Cell], columns: int = 64, size_px: int = 8) -> str:
    """A compact grid of small squares; every title is HTML-escaped (request ids come from users)."""
    columns = max(1, int(columns))
    size = max(1, int(size_px))
    squares = "".join(
        f'<div class="kv-cell kv-{html.escape(c.state)}{" kv-marked" if c.marked else ""}" title="{html.escape(c.title, quote=True)}" '
        f'style="background:{html.escape(c.color, quote=True)}"></div>'
        for c in cells)
    return (f'<div class="kv-grid" style="display:grid;grid-template-columns:repeat({columns},{size}px);'
            f'gap:1px;grid-auto-rows:{size}px">{squares}</div>')
