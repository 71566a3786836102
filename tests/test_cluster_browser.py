"""The panel of an app in front of two real `python -m engine.serve` processes, in a real browser
(Debian's chromium, headless): a row per backend with its figures, and each one's block map."""
from __future__ import annotations

import uuid

import pytest
from gradio_client import Client
from web_browser import Browser, browser, png_size, screenshot_target, serve, sync_api  # noqa: F401

from storage import Store
from ui import backends

expect = sync_api.expect


@pytest.fixture(scope="module")
def cluster_app(engine_servers, tmp_path_factory):
    router = backends.remote([s.url for s in engine_servers], interval_s=0.5)
    server, url = serve(None, Store(tmp_path_factory.mktemp("cluster-panel") / "chat.db"), backend=router)
    try:
        yield router, url
    finally:
        server.close()


def test_the_panel_shows_a_row_and_a_block_map_for_each_backend(browser, cluster_app, engine_servers, tmp_path):
    router, url = cluster_app
    profile = Browser(browser, url)
    page = profile.open("panel", viewport={"width": 1400, "height": 1100})
    for i, server in enumerate(engine_servers):
        row = page.locator(f'.cl-row[data-backend="{server.name}"]')
        expect(row).to_have_attribute("data-up", "true")
        expect(row.locator(".cl-model")).to_contain_text("tiny")
        for chart in ("kv_usage", "requests", "hit_rate", "preemptions", "throughput", "ttft"):
            expect(row.locator(f'.cl-chart[data-chart="{chart}"]')).to_have_count(1)
        expect(row.locator(".cl-missing")).to_have_count(0)  # a PagedChat server exports every figure
        device = page.locator(f'#block-map-{i} [data-pool="device"]')
        expect(device).to_have_attribute("data-total", "128")
        expect(device.locator(".kv-cell")).to_have_count(128)

    # A long reply: its backend's row counts it and its map shows the blocks it holds.
    session = Client(url, verbose=False)
    job = session.submit(f"anon:{uuid.uuid4().hex}", None, "A long story, please.", "None", "", 0.0, 1.0, 1500,
                         api_name="/send")
    page.wait_for_function("""() => [...document.querySelectorAll('.cl-row [data-metric="in-flight"]')]
                                    .some(e => parseInt(e.textContent) >= 1)""")
    page.wait_for_function("""() => [...document.querySelectorAll('.remote-block-map [data-pool="device"]')]
                                    .some(p => +p.getAttribute('data-free') < +p.getAttribute('data-total'))""")
    target = screenshot_target("cluster-panel.png", tmp_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(target), full_page=True)
    assert png_size(target)[0] == 1400
    job.result(timeout=120)
    profile.context.close()
    assert profile.errors == []
