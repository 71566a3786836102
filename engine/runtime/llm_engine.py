"""The engine in one object on one thread: prompts in, streamed text out. It joins the three
parts that a served engine splits across processes (engine/runtime/process_client.py): the InputProcessor
(prompts to token ids), the EngineCore (the model, the scheduler and the KV cache) and the
OutputProcessor (token ids to text). The offline `LLM` and the in-process EngineClient run it."""
from __future__ import annotations

import torch

from engine.core.block_map import BlockMap, BlockMapState
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.stats import SchedulerStats
from engine.runtime.engine_core import EngineCore
from engine.frontend.input_processor import InputProcessor, ProcessedPrompt, check_structured_outputs
from engine.frontend.output_processor import OutputProcessor
from engine.outputs import Delta, EngineInfo
from engine.worker.host_allocator import release_freed_memory


class LLMEngine:
    def __init__(self, model: str | None = None, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, **options) -> None:
        """`options`: EngineCore's (block_size, num_gpu_blocks, num_cpu_blocks, max_num_seqs,
        max_num_batched_tokens, max_model_len, max_step_ms, enable_prefix_caching, ...)."""
        self.core = EngineCore(model, device, dtype, **options)
        self.tokenizer = self.core.tokenizer
        self.inputs = InputProcessor(self.tokenizer)
        self.outputs = OutputProcessor(self.tokenizer)
        if self.core.device.type == "cpu":
            # as the core does once loaded: the tokenizer's load and the processors' tables leave
            # transients too (~80 MiB for a 151,936-token vocabulary)
            release_freed_memory()

    # The core's parts, for tools and tests that look inside.
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def runner(self):
        return self.core.runner

    @property
    def compiled(self):
        return self.core.compiled

    @property
    def config(self):
        return self.core.config

    @property
    def model(self):
        return self.core.model

    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def device(self) -> torch.device:
        return self.core.device

    @property
    def dtype(self) -> torch.dtype:
        return self.core.dtype

    @property
    def eos_token_id(self) -> int | None:
        return self.core.eos_token_id

    # ---- requests -----------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        return self.inputs.encode(prompt)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.inputs.apply_chat_template(messages)

    def add_request(self, request_id: str, prompt: str | list[int] | list[dict], params: SamplingParams, *,
                    cache_salt: str | None = None, num_shared_messages: int = 0) -> Request:
        """Queue a request: text, token ids, or chat messages (rendered with the chat template).
        With `cache_salt` (the user), its prefix-cache blocks can be hit only by requests with the
        same salt, except those wholly inside the first `num_shared_messages` messages (a preset
        system prompt everyone shares). Raises (queueing nothing) on an empty or too long prompt
        and on a constraint that does not compile."""
        check_structured_outputs(params)
        return self.add_processed(request_id, self.inputs.process(prompt, cache_salt, num_shared_messages), params,
                                  cache_salt=cache_salt)

    def add_processed(self, request_id: str, processed: ProcessedPrompt, params: SamplingParams, *,
                      cache_salt: str | None = None) -> Request:
        """`add_request` for a prompt already tokenized (by an engine client, off the step loop)."""
        request = self.core.add_request(request_id, processed.token_ids, params, cache_salt=cache_salt,
                                        num_shared_prefix_tokens=processed.num_shared_prefix_tokens)
        self.outputs.add_request(request_id, processed.token_ids, params)
        return request

    def abort_request(self, request_id: str) -> None:
        """Abort a request and all its samples, in any state; its blocks return at once."""
        self.outputs.abort(request_id)
        self.core.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[Delta]:
        deltas, stopped = self.outputs.process(self.core.step())
        for sample_id in stopped:  # a stop string ended it: its blocks return now
            self.core.finish_request(sample_id)
        return deltas

    # ---- snapshots ----------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return self.core.stats()

    def block_map(self) -> BlockMap:
        return self.core.block_map()

    def block_map_state(self) -> BlockMapState:
        return self.core.block_map_state()

    def compiled_pending(self) -> bool:
        return self.core.compiled_pending()

    def info(self) -> EngineInfo:
        return self.core.info()
