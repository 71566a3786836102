"""The engine core's token outputs as streamed text: per sample, incremental detokenizing, stop
strings, and the usage figures of its final delta. This is the frontend's per-token work (vLLM
v1's output processor): next to the core on its thread in-process, or in the serving process when
the core runs in a process of its own. Not thread-safe: one caller at a time."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.core.request import sample_id
from engine.core.sampling_params import SamplingParams
from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.outputs import Delta, TokenOutput, Usage


@dataclass
class _Sample:
    detokenizer: IncrementalDetokenizer
    num_tokens: int = 0
    first_token_at: float | None = None


@dataclass
class _RequestState:
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    open: set[int]                                   # samples not finished yet
    samples: dict[int, _Sample] = field(default_factory=dict)
    num_cached_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival: float | None = None) -> None:
        self._requests[request_id] = _RequestState(prompt_token_ids, params, arrival or time.monotonic(),
                                                   set(range(params.n)))

    def abort(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def clear(self) -> None:
        self._requests.clear()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def process(self, outputs: list[TokenOutput]) -> tuple[list[Delta], list[str]]:
        """The deltas of one step's outputs, and the samples (core ids) a stop string ended, which
        the core must finish. Outputs of requests aborted meanwhile, or of samples already ended,
        are dropped."""
        deltas: list[Delta] = []
        stopped: list[str] = []
        now = time.monotonic()
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None or out.index not in state.open:
                continue
            params = state.params
            sample = state.samples.get(out.index)
            if sample is None:
                sample = state.samples[out.index] = _Sample(IncrementalDetokenizer(
                    self.tokenizer, state.prompt_token_ids, params.stop, params.skip_special_tokens,
                    params.include_stop_str_in_output))
            state.num_cached_tokens = out.num_cached_tokens
            detokenizer = sample.detokenizer
            text = []
            new_tokens = out.token_ids
            if out.finish_reason == "stop" and new_tokens and not params.include_stop_str_in_output:
                # The core ends a reply with "stop" on a stop token (eos, stop_token_ids, a grammar's
                # end): as in vLLM, its text is not the reply's, special or not.
                new_tokens = new_tokens[:-1]
            for offset, token in enumerate(new_tokens, start=sample.num_tokens + 1):  # its output position
                text.append(detokenizer.add(token, check_stop=offset > params.min_tokens))
                if detokenizer.stopped:
                    break
            sample.num_tokens += len(out.token_ids)
            if out.token_ids and sample.first_token_at is None:
                sample.first_token_at = now
            finish = out.finish_reason
            if detokenizer.stopped and finish is None:
                finish = "stop"
                stopped.append(sample_id(out.request_id, out.index))
            if finish is None:
                deltas.append(Delta(out.request_id, out.index, "".join(text), out.token_ids, logprobs=out.logprobs))
                continue
            if not detokenizer.stopped and finish != "error":
                text.append(detokenizer.flush())
            first = sample.first_token_at or now
            usage = Usage(prompt_tokens=len(state.prompt_token_ids), cached_tokens=state.num_cached_tokens,
                          completion_tokens=sample.num_tokens, ttft_s=first - state.arrival,
                          duration_s=now - state.arrival)
            deltas.append(Delta(out.request_id, out.index, "".join(text), out.token_ids, finish_reason=finish,
                                usage=usage, error=out.error, logprobs=out.logprobs))
            state.open.discard(out.index)
            del state.samples[out.index]
            if not state.open:
                del self._requests[out.request_id]
        return deltas, stopped
