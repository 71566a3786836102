"""The engine core: the model, the scheduler and the KV cache, stepping requests given as token
ids and handing back token ids (TokenOutput). No text passes through it: tokenizing is the
InputProcessor's and detokenizing the OutputProcessor's, so the core can run alone in its own
process (engine/runtime/core_process.py) while a frontend does that work. Single-threaded."""
from __future__ import annotations

import gc
import json
import logging
import os
import resource
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import cached_property

import torch

import kernels
from engine.core.block_hash import DEFAULT_HASH_ALGO
from engine.core.block_map import BlockMap, BlockMapState
from engine.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_STEP_MS, EngineConfig, SchedulerConfig
from engine.core.request import FinishReason, Request, is_sample_of, sample_id
from engine.core.sampling_params import InvalidStructuredOutputsError, SamplingParams, StructuredOutputsParams
from engine.core.scheduler import Scheduler
from engine.core.stats import SchedulerStats
from engine.outputs import EngineInfo, TokenOutput
from engine.worker.compiled import steps as compiled_steps
from engine.worker.cuda_graphs import BUCKETS
from engine.worker.host_allocator import keep_freed_memory, release_freed_memory
from engine.worker.memory import num_device_blocks, num_host_blocks, resolve_device, resolve_dtype
from engine.worker.loading.embedded_model import DEFAULT_MODEL_NAME
from engine.worker.loading.model_files import model_dtype
from engine.worker.loading.model_loader import eos_token_id, load_checkpoint, load_tokenizer
from engine.worker.loading.quantization_choice import describe_weights, resolve_quantization
from engine.worker.model_runner import ModelRunner
from engine.worker.models.llama import LlamaModel

log = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.005  # an idle engine's wait for a compiling grammar, between looks at its inbox


