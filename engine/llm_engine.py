"""The engine: one object that owns the model, the scheduler and the cache, and turns
`step()` calls into streamed text. Single-threaded: the client runs it on its own thread."""
from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass

import torch

import kernels
from engine.core.block_map import BlockMap, BlockMapState
from engine.core.config import SchedulerConfig
from engine.core.request import FinishReason, Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.stats import SchedulerStats
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import Delta, EngineInfo, Usage
from engine.worker.decode_graphs import BUCKETS
from engine.worker.host_allocator import keep_freed_memory
from engine.worker.memory import num_device_blocks, num_host_blocks, resolve_device, resolve_dtype
from engine.worker import compiled_decode
from engine.worker.model_loader import DEFAULT_MODEL_NAME, load_hf_model, model_dtype
from engine.worker.model_runner import ModelRunner
from engine.worker.models.llama import LlamaModel

log = logging.getLogger(__name__)


@dataclass
class _SampleState:
    detokenizer: IncrementalDetokenizer
    emitted: int = 0  # output tokens already streamed


class LLMEngine:
    def __init__(self, model: str | None = None, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, *, block_size: int = 16,
                 num_gpu_blocks: int | None = None, num_cpu_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, kv_cache_memory_gib: float = 1.0,
                 swap_space: float = 1.0, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 preemption_mode: str = "auto", watermark: float = 0.01, cuda_graphs: bool | None = None,
                 compile_decode: bool | None = None) -> None:
        self.device = resolve_device(device)
        if self.device.type == "cpu":
            keep_freed_memory()  # before the weights: every step's activations then reuse one heap
        self.dtype = resolve_dtype(dtype, self.device, model_dtype(model) if dtype in (None, "auto") else None)
        hf_model, self.tokenizer = load_hf_model(model, self.dtype)
        self.model_name = model or os.environ.get("MODEL") or DEFAULT_MODEL_NAME
        self.model = LlamaModel(hf_model, self.dtype, self.device)
        hf_config = hf_model.config
        del hf_model
        # vLLM's option names (num_gpu_blocks, num_cpu_blocks) end here; inside, the pools are the
        # device pool and the host pool (a CPU-only engine's "GPU" pool lives in main memory).
        block_bytes = self.model.kv_block_bytes(block_size)
        device_blocks = num_gpu_blocks if num_gpu_blocks is not None else num_device_blocks(
            self.device, block_bytes, gpu_memory_utilization, kv_cache_memory_gib)
        host_blocks = num_cpu_blocks if num_cpu_blocks is not None else num_host_blocks(block_bytes, swap_space)
        model_limit = getattr(hf_config, "max_position_embeddings", None) or device_blocks * block_size
        window = getattr(hf_config, "sliding_window", None)
        if window and getattr(hf_config, "use_sliding_window", True):
            model_limit = min(model_limit, window)  # beyond the window the model attends differently
        if max_model_len is None:
            max_model_len = min(model_limit, device_blocks * block_size)
        elif max_model_len > model_limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds what the model supports ({model_limit})")
        self.config = SchedulerConfig(
            num_device_blocks=device_blocks, num_host_blocks=host_blocks, block_size=block_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            preemption_mode=preemption_mode, watermark=watermark)
        self.scheduler = Scheduler(self.config)
        if cuda_graphs is None:  # on a GPU by default; elsewhere only asked for (the tests do)
            cuda_graphs = self.device.type == "cuda"
        graph_batch = min(max_num_seqs, BUCKETS[-1]) if cuda_graphs else 0
        # A lone chat's decode step compiled ahead of time (CPU): built once per machine into a
        # cache, and loaded, in the background from the first step on; the eager path serves until
        # it is ready. None: $PAGEDCHAT_COMPILE.
        self.compiled = None
        if compile_decode is None:
            compile_decode = compiled_decode.enabled_by_default()
        unsupported = compiled_decode.supported(self.device, self.dtype)
        if compile_decode and unsupported:
            log.info("no compiled decode step: %s", unsupported)
        elif compile_decode:
            self.compiled = compiled_decode.CompiledDecode(model, self.dtype, self.model)
        self.runner = ModelRunner(self.model, device_blocks, host_blocks, block_size, max_model_len, graph_batch,
                                  self.compiled)
        self.eos_token_id = self.tokenizer.eos_token_id
        self._samples: dict[str, _SampleState] = {}
        # Shared messages are a few presets: tokenize each once, not on every request.
        self._shared_prefix_ids = functools.lru_cache(maxsize=64)(self._encode_shared)

    # ---- requests -----------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False).input_ids
        return list(prompt)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def add_request(self, request_id: str, prompt: str | list[int] | list[dict], params: SamplingParams, *,
                    cache_salt: str | None = None, num_shared_messages: int = 0) -> Request:
        """Queue a request: text, token ids, or chat messages (rendered with the chat template).
        With `cache_salt` (the user), its prefix-cache blocks can be hit only by requests with the
        same salt, except those wholly inside the first `num_shared_messages` messages (a preset
        system prompt everyone shares). Raises (queueing nothing) on an empty or too long prompt."""
        shared: list[int] = []
        if prompt and isinstance(prompt, list) and isinstance(prompt[0], dict):
            if cache_salt is not None and num_shared_messages > 0:
                head = tuple((m["role"], m["content"]) for m in prompt[:num_shared_messages])
                shared = self._shared_prefix_ids(head)
            prompt = self.apply_chat_template(prompt)
        token_ids = self.encode(prompt)
        # Only tokens the shared messages alone produce, and the full prompt starts with, are shared.
        num_shared = next((i for i, (a, b) in enumerate(zip(shared, token_ids)) if a != b),
                          min(len(shared), len(token_ids)))
        request = Request(request_id, token_ids, params, eos_token_id=self.eos_token_id, cache_salt=cache_salt,
                          num_shared_prefix_tokens=num_shared if cache_salt is not None else 0)
        self.scheduler.add_request(request)
        return request

    def _encode_shared(self, messages: tuple[tuple[str, str], ...]) -> list[int]:
        rendered = self.tokenizer.apply_chat_template([{"role": role, "content": content} for role, content in messages],
                                                      add_generation_prompt=False, tokenize=False)
        return self.encode(rendered)

    def abort_request(self, request_id: str) -> None:
        """Abort a request and all its samples, in any state; its blocks return at once."""
        for rid in [rid for rid in self._samples if rid == request_id or rid.startswith(request_id + "#")]:
            del self._samples[rid]
        self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[Delta]:
        out = self.scheduler.schedule()
        try:
            sampled = self.runner.execute(out)
        except Exception as error:  # a failed forward fails the requests in it, not the engine
            log.exception("model step failed")
            return self._fail([item.request for item in out.scheduled], error)
        if self.compiled is not None and not self.compiled.started:
            self.compiled.start()  # after a first step, which it must not delay
        finished = self.scheduler.update(out, sampled)
        done = {r.request_id: r for r in finished}
        deltas: list[Delta] = []
        for item in out.scheduled:
            if not item.num_samples:
                continue
            request = item.request
            logprobs = self.runner.logprobs.get(request.request_id)
            deltas += self._emit(request, logprobs[0] if logprobs else None)
            for index in range(1, item.num_samples):  # samples forked this step
                child_id = f"{request.request_id}#{index}"
                child = self.scheduler.requests.get(child_id) or done.get(child_id)
                if child is not None:
                    deltas += self._emit(child, logprobs[index] if logprobs else None)
        if not self.scheduler.has_unfinished():
            self.runner.idle()
        return deltas

    def _emit(self, request: Request, logprobs: dict[int, float] | None) -> list[Delta]:
        """The request's new output since it was last emitted: one sampled token per step."""
        state = self._samples.get(request.request_id)
        params = request.sampling_params
        if state is None:
            state = self._samples[request.request_id] = _SampleState(IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.stop, params.skip_special_tokens,
                params.include_stop_str_in_output))
        new_tokens = request.all_token_ids[request.num_prompt_tokens + state.emitted:]
        text = []
        for offset, token in enumerate(new_tokens, start=state.emitted + 1):  # offset: its output position
            text.append(state.detokenizer.add(token, check_stop=offset > params.min_tokens))
            if state.detokenizer.stopped:
                if not request.is_finished:
                    self.scheduler.finish_request(request.request_id, FinishReason.STOP)
                break
        state.emitted += len(new_tokens)
        group_id = request.parent_id or request.request_id
        lp = (logprobs,) if logprobs is not None else None
        if not request.is_finished:
            return [Delta(group_id, request.sample_index, "".join(text), tuple(new_tokens), logprobs=lp)]
        if not state.detokenizer.stopped:
            text.append(state.detokenizer.flush())
        del self._samples[request.request_id]
        return [Delta(group_id, request.sample_index, "".join(text), tuple(new_tokens),
                      finish_reason=request.finish_reason.value, usage=self._usage(request), logprobs=lp)]

    def _usage(self, request: Request) -> Usage:
        now = time.monotonic()
        first = request.first_token_time or now
        return Usage(prompt_tokens=request.num_prompt_tokens, cached_tokens=max(request.num_cached_tokens, 0),
                     completion_tokens=request.num_output_tokens, ttft_s=first - request.arrival_time,
                     duration_s=now - request.arrival_time)

    def _fail(self, requests: list[Request], error: Exception) -> list[Delta]:
        """End every sample of every request group in a failed step, each with a final error
        delta (the caller counts one final delta per sample), and return their blocks. Samples
        not forked yet, and forked ones not in the step, end too."""
        reason = f"{type(error).__name__}: {error}"
        groups = {r.parent_id or r.request_id: r for r in requests if not r.is_finished}
        deltas = []
        for group_id, request in groups.items():
            usage = self._usage(request)
            members = [r for r in self.scheduler.requests.values() if (r.parent_id or r.request_id) == group_id]
            indices = {r.sample_index for r in members}
            parent = self.scheduler.requests.get(group_id)
            if parent is not None and parent.sampling_params.n > 1 and not parent.forked:
                indices.update(range(1, parent.sampling_params.n))
            self.abort_request(group_id)  # the parent and every forked sample, in any state
            deltas += [Delta(group_id, index, "", (), finish_reason="error", usage=usage, error=reason)
                       for index in sorted(indices)]
        self.scheduler.refresh_stats()  # no update() will say so
        return deltas

    # ---- snapshots ----------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return self.scheduler.last_stats

    def block_map(self) -> BlockMap:
        return self.scheduler.block_map()

    def block_map_state(self) -> BlockMapState:
        return self.scheduler.block_map_state()

    def info(self) -> EngineInfo:
        cache = self.runner.kv_cache
        return EngineInfo(model=self.model_name, device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
                          block_size=self.config.block_size, num_device_blocks=self.config.num_device_blocks,
                          num_host_blocks=self.config.num_host_blocks, kernels=kernels.backend(cache),
                          max_model_len=self.config.max_model_len)
