"""The cluster view (ui/panel/cluster_view.py), parsed as a browser would: rows, badges, escaping,
missing figures and the sparklines' points and scales."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

import pytest

from ui.backends.figures import FIGURES, BackendStatus, Figures
from ui.panel import cluster_view
from ui.panel.cluster_view import CHARTS, HEIGHT, SPAN_S, WIDTH, cluster_html


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node] = field(default_factory=list)
    parts: list[str | Node] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(p if isinstance(p, str) else p.text for p in self.parts)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def all(self, cls: str | None = None, tag: str | None = None, **attrs: str) -> list[Node]:
        found = []
        for child in self.children:
            if ((cls is None or cls in child.classes) and (tag is None or child.tag == tag)
                    and all(child.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())):
                found.append(child)
            found += child.all(cls, tag, **attrs)
        return found

    def one(self, cls: str | None = None, tag: str | None = None, **attrs: str) -> Node:
        [node] = self.all(cls, tag, **attrs)
        return node


class TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        self.stack[-1].parts.append(node)
        self.stack.append(node)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        self.stack.pop()

    def handle_endtag(self, tag):
        assert self.stack[-1].tag == tag, f"</{tag}> closes <{self.stack[-1].tag}>"
        self.stack.pop()

    def handle_data(self, data):
        self.stack[-1].parts.append(data)


def parse(page: str) -> Node:
    builder = TreeBuilder()
    builder.feed(page)
    builder.close()
    assert builder.stack == [builder.root], "unclosed elements"
    return builder.root


def points_of(line: Node) -> list[tuple[float, float]]:
    return [tuple(map(float, p.split(","))) for p in line.attrs["points"].split()]


def history(n: int, start: float = 1000.0, **series: list) -> tuple[Figures, ...]:
    """n samples a second apart; each keyword gives one figure's values (a list of n)."""
    return tuple(Figures(start + i, **{k: v[i] for k, v in series.items()}) for i in range(n))


FULL = dict(kv_usage=[0.1, 0.2, 0.42], running=[1, 2, 3], waiting=[0, 0, 1], hit_rate=[None, 0.5, 0.75],
            preemptions=[0, 2, 0], throughput=[10.0, 11.0, 12.5], ttft=[0.2, None, 0.35])


def test_the_charts_draw_every_figure_once():
    drawn = [s for chart in CHARTS for s in chart.series]
    assert sorted(drawn) == sorted(FIGURES)


def test_one_row_per_backend_in_order_with_its_identity():
    backends = [BackendStatus("in-process", None, True, model="SmolLM2", flavor="pagedchat", in_flight=2,
                              max_model_len=2048, history=history(3, **FULL)),
                BackendStatus("10.0.0.2:8000", "http://10.0.0.2:8000", True, model="Qwen", flavor="vllm"),
                BackendStatus("gpu-3", "http://gpu-3:30000", True, flavor="sglang", in_flight=1)]
    root = parse(cluster_html(backends))
    rows = root.all("cl-row")
    assert [r.attrs["data-backend"] for r in rows] == ["in-process", "10.0.0.2:8000", "gpu-3"]
    assert root.one("cl-cluster").attrs["data-backends"] == "3"
    first, second, third = rows
    assert first.one("cl-name").text == "in-process" and first.one("cl-name").attrs["title"] == "in-process engine"
    assert first.one("cl-model").text == "SmolLM2" and first.one("cl-flavor").text == "PagedChat"
    assert "2048 tokens max" in first.one("cl-meta").text
    assert first.one("cl-badge").text == "up" and "cl-badge-up" in first.one("cl-badge").classes
    assert first.one(data_metric="in-flight").text == "2" and "replies in flight" in first.one("cl-state").text
    assert second.one("cl-flavor").text == "vLLM" and second.one("cl-name").attrs["title"] == "http://10.0.0.2:8000"
    assert third.one("cl-model").text == "model unknown" and "1 reply in flight" in third.one("cl-state").text
    for row in rows:
        assert [c.attrs["data-chart"] for c in row.all("cl-chart")] == [c.key for c in CHARTS]
        assert row.all("cl-problem") == []


def test_current_values_are_formatted():
    row = parse(cluster_html([BackendStatus("a", "http://a", True, history=history(3, **FULL))])).one("cl-row")
    values = {c.attrs["data-chart"]: c.one("cl-value").text for c in row.all("cl-chart")}
    assert values == {"kv_usage": "42%", "requests": "3 / 1", "hit_rate": "75%", "preemptions": "0",
                      "throughput": "12.5 tok/s", "ttft": "0.35 s"}
    # the label of the two-line chart names both series, coloured as their lines
    label = row.one("cl-chart", data_chart="requests").one("cl-label")
    assert label.text == "running / waiting" and {n.attrs["class"] for n in label.children} == {"cl-k-running",
                                                                                              "cl-k-waiting"}


