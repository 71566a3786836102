"""A compiled step's package made: its module traced by torch.export and compiled by AOTInductor
into one C++ call, written whole and installed (engine/worker/package_trust.py). What the engine
runs it through is steps.py; a build runs in a process of its own (builds.py, `python -m
engine.worker.compiled`)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.worker.cache_folders import packages_folder
from engine.worker.compiled.package_key import staging_path
from engine.worker.compiled.shapes import BATCH_BLOCK_SIZE, CAPACITY_STEP, MAX_BATCH, MAX_CONTEXT
from engine.worker.loading.model_loader import load_checkpoint
from engine.worker.compiled.lone_step import LoneStep
from engine.worker.compiled.flat_step import FlatStep
from engine.worker.models.layers.packed_rows import C_SHIM, load_library
from engine.worker.models.llama import LlamaModel
from engine.worker.package_trust import digest_path, install

def build(model: str | None, dtype: torch.dtype, out: Path, kind: str = "lone") -> Path:
    """Export and compile the `kind` step for `model` in `dtype` into the package `out` (written
    whole, its sha256 recorded beside it, then renamed into place: a reader never sees half a
    package)."""
    checkpoint = load_checkpoint(model, dtype)
    program = _export_flat(checkpoint, dtype) if kind == "flat" else _export_lone(checkpoint, dtype)
    del checkpoint
    # Reassociation and fused multiply-adds let the C++ compiler split a loop's running sum over
    # several registers (infinities and NaNs keep their meaning).
    configs = {"cpp.enable_unsafe_math_opt_flag": True, "cpp.enable_floating_point_contract_flag": "fast"}
    # Each step multiplies by weights the engine holds (FlatStep.constants, LoneStep.constants),
    # handed over when the package is loaded: nothing is folded, and the package holds no weights.
    configs.update({"freezing": False, "aot_inductor.package_constants_in_so": False})
    if kind == "lone":
        # A lone row's products run on the packed weights in place (packed_rows.py) or over
        # blocks laid out for them (`MatVec` in engine/worker/models/layers/matvec.py), as they
        # are. An input read by two loops (the q and k/v projections' normalized input, the
        # rotated query) is computed once into a buffer, not again for every block of weights
        # (`realize_reads_threshold`).
        configs.update({"cpp.weight_prepack": False, "realize_reads_threshold": 1})
        # Products on the engine's packed weights call packed_rows.c's C shim directly; the
        # library is loaded first so that the package's symbol resolves.
        configs["aot_inductor.custom_ops_to_c_shims"] = {torch.ops.pagedchat.packed_rows.default: [C_SHIM]}
        load_library()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(out, os.getpid())
    with torch.no_grad():
        torch._inductor.aoti_compile_and_package(program, package_path=str(staging), inductor_configs=configs)
    install(staging, out)
    # Older builds for this model, dtype and kind (other code, another torch) are never loaded
    # again; a package written elsewhere (--out) leaves its folder alone.
    if out.parent.resolve() == packages_folder().resolve():
        family = out.name.rsplit("-", 1)[0]
        for stale in out.parent.glob(f"{family}-*.pt2"):
            if stale != out and ".tmp." not in stale.name:
                stale.unlink(missing_ok=True)
                digest_path(stale).unlink(missing_ok=True)
    return out


def _export_lone(checkpoint, dtype: torch.dtype):
    from torch.export import Dim

    step = LoneStep(LlamaModel(checkpoint, dtype, torch.device("cpu"), consume=True)).eval()
    layers, kv_heads, dim = len(step.layers), step.shape.num_kv_heads, step.shape.head_dim
    example = (torch.zeros(1, dtype=torch.int64), torch.ones(1, dim, dtype=dtype), torch.zeros(1, dim, dtype=dtype),
               torch.zeros(layers, 2, kv_heads, 2 * CAPACITY_STEP, dim, dtype=dtype), torch.tensor(1))
    capacity = Dim("capacity", min=2, max=MAX_CONTEXT + CAPACITY_STEP)
    with torch.no_grad():
        return torch.export.export(step, example, dynamic_shapes=(None, None, None, {3: capacity}, None))


def _export_flat(checkpoint, dtype: torch.dtype):
    from torch.export import Dim

    step = FlatStep(LlamaModel(checkpoint, dtype, torch.device("cpu"), consume=True)).eval()
    layers, kv_heads, dim, bs = len(step.layers), step.shape.num_kv_heads, step.shape.head_dim, BATCH_BLOCK_SIZE
    # any sizes, each its own: every one is dynamic
    decodes, prompt_tokens, chunks, width, decode_blocks, prompt_blocks, shared, sampled = 3, 7, 2, 5, 4, 6, 2, 4
    i64 = torch.int64
    example = (torch.zeros(decodes, dtype=i64), torch.zeros(prompt_tokens, dtype=i64),
               torch.zeros(decodes, 2, dim, dtype=dtype), torch.zeros(prompt_tokens, 2, dim, dtype=dtype),
               torch.zeros(64, layers, 2, kv_heads, bs, dim, dtype=dtype),
               torch.zeros(shared, dtype=i64), torch.zeros(shared * bs),
               torch.zeros(decodes, decode_blocks, dtype=i64), torch.zeros(decodes, decode_blocks * bs),
               torch.zeros(chunks, prompt_blocks, dtype=i64), torch.zeros(chunks, prompt_blocks * bs),
               torch.zeros(chunks, width, dtype=i64), torch.zeros(chunks, width, width),
               torch.zeros(prompt_tokens, dtype=i64), torch.zeros(sampled, dtype=i64))
    d, t = Dim("decodes", min=1, max=MAX_BATCH), Dim("prompt_tokens", min=1, max=MAX_CONTEXT)
    p, q = Dim("chunks", min=1, max=MAX_BATCH), Dim("width", min=1, max=MAX_CONTEXT)
    od, op = Dim("decode_blocks", min=1, max=MAX_CONTEXT), Dim("prompt_blocks", min=1, max=MAX_CONTEXT)
    s, r, blocks = Dim("shared", min=1, max=MAX_CONTEXT), Dim("sampled", min=1, max=2 * MAX_BATCH), Dim("blocks", min=2)
    dynamic = ({0: d}, {0: t}, {0: d}, {0: t}, {0: blocks}, {0: s}, {0: s * bs}, {0: d, 1: od}, {0: d, 1: od * bs},
               {0: p, 1: op}, {0: p, 1: op * bs}, {0: p, 1: q}, {0: p, 1: q, 2: q}, {0: t}, {0: r})
    with torch.no_grad():
        return torch.export.export(step, example, dynamic_shapes=dynamic)
