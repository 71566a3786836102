"""The engine's settings: what it runs (EngineConfig, decided once at start) and how it schedules
(SchedulerConfig, checked at construction). Plain data: the core, the worker, the panel and the
HTTP API all read them, and none of them needs torch to.

Two pools, one vocabulary inside the engine: the *device* pool (where attention reads K/V: the
GPU, or main memory on a CPU-only machine) and the *host* pool (main memory that preempted
requests are swapped to). vLLM's option names for them, `num_gpu_blocks` and `num_cpu_blocks`,
are kept only at the API edge (`LLM`, `LLMEngine`, the app's flags).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.core.block_hash import DEFAULT_HASH_ALGO, HASH_ALGOS

PREEMPTION_MODES = ("swap", "recompute", "auto")
# The engine's step-time target unless told otherwise: a streaming reply's tokens come at most
# about this far apart while another chat's prompt is computed (see engine/core/step_cost.py).
# Reading speed is ~5 words (~7 tokens) a second; an online service's usual bar for a good stream
# is 200 ms between tokens at p99, which noise on a busy machine must stay under.
DEFAULT_MAX_STEP_MS = 120.0
# The most tokens one step computes (vLLM's max_num_batched_tokens): a prompt longer than what is
# left of it goes on in chunks over the next steps.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class SchedulerConfig:
    num_device_blocks: int              # device pool size in blocks
    num_host_blocks: int = 0            # host (swap) pool size in blocks
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None    # None: as long as the device pool can hold
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO  # "sha256" where users may attack each other (block_hash.py)
    preemption_mode: str = "auto"
    watermark: float = 0.01             # share of device blocks kept free when admitting work
    # Stall-free batching: a step's prompt tokens are limited to what the step's decodes leave
    # of this many milliseconds (engine/core/step_cost.py); None: the token budget alone.
    max_step_ms: float | None = None
    min_prompt_chunk: int = 8           # prompt tokens a step may always compute, so prompts progress
                                        # (and all it computes beside decodes until the cost model has data)

    def __post_init__(self) -> None:
        for name in ("num_device_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.num_host_blocks, int) or self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be a non-negative integer, got {self.num_host_blocks!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (the kernels tile by it), got {self.block_size}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                             f"got {self.prefix_caching_hash_algo!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_step_ms is not None and not self.max_step_ms > 0:
            raise ValueError(f"max_step_ms must be positive (or None for no step-time target), got {self.max_step_ms!r}")
        if not isinstance(self.min_prompt_chunk, int) or self.min_prompt_chunk < 1:
            raise ValueError(f"min_prompt_chunk must be a positive integer, got {self.min_prompt_chunk!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        capacity = self.num_device_blocks * self.block_size
        if self.max_model_len is None:
            self.max_model_len = capacity
        elif self.max_model_len < 1 or self.max_model_len > capacity:
            # One request alone must always be able to finish, or preemption could never help it.
            raise ValueError(
                f"max_model_len={self.max_model_len} must be between 1 and what the device KV pool "
                f"holds: {self.num_device_blocks} blocks x {self.block_size} tokens = {capacity} tokens")

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_device_blocks)


@dataclass(frozen=True)
class EngineConfig:
    """What the engine runs and how, decided once at start from its options, the model and the
    machine (engine_core.py builds it), logged then and shown by `python -m engine.serve
    --print-config` and in /v1/kv_cache. Fixed for the engine's life."""
    model: str           # the name it serves: a path, a hub id, or the embedded model's name
    device: str          # "cpu", "cuda:0"
    dtype: str           # of activations, the KV cache and dense weights: "float32", "bfloat16", "float16"
    quantization: str    # "dequantize" (dense weights in `dtype`) or "native" (a GGUF file's, kept quantized)
    quantization_reason: str
    weights: str         # what the weights are, as people read them
    num_parameters: int
    kernels: str         # attention: "triton" (GPU kernels) or "torch"
    kv_block_bytes: int  # one block of every layer's K and V
    scheduler: SchedulerConfig  # pools, lengths, batch limits, prefix caching, preemption, step target
    # The ways a step may run here, in the order the runner tries them (engine/worker/model_runner.py):
    # "graphs" (captured CUDA graphs of decodes), "graphs-flat" (of prompt chunks beside decodes,
    # flattened), "lone" (one chat's compiled decode), "flat"
    # (decodes and prompt chunks, compiled), "eager-native" (eager, its attention in native code),
    # "native" (a quantized model's layers in native code), "eager".
    step_paths: tuple[str, ...]
    compiled_steps: str  # the compiled steps' state at start: "built", "building in the background", or why not

    def as_dict(self) -> dict:
        """JSON-ready, the scheduler's settings nested under "scheduler"."""
        return asdict(self) | {"step_paths": list(self.step_paths)}

    def describe(self) -> str:
        """One line a log or a reader takes in at a glance."""
        s = self.scheduler
        return (f"{self.model} on {self.device} in {self.dtype}; weights: {self.weights} ({self.quantization_reason}); "
                f"KV pools: {s.num_device_blocks} device + {s.num_host_blocks} host blocks of {s.block_size} tokens "
                f"({self.kv_block_bytes} bytes each); max_model_len {s.max_model_len}, {s.max_num_seqs} sequences, "
                f"{s.max_num_batched_tokens} tokens a step, step target {s.max_step_ms} ms; "
                f"steps: {', '.join(self.step_paths)}; compiled steps: {self.compiled_steps}; kernels: {self.kernels}")
