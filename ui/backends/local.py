"""The in-process engine as a router endpoint: replies through its EngineClient, and its state
in the same terms as a remote server's /metrics."""
from __future__ import annotations

import time

from engine import BlockMap, Delta, EngineDeadError, EngineInfo, SamplingParams, StreamingClient
from ui.backends.backend import BackendError, Deltas, Probe
from ui.backends.block_map_cache import BlockMapCache
from ui.backends.figures import MetricsSnapshot

LOCAL_NAME = "in-process"


class LocalEndpoint:
    url = None

    def __init__(self, client: StreamingClient, name: str = LOCAL_NAME,
                 block_map_cache: BlockMapCache[BlockMap] | None = None) -> None:
        """`block_map_cache`: the engine's, where something else shows its map too (the panel's
        feed); by default one of its own."""
        self.client = client
        self.name = name
        self.block_map_cache = block_map_cache or BlockMapCache(client.block_map)
        # Counted on the engine loop thread, read by the monitor: floats, so a torn read cannot happen.
        self._generation_tokens = 0.0
        self._ttft_sum = 0.0
        self._ttft_count = 0.0
        client.add_listener(self._on_delta)

    async def start(self, messages: list[dict], params: SamplingParams, *, request_id: str,
                    user: str | None, num_shared_messages: int) -> Deltas:
        try:  # the client's stream aborts the request when closed, even unread
            return await self.client.asubmit(messages, params, request_id=request_id, cache_salt=user,
                                             num_shared_messages=num_shared_messages)
        except EngineDeadError as error:  # stopped, or its core restarting: as a server that is down
            raise BackendError(str(error)) from None

    def probe(self) -> Probe:
        info = self.client.info()
        if self.client.closed:
            return Probe(up=False, problem=self.client.closed_reason() or "the engine has stopped", model=info.label)
        stats = self.client.stats()
        metrics = MetricsSnapshot(
            timestamp=time.time(), flavor="pagedchat",
            kv_usage=stats.device_blocks_used / max(stats.device_blocks_total, 1),
            running=stats.num_running, waiting=stats.num_waiting, swapped=stats.num_swapped,
            prefix_queries=stats.prefix_cache_queries, prefix_hits=stats.prefix_cache_hits,
            preemptions=stats.num_preemptions_swap + stats.num_preemptions_recompute,
            generation_tokens=self._generation_tokens, ttft_sum=self._ttft_sum, ttft_count=self._ttft_count)
        return Probe(up=True, model=info.label, max_model_len=info.max_model_len, metrics=metrics)

    def block_map(self) -> tuple[BlockMap, EngineInfo] | None:
        return self.block_map_cache.get(), self.client.info()

    def _on_delta(self, delta: Delta, now: float) -> None:
        self._generation_tokens += len(delta.token_ids)
        if delta.usage is not None and delta.index == 0 and delta.usage.completion_tokens:
            self._ttft_sum += delta.usage.ttft_s
            self._ttft_count += 1
