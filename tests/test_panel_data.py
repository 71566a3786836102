"""The live panel's data layer: the stats history (ui/panel/history.py) and block grid (ui/panel/block_grid.py)."""
import dataclasses

import pytest

from engine.devtools.simulated_runner import run_step
from engine import BlockInfo, BlockMap, BlockState, SchedulerStats
from simulation import make, request, run
from ui.panel import block_grid
from ui.panel.block_grid import SHARED_COLOR, CACHED_COLOR, FREE_COLOR, block_cells, owner_color, render_html, summary_of
from ui.panel.history import StatsHistory, to_frame


def stats(t: float, **fields) -> SchedulerStats:
    base = dict(step=0, timestamp=t, device_blocks_total=100, device_blocks_used=0, device_blocks_cached=0,
                host_blocks_total=50, host_blocks_used=0, num_running=0, num_waiting=0, num_swapped=0,
                num_preemptions_swap=0, num_preemptions_recompute=0, blocks_swapped_out=0,
                blocks_swapped_in=0, blocks_copied=0, prefix_cache_queries=0, prefix_cache_hits=0,
                num_prefill_tokens=0, num_decode_tokens=0)
    return SchedulerStats(**(base | fields))


def series(rows, name, column):
    return [r[column] for r in rows if r["series"] == name]


# ---- history ----------------------------------------------------------------------------
def test_ring_buffer_keeps_the_last_capacity_samples():
    h = StatsHistory(capacity=3)
    for i in range(5):
        h.add(stats(float(i), step=i))
    assert len(h) == 3 and [s.step for s in h.samples] == [2, 3, 4] and h.latest.step == 4
    assert [r["t"] for r in h.host_usage_rows()] == [-2.0, -1.0, 0.0]


def test_empty_and_first_sample_give_no_rates_and_no_errors():
    h = StatsHistory()
    assert h.header() == {"tokens_per_s": 0.0, "device_usage_percent": 0.0, "hit_rate": None,
                          "preemptions_swap": 0, "preemptions_recompute": 0}
    h.add(stats(10.0, device_blocks_used=25, device_blocks_cached=5, total_generated_tokens=500,
                prefix_cache_queries=100, prefix_cache_hits=50, num_preemptions_swap=2))
    assert h.throughput_rows() == [] and h.swap_rows() == [] and h.preemption_rows() == []
    assert h.cache_token_rows() == [] and h.hit_rate_rows() == []
    assert h.windowed_hit_rate() is None  # counts since engine start are not in any window
    assert series(h.device_usage_rows(), "in use", "percent") == [25.0]
    assert series(h.device_usage_rows(), "cached", "percent") == [5.0]
    head = h.header()
    assert head["tokens_per_s"] == 0.0 and head["device_usage_percent"] == 25.0 and head["preemptions_swap"] == 2


def test_zero_sized_pools_and_still_counters_do_not_divide_by_zero():
    h = StatsHistory()
    for t in (1.0, 2.0, 3.0):
        h.add(stats(t, device_blocks_total=0, host_blocks_total=0))
    assert set(series(h.device_usage_rows(), "in use", "percent")) == {0.0}
    assert set(series(h.host_usage_rows(), "host", "percent")) == {0.0}
    assert set(series(h.throughput_rows(), "generation", "tokens_per_s")) == {0.0}
    assert h.windowed_hit_rate() is None and h.hit_rate_rows() == []
    assert h.header()["tokens_per_s"] == 0.0


def test_throughput_from_cumulative_counters_and_timestamps():
    h = StatsHistory()
    h.add(stats(100.0, total_generated_tokens=0, total_prompt_tokens=0))
    h.add(stats(102.0, total_generated_tokens=200, total_prompt_tokens=1000))
    h.add(stats(102.5, total_generated_tokens=300, total_prompt_tokens=1000))
    rows = h.throughput_rows()
    assert series(rows, "generation", "tokens_per_s") == [100.0, 200.0]
    assert series(rows, "prompt", "tokens_per_s") == [500.0, 0.0]
    assert [r["t"] for r in rows if r["series"] == "generation"] == [-0.5, 0.0]
    assert h.header()["tokens_per_s"] == pytest.approx(300 / 2.5)
    frame = to_frame(rows)
    assert list(frame.columns) == ["t", "series", "tokens_per_s"] and len(frame) == 4
    assert list(to_frame([], ["t", "series", "tokens_per_s"]).columns) == ["t", "series", "tokens_per_s"]


def test_identical_timestamps_carry_their_counts_into_the_next_interval():
    h = StatsHistory()
    h.add(stats(1.0, total_generated_tokens=0, total_blocks_swapped_out=0))
    h.add(stats(1.0, total_generated_tokens=40, total_blocks_swapped_out=4))  # no time passed
    h.add(stats(3.0, total_generated_tokens=100, total_blocks_swapped_out=10))
    assert series(h.throughput_rows(), "generation", "tokens_per_s") == [50.0]
    assert series(h.swap_rows(), "out", "blocks_per_s") == [5.0]
    h2 = StatsHistory()
    h2.add(stats(5.0, total_generated_tokens=10))
    h2.add(stats(5.0, total_generated_tokens=20))
    assert h2.throughput_rows() == [] and h2.header()["tokens_per_s"] == 0.0


