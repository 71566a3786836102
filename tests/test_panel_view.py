"""What the live panel draws (ui/panel/view.py) and the shared feed behind it (ui/panel/feed.py),
without a browser."""
import html
import re
import threading
import time

import pytest
from waiting import wait_for

from engine import BlockInfo, BlockMap, BlockState, EngineInfo, FirstToken
from test_panel_data import stats
from ui.panel import view as panel_view
from ui.panel.load_generator import LoadStatus
from ui.panel.feed import PanelFeed
from ui.panel.history import StatsHistory

CPU = EngineInfo("SmolLM2 <b>", "cpu", "float32", 16, 100, 50, "torch")
GPU = EngineInfo("SmolLM2", "cuda:0", "bfloat16", 16, 100, 50, "triton")


def metric(page: str, name: str) -> str:
    match = re.search(rf'data-metric="{name}">([^<]*)<', page)
    assert match, f"no {name} in {page}"
    return match.group(1)


def history(*samples) -> StatsHistory:
    h = StatsHistory(window_s=30.0)
    for s in samples:
        h.add(s)
    return h


# ---- plots --------------------------------------------------------------------------------------
def test_no_samples_no_frames():
    assert panel_view.plot_frames(StatsHistory(), ()) == {name: None for name in panel_view.PLOTS}


def test_frames_have_each_plots_columns_series_and_span():
    h = history(stats(0.0), stats(50.0, total_generated_tokens=100, total_prompt_tokens=500, prefix_cache_queries=600,
                                   prefix_cache_hits=150, device_blocks_used=40, device_blocks_cached=10,
                                   host_blocks_used=5, num_running=3, num_preemptions_swap=2,
                                   total_blocks_swapped_out=25),
                stats(200.0, total_generated_tokens=400, total_prompt_tokens=500, prefix_cache_queries=600,
                      prefix_cache_hits=150, device_blocks_used=20))
    first = (FirstToken("a/1", 199.0, 0.25), FirstToken("b/1", 10.0, 2.0))
    frames = panel_view.plot_frames(h, first)
    assert frames["hit_rate"] is None  # nothing queried in the last 30 s
    for name, frame in frames.items():
        if frame is None:
            continue
        assert list(frame.columns) == ["t", "series", panel_view.PLOTS[name].y], name
        assert frame["t"].between(-panel_view.PLOT_SPAN_S, 0).all(), name  # the t=0 and t=-150 rows are gone
    usage = frames["usage"]
    assert set(usage["series"]) == {"device used", "device cached", "host used"}
    assert usage[usage["series"] == "device used"]["percent"].tolist() == [20.0]
    assert frames["generation"]["tokens_per_s"].tolist() == [2.0]               # 300 tokens / 150 s
    assert set(frames["prompt"]["series"]) == {"computed", "from cache"}
    assert frames["ttft"].to_dict("records") == [{"t": -1.0, "series": "first token", "ms": 250.0}]


def test_every_series_has_a_fixed_colour():
    from ui.panel.page import COLORS
    h = history(*(stats(float(t), total_generated_tokens=t, prefix_cache_queries=t, prefix_cache_hits=t)
                  for t in range(5)))
    frames = panel_view.plot_frames(h, (FirstToken("a/1", 4.0, 0.1),))
    names = {s for frame in frames.values() if frame is not None for s in frame["series"]}
    assert names - set(COLORS) == set() and len(names) >= 14


# ---- header -------------------------------------------------------------------------------------
def test_header_figures_match_the_history():
    h = history(stats(0.0), stats(10.0, total_generated_tokens=500, device_blocks_used=25, prefix_cache_queries=400,
                                  prefix_cache_hits=300, num_preemptions_swap=3, num_preemptions_recompute=1,
                                  total_blocks_swapped_out=12, total_blocks_swapped_in=7, num_running=4,
                                  num_waiting=2, num_swapped=1))
    firsts = tuple(FirstToken(f"r{i}", float(i), s) for i, s in enumerate([0.1] * 5 + [0.3] * 30))
    page = panel_view.header_html(h, GPU, firsts)
    assert metric(page, "tokens-per-s") == "50.0"
    assert metric(page, "device-usage") == "25%"
    assert metric(page, "hit-rate") == "75%"
    assert metric(page, "preemptions") == "4" and "(3 swap, 1 recompute)" in page
    assert [metric(page, m) for m in ("running", "waiting", "swapped", "swapped-out", "swapped-in")] == \
        ["4", "2", "1", "12", "7"]
    assert metric(page, "ttft") == "300 ms"  # the median of the latest 20, not of all 35
    assert "main memory" not in page and "cuda:0" in page and "triton" in page


