"""The decoder's sizes and constants, read once from its config (a transformers config, or config.json's keys)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderShape:
    num_layers: int
    hidden_size: int
    num_heads: int      # query heads
    num_kv_heads: int   # K/V heads, each shared by `group` query heads
    head_dim: int
    vocab_size: int
    eps: float          # RMSNorm's

    @classmethod
    def of(cls, config) -> DecoderShape:
        return cls(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                   num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                   vocab_size=config.vocab_size, eps=config.rms_norm_eps)

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.num_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        """What attention multiplies q·k by."""
        return self.head_dim ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
