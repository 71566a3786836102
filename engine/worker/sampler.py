"""Sampling: one batch of next-token logits in, sampled token ids out, one row per request.

Each row follows Hugging Face transformers and vLLM: tokens banned this step (stop tokens before
`min_tokens`) are masked, OpenAI's logit_bias added, its presence and frequency penalties
subtracted (for the tokens of the output so far), the repetition penalty applied (prompt and
output), then either argmax (temperature 0) or temperature, min-p, top-k, top-p and a draw from
the softmax. The arithmetic is batched over the rows, in fp32 whatever the logits' dtype; the
per-row work is reading a row's token ids and drawing its uniform numbers from its own
generator. A row's tokens depend on its own logits, parameters and generator alone, so a seeded
request samples the same tokens whatever else is in the batch, in whatever order. A constrained
request's logits come here already masked to what its grammar allows (engine/worker/structured/).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.sampling_params import SamplingParams

# Top-p looks for a row's nucleus among its largest logits, in windows of these sizes before the
# whole row: sorting all of a 50k vocabulary costs far more on a CPU than a top-k of a few hundred.
TOP_P_WINDOWS = (256, 4096)


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams                 # from engine.sampling_params
    token_ids: Sequence[int]               # the request's prompt + output so far (for repetition penalty)
    generator: torch.Generator | None      # per-request generator, seeded from params.seed; None = torch's default RNG
    num_samples: int = 1                   # draw this many tokens from this row (n > 1 forking); >= 1
    num_prompt_tokens: int = 0             # token_ids[num_prompt_tokens:] is the output so far (for the penalties)
    banned_token_ids: frozenset[int] = frozenset()  # never sampled this step (stop tokens before min_tokens)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with `seed`, or None when seed is None."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample(logits: torch.Tensor, rows: list[SamplingRow], known_argmax: torch.Tensor | None = None) -> list[list[int]]:
    """logits: float tensor [len(rows), vocab] (fp32, fp16 or bf16; may be on CUDA). Returns, per row,
    `num_samples` token ids (python ints). `known_argmax` `[len(rows)]`: the logits' argmax where
    the caller has it already (the compiled decode step computes it with them); greedy rows with
    nothing to ban or penalize take it instead of another pass over the vocabulary."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
    if any(row.num_samples < 1 for row in rows):
        raise ValueError("num_samples must be at least 1")
    logits = logits.float()
    adjusted = any(_adjusts(row) for row in rows)
    if adjusted:
        logits = logits.clone()  # the caller's logits (for logprobs) stay as the model gave them
        _ban_(logits, rows)
        _apply_logit_bias_(logits, rows)
        _apply_output_penalties_(logits, rows)
    results: list[list[int]] = [[] for _ in rows]
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    if greedy:
        greedy_rows = [rows[i] for i in greedy]
        penalizes = any(_penalizes(row) for row in greedy_rows)
        if known_argmax is not None and not adjusted and not penalizes:
            best = _take(known_argmax, greedy)
        else:
            penalized = _take(logits, greedy, copy=penalizes)
            _apply_repetition_penalty_(penalized, greedy_rows)
            best = argmax(penalized)
        for i, token in zip(greedy, best.tolist()):
            results[i] = [token] * rows[i].num_samples
    random = [i for i, row in enumerate(rows) if not row.params.greedy]
    if random:
        for i, tokens in zip(random, _sample_random(_take(logits, random), [rows[i] for i in random])):
            results[i] = tokens
    return results


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of a `[rows, vocab]` tensor, the same index on ties (the first)
    and NaN (the first NaN). In two passes on a CPU: torch's arg-reduction over a 49k vocabulary is
    not vectorised (~0.5 ms for 32 rows on a 2-core EPYC, over 1% of a decode step), its
    max-reduction is; the largest value of each chunk of up to 1,024 first, then the winning
    chunk's argmax (~0.08 ms)."""
    rows, vocab = logits.shape
    chunk = math.gcd(vocab, 1024)
    if logits.device.type != "cpu" or chunk < 128 or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    chunks = logits.view(rows, vocab // chunk, chunk)
    best = chunks.amax(dim=-1).argmax(dim=-1)  # the first chunk holding the row's maximum
    return best * chunk + chunks[torch.arange(rows), best].argmax(dim=-1)


def _adjusts(row: SamplingRow) -> bool:
    return bool(row.banned_token_ids) or bool(row.params.logit_bias) or _penalizes_output(row)


def _penalizes_output(row: SamplingRow) -> bool:
    params = row.params
    return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0) and len(row.token_ids) > row.num_prompt_tokens


