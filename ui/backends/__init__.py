"""What writes the chat's replies: the in-process engine or remote OpenAI-compatible servers,
behind one small interface (`ChatBackend`, ui/backends/backend.py), and what the panel reads of
them. Both constructors start a monitor; `close()` the router to stop it."""
from __future__ import annotations

from collections.abc import Sequence

from engine import BlockMap, StreamingClient
from ui.backends.block_map_cache import BlockMapCache
from ui.backends.local import LocalEndpoint
from ui.backends.monitor import Monitor
from ui.backends.remote import RemoteEndpoint
from ui.backends.router import Router


def in_process(client: StreamingClient, interval_s: float = 1.0,
               block_map_cache: BlockMapCache[BlockMap] | None = None) -> Router:
    """The engine in this process, alone. `block_map_cache`: the panel feed's, so the panel and
    the chats read one block map per interval (by default the backend fetches its own)."""
    cache = block_map_cache or BlockMapCache(client.block_map, interval_s)
    return Router(Monitor([LocalEndpoint(client, block_map_cache=cache)], interval_s).start())


def remote(urls: Sequence[str], api_keys: Sequence[str] = (), interval_s: float = 1.0) -> Router:
    """OpenAI-compatible servers; `api_keys` in the same order (one key serves them all)."""
    if not urls:
        raise ValueError("remote backends need at least one URL")
    if len(api_keys) not in (0, 1, len(urls)):
        raise ValueError(f"give one API key for all backends or one per backend: {len(urls)} backends, "
                         f"{len(api_keys)} keys")
    keys = list(api_keys) * len(urls) if len(api_keys) == 1 else list(api_keys) or [None] * len(urls)
    endpoints = [RemoteEndpoint(url, key or None, map_interval_s=interval_s) for url, key in zip(urls, keys)]
    return Router(Monitor(endpoints, interval_s).start())
