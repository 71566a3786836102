"""A step's scheduled sequences as the inputs of the compiled flat step (compiled/flat_step.py).

Each sequence brings its new tokens from position `start` on, and its block table. Sequences with
one new token are decode rows; the others are prompt chunks, padded to the longest. Every input
size of the graph is at least one (a size of zero cannot be compiled for): a step without decodes
or without chunks carries one stand-in row in that group, which attends only to itself, whose
K/V is not stored and whose logits nobody asks for.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class FlatSequence:
    tokens: list[int]   # the tokens this step computes
    start: int          # the position of the first of them (its past: positions 0 .. start - 1)
    table: list[int]    # its blocks, covering start + len(tokens) positions
    samples: bool       # whether its last token's logits are wanted


@dataclass
class FlatBatch:
    """FlatStep's inputs but the cache (`arguments` puts it in its place), and where the rows'
    new K/V goes. The logits come back one row per sampling sequence, in the caller's order
    (one row of nothing when none samples)."""
    tokens_and_rotary: tuple      # decode_tokens, prompt_tokens, decode_rotary, prompt_rotary
    layout: tuple                 # every input after the cache
    blocks: torch.Tensor          # [N] the cache block of each stored row's new K/V
    offsets: torch.Tensor         # [N] ... and its offset in the block
    stored_rows: torch.Tensor     # [N] which of the graph's rows those are (stand-ins are not stored)

    def arguments(self, kv_cache: torch.Tensor) -> tuple:
        return (*self.tokens_and_rotary, kv_cache, *self.layout)


def flat_batch(sequences: list[FlatSequence], block_size: int, rotary: torch.Tensor) -> FlatBatch:
    """The inputs for `sequences` (any order; the graph puts decodes first), with `rotary` the
    model's `RotaryTable.table`."""
    decodes = [s for s in sequences if len(s.tokens) == 1]
    chunks = [s for s in sequences if len(s.tokens) > 1]
    bs = block_size
    # Blocks every sequence holds in common before its first new token: read once for all rows.
    limit, first = min(s.start for s in sequences) // bs, sequences[0].table
    common = 0
    while common < limit and all(s.table[common] == first[common] for s in sequences):
        common += 1
    if common:
        shared, shared_bias = torch.tensor(first[:common]), torch.zeros(common * bs)
    else:  # nothing shared: one block no key of which counts
        shared, shared_bias = torch.zeros(1, dtype=torch.int64), torch.full((bs,), NEG_INF)

    def own_blocks(group: list[FlatSequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's blocks after the common ones, up to its past's end, and the bias that
        hides the keys from its start on."""
        width = max(1, max(-(-s.start // bs) for s in group) - common)
        table = torch.tensor([(s.table[common:common + width] + [0] * width)[:width] for s in group])
        keys = common * bs + torch.arange(width * bs)
        starts = torch.tensor([s.start for s in group])
        return table, torch.where(keys[None, :] < starts[:, None], 0.0, NEG_INF)

    stand_in = FlatSequence([0], 0, [0], False)
    decode_group = decodes or [stand_in]
    decode_blocks, decode_bias = own_blocks(decode_group)
    if not decodes:
        decode_bias.fill_(NEG_INF)
    chunk_group = chunks or [stand_in]
    prompt_blocks, prompt_bias = own_blocks(chunk_group)
    if not chunks:
        prompt_bias.fill_(NEG_INF)
    lengths = [len(s.tokens) for s in chunk_group]
    width = max(lengths)
    offsets = torch.tensor([0] + lengths[:-1]).cumsum(0)
    steps = torch.arange(width)
    lengths_t = torch.tensor(lengths)
    valid = steps[None, :] < lengths_t[:, None]                                # [P, Q]
    chunk_rows = torch.where(valid, offsets[:, None] + steps[None, :], offsets[:, None])
    sees = (steps[None, None, :] <= steps[None, :, None]) & (steps[None, None, :] < lengths_t[:, None, None])
    chunk_bias = torch.where(sees, 0.0, NEG_INF)                               # [P, Q, Q]
    prompt_rows = (torch.arange(len(chunk_group))[:, None] * width + steps[None, :])[valid]

    decode_tokens = [s.tokens[0] for s in decode_group]
    prompt_tokens = [t for s in chunk_group for t in s.tokens]
    positions = [s.start for s in decode_group] + [s.start + i for s in chunk_group for i in range(len(s.tokens))]
    positions_t = torch.tensor(positions)
    table = rotary[positions_t]
    num_decode_rows = len(decode_group)

    # The rows of real sequences, in the graph's order, and where their K/V goes.
    rows, row_of_last = [], {}
    for index, s in enumerate(decode_group if decodes else []):
        rows.append((index, s, 0))
        row_of_last[id(s)] = index
    row = num_decode_rows
    for s in chunks:
        for i in range(len(s.tokens)):
            rows.append((row + i, s, i))
        row_of_last[id(s)] = row + len(s.tokens) - 1
        row += len(s.tokens)
    blocks = torch.tensor([s.table[(s.start + i) // bs] for _, s, i in rows], dtype=torch.int64)
    offsets_in_block = torch.tensor([(s.start + i) % bs for _, s, i in rows], dtype=torch.int64)
    stored_rows = torch.tensor([r for r, _, _ in rows], dtype=torch.int64)
    sampling = [s for s in sequences if s.samples]
    logits_rows = [row_of_last[id(s)] for s in sampling] or [0]
    return FlatBatch((torch.tensor(decode_tokens), torch.tensor(prompt_tokens), table[:num_decode_rows].contiguous(),
                      table[num_decode_rows:].contiguous()),
                     (shared, shared_bias, decode_blocks, decode_bias, prompt_blocks, prompt_bias, chunk_rows,
                      chunk_bias, prompt_rows, torch.tensor(logits_rows)),
                     blocks, offsets_in_block, stored_rows)
