"""`python -m engine.worker.compiled --kind lone|flat`: build a compiled step's package (what an
engine does in the background when it finds none; run by hand, it builds one ahead of time)."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

import torch

from engine.worker.compiled.builds import end_group, lower_priority
from engine.worker.compiled.export import build
from engine.worker.compiled.package_key import package_path
from engine.worker.compiled.shapes import DTYPES, KINDS
from engine.worker.package_trust import digest_problem, folder_problem
from engine.worker.parent_watch import end_with_parent

def main() -> None:
    parser = argparse.ArgumentParser(description="Build a compiled step (a lone chat's decode, or the flat step) for a model and dtype.")
    parser.add_argument("--model", default=None, help="folder, hub id, .gguf file or hub GGUF (user/repo:Q4_K_M) (default: $MODEL, else the embedded model)")
    parser.add_argument("--dtype", choices=[str(d).removeprefix("torch.") for d in DTYPES], default="float32")
    parser.add_argument("--kind", choices=KINDS, default="lone", help="a lone chat's decode step, or the flat step")
    parser.add_argument("--out", default=None, help="package path (default: this machine's cache entry)")
    parser.add_argument("--background", action="store_true", help="at a low priority (beside a serving engine)")
    parser.add_argument("--scratch", default=None,
                        help="folder for the compiler's own cache, which the caller removes (default: a temporary one)")
    parser.add_argument("--parent", type=int, default=None, help="end when this process (the engine) is gone")
    args = parser.parse_args()
    if args.parent is not None:
        end_with_parent(args.parent, end_group)  # a killed engine can end nothing: its build ends itself
    if args.background:
        lower_priority()
    dtype = getattr(torch, args.dtype)
    out = Path(args.out) if args.out else package_path(args.model, dtype, args.kind)
    if not args.out:
        out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = folder_problem(out.parent)
        if problem is not None:
            sys.exit(f"not building into {out.parent}, which the engine would refuse to load from: {problem}")
        if out.exists() and digest_problem(out) is None:
            print(f"already built: {out}")
            return
    with contextlib.ExitStack() as stack:
        # inductor's own cache of the build (hundreds of MB) goes with the scratch folder
        scratch = args.scratch or stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedchat-inductor-"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = scratch
        print(f"built: {build(args.model, dtype, out, args.kind)}")


if __name__ == "__main__":
    main()
