"""The whole app served on a free loopback port, for the tests that talk to it over HTTP
(gradio_client sessions, or a browser through web_browser.py)."""
from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(client, store, feed=None, load=None, host: str | None = None) -> tuple[object, str]:
    """`app.build_app` launched on 127.0.0.1, in this process: the app and its URL. `host` is the
    address the app is told it is bound to (it decides who may run the load generator)."""
    from app import build_app
    from ui.sessions import Sessions

    sessions = Sessions()
    demo = build_app(client, store, feed, load, host=host, sessions=sessions)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                app_kwargs=sessions.app_kwargs())
    return demo, f"http://127.0.0.1:{port}/"


@contextmanager
def served_chat(model: str | None, db_path, **engine_options) -> Iterator[tuple[object, object, str]]:
    """An engine on `model` (LLMEngine's options) and a store at `db_path`, the app around them
    served: (engine client, store, URL); everything stopped afterwards."""
    from engine.client import EngineClient
    from engine.llm_engine import LLMEngine
    from storage import Store

    client = EngineClient(LLMEngine(model, **engine_options))
    store = Store(db_path)
    demo, url = serve(client, store)
    try:
        yield client, store, url
    finally:
        demo.close()
        client.close()
        store.close()


@contextmanager
def served_with_load(model: str | None, db_path, num_gpu_blocks: int, num_cpu_blocks: int,
                     host: str | None = None, interval_s: float = 1.0) -> Iterator[tuple[object, object, str]]:
    """An engine on `model`, its panel feed and load generator, and the app around them served:
    (engine client, load generator, URL); everything stopped afterwards."""
    from engine.client import EngineClient
    from engine.llm_engine import LLMEngine
    from storage import Store
    from ui.panel.feed import PanelFeed
    from ui.panel.load_generator import LoadGenerator

    client = EngineClient(LLMEngine(model, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks))
    feed, load = PanelFeed(client, interval_s=interval_s), LoadGenerator(client)
    demo, url = serve(client, Store(db_path), feed, load, host=host)
    try:
        yield client, load, url
    finally:
        load.stop()
        demo.close()
        feed.close()
        client.close()
