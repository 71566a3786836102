"""The whole app served on a free loopback port, for the tests that talk to it over HTTP
(gradio_client sessions, or a browser through web_browser.py)."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from waiting import DEADLINE_S, poll, wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CLOSE_GRACE_S = 1  # what is left streaming when a test's server closes is the test's litter
PORT_TRIES = 5


class Served:
    """A FastAPI app served by uvicorn on a free loopback port, on a thread of this process."""

    def __init__(self, app, on_close=(), **options) -> None:
        """`options`: more of uvicorn.Config's."""
        import uvicorn

        self._on_close = list(on_close)
        # A stream still open at close (a gradio_client session's heartbeat never ends) is
        # cancelled after CLOSE_GRACE_S: uvicorn waited on it until close() gave up on the
        # thread, 7-15 s of an idle core per module, and the server thread lived on.
        options = {"timeout_graceful_shutdown": CLOSE_GRACE_S, **options}
        # The free port is free when asked for, not when bound: another process of the suite can
        # take it in between ("address already in use"), and then another port is tried.
        for _ in range(PORT_TRIES):
            self.port = free_port()
            self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                         **options))
            self._thread = threading.Thread(target=self._server.run, name=f"uvicorn-{self.port}", daemon=True)
            self._thread.start()
            wait_for(lambda: self._server.started or not self._thread.is_alive(),
                     f"the server on port {self.port} to start")
            if self._server.started:
                break
        else:
            raise RuntimeError(f"the server did not start on any of {PORT_TRIES} free ports")
        self.url = f"http://127.0.0.1:{self.port}/"

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
        for close in self._on_close:
            close()


def engine_idle(client, timeout: float = DEADLINE_S) -> bool:
    """Whether `client`'s engine has no request left (running, waiting or swapped) within `timeout` s."""
    def idle() -> bool:
        stats = client.stats()
        return stats.num_running + stats.num_waiting + stats.num_swapped == 0
    return bool(poll(idle, timeout, interval=0.01))


class PeakRunning:
    """Context manager: the most requests `client`'s engine ran at once while it was open
    (sampled every 2 ms)."""

    def __init__(self, client) -> None:
        self.client = client
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch)

    def __enter__(self) -> PeakRunning:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self.client.stats().num_running)
            time.sleep(0.002)


def serve(client, store, feed=None, load=None, host: str | None = None, api_key: str | None = None,
          backend=None) -> tuple[Served, str]:
    """The whole app (`ui.server.build_app` behind `ui.server.build_server`) on 127.0.0.1, in this process: the
    server and its URL. `client`: an in-process engine (with a panel feed and a load generator,
    made here unless given); or None and `backend`, remote servers (ui.backends.remote). `host`
    is the address the app is told it is bound to (it decides who may run the load generator
    and whether the API needs a key)."""
    from ui.server import build_app, build_server
    from ui import backends
    from ui.panel.feed import PanelFeed
    from ui.panel.load_generator import LoadGenerator
    from ui.sessions import Sessions

    closing = []
    if client is not None:
        if feed is None:
            feed, load = PanelFeed(client), LoadGenerator(client)
            closing += [load.stop, feed.close]
        backend = backends.in_process(client, block_map_cache=feed.block_map_cache)  # as app.py does
    closing.append(backend.close)
    sessions = Sessions()
    demo = build_app(backend, store, feed, load, host=host, sessions=sessions)
    served = Served(build_server(demo, client, sessions, host or "127.0.0.1", api_key), closing)
    return served, served.url


@contextmanager
def served_chat(model: str | None, db_path, **engine_options) -> Iterator[tuple[object, object, str]]:
    """An engine on `model` (LLMEngine's options) and a store at `db_path`, the app around them
    served: (engine client, store, URL); everything stopped afterwards."""
    from engine.runtime.thread_client import EngineClient
    from engine.runtime.llm_engine import LLMEngine
    from storage import Store

    client = EngineClient(LLMEngine(model, **engine_options))
    store = Store(db_path)
    server, url = serve(client, store)
    try:
        yield client, store, url
    finally:
        server.close()
        client.close()
        store.close()


@contextmanager
def served_with_load(model: str | None, db_path, num_gpu_blocks: int, num_cpu_blocks: int,
                     host: str | None = None, interval_s: float = 1.0) -> Iterator[tuple[object, object, str]]:
    """An engine on `model`, its panel feed and load generator, and the app around them served:
    (engine client, load generator, URL); everything stopped afterwards."""
    from engine.runtime.thread_client import EngineClient
    from engine.runtime.llm_engine import LLMEngine
    from storage import Store
    from ui.panel.feed import PanelFeed
    from ui.panel.load_generator import LoadGenerator

    client = EngineClient(LLMEngine(model, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks))
    feed, load = PanelFeed(client, interval_s=interval_s), LoadGenerator(client)
    server, url = serve(client, Store(db_path), feed, load, host=host)
    try:
        yield client, load, url
    finally:
        load.stop()
        server.close()
        feed.close()
        client.close()