def test_header_before_any_sample_and_on_a_cpu():
    page = panel_view.header_html(StatsHistory(), CPU, ())
    assert metric(page, "hit-rate") == "—" and metric(page, "ttft") == "—" and metric(page, "running") == "0"
    assert 'data-note="cpu"' in page and "lives in main memory" in page
    assert "SmolLM2 &lt;b&gt;" in page  # names are escaped


# ---- block map ----------------------------------------------------------------------------------
def block_map(device_states, host_states=()) -> BlockMap:
    def blocks(states):
        out = []
        for i, state in enumerate(states):
            refs = {"free": 0, "cached": 0, "used": 1, "shared": 2}[state]
            owners = {"used": (f"chat{i}/t1",), "shared": ("chat1/t1", "<x>/t2")}.get(state, ())
            out.append(BlockInfo(i, BlockState.USED if refs else BlockState(state), refs, 16,
                                 None if state == "free" else i, owners))
        return tuple(out)
    return BlockMap(16, blocks(device_states), blocks(host_states))


def pool_counts(page: str, pool: str) -> dict[str, int]:
    tag = re.search(rf'<div class="kv-pool" data-pool="{pool}"([^>]*)>', page).group(1)
    return {k: int(v) for k, v in re.findall(r'data-(\w+)="(\d+)"', tag)}


def test_block_map_counts_add_up_to_the_pools_and_every_block_is_a_cell():
    states = ["free"] * 10 + ["cached"] * 5 + ["used"] * 7 + ["shared"] * 3
    page = panel_view.block_map_html(block_map(states, ["used"] * 4 + ["free"] * 6), CPU, show_private=True)
    device, host = pool_counts(page, "device"), pool_counts(page, "host")
    assert device == {"free": 10, "cached": 5, "used": 7, "shared": 3, "total": 25}
    assert host == {"free": 6, "cached": 0, "used": 4, "shared": 0, "total": 10}
    assert page.count('class="kv-cell') == 35
    assert page.count("kv-shared") == 3 and page.count("kv-cached") == 5
    assert '&quot;GPU&quot;, in main memory' in page
    assert "&lt;x&gt;/t2" in page and "<x>" not in page  # owner ids come from users: escaped


OWNERS = ("chat12/ab12cd34", "load-3/t7#1", "chat-secret/f00d")
HASHES = (0x5EC12E7A11CEB0B5, -0x3B1D2C4E5F60718A, 0x0123456789ABCDEF)