def test_preemptions_per_interval_are_counter_differences():
    h = StatsHistory()
    for t, swap, rec in [(0, 1, 0), (1, 1, 0), (2, 4, 1), (3, 4, 3)]:
        h.add(stats(float(t), num_preemptions_swap=swap, num_preemptions_recompute=rec))
    rows = h.preemption_rows()
    assert series(rows, "swap", "count") == [0, 3, 0]
    assert series(rows, "recompute", "count") == [0, 1, 2]
    head = h.header()
    assert (head["preemptions_swap"], head["preemptions_recompute"]) == (4, 3)


def test_swap_rates_per_second():
    h = StatsHistory()
    h.add(stats(0.0))
    h.add(stats(0.5, total_blocks_swapped_out=10, total_blocks_swapped_in=2))
    rows = h.swap_rows()
    assert series(rows, "out", "blocks_per_s") == [20.0] and series(rows, "in", "blocks_per_s") == [4.0]


def test_windowed_hit_rate_against_a_hand_computed_value():
    h = StatsHistory(window_s=10.0)
    # (time, cumulative queried tokens, cumulative hit tokens)
    for t, q, hits in [(0, 0, 0), (5, 100, 90), (12, 200, 100), (20, 300, 100), (21, 300, 100)]:
        h.add(stats(float(t), prefix_cache_queries=q, prefix_cache_hits=hits))
    # At t=21 the window [11, 21] starts at the sample t=12: (100 - 100) / (300 - 200) = 0.
    assert h.windowed_hit_rate() == 0.0
    # At t=12 the window [2, 12] starts at t=5: (100 - 90) / (200 - 100) = 0.1, not the
    # lifetime 100 / 200 = 0.5 that SchedulerStats.prefix_cache_hit_rate would give.
    assert h.windowed_hit_rate(2) == pytest.approx(0.1)
    assert h.samples[2].prefix_cache_hit_rate == 0.5
    # At t=5 the window [-5, 5] starts at t=0: 90 / 100.
    assert h.windowed_hit_rate(1) == pytest.approx(0.9)
    # A wider window at t=21 reaches t=5: (100 - 90) / (300 - 100) = 0.05.
    assert h.windowed_hit_rate(window_s=16.0) == pytest.approx(0.05)
    rows = h.hit_rate_rows()
    assert [round(r["percent"], 6) for r in rows] == [90.0, 10.0, 0.0, 0.0]
    assert h.header()["hit_rate"] == 0.0
    assert series(h.cache_token_rows(), "from cache", "tokens_per_s") == [18.0, 10 / 7, 0.0, 0.0]


def test_history_from_a_real_scheduler_run():
    sched, runner = make(num_device_blocks=12, num_host_blocks=32, preemption_mode="swap")
    for i in range(3):
        sched.add_request(request(f"r{i}", [(i * 13 + k) % 40 + 5 for k in range(10)], max_tokens=20, ignore_eos=True))
    h = StatsHistory(capacity=10_000)
    clock = iter(range(1, 10_000))
    run(sched, runner, on_step=lambda out: h.add(dataclasses.replace(sched.last_stats, timestamp=float(next(clock)))))
    total = sum(series(h.throughput_rows(), "generation", "tokens_per_s"))  # 1 s per sample
    assert total == h.latest.total_generated_tokens - h.samples[0].total_generated_tokens
    swaps = sum(series(h.preemption_rows(), "swap", "count"))
    assert swaps == h.latest.num_preemptions_swap - h.samples[0].num_preemptions_swap
    assert h.latest.total_blocks_swapped_out > 0


# ---- block grid -------------------------------------------------------------------------
def info(block_id, state, ref_count=0, owners=(), num_tokens=0, block_hash=None):
    return BlockInfo(block_id, state, ref_count, num_tokens, block_hash, tuple(owners))


def sample_map() -> BlockMap:
    device = (info(0, BlockState.FREE),
              info(1, BlockState.CACHED, num_tokens=4, block_hash=0xABCDEF0123456789),
              info(2, BlockState.USED, 1, ["a"], 4, block_hash=-5),
              info(3, BlockState.USED, 2, ["a", "b"], 4, block_hash=0x1234),
              info(4, BlockState.USED, 1, ["b"], 2),
              info(5, BlockState.USED, 1, ["a"], 3))
    host = (info(0, BlockState.USED, 1, ["c"], 4), info(1, BlockState.FREE))
    return BlockMap(4, device, host)


