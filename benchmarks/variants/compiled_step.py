"""A `benchmarks/forward_ab.py` variant: the captured one-chat decode step through the compiled
step (engine/worker/compiled_decode.py) instead of the eager forward, built first if this
machine has no package for the model and dtype yet. The model is $MODEL's (the embedded default
without it): name the same one with forward_ab.py's --model.

    .venv/bin/python benchmarks/forward_ab.py --dtype bfloat16 --chats 1 \\
        --variant benchmarks/variants/compiled_step.py
"""
from __future__ import annotations

import os


def VARIANTS(model, inputs) -> dict:
    from engine.worker.compiled_decode import CompiledDecode

    input_ids, positions, kv_cache, meta, _ = inputs
    if input_ids.shape[0] != 1:
        raise SystemExit("the compiled step decodes one chat: capture with --chats 1")
    length, block_size = int(meta.seqused_k[0]), kv_cache.shape[4]
    blocks = meta.block_table[0, :-(-length // block_size)].tolist()
    token, position = int(input_ids[0]), int(positions[0])
    compiled = CompiledDecode(os.environ.get("MODEL"), model.dtype, model)
    if not compiled.wait():
        raise SystemExit(f"no compiled step: {compiled.error}")

    def forward(*_):
        return compiled.decode(token, position, blocks, length, kv_cache, block_size)[0]

    def apply():
        model.forward = forward
        return lambda: delattr(model, "forward")

    return {"compiled": apply}