def owned_and_hashed(n: int) -> BlockMap:
    """Used, shared and cached blocks with owners and hashes in both pools."""
    def block(i: int) -> BlockInfo:
        h = HASHES[i % len(HASHES)]
        if i % 3 == 2:
            return BlockInfo(i, BlockState.CACHED, 0, 16, h, ())
        owners = OWNERS[i % 2:] if i % 3 == 1 else (OWNERS[i % len(OWNERS)],)
        return BlockInfo(i, BlockState.USED, len(owners), 16, h, owners)
    return BlockMap(16, tuple(block(i) for i in range(n)), tuple(block(i) for i in range(n // 2)))


def private_texts() -> list[str]:
    """Every way an owner or a hash could be written into the page: whole or in part, signed or
    not, decimal or hex."""
    texts = []
    for owner in OWNERS:
        texts += [owner, owner.split("/")[0], owner.split("/")[1], owner.split("#")[0]]
    for h in HASHES:
        unsigned = h & 0xFFFFFFFFFFFFFFFF
        texts += [str(h), str(unsigned), f"{unsigned:016x}", f"{unsigned:016x}"[:8]]
    return texts


@pytest.mark.parametrize("max_cells", [2048, 4])  # one cell per block, and many blocks per cell
def test_a_visitors_block_map_has_no_owner_and_no_hash_anywhere(max_cells):
    bm = owned_and_hashed(12)
    visitor = panel_view.block_map_html(bm, CPU, max_cells=max_cells)
    operator = panel_view.block_map_html(bm, CPU, max_cells=max_cells, show_private=True)
    for text in private_texts():
        assert text.lower() not in visitor.lower(), text
    assert panel_view.PRIVATE_NOTE in visitor and panel_view.PRIVATE_NOTE not in operator
    assert visitor.count('class="kv-cell') == operator.count('class="kv-cell')
    assert pool_counts(visitor, "device") == pool_counts(operator, "device")
    if max_cells > 12:
        assert "refs 2" in visitor and "tokens 16" in visitor  # what a visitor still sees
        for text in (*OWNERS, "hash 5ec12e7a", "hash c4e2d3b1", "hash 01234567"):
            assert html.escape(text) in operator, text


def test_a_large_pool_is_aggregated_into_at_most_max_cells():
    page = panel_view.block_map_html(block_map(["used"] * 10_000), GPU, max_cells=2048)
    assert pool_counts(page, "device")["total"] == 10_000
    assert page.count('class="kv-cell') <= 2048
    assert "consecutive blocks" in page and "Device pool (cuda:0)" in page
    assert "no pool of this kind" in page  # the empty host pool says so


def test_load_status_lines():
    assert 'data-running="false"' in panel_view.load_status_html(LoadStatus(False, 0, 0, 0, 0, None))
    running = panel_view.load_status_html(LoadStatus(True, 8, 12, 1, 2, "Boom <b>"))
    assert 'data-running="true"' in running and metric(running, "replies") == "12"
    assert "1 refused" in running and "2 errors" in running and "Boom &lt;b&gt;" in running


# ---- feed ---------------------------------------------------------------------------------------
class FakeClient:
    def __init__(self):
        self.closed = False
        self.block_maps = 0
        self.stats_value = stats(5.0, total_generated_tokens=7)

    def stats(self):
        return self.stats_value

    def block_map(self):
        self.block_maps += 1
        return block_map(["free"])


def test_feed_samples_now_and_shares_block_maps_per_interval():
    client = FakeClient()
    feed = PanelFeed(client, interval_s=600)  # every call below falls in its first interval
    before = time.time()
    feed.sample()
    feed.sample()
    h = feed.history()
    assert len(h) == 2 and all(s.timestamp >= before for s in h.samples)  # restamped: an idle engine moves on
    assert h.latest.total_generated_tokens == 7
    h.add(stats(99.0))
    assert len(feed.history()) == 2  # a copy
    maps = [feed.block_map() for _ in range(5)]
    assert client.block_maps == 1 and all(m is maps[0] for m in maps)
    # Once an interval has passed, the next caller fetches a new map.
    short = PanelFeed(client, interval_s=0.05)
    short.block_map()
    wait_for(lambda: short.block_map() is not None and client.block_maps >= 3, "a fetch in the next interval")


def test_feed_thread_samples_until_closed_or_the_client_closes():
    client = FakeClient()
    feed = PanelFeed(client, interval_s=0.05).start()
    wait_for(lambda: len(feed.history()) >= 4, lambda: f"4 samples; {len(feed.history())} taken")
    client.closed = True

    def unchanged_over_a_few_intervals() -> bool:
        # A sample under way when the client closed may still land; after it, none does. The
        # window only catches a feed that goes on (a starved thread could hide one, never fail it).
        latest = feed.history().latest.timestamp  # each sample is stamped anew
        time.sleep(5 * feed.interval_s)
        return feed.history().latest.timestamp == latest
    wait_for(unchanged_over_a_few_intervals, "sampling to stop once the client closed")
    feed.close()
    wait_for(lambda: not any(t.name == "panel-feed" and t.is_alive() for t in threading.enumerate()),
             "the feed thread to end")
    with pytest.raises(ValueError, match="interval_s"):
        PanelFeed(client, interval_s=0)
