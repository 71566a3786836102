"""A `benchmarks/forward_ab.py` variant: the captured decode step through the compiled step
(engine/worker/compiled/) instead of the eager forward: the lone-chat graph for one
chat, the flat graph for more. The one it needs is built first if this machine has no package
for the model and dtype yet. The model is $MODEL's (the embedded default without it): name the
same one with forward_ab.py's --model.

    .venv/bin/python benchmarks/forward_ab.py --dtype bfloat16 --chats 1 \\
        --variant benchmarks/variants/compiled_step.py
    .venv/bin/python benchmarks/forward_ab.py --dtype bfloat16 --chats 32 \\
        --variant benchmarks/variants/compiled_step.py
"""
from __future__ import annotations

import os


def VARIANTS(model, inputs) -> dict:
    from engine.worker.compiled.steps import CompiledSteps
    from engine.worker.flat_batch import FlatSequence

    input_ids, positions, kv_cache, meta, _ = inputs
    block_size = kv_cache.shape[4]
    lengths = meta.seqused_k.tolist()
    if len(lengths) != input_ids.shape[0]:
        raise SystemExit("the compiled steps decode one token per chat: capture a decode step")
    tables = [meta.block_table[i, :-(-n // block_size)].tolist() for i, n in enumerate(lengths)]
    kinds = ("lone",) if len(lengths) == 1 else ("flat",)  # the one step this captured forward takes
    compiled = CompiledSteps(os.environ.get("MODEL"), model.dtype, model, kinds)
    if not compiled.wait():
        raise SystemExit(f"no compiled step: {compiled.error}")
    tokens, positions = input_ids.tolist(), positions.tolist()

    def forward(*_):
        if len(tokens) == 1:
            return compiled.decode(tokens[0], positions[0], tables[0], lengths[0], kv_cache, block_size)[0]
        sequences = [FlatSequence([token], length - 1, table, True)
                     for token, table, length in zip(tokens, tables, lengths)]
        return compiled.run_flat(sequences, kv_cache, block_size)[0]

    def apply():
        model.forward = forward
        return lambda: delattr(model, "forward")

    return {"compiled": apply}
