"""Which models the engine runs: Llama-family decoders, named as transformers' configs (`model_type`)
and GGUF files (`general.architecture`) name them, the same names in both."""
from __future__ import annotations

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    """A model the engine cannot run: its architecture, or a tensor type it does not read."""


def check_architecture(architecture: str | None, where: str) -> None:
    """Refuse anything but the supported architectures; `where` names what said it (a config's
    model type, a file's architecture)."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{where} {architecture!r} is not supported: PagedChat runs Llama-family decoders "
            f"({', '.join(SUPPORTED_ARCHITECTURES)})")
