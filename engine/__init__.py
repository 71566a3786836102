"""PagedChat's serving engine: paged KV cache, prefix caching, continuous batching, preemption."""
from engine.config import SchedulerConfig
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import PromptTooLongError, Scheduler


def __getattr__(name: str):
    # The model-facing API pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "EngineClient":
        from engine.client import EngineClient
        return EngineClient
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = ["EngineClient", "FinishReason", "LLM", "PromptTooLongError", "Request", "RequestStatus", "SamplingParams",
           "Scheduler",
           "SchedulerConfig"]
