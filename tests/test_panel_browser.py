"""The live engine panel in a real browser (Debian's chromium, headless, Playwright): start the
load generator against an engine with a tiny device pool, watch the plots move, swap-outs
climb and shared blocks appear in the block map; stop it and watch every block come back.
A second test takes the README's panel screenshot with the real default model under load."""
from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("gradio")
from served_app import served_with_load  # noqa: E402
from waiting import DEADLINE_S, wait_for  # noqa: E402
from web_browser import Browser, browser, png_size, screenshot_target, serve, set_slider, sync_api  # noqa: E402,F401

expect = sync_api.expect

DEVICE_BLOCKS, HOST_BLOCKS = 48, 128
LOAD_TIMEOUT_MS = int(DEADLINE_S * 1000)  # a bound on a hang, on a busy machine


@pytest.fixture(scope="module")
def panel_app(tiny_model_dir, tmp_path_factory):
    with served_with_load(tiny_model_dir, tmp_path_factory.mktemp("panel") / "chat.db", DEVICE_BLOCKS, HOST_BLOCKS,
                          interval_s=0.5) as served:
        yield served


def metric(page, name: str) -> str:
    return page.locator(f'#panel-header [data-metric="{name}"]').inner_text()


def wait_for_metric(page, name: str, test: str) -> None:
    """Until the header figure `name` (as a number x) satisfies the JS expression `test`."""
    page.wait_for_function(
        f"""() => {{ const e = document.querySelector('#panel-header [data-metric="{name}"]');
                     const x = e ? parseFloat(e.textContent) : NaN; return !isNaN(x) && ({test}); }}""",
        timeout=LOAD_TIMEOUT_MS)


def pool(page, name: str):
    return page.locator(f'#block-map [data-pool="{name}"]')


def line_paths(page, plot: str) -> list[str]:
    return page.locator(f"#plot-{plot} .mark-line path").evaluate_all("paths => paths.map(p => p.getAttribute('d'))")


def test_the_panel_shows_load_preemption_sharing_and_blocks_coming_back(browser, panel_app):
    client, load, url = panel_app
    profile = Browser(browser, url)
    page = profile.open("panel", viewport={"width": 1400, "height": 1200})

    # Idle: every block of both pools drawn, all free; the CPU note says where the "GPU" pool is.
    expect(pool(page, "device")).to_have_attribute("data-total", str(DEVICE_BLOCKS))
    expect(pool(page, "device").locator(".kv-cell")).to_have_count(DEVICE_BLOCKS)
    expect(pool(page, "host").locator(".kv-cell")).to_have_count(HOST_BLOCKS)
    expect(pool(page, "device")).to_have_attribute("data-free", str(DEVICE_BLOCKS))
    expect(page.locator("#panel-header [data-note=cpu]")).to_contain_text("lives in main memory")

    set_slider(page, "Synthetic users", 8)
    page.locator("#load-start").click()
    expect(page.locator("#load-status [data-running=true]")).to_contain_text("8")

    wait_for_metric(page, "running", "x >= 2")       # batching: several users' requests at once
    wait_for_metric(page, "swapped-out", "x > 0")    # the tiny pool preempts by swapping to the host
    wait_for_metric(page, "hit-rate", "x > 0")       # the shared system prompt comes from the cache
    shared = pool(page, "device").locator(".kv-shared")
    expect(shared.first).to_be_visible(timeout=LOAD_TIMEOUT_MS)
    title = shared.first.get_attribute("title")
    assert "refs" in title and "owners load" in title, title
    page.wait_for_function("() => parseInt(document.querySelector('#load-status [data-metric=replies]')"
                           "?.textContent ?? '0') > 0", timeout=LOAD_TIMEOUT_MS)

    # The plots move: the usage lines are redrawn with new points second by second.
    expect(page.locator("#plot-usage")).to_contain_text("device used")
    before = line_paths(page, "usage")
    assert before
    wait_for(lambda: line_paths(page, "usage") not in (before, []), "the usage lines redrawn with new points",
             interval=0.2)
    assert line_paths(page, "swaps") and line_paths(page, "generation")

    page.locator("#load-stop").click()
    expect(page.locator("#load-status [data-running=false]")).to_contain_text("stopped")
    expect(pool(page, "device")).to_have_attribute("data-used", "0", timeout=LOAD_TIMEOUT_MS)
    expect(pool(page, "device")).to_have_attribute("data-shared", "0")
    expect(pool(page, "host")).to_have_attribute("data-used", "0")
    expect(pool(page, "device").locator(".kv-cached").first).to_be_visible()  # prefixes stay reusable
    wait_for_metric(page, "running", "x === 0")
    stats = client.stats()
    assert stats.device_blocks_used == stats.host_blocks_used == 0
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0
    profile.context.close()
    assert profile.errors == []


