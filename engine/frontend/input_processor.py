"""A prompt as the engine core takes it: text, token ids, or chat messages rendered with the
model's chat template, turned into token ids, with the length of the prefix every user shares.

Tokenizing costs time in proportion to the text (seconds for the megabytes an API body may
hold), so a prompt is first measured in characters: no token is longer than the vocabulary's
longest, so a text longer than `max_model_len` of those cannot fit, and is refused untokenized."""
from __future__ import annotations

import asyncio
import copy
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import PromptTooLongError, check_prompt_length
from engine.outputs import EngineInfo


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    token_ids: list[int]
    num_shared_prefix_tokens: int  # leading tokens that the first `num_shared_messages` messages alone produce


class InputProcessor:
    """Not thread-safe (a fast tokenizer is not): one caller at a time."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_token_chars = longest_token_chars(tokenizer)
        # Shared messages are a few presets: tokenize each once, not on every request.
        self._shared_prefix_ids = functools.lru_cache(maxsize=64)(self._encode_shared)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False).input_ids
        return list(prompt)

    def check_fits(self, prompt: str | list[int] | list[dict], max_model_len: int) -> None:
        """Refuse (PromptTooLongError) a text prompt too long in characters to fit `max_model_len`
        tokens. Cheap and safe from any thread: it never touches the tokenizer."""
        chars = prompt_chars(prompt)
        limit = max_model_len * self.max_token_chars
        if chars > limit:
            raise PromptTooLongError(f"the prompt has {chars} characters, more than max_model_len={max_model_len} "
                                     f"tokens can hold (a token here is at most {self.max_token_chars} characters: "
                                     f"the limit is {limit} characters)")

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def process(self, prompt: str | list[int] | list[dict], cache_salt: str | None = None,
                num_shared_messages: int = 0) -> ProcessedPrompt:
        """The prompt's token ids. With `cache_salt` and `num_shared_messages`, also how many
        leading tokens the first messages alone produce and the full prompt starts with: the
        blocks wholly inside them are shared by every user (engine/core/block_hash.py)."""
        shared: list[int] = []
        if prompt and isinstance(prompt, list) and isinstance(prompt[0], dict):
            if cache_salt is not None and num_shared_messages > 0:
                head = tuple((m["role"], m["content"]) for m in prompt[:num_shared_messages])
                shared = self._shared_prefix_ids(head)
            prompt = self.apply_chat_template(prompt)
        token_ids = self.encode(prompt)
        num_shared = next((i for i, (a, b) in enumerate(zip(shared, token_ids)) if a != b),
                          min(len(shared), len(token_ids)))
        return ProcessedPrompt(token_ids, num_shared if cache_salt is not None else 0)

    def _encode_shared(self, messages: tuple[tuple[str, str], ...]) -> list[int]:
        rendered = self.tokenizer.apply_chat_template([{"role": role, "content": content} for role, content in messages],
                                                      add_generation_prompt=False, tokenize=False)
        return self.encode(rendered)


class CallerSideInputs:
    """Prompts tokenized on the callers' side of an engine client, never on the thread that steps
    the engine (every stream would wait for a long text) nor on the event loop that streams them:
    a synchronous caller tokenizes on its own thread, an async one on a thread kept for it. One
    tokenizer copy, used by one thread at a time (a fast tokenizer is not thread-safe)."""

    def __init__(self, tokenizer, check_constraints: bool = True) -> None:
        """`check_constraints`: refuse a constraint that does not compile here, before it is sent
        (a caller in a process that holds torch already); otherwise the core's own check fails
        the request with InvalidStructuredOutputsError as its first output."""
        self._check_constraints = check_constraints
        self._inputs = InputProcessor(copy.deepcopy(tokenizer))
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-tokenizer")
        self._thread.submit(lambda: None)  # its thread starts now: a steady thread count from the first request

    def prepare(self, prompt: str | list[int] | list[dict], params: SamplingParams, options: dict,
                info: EngineInfo) -> ProcessedPrompt:
        """The prompt's token ids; raises for one that cannot fit (a long text before tokenizing)
        and for a constraint that does not compile."""
        self._inputs.check_fits(prompt, info.max_model_len)
        if self._check_constraints:
            check_structured_outputs(params)
        with self._lock:
            processed = self._inputs.process(prompt, options["cache_salt"], options["num_shared_messages"])
        check_prompt_length(len(processed.token_ids), info.max_model_len, info.num_device_blocks * info.block_size)
        return processed

    async def aprepare(self, prompt: str | list[int] | list[dict], params: SamplingParams, options: dict,
                       info: EngineInfo) -> ProcessedPrompt:
        """`prepare` on the kept thread; a caller cancelled meanwhile has taken nothing."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.prepare, prompt, params, options,
                                                                info)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def check_structured_outputs(params: SamplingParams) -> None:
    """Refuse (InvalidStructuredOutputsError, naming the fault) a constraint that does not compile,
    before anything is queued. The grammar library loads in this process with the first
    constrained request."""
    if params.structured_outputs is not None:
        from engine.worker.structured.grammar import grammar_of
        grammar_of(params.structured_outputs)


def longest_token_chars(tokenizer) -> int:
    """The most characters of text one token stands for, at most: the longest entry of the
    vocabulary (a byte-level BPE entry spells each byte as one character, and a text has no more
    characters than bytes; a byte-fallback entry such as `<0x41>` overcounts, which is safe)."""
    return max(len(token) for token in (*tokenizer.get_vocab(), *tokenizer.get_added_vocab()))


def prompt_chars(prompt: str | list[int] | list[dict]) -> int:
    """A text prompt's characters, or its messages' contents' (a chat template only adds to them);
    0 for token ids (their count is checked as it is)."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(m["content"]) for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str))
