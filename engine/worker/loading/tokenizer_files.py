"""A model folder's tokenizer, and its end-of-sequence id, read the quickest way the folder allows."""
from __future__ import annotations

import json
from pathlib import Path

from engine.worker.loading.gguf_folder import GGUF_SOURCE


# What AutoTokenizer makes of a folder whose tokenizer_config.json names one of these: the
# tokenizers-library class itself, which loads directly.
TOKENIZERS_BACKED = ("TokenizersBackend", "PreTrainedTokenizerFast")


def tokenizer_at(path: str):
    """The tokenizer of the model folder or hub id `path`, as AutoTokenizer loads it. A folder whose tokenizer is the
    tokenizers-backed class (the embedded model's, a GGUF file's, most Llama-family folders
    saved by transformers 5) loads that class directly: AutoTokenizer first reads the model's
    config and maps every model's modules, ~3.5 s of a 2-core Zen 1's CPU, which every server
    and app start paid again. So does a GGUF file's cached folder (gguf_folder.py) whatever class
    it names: its tokenizer.json is transformers' own conversion of the file's vocabulary, whole,
    and a model's class (Qwen2Tokenizer) would build the same pipeline again beside it, ~190 MiB
    more for Qwen's 151,936 tokens, for the same ids."""
    config_path = Path(path) / "tokenizer_config.json"
    if config_path.is_file() and (Path(path) / "tokenizer.json").is_file():
        try:
            named = json.loads(config_path.read_text()).get("tokenizer_class")
        except (OSError, ValueError):
            named = None
        if named in TOKENIZERS_BACKED or (Path(path) / GGUF_SOURCE).is_file():
            from transformers import PreTrainedTokenizerFast
            return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def eos_token_id_at(path: str) -> int | None:
    """The id of the end-of-sequence token of the model at `path`, as its tokenizer says. A folder
    whose tokenizer_config.json names the token and the tokenizers-backed class is read with the
    `tokenizers` library alone: an engine core needs this id, not the tokenizer, and importing
    transformers for it is ~2.5 s of its start's CPU. Anything else loads the tokenizer."""
    folder = Path(path)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    eos = config.get("eos_token")
    if isinstance(eos, dict):  # an AddedToken written out
        eos = eos.get("content")
    # special_tokens_map.json (older saves) can name the tokens too: the tokenizer decides then.
    if (isinstance(eos, str) and config.get("tokenizer_class") in TOKENIZERS_BACKED
            and (folder / "tokenizer.json").is_file() and not (folder / "special_tokens_map.json").exists()):
        from tokenizers import Tokenizer
        token_id = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(eos)
        if token_id is not None:
            return token_id
    return tokenizer_at(path).eos_token_id