def test_a_polyline_per_series_with_a_point_per_number_and_a_scale_covering_them():
    throughput = [3.0, None, 7.5, 12.5, None, 17.0]
    status = BackendStatus("a", "http://a", True, history=history(6, throughput=throughput,
                                                                   running=[1, 2, 3, 4, 5, 6],
                                                                   waiting=[0, 0, 9, 0, 0, 2]))
    row = parse(cluster_html([status])).one("cl-row")
    chart = row.one("cl-chart", data_chart="throughput")
    [line] = chart.all(tag="polyline")
    points = points_of(line)
    assert len(points) == sum(v is not None for v in throughput) == 4
    svg = chart.one(tag="svg")
    # html.parser lowercases attribute names
    assert svg.attrs["viewbox"] == f"0 0 {WIDTH} {HEIGHT}" and float(svg.attrs["data-y-max"]) == 20.0
    assert all(0 <= x <= WIDTH and 0 <= y <= HEIGHT for x, y in points)
    xs, ys = zip(*points)
    assert list(xs) == sorted(xs) and xs[-1] == WIDTH  # oldest left, the newest at the right edge
    # higher values higher up (smaller y), and the scale's top is above the largest value
    assert ys[0] > ys[1] > ys[2] > ys[3] >= 1.0
    assert chart.one("cl-scale").text == "0–20 tok/s"
    requests = row.one("cl-chart", data_chart="requests")
    lines = {line.attrs["data-series"]: line for line in requests.all(tag="polyline")}
    assert set(lines) == {"running", "waiting"} and all(len(points_of(v)) == 6 for v in lines.values())
    assert float(requests.one(tag="svg").attrs["data-y-max"]) == 10.0  # covers waiting's 9
    assert "cl-s-running" in lines["running"].classes
    # a polyline is the only element per series: no per-point nodes
    assert [n.tag for n in row.all() if n.tag in ("circle", "rect", "line", "path", "text")] == []


def test_percent_charts_have_a_fixed_scale():
    status = BackendStatus("a", "http://a", True, history=history(3, kv_usage=[0.0, 0.01, 0.02]))
    chart = parse(cluster_html([status])).one("cl-chart", data_chart="kv_usage")
    assert chart.one(tag="svg").attrs["data-y-max"] == "100" and chart.one("cl-scale").text == "0–100%"
    assert chart.one("cl-value").text == "2%"


def test_the_window_drops_old_samples_and_now_moves_the_right_edge():
    status = BackendStatus("a", "http://a", True, history=history(5, start=0.0, throughput=[1.0] * 5))
    late = parse(cluster_html([status], now=SPAN_S + 2.0)).one("cl-chart", data_chart="throughput")
    points = points_of(late.one(tag="polyline"))
    assert len(points) == 3  # t = 2, 3, 4 are inside [now - SPAN_S, now]
    assert [x for x, _ in points] == pytest.approx([WIDTH * (t - 2.0) / SPAN_S for t in (2.0, 3.0, 4.0)], abs=0.05)
    gone = parse(cluster_html([status], now=10_000.0)).one("cl-chart", data_chart="throughput")
    assert gone.all(tag="polyline") == [] and gone.one("cl-value").text == "—"


def test_a_missing_figure_shows_why_and_draws_nothing():
    why = "llama.cpp exports no prefix-cache counters <sic>"
    status = BackendStatus("llama", "http://llama:8080", True, flavor="llamacpp",
                           history=history(3, **{k: v for k, v in FULL.items() if k not in ("hit_rate", "waiting")}),
                           missing={"hit_rate": why, "waiting": "no queue gauge"})
    page = cluster_html([status])
    chart = parse(page).one("cl-chart", data_chart="hit_rate")
    assert "cl-missing" in chart.classes and chart.one("cl-value").text == "not exported"
    assert chart.one("cl-reason").text == why and chart.one("cl-reason").attrs["title"] == why
    assert chart.attrs["title"] == f"not exported: {why}"
    assert chart.all(tag="polyline") == [] and chart.all(tag="svg") == []
    assert "<sic>" not in page and "&lt;sic&gt;" in page
    # in the two-line chart, only the exported line is drawn and the other one says why
    requests = parse(page).one("cl-chart", data_chart="requests")
    assert [line.attrs["data-series"] for line in requests.all(tag="polyline")] == ["running"]
    assert requests.one("cl-value").text == "3 / —"
    assert requests.one("cl-reason").text == "waiting: not exported: no queue gauge"


