"""Softmax attention over keys that come in parts, merged as one softmax.

The compiled decode steps read a query's keys from several places (the K/V buffer, or the blocks
every sequence shares and a sequence's own blocks, and always the new token's own K/V, computed
in the step and not yet stored anywhere). Each place is scored and its values read in that path's
own way; what they share is the merge: with m the largest score of any part,

    attention = Σ_parts Σ_keys exp(score - m) · value  /  Σ_parts Σ_keys exp(score - m)

which is softmax over all parts' keys as one, without concatenating them (a concatenation is a
loop and a buffer of its own) and dividing once per output rather than once per key. The eager
forward's attention is kernels.paged_attention, which reads the paged cache itself.
"""
from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

import torch

# A part: its scores `[..., keys]` (fp32, scaled, -inf where a key must not count) and `weigh`,
# which takes that part's unnormalised weights `[..., keys]` and returns Σ weight · value `[..., dim]`.
KeyPart = tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]


def attend(parts: Sequence[KeyPart]) -> torch.Tensor:
    """Softmax attention over every part's keys together: `[..., dim]`, fp32. Every row needs a
    finite score in some part (the new token's own key always is)."""
    top = functools.reduce(torch.maximum, [scores.amax(-1, keepdim=True) for scores, _ in parts])
    weights = [torch.exp(scores - top) for scores, _ in parts]
    total = functools.reduce(operator.add, [w.sum(-1, keepdim=True) for w in weights])
    return functools.reduce(operator.add, [weigh(w) for (_, weigh), w in zip(parts, weights)]) / total