def test_a_visitor_sees_no_load_controls_until_giving_the_admin_token(browser, tiny_model_dir, tmp_path, monkeypatch):
    """On an app decided as public (bound to 0.0.0.0; the test reaches it on 127.0.0.1)."""
    from ui.panel.operator import TOKEN_ENV

    monkeypatch.setenv(TOKEN_ENV, "let-me-operate")
    with served_with_load(tiny_model_dir, tmp_path / "chat.db", DEVICE_BLOCKS, HOST_BLOCKS, host="0.0.0.0",
                          interval_s=0.5) as (client, load, url):
        profile = Browser(browser, url)
        page = profile.open("panel")
        token = page.get_by_label("Admin token")
        expect(token).to_be_visible()
        expect(page.locator("#load-status")).to_contain_text("not started")
        expect(page.locator("#load-start")).to_be_hidden()
        expect(page.locator("#load-stop")).to_be_hidden()
        private_note = page.locator("#block-map [data-note=private]")
        expect(private_note).to_contain_text("shown to the operator only")
        token.fill("a guess")
        token.press("Enter")
        expect(page.get_by_text("That is not the admin token.")).to_be_visible()
        expect(page.locator("#load-start")).to_be_hidden()
        token.fill("let-me-operate")
        token.press("Enter")
        expect(private_note).to_have_count(0)  # the operator's map, sent at the next tick
        page.locator("#load-start").click()
        expect(page.locator("#load-status [data-running=true]")).to_be_visible()
        page.locator("#load-stop").click()
        expect(page.locator("#load-status [data-running=false]")).to_contain_text("stopped")
        assert not load.status().running
        profile.context.close()
        assert profile.errors == []


def test_screenshot_of_the_panel_under_load(browser, tiny_model_dir, tmp_path):
    """The README's panel screenshot, a 96-block device pool under 16 synthetic users: with
    PAGEDCHAT_SCREENSHOT=1 the real default model, into docs/panel.png; on every other run the
    tiny model into a temporary file (the picture's path, not its model: the real model's load
    took ~45 s here of a suite that must stay short; the test above shows the same behaviours)."""
    from engine.runtime.thread_client import EngineClient
    from engine.runtime.llm_engine import LLMEngine
    from storage import Store
    from ui.panel.load_generator import LoadGenerator
    from ui.panel.feed import PanelFeed

    target = screenshot_target("panel.png", tmp_path)
    model = None if os.environ.get("PAGEDCHAT_SCREENSHOT") else tiny_model_dir
    client = EngineClient(LLMEngine(model, num_gpu_blocks=96, num_cpu_blocks=256))
    feed, load = PanelFeed(client), LoadGenerator(client)
    server, url = serve(client, Store(tmp_path / "chat.db"), feed, load)
    try:
        profile = Browser(browser, url)
        page = profile.open("panel", viewport={"width": 1400, "height": 1200})
        page.locator("#load-start").click()  # 16 users by default
        wait_for_metric(page, "swapped-out", "x > 0")
        wait_for_metric(page, "device-usage", "x >= 50")
        expect(pool(page, "device").locator(".kv-shared").first).to_be_visible(timeout=LOAD_TIMEOUT_MS)
        # More history in the plots for the README's copy; a few seconds on every other run.
        # (a sleep that stays: it asserts nothing, it only lets the plots draw more for the picture)
        time.sleep(40 if os.environ.get("PAGEDCHAT_SCREENSHOT") else 3)
        target.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(target), full_page=True)
        page.locator("#load-stop").click()
        expect(page.locator("#load-status [data-running=false]")).to_be_visible()
        profile.context.close()
        assert profile.errors == []
        assert png_size(target)[0] == 1400
    finally:
        load.stop()
        server.close()
        feed.close()
        client.close()
