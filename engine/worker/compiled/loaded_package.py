"""A compiled step's package (.pt2) loaded by torch's C++ loader and run on tensors.

`torch._inductor.aoti_load_package` wraps the same loader, but importing it brings the whole
compiler into the serving process (inductor, dynamo, triton: ~140 MiB resident) only to flatten
arguments that here are always tensors in order; the build process alone needs the compiler."""
from __future__ import annotations

from pathlib import Path

import torch


class LoadedPackage:
    """One package's model, called with its inputs in order; returns its outputs as a list."""

    def __init__(self, path: Path) -> None:
        # the package's one model ("model"), with thread synchronization, one runner, the CPU
        self._loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return self._loader.boxed_run(list(inputs))

    def load_constants(self, constants: dict[str, torch.Tensor], *, check_full_update: bool,
                       user_managed: bool) -> None:
        """Give the model its weights by name; `user_managed`: it keeps these tensors themselves
        (they must outlive it), not copies."""
        self._loader.load_constants(constants, False, check_full_update, user_managed, False)
