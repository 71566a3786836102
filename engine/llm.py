"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, params)` and `.chat(...)`."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from engine.core.block_map import BlockMap
from engine.core.sampling_params import SamplingParams
from engine.core.stats import SchedulerStats
from engine.runtime.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput

Prompt = str | Sequence[int]


class LLM:
    """Runs batches of prompts to completion on the engine.

    `LLM(model=None, device=None, **options)`: `model` is a hub id, a local folder or a GGUF file
    (a path, or on the hub as `user/repo:Q4_K_M`) of a Llama-family model (default: $MODEL, else
    the embedded SmolLM2-135M-Instruct); `device`
    defaults to CUDA when present; options are the engine's (`block_size`, `num_gpu_blocks`,
    `num_cpu_blocks`, `gpu_memory_utilization`, `swap_space`, `max_num_seqs`,
    `max_num_batched_tokens`, `max_model_len`, `enable_prefix_caching`, `preemption_mode`, `dtype`,
    `max_step_ms`: none by default here, where throughput is what counts).
    """

    def __init__(self, model: str | None = None, device: str | None = None, **options) -> None:
        # Offline, nobody watches tokens stream: no step-time target (engine/core/step_cost.py)
        # unless asked for; each step takes what the token budget allows.
        options.setdefault("max_step_ms", None)
        self.engine = LLMEngine(model, device, **options)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for each prompt (text, or a list of token ids); one output per prompt, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        param_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(param_list)} sampling params")
        outputs: dict[str, RequestOutput] = {}
        try:
            for prompt, p in zip(prompts, param_list):
                rid = str(next(self._ids))
                request = self.engine.add_request(rid, prompt, p)
                outputs[rid] = RequestOutput(rid, prompt if isinstance(prompt, str) else None,
                                             request.prompt_token_ids,
                                             [CompletionOutput(i) for i in range(p.n)])
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    outputs[delta.request_id].add(delta)
        except BaseException:
            for rid in outputs:  # an error or Ctrl-C leaves nothing behind in the engine
                self.engine.abort_request(rid)
            raise
        return list(outputs.values())

    def chat(self, conversations: list[dict] | Sequence[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate a reply to each conversation (a list of {"role", "content"} messages),
        rendered with the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.engine.apply_chat_template(list(c)) for c in conversations]
        return self.generate(prompts, params)

    def stats(self) -> SchedulerStats:
        return self.engine.stats()

    def block_map(self) -> BlockMap:
        return self.engine.block_map()
