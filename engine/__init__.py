"""PagedChat's serving engine: paged KV cache, prefix caching, continuous batching, preemption."""
from engine.config import SchedulerConfig
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import PromptTooLongError, Scheduler

__all__ = ["FinishReason", "PromptTooLongError", "Request", "RequestStatus", "SamplingParams", "Scheduler",
           "SchedulerConfig"]
