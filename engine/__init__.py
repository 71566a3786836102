"""PagedChat's serving engine: paged KV cache, prefix caching, continuous batching, preemption.

The layers, each importing only those below it:
    engine/           the public surface: LLM, LLMEngine, EngineClient (the engine on a thread),
                      CoreProcessClient (the engine core in its own process), SamplingParams, outputs
    engine/api/       the OpenAI-compatible HTTP API and its Prometheus metrics (`python -m engine.serve`)
    engine/runtime/   the engine core, its process, LLMEngine and the clients that stream from it
    engine/frontend/  the serving side: prompts to token ids, token ids to streamed text, callers' streams
    engine/core/      CPU-side decisions: requests, scheduler, KV-cache manager, block pool (no torch)
    engine/worker/    the tensor side: model runner, models, sampler, decode graphs, loader, memory
    engine/devtools/  a simulated runner, the invariant checker and `python -m engine.devtools.simulate`
"""
from engine.core.block_map import BlockInfo, BlockMap, BlockState
from engine.core.config import SchedulerConfig
from engine.core.request import FinishReason, Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import PromptTooLongError, Scheduler
from engine.core.stats import SchedulerStats
from engine.outputs import CompletionOutput, Delta, EngineInfo, FirstToken, RequestOutput, Usage, decode_rate

# The model-facing API pulls in torch and transformers: imported only when asked for.
_LAZY = {"LLM": "engine.llm", "LLMEngine": "engine.runtime.llm_engine", "EngineClient": "engine.runtime.thread_client",
         "CoreProcessClient": "engine.runtime.process_client", "StreamingClient": "engine.runtime.streaming_client",
         "EngineBusyError": "engine.runtime.streaming_client", "EngineDeadError": "engine.runtime.streaming_client",
         "add_openai_api": "engine.api", "is_loopback": "engine.api.access",
         "made_here": "engine.api.access", "client_address": "engine.api.access",
         "block_map_from_kv_cache_json": "engine.api.kv_cache"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = ["BlockInfo", "BlockMap", "BlockState", "CompletionOutput", "CoreProcessClient", "Delta", "EngineBusyError", "EngineClient", "EngineDeadError", "EngineInfo",
           "FinishReason", "FirstToken", "LLM", "LLMEngine", "PromptTooLongError", "Request", "RequestOutput",
           "RequestStatus", "SamplingParams", "Scheduler", "SchedulerConfig", "SchedulerStats", "StreamingClient", "Usage", "add_openai_api",
           "block_map_from_kv_cache_json", "client_address", "decode_rate", "is_loopback", "made_here"]