def test_cell_states_colours_and_titles():
    bm = sample_map()
    device = block_cells(bm.device, show_private=True)
    assert [c.state for c in device] == ["free", "cached", "used", "shared", "used", "used"]
    assert device[0].color == FREE_COLOR and device[1].color == CACHED_COLOR and device[3].color == SHARED_COLOR
    assert device[2].color == device[5].color == owner_color("a")  # same owner, same colour
    assert device[4].color == owner_color("b")
    assert len({FREE_COLOR, CACHED_COLOR, SHARED_COLOR, owner_color("a"), owner_color("b")}) == 5
    assert owner_color("a#1") == owner_color("a")  # forked samples share the parent's colour
    assert owner_color("chat-7/t2") == owner_color("chat-7/t1#3") == owner_color("chat-7")  # one conversation
    assert owner_color("chat-7/t1") != owner_color("chat-8/t1")
    t = device[3].title
    assert "block 3" in t and "refs 2" in t and "owners a, b" in t and "tokens 4" in t and "hash 00000000" in t
    assert "hash abcdef01" in device[1].title and "hash ffffffff" in device[2].title
    assert "hash" not in device[0].title and "owners" not in device[0].title
    assert [c.state for c in block_cells(bm.host)] == ["used", "free"]
    assert all(c.num_blocks == 1 and sum(n for _, n in c.counts) == 1 for c in device)


def test_a_visitors_cells_name_no_owners_and_no_hashes():
    bm = sample_map()
    operator, visitor = block_cells(bm.device, show_private=True), block_cells(bm.device)
    assert visitor[3].title == "block 3: shared; refs 2; tokens 4"
    assert [c.title.split("; owners")[0].split("; hash")[0] for c in operator] == [c.title for c in visitor]
    assert [(c.state, c.color, c.counts) for c in operator] == [(c.state, c.color, c.counts) for c in visitor]


def test_a_block_holding_a_preset_system_prompt_says_so_to_everyone():
    alone = dataclasses.replace(info(2, BlockState.USED, 1, ["a"], 4), shared_prefix=True)
    visitor, operator = block_cells([alone])[0], block_cells([alone], show_private=True)[0]
    assert visitor.title == "block 2: used; refs 1; tokens 4; preset system prompt" and visitor.state == "used"
    assert operator.title.startswith(visitor.title + "; owners a")


def test_owner_colour_is_stable_and_never_the_shared_orange():
    for i in range(500):
        colour = owner_color(f"req-{i}")
        assert colour == owner_color(f"req-{i}")
        hue = int(colour[4:colour.index(",")])
        assert not 15 <= hue < 55


def test_summary_adds_up_to_the_pool_sizes():
    bm = sample_map()
    assert summary_of(bm.device) == {"free": 1, "cached": 1, "used": 3, "shared": 1, "total": 6}
    assert summary_of(bm.host) == {"free": 1, "cached": 0, "used": 1, "shared": 0, "total": 2}


def test_aggregation_above_max_cells_keeps_the_totals():
    n = 10_000
    device = tuple(info(i, BlockState.USED, 1, [f"r{i // 100}"], 4) if i % 3 == 0 else
                   info(i, BlockState.CACHED, num_tokens=4, block_hash=i) if i % 3 == 1 else
                   info(i, BlockState.FREE) for i in range(n))
    bm = BlockMap(16, device, ())
    cells = block_cells(bm.device)
    assert len(cells) <= 2048 and sum(c.num_blocks for c in cells) == n
    totals = {s: sum(dict(c.counts)[s] for c in cells) for s in block_grid.STATES}
    assert totals == {k: v for k, v in summary_of(bm.device).items() if k != "total"}
    first = cells[0]  # blocks 0-4: used, cached, free, used, cached -> a tie of used and cached
    assert first.num_blocks == 5 and first.state == "used" and first.color == owner_color("r0")
    assert first.title == "blocks 0-4: free 1, cached 2, used 2"
    assert all(sum(n for _, n in c.counts) == c.num_blocks for c in cells)
    assert len(block_cells(device, max_cells=7)) <= 7
    assert len(block_cells(bm.device, max_cells=n)) == n


def test_cells_and_summary_from_a_real_scheduler():
    sched, runner = make(num_device_blocks=16, num_host_blocks=8)
    shared_prompt = list(range(5, 21))
    sched.add_request(request("x", shared_prompt + [30], max_tokens=6, ignore_eos=True, n=2))
    saw_shared = False
    while sched.has_unfinished():
        run_step(sched, runner)
        bm, st = sched.block_map(), sched.last_stats
        s = summary_of(bm.device)
        assert sum(s[k] for k in block_grid.STATES) == s["total"] == 16
        assert s["used"] + s["shared"] == st.device_blocks_used
        assert s["cached"] == st.device_blocks_cached
        saw_shared |= s["shared"] > 0
        cells = block_cells(bm.device)
        colours = {c.color for c in cells if c.state == "used"}
        assert colours <= {owner_color("x")}  # one request and its forked sample: one colour
    assert saw_shared


def test_html_escapes_hostile_request_ids():
    evil = '<img src=x onerror=alert(1)>'
    bm = BlockMap(4, (info(0, BlockState.USED, 1, [evil], 4), info(1, BlockState.USED, 2, [evil, '"q"'], 4)), ())
    cells = block_cells(bm.device, show_private=True)
    out = render_html(cells, columns=2)
    assert "<img" not in out and "&lt;img src=x onerror=alert(1)&gt;" in out
    assert '"q"' not in out and "&quot;q&quot;" in out
    assert out.count('class="kv-cell') == 2 and "repeat(2," in out
    assert render_html([], columns=0).startswith('<div class="kv-grid"')