def test_a_figure_with_no_numbers_yet_says_so():
    status = BackendStatus("a", "http://a", True, history=history(3, kv_usage=[0.1, 0.1, 0.1]))
    row = parse(cluster_html([status])).one("cl-row")
    ttft = row.one("cl-chart", data_chart="ttft")
    assert "cl-empty" in ttft.classes and ttft.one("cl-value").text == "—"
    assert ttft.one("cl-reason").text == "no data yet" and ttft.all(tag="polyline") == []
    fresh = parse(cluster_html([BackendStatus("b", "http://b", True)])).one("cl-row")
    assert all(c.one("cl-value").text == "—" for c in fresh.all("cl-chart"))


def test_not_a_number_is_not_drawn():
    status = BackendStatus("a", "http://a", True, history=history(3, throughput=[1.0, float("nan"), float("inf")]))
    chart = parse(cluster_html([status])).one("cl-chart", data_chart="throughput")
    assert len(points_of(chart.one(tag="polyline"))) == 1 and chart.one("cl-value").text == "1.0 tok/s"


def test_a_down_backend_shows_its_badge_and_problem():
    status = BackendStatus("gpu-2", "http://gpu-2:8000", False, problem="connection refused (after 3 tries)",
                           flavor="vllm", history=history(2, kv_usage=[0.5, 0.6]))
    row = parse(cluster_html([status])).one("cl-row")
    assert row.attrs["data-up"] == "false" and "cl-down" in row.classes
    badge = row.one("cl-badge")
    assert badge.text == "down" and "cl-badge-down" in badge.classes
    assert row.one("cl-problem").text == "connection refused (after 3 tries)"
    assert row.one("cl-chart", data_chart="kv_usage").one("cl-value").text == "60%"  # its last figures stay
    up_but_lacking = BackendStatus("x", "http://x", True, problem="no /metrics: 404")
    assert parse(cluster_html([up_but_lacking])).one("cl-problem").text == "no /metrics: 404"


def test_everything_from_a_backend_is_escaped():
    evil = '<script>alert("x")</script>'
    status = BackendStatus(evil, 'http://"><img src=x>', False, problem=f"bad {evil}", model=f"m {evil}",
                           flavor=evil, missing={"ttft": evil})
    page = cluster_html([status])
    assert "<script" not in page and "<img" not in page
    root = parse(page)
    row = root.one("cl-row")
    assert row.attrs["data-backend"] == evil and row.one("cl-name").text == evil
    assert row.one("cl-name").attrs["title"] == 'http://"><img src=x>'
    assert row.one("cl-model").text == f"m {evil}" and row.one("cl-flavor").text == evil
    assert row.one("cl-problem").text == f"bad {evil}"
    assert row.one("cl-chart", data_chart="ttft").one("cl-reason").text == evil
    assert [n.tag for n in root.all() if n.tag in ("script", "img")] == []


def test_no_backends_and_the_shared_time_axis():
    assert parse(cluster_html([])).one("cl-none").text == "No backends."
    # by default the right edge is the newest sample of any backend: a backend that stopped
    # reporting 60 s ago ends mid-chart
    fresh = BackendStatus("a", "http://a", True, history=history(2, start=1060.0, throughput=[1.0, 1.0]))
    stale = BackendStatus("b", "http://b", False, history=history(2, start=1000.0, throughput=[1.0, 1.0]))
    rows = parse(cluster_html([fresh, stale])).all("cl-row")
    edges = [points_of(r.one("cl-chart", data_chart="throughput").one(tag="polyline"))[-1][0] for r in rows]
    assert edges[0] == WIDTH and edges[1] == pytest.approx(WIDTH * (1 - 60.0 / SPAN_S), abs=0.1)


def test_the_html_stays_small():
    n = 300  # five minutes of samples, of which the last SPAN_S seconds are drawn
    series = {k: [(i % 7) / 7 for i in range(n)] for k in FIGURES}
    backends = [BackendStatus(f"backend-{i}", f"http://b{i}", True, model="m", history=history(n, **series))
                for i in range(4)]
    page = cluster_html(backends)
    assert len(page) < 4 * 12_000, len(page)
    assert page.count("<polyline") == 4 * len(FIGURES)


def test_the_styles_name_every_class_the_html_uses():
    status = BackendStatus("a", "http://a", False, problem="p", history=history(3, **FULL), missing={"ttft": "why"})
    used = set(re.findall(r'class="([^"]+)"', cluster_html([status])))
    classes = {c for group in used for c in group.split()}
    hooks = {"cl-model", "cl-flavor"}  # for tests and browsers only
    assert {c for c in classes if f".{c}" not in cluster_view.CLUSTER_CSS} == hooks
    assert "auto-fit" in cluster_view.CLUSTER_CSS
