"""What the compiled steps take: their kinds, dtypes, and the sizes their graphs are traced for
(a step outside them runs eagerly)."""
from __future__ import annotations

import torch

KINDS = ("lone", "flat")  # one sequence's decode step (`LoneStep`), any mix of decodes and prompt chunks (`FlatStep`)
DTYPES = (torch.float32, torch.bfloat16)
CAPACITY_STEP = 64    # the lone step's K/V buffer grows by this many tokens; attention runs over all of it, masked
MAX_CONTEXT = 4096    # longer contexts decode eagerly (the buffer of SmolLM2 at 4,096 tokens is 190 MB in fp32)
BATCH_BLOCK_SIZE = 16  # the flat graph reads caches of this block size (the engine's default)
MAX_BATCH = 256       # steps of more sequences run eagerly