def _ban_(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        banned = [t for t in row.banned_token_ids if t < vocab]
        if banned:
            logits[i, banned] = float("-inf")


def _apply_logit_bias_(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            pairs = [(t, b) for t, b in row.params.logit_bias.items() if t < vocab]
            if pairs:
                ids, biases = zip(*pairs)
                logits[i, list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)


def _apply_output_penalties_(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place, OpenAI's rule (as vLLM applies it, before the temperature): for each token of the
    output so far, subtract frequency_penalty per occurrence and presence_penalty once."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        if not _penalizes_output(row):
            continue
        output = torch.as_tensor(np.asarray(row.token_ids[row.num_prompt_tokens:], dtype=np.int64))
        counts = torch.bincount(output[output < vocab], minlength=vocab).to(logits.device, torch.float32)
        logits[i] -= row.params.frequency_penalty * counts + row.params.presence_penalty * (counts > 0)


def _penalizes(row: SamplingRow) -> bool:
    return row.params.repetition_penalty != 1.0 and len(row.token_ids) > 0


def _apply_repetition_penalty_(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place, HF's rule for every token a row has seen: a negative logit is multiplied by the
    penalty, any other divided by it."""
    penalized = [(i, row) for i, row in enumerate(rows) if _penalizes(row)]
    if not penalized:
        return
    ids = [torch.from_numpy(np.asarray(row.token_ids, dtype=np.int64)).flatten() for _, row in penalized]
    lengths = torch.tensor([len(t) for t in ids])
    row_idx = torch.tensor([i for i, _ in penalized]).repeat_interleave(lengths)
    penalty = torch.tensor([row.params.repetition_penalty for _, row in penalized]).repeat_interleave(lengths)
    token_idx = torch.cat(ids)
    keep = token_idx < logits.shape[1]  # ids past the logits' vocabulary can't be sampled; HF skips them too
    row_idx, token_idx, penalty = (t[keep].to(logits.device) for t in (row_idx, token_idx, penalty))
    # A token seen twice appears twice in the index; both writes carry the same value.
    seen = logits[row_idx, token_idx]
    logits[row_idx, token_idx] = torch.where(seen < 0, seen * penalty, seen / penalty)


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> list[list[int]]:
    """Temperature, top-k, top-p, softmax, then each row's draws. `logits` is not modified."""
    device = logits.device
    temperature = torch.tensor([row.params.temperature for row in rows], dtype=torch.float32, device=device)
    scaled = logits / temperature.unsqueeze(1)  # a new tensor: what follows may work in place
    # The penalty scales a logit by a positive factor chosen by its sign, which dividing by a positive
    # temperature keeps, so applying it after the temperature gives HF's penalty-first result.
    _apply_repetition_penalty_(scaled, rows)
    min_p = [i for i, row in enumerate(rows) if row.params.min_p > 0.0]
    if min_p:
        p = torch.tensor([rows[i].params.min_p for i in min_p], dtype=torch.float32, device=device)
        # log(min_p * max prob) = log(min_p) + the largest logit, without a softmax.
        _update_rows(scaled, min_p, lambda x: _mask_below(x, x.max(dim=-1, keepdim=True).values + p.log().unsqueeze(1)))
    vocab = scaled.shape[1]
    top_k = [i for i, row in enumerate(rows) if 0 < row.params.top_k < vocab]
    if top_k:
        k = torch.tensor([rows[i].params.top_k for i in top_k], device=device)
        _update_rows(scaled, top_k, lambda x: _mask_below(x, _top_k_thresholds(x, k)))
    top_p = [i for i, row in enumerate(rows) if row.params.top_p < 1.0]
    if top_p:
        p = torch.tensor([rows[i].params.top_p for i in top_p], dtype=torch.float32, device=device)
        _update_rows(scaled, top_p, lambda x: _mask_below(x, _top_p_thresholds(x, p)))
    return _draw(scaled.softmax(dim=-1), rows)


def _top_k_thresholds(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Each row's k-th largest logit, [rows, 1]."""
    values = logits.topk(int(k.max()), dim=-1).values
    return values.gather(1, (k - 1).unsqueeze(1))


def _top_p_thresholds(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Each row's smallest logit inside its nucleus, [rows, 1]: HF's rule, a token stays while the
    probability of the tokens above it is below p, so the top token always stays."""
    vocab = logits.shape[1]
    log_total = logits.logsumexp(dim=-1, keepdim=True)
    thresholds = torch.empty_like(log_total)
    todo = torch.arange(logits.shape[0], device=logits.device)
    for window in (*(w for w in TOP_P_WINDOWS if w < vocab), vocab):
        values = logits[todo].topk(window, dim=-1).values  # descending
        cumulative = (values - log_total[todo]).exp().cumsum(dim=-1)
        row_p = p[todo].unsqueeze(1)
        # The nucleus fits in the window once the window's mass reaches p, or the window already
        # holds every token left after top-k (the rest are -inf).
        found = (cumulative[:, -1:] >= row_p).squeeze(1) | (values[:, -1] == float("-inf"))
        if window == vocab:
            found[:] = True
        last = (cumulative < row_p).sum(dim=-1, keepdim=True).clamp_max(window - 1)
        thresholds[todo[found]] = values.gather(1, last)[found]
        todo = todo[~found]
        if not todo.numel():
            break
    return thresholds


def _mask_below(logits: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    # Compares values, not ranks, so a token tied with the last kept one stays too (as in HF's top-k).
    return logits.masked_fill_(logits < thresholds, float("-inf"))


def _draw(probs: torch.Tensor, rows: list[SamplingRow]) -> list[list[int]]:
    """Inverse-CDF sampling, `num_samples` per row: one uniform number per sample (from the row's
    generator, or one batched call to the default RNG for the rows without one) instead of the
    vocabulary-sized noise of the exponential race or the per-row work of torch.multinomial."""
    device = probs.device
    counts = [row.num_samples for row in rows]
    uniform = torch.zeros(len(rows), max(counts), device=device)
    unseeded = [i for i, row in enumerate(rows) if row.generator is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), max(counts), device=device)
    for i, row in enumerate(rows):
        if row.generator is not None:
            uniform[i, :row.num_samples] = torch.rand(row.num_samples, generator=row.generator, device=device)
    cdf = probs.cumsum(dim=-1)
    # The first token whose cumulative probability reaches (1 - u) * total: 1 - u lies in (0, 1], so
    # the target is above 0 and at most the total, and a zero-probability token is never chosen.
    targets = (1.0 - uniform) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, targets).tolist()
    return [row_tokens[:count] for row_tokens, count in zip(tokens, counts)]


def _take(tensor: torch.Tensor, index: list[int], copy: bool = False) -> torch.Tensor:
    """tensor[index]: a copy when asked for, and otherwise only if index is not every row in order."""
    if index == list(range(tensor.shape[0])):
        return tensor.clone() if copy else tensor
    return tensor[torch.tensor(index, device=tensor.device)]


def _update_rows(tensor: torch.Tensor, index: list[int], fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """tensor[index] = fn(tensor[index]), in place; fn may modify its argument."""
    if index == list(range(tensor.shape[0])):
        fn(tensor)
        return
    rows = torch.tensor(index, device=tensor.device)
    tensor[rows] = fn(tensor[rows])