class EngineCore:
    def __init__(self, model: str | None = None, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, *, block_size: int = 16,
                 num_gpu_blocks: int | None = None, num_cpu_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, kv_cache_memory_gib: float = 1.0,
                 swap_space: float = 1.0, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO, preemption_mode: str = "auto", watermark: float = 0.01,
                 cuda_graphs: bool | None = None, compile_decode: bool | None = None,
                 max_step_ms: float | None = DEFAULT_MAX_STEP_MS, quantization: str = "auto") -> None:
        self.device = resolve_device(device)
        if self.device.type == "cpu":
            keep_freed_memory()  # before the weights: every step's activations then reuse one heap
        self.dtype = resolve_dtype(dtype, self.device, model_dtype(model) if dtype in (None, "auto") else None)
        # A GGUF file's quantized weights: kept quantized on a CPU (native) or dequantized at load.
        self.quantization, why = resolve_quantization(quantization, model, self.device, self.dtype)
        if self.quantization == "native" and dtype in (None, "auto"):
            # The native loops take and give fp32: bf16 activations (auto's pick on an AVX-512
            # BF16 CPU) would only round them, and leave out the native decode layers.
            self.dtype = torch.float32
        checkpoint = load_checkpoint(model, self.dtype, quantized=self.quantization == "native")
        self._model = model
        self.model_name = model or os.environ.get("MODEL") or DEFAULT_MODEL_NAME
        if compile_decode is None:
            compile_decode = compiled_steps.enabled_by_default()
        # Where compiled steps will run the decodes, no fp32 matrix is kept plain beside its packed
        # copy (they read the packed one): the load never holds both.
        compiles = (compile_decode and compiled_steps.supported(self.device, self.dtype) is None
                    and self.quantization != "native")
        self.model = LlamaModel(checkpoint, self.dtype, self.device, consume=True, plain_copies=not compiles)
        hf_config = checkpoint.config
        del checkpoint
        if self.device.type == "cpu":
            gc.collect()  # the GGUF reader's memory map, in reference cycles
        self.weights_info = describe_weights(model, self.quantization)
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
        scheduling = SchedulerConfig(
            num_device_blocks=device_blocks, num_host_blocks=host_blocks, block_size=block_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            prefix_caching_hash_algo=prefix_caching_hash_algo, preemption_mode=preemption_mode, watermark=watermark,
            max_step_ms=max_step_ms)
        self.scheduler = Scheduler(scheduling)
        if cuda_graphs is None:  # on a GPU by default; elsewhere only asked for (the tests do)
            cuda_graphs = self.device.type == "cuda"
        graph_batch = min(max_num_seqs, BUCKETS[-1]) if cuda_graphs else 0
        # The compiled steps (CPU: a lone chat's decode, the flat step): built once per machine into
        # a cache, and loaded, in the background from the first step on (a server loads built ones
        # before its first request); the eager path serves until they are ready. None: $PAGEDCHAT_COMPILE.
        self.compiled = None
        unsupported = compiled_steps.supported(self.device, self.dtype) or (
            "its graphs hold dense weights; the quantized ones run eagerly" if self.model.quantized else None)
        if not compile_decode:
            compiled_state = "off"
        elif unsupported:
            compiled_state = f"off: {unsupported}"
        else:
            self.compiled = compiled_steps.CompiledSteps(model, self.dtype, self.model)
            compiled_state = f"on ({', '.join(self.compiled.kinds)}): loaded, or built once per machine, in the background"
        self.runner = ModelRunner(self.model, device_blocks, host_blocks, block_size, scheduling.max_model_len,
                                  graph_batch, self.compiled, graph_tokens=max_num_batched_tokens if cuda_graphs else 0)
        self.config = EngineConfig(
            model=self.model_name, device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
            quantization=self.quantization, quantization_reason=why, weights=self.weights_info["description"],
            num_parameters=self.model.num_parameters, kernels=kernels.backend(self.runner.kv_cache),
            kv_block_bytes=block_bytes, scheduler=scheduling, step_paths=self.runner.step_paths(),
            compiled_steps=compiled_state)
        log.info("engine: %s", self.config.describe())
        self.eos_token_id = eos_token_id(model)
        self._emitted: dict[str, int] = {}  # request id -> output tokens already handed back
        # Structured output: the grammar library, loading or loaded (a Future of the runner's
        # GrammarMatchers), and the constrained requests not yet handed to it.
        self._grammar_library: Future | None = None
        self._unsent_grammars: dict[str, StructuredOutputsParams] = {}
        # $PAGEDCHAT_STEP_LOG: a JSON line per step (its shape, how it ran, how long it took), for
        # profiling a server under load (benchmarks/step_log.py reads it).
        log_path = os.environ.get("PAGEDCHAT_STEP_LOG")
        self._step_log = open(log_path, "a", buffering=1) if log_path else None
        if self.device.type == "cpu":
            # Once loading is done, not right after the weights: reading the tokenizer file for the
            # eos id leaves transients too (~90 MiB for a 151,936-token vocabulary).
            release_freed_memory()

    @cached_property
    def tokenizer(self):
        """The model's tokenizer, loaded when first asked for: an in-process engine (LLMEngine)
        needs it, a core process (engine/runtime/core_process.py) only the end-of-sequence id."""
        return load_tokenizer(self._model)

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams, *,
                    cache_salt: str | None = None, num_shared_prefix_tokens: int = 0) -> Request:
        """Queue a prompt of token ids. With `cache_salt` (the user), its prefix-cache blocks can be
        hit only by requests with the same salt, except those wholly inside its first
        `num_shared_prefix_tokens` tokens (a preset system prompt everyone shares). Raises
        (queueing nothing) on an empty or too long prompt."""
        request = Request(request_id, token_ids, params, eos_token_id=self.eos_token_id, cache_salt=cache_salt,
                          num_shared_prefix_tokens=num_shared_prefix_tokens if cache_salt is not None else 0)
        self.scheduler.add_request(request)
        if params.structured_outputs is not None:
            request.waiting_for_grammar = True
            self._unsent_grammars[request_id] = params.structured_outputs
            self._start_grammar_library()
        return request

    def _start_grammar_library(self) -> None:
        """With the first constrained request: the grammar library (xgrammar, ~0.7 s to import,
        ~45 MiB) and the constrained requests' matchers are made on a thread of their own, not on
        the loop, whose steps go on; an engine that never sees one never loads it."""
        if self._grammar_library is None:
            vocab_size = self.model.shape.vocab_size
            stops = [self.eos_token_id] if self.eos_token_id is not None else []
            loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-library")
            self._grammar_library = loader.submit(_grammar_matchers, lambda: self.tokenizer, vocab_size, stops)
            loader.shutdown(wait=False)

    def abort_request(self, request_id: str) -> None:
        """Abort a request and all its samples, in any state; its blocks return at once."""
        for rid in [rid for rid in self._emitted if is_sample_of(rid, request_id)]:
            del self._emitted[rid]
        self.scheduler.abort_request(request_id)
        self._idle_if_done()

    def finish_request(self, sample_id: str) -> None:
        """End one sample that the frontend found a stop string in (its text is complete)."""
        self._emitted.pop(sample_id, None)
        self.scheduler.finish_request(sample_id, FinishReason.STOP)
        self._idle_if_done()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        refused = self._take_grammars()
        started = time.perf_counter()
        usage = resource.getrusage(resource.RUSAGE_SELF) if self._step_log is not None else None
        out = self.scheduler.schedule()
        if not out.scheduled and self._unsent_grammars:  # the library loads: nothing else to run
            wait([self._grammar_library], timeout=GRAMMAR_WAIT_S)
        elif not out.scheduled and self.runner.grammars is not None and self.runner.grammars.pending:
            self.runner.grammars.wait(GRAMMAR_WAIT_S)  # nothing else to run: no spinning beside the compiler
        try:
            sampled = self.runner.execute(out)
        except Exception as error:  # a failed forward fails the requests in it, not the engine
            log.exception("model step failed")
            return refused + self._fail([item.request for item in out.scheduled], error)
        if self.compiled is not None and not self.compiled.started:
            self.compiled.start()  # after a first step, which it must not delay
        finished = self.scheduler.update(out, sampled)
        seconds = time.perf_counter() - started
        if self._step_log is not None:
            self._log_step(out, started, seconds, usage)
        self.scheduler.observe_step(out, seconds)
        done = {r.request_id: r for r in finished}
        outputs: list[TokenOutput] = []
        for item in out.scheduled:
            if not item.num_samples:
                continue
            request = item.request
            logprobs = self.runner.logprobs.get(request.request_id)
            outputs.append(self._output(request, logprobs[0] if logprobs else None))
            for index in range(1, item.num_samples):  # samples forked this step
                child_id = sample_id(request.request_id, index)
                child = self.scheduler.requests.get(child_id) or done.get(child_id)
                if child is not None:
                    outputs.append(self._output(child, logprobs[index] if logprobs else None))
        self._idle_if_done()
        return refused + outputs

    def _take_grammars(self) -> list[TokenOutput]:
        """Let the requests whose grammars are compiled be scheduled; fail those whose constraint
        does not compile (a core in its own process is where a broken one is found)."""
        if self._unsent_grammars and self._grammar_library.done():
            if self.runner.grammars is None:
                error = self._grammar_library.exception()
                if error is not None:  # no library: every constrained request fails, the others go on
                    return self._fail_constrained(f"the grammar library could not load: {error}")
                self.runner.grammars = self._grammar_library.result()
            for request_id, params in self._unsent_grammars.items():
                if request_id in self.scheduler.requests:
                    self.runner.grammars.add(request_id, params)
            self._unsent_grammars.clear()
        grammars = self.runner.grammars
        if grammars is None or not grammars.pending:
            return []
        ready, failed = grammars.poll()
        for request_id in ready:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                request.waiting_for_grammar = False
        outputs = []
        for request_id, reason in failed.items():
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                outputs += self._fail([request], InvalidStructuredOutputsError(reason))
        return outputs

    def _fail_constrained(self, reason: str) -> list[TokenOutput]:
        requests = [self.scheduler.requests[rid] for rid in self._unsent_grammars if rid in self.scheduler.requests]
        self._unsent_grammars.clear()
        return self._fail(requests, RuntimeError(reason)) if requests else []

    def _log_step(self, out, started: float, seconds: float, usage: resource.struct_rusage) -> None:
        stats = self.scheduler.last_stats
        # What the process did meanwhile, to tell a slow step's own work from waiting: CPU time
        # of all its threads (two busy threads: twice the wall time), page faults (memory taken
        # from the kernel again) and context switches (involuntary: a thread preempted).
        now = resource.getrusage(resource.RUSAGE_SELF)
        self._step_log.write(json.dumps({
            "cpu_ms": round(1000 * (now.ru_utime + now.ru_stime - usage.ru_utime - usage.ru_stime), 1),
            "faults": now.ru_minflt - usage.ru_minflt + now.ru_majflt - usage.ru_majflt,
            "switches": now.ru_nvcsw - usage.ru_nvcsw, "preempted": now.ru_nivcsw - usage.ru_nivcsw,
            "t": round(started, 6), "ms": round(1000 * seconds, 3), "path": self.runner.last_path,
            "rows": len(out.scheduled), "decodes": out.num_decode_tokens, "prefill": out.num_prefill_tokens,
            "predicted_ms": round(1000 * self.scheduler.predict_step(out), 3) if out.num_prefill_tokens else None,
            "target_ms": self.scheduler.config.max_step_ms,
            "running": stats.num_running, "waiting": stats.num_waiting}) + "\n")

    def _output(self, request: Request, logprobs: dict[int, float] | None) -> TokenOutput:
        """The request's tokens since its last output (one per step), and its end if it ended."""
        emitted = self._emitted.get(request.request_id, 0)
        new_tokens = tuple(request.all_token_ids[request.num_prompt_tokens + emitted:])
        finish = request.finish_reason.value if request.is_finished else None
        if finish is None:
            self._emitted[request.request_id] = emitted + len(new_tokens)
        else:
            self._emitted.pop(request.request_id, None)
        return TokenOutput(request.parent_id or request.request_id, request.sample_index, new_tokens, finish,
                           logprobs=(logprobs,) if logprobs is not None else None,
                           num_cached_tokens=max(request.num_cached_tokens, 0))

    def _fail(self, requests: list[Request], error: Exception) -> list[TokenOutput]:
        """End every sample of every request group in a failed step with an error output (the
        frontend counts one final output per sample), and return their blocks. Samples not forked
        yet, and forked ones not in the step, end too."""
        reason = f"{type(error).__name__}: {error}"
        groups = {r.parent_id or r.request_id: r for r in requests if not r.is_finished}
        outputs = []
        for group_id in groups:
            members = [r for r in self.scheduler.requests.values() if (r.parent_id or r.request_id) == group_id]
            indices = {r.sample_index for r in members}
            parent = self.scheduler.requests.get(group_id)
            if parent is not None and parent.sampling_params.n > 1 and not parent.forked:
                indices.update(range(1, parent.sampling_params.n))
            self.abort_request(group_id)  # the parent and every forked sample, in any state
            outputs += [TokenOutput(group_id, index, (), "error", error=reason) for index in sorted(indices)]
        self.scheduler.refresh_stats()  # no update() will say so
        return outputs

    def _idle_if_done(self) -> None:
        if not self.scheduler.has_unfinished():
            self.runner.idle()

    # ---- snapshots ----------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return self.scheduler.last_stats

    def block_map(self) -> BlockMap:
        return self.scheduler.block_map()

    def block_map_state(self) -> BlockMapState:
        return self.scheduler.block_map_state()

    def load_compiled_steps_if_built(self, timeout_s: float = 300.0) -> None:
        """For a server, before it takes requests: load the compiled steps now when they are built
        already. Loading a package holds the GIL for seconds; started by the first step, it
        stalled the first chats' streams by up to 2 s. A build (minutes) still starts with the
        first step, the eager path serving meanwhile. The matrices' plain copies (if any were kept)
        go first: the compiled steps read the packed ones."""
        if self.compiled is not None and not self.compiled.started and self.compiled.all_built():
            self.runner.release_plain_copies()
            self.compiled.wait(timeout_s)

    def compiled_pending(self) -> bool:
        """Whether a compiled decode step is still being built or loaded (the eager path serves meanwhile)."""
        return self.compiled is not None and not self.compiled.settled

    def info(self) -> EngineInfo:
        cache = self.runner.kv_cache
        config, scheduling = self.config, self.config.scheduler
        return EngineInfo(model=config.model, device=config.device, dtype=config.dtype, block_size=scheduling.block_size,
                          num_device_blocks=scheduling.num_device_blocks, num_host_blocks=scheduling.num_host_blocks,
                          kernels=kernels.backend(cache), max_model_len=scheduling.max_model_len,
                          weights=self.weights_info["label"], config=config)


def _grammar_matchers(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """The runner's GrammarMatchers, made on the grammar-library thread: the library is imported
    here, off the engine loop."""
    from engine.worker.structured.grammar_compiler import GrammarCompiler
    from engine.worker.structured.grammar_matchers import GrammarMatchers
    return GrammarMatchers(GrammarCompiler(tokenizer, vocab_size, stop_token_ids), vocab_size)
