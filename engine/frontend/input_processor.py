"""A prompt as the engine core takes it: text, token ids, or chat messages rendered with the
model's chat template, turned into token ids, with the length of the prefix every user shares."""
from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    token_ids: list[int]
    num_shared_prefix_tokens: int  # leading tokens that the first `num_shared_messages` messages alone produce


class InputProcessor:
    """Not thread-safe (a fast tokenizer is not): one caller at a time."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # Shared messages are a few presets: tokenize each once, not on every request.
        self._shared_prefix_ids = functools.lru_cache(maxsize=64)(self._encode_shared)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False).input_ids
        return list(prompt)

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
