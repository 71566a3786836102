"""Opt-in: the app in front of real peer servers. Each test runs when its variable points at the
server, serving SmolLM2-135M-Instruct:

    bash benchmarks/peers/vllm_cpu.sh setup && bash benchmarks/peers/vllm_cpu.sh serve 8100 &
    bash benchmarks/peers/llama_cpp.sh    # builds llama-server and the GGUF, then:
    benchmarks/peers/.build/llama-server -m benchmarks/peers/.build/smollm2-135m-f32.gguf --port 8200 --metrics &
    PAGEDCHAT_VLLM_URL=http://127.0.0.1:8100 PAGEDCHAT_LLAMACPP_URL=http://127.0.0.1:8200 \
        .venv/bin/python -m pytest tests/test_peer_backends.py

With PAGEDCHAT_SCREENSHOT=1 the vLLM test saves the panel as docs/cluster-panel-vllm.png."""
from __future__ import annotations

import os
import time
import uuid

import pytest

VLLM_URL = os.environ.get("PAGEDCHAT_VLLM_URL")
LLAMACPP_URL = os.environ.get("PAGEDCHAT_LLAMACPP_URL")
if not VLLM_URL and not LLAMACPP_URL:
    pytest.skip("set PAGEDCHAT_VLLM_URL or PAGEDCHAT_LLAMACPP_URL to a running peer server (see this module)",
                allow_module_level=True)

from gradio_client import Client  # noqa: E402
from web_browser import Browser, browser, png_size, screenshot_target, serve, sync_api  # noqa: E402,F401

from storage import Store  # noqa: E402
from ui import backends  # noqa: E402

expect = sync_api.expect


@pytest.mark.skipif(not VLLM_URL, reason="set PAGEDCHAT_VLLM_URL (benchmarks/peers/vllm_cpu.sh serve)")
def test_chats_through_vllm_with_its_metrics_on_the_panel(browser, engine_servers, tmp_path):
    router = backends.remote([VLLM_URL, engine_servers[0].url], interval_s=0.5)
    store = Store(tmp_path / "chat.db")
    server, url = serve(None, store, backend=router)
    try:
        vllm, ours = router.statuses()
        assert vllm.up and vllm.flavor == "vllm" and vllm.max_model_len, vllm
        assert ours.up and ours.flavor == "pagedchat"

        # Four chats at once: the least loaded rule spreads them over both backends. Then the next
        # turns of one that vLLM wrote go back to vLLM and reuse its blocks there.
        users = [f"anon:{uuid.uuid4().hex}" for _ in range(4)]
        sessions = [Client(url, verbose=False) for _ in users]
        jobs = [session.submit(user, None, "What is a KV cache? Explain in detail.", "Code reviewer", "", 0.0, 1.0,
                               160, api_name="/send") for user, session in zip(users, sessions)]
        chats = {user: job.result(timeout=300)[1] for user, job in zip(users, jobs)}
        written = {user: store.messages(user, chats[user])[-1]["backend"] for user in users}
        assert set(written.values()) == {vllm.name, ours.name}, written
        user = next(user for user in users if written[user] == vllm.name)
        Client(url, verbose=False).predict(user, chats[user], "And paged attention?", "Code reviewer", "", 0.0, 1.0,
                                           32, api_name="/send")
        Client(url, verbose=False).predict(user, chats[user], "Thanks!", "Code reviewer", "", 0.0, 1.0, 16,
                                           api_name="/send")
        first, second, third = [m for m in store.messages(user, chats[user]) if m["role"] == "assistant"]
        assert first["content"].strip() and first["backend"] == second["backend"] == third["backend"] == vllm.name
        # vLLM caches the full blocks of a prompt (128 tokens each on CPU), not those its replies
        # fill: turn 2 finds turn 1's prompt alone (under one block here), turn 3 turn 2's prompt.
        assert second["cached_tokens"] is not None and third["cached_tokens"] >= 128

        deadline = time.monotonic() + 15  # its figures over at least one interval with work in it
        while time.monotonic() < deadline:
            vllm = router.statuses()[0]
            if any(f.throughput for f in vllm.history) and any(f.ttft for f in vllm.history):
                break
            time.sleep(0.5)
        assert dict(vllm.missing) == {}, vllm.missing  # vLLM exports every figure the row draws
        assert any(f.kv_usage is not None for f in vllm.history) and any(f.throughput for f in vllm.history)
        print(f"\nvLLM: {vllm.model} max_model_len {vllm.max_model_len}; cached prompt tokens by turn: "
              f"{[(m['cached_tokens'], m['prompt_tokens']) for m in (first, second, third)]}, by {third['backend']}; "
              f"latest figures {vllm.history[-1]}")

        profile = Browser(browser, url)
        page = profile.open("panel", viewport={"width": 1400, "height": 1000})
        row = page.locator(f'.cl-row[data-backend="{vllm.name}"]')
        expect(row).to_have_attribute("data-up", "true")
        expect(row.locator(".cl-flavor")).to_contain_text("vLLM")
        expect(row.locator(".cl-missing")).to_have_count(0)
        expect(page.locator("#block-map-0")).to_contain_text("publishes no block map")
        expect(page.locator('#block-map-1 [data-pool="device"] .kv-cell')).to_have_count(128)
        target = screenshot_target("cluster-panel-vllm.png", tmp_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(target), full_page=True)
        assert png_size(target)[0] == 1400
        profile.context.close()
        assert profile.errors == []
    finally:
        server.close()
        store.close()


@pytest.mark.skipif(not LLAMACPP_URL, reason="set PAGEDCHAT_LLAMACPP_URL (llama-server --metrics)")
def test_chats_through_llama_cpp_and_the_panel_says_what_it_does_not_export(browser, tmp_path):
    router = backends.remote([LLAMACPP_URL], interval_s=0.5)
    store = Store(tmp_path / "chat.db")
    server, url = serve(None, store, backend=router)
    try:
        [status] = router.statuses()
        assert status.up and status.flavor == "llamacpp" and status.max_model_len
        user, session = f"anon:{uuid.uuid4().hex}", Client(url, verbose=False)
        _, conversation_id, _ = session.predict(user, None, "What is a KV cache?", "Code reviewer", "", 0.0, 1.0, 40,
                                                api_name="/send")
        session.predict(user, conversation_id, "More, please.", "Code reviewer", "", 0.0, 1.0, 16, api_name="/send")
        first, second = [m for m in store.messages(user, conversation_id) if m["role"] == "assistant"]
        assert first["content"].strip() and second["cached_tokens"] > 0  # its slot kept the first turn

        time.sleep(2)
        [status] = router.statuses()
        print(f"\nllama.cpp: max_model_len {status.max_model_len}; turn 2: {second['cached_tokens']} of "
              f"{second['prompt_tokens']} prompt tokens cached; missing {dict(status.missing)}")
        assert {"kv_usage", "preemptions", "ttft"} <= set(status.missing)  # with a reason each
        assert any(f.throughput for f in status.history) and any(f.hit_rate for f in status.history)

        profile = Browser(browser, url)
        page = profile.open("panel", viewport={"width": 1400, "height": 900})
        row = page.locator(f'.cl-row[data-backend="{status.name}"]')
        expect(row.locator(".cl-flavor")).to_contain_text("llama.cpp")
        expect(row.locator('.cl-chart.cl-missing[data-chart="kv_usage"]')).to_contain_text("not exported")
        expect(row.locator('.cl-chart[data-chart="throughput"] polyline')).to_have_count(1)
        profile.context.close()
        assert profile.errors == []
    finally:
        server.close()
        store.close()
