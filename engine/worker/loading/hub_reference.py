"""A GGUF model on the Hugging Face hub named as Ollama and llama.cpp name one: `user/repo:Q4_K_M`
(llama.cpp's `-hf`), `hf.co/user/repo:Q4_K_M` (Ollama's), `https://huggingface.co/user/repo:Q4_K_M`;
the quantization is matched case-insensitively in the repository's `.gguf` file names
(`smollm2-135m-instruct-q4_k_m.gguf`, `Model.Q4_K_M.gguf`, `Q4_K_M/Model-00001-of-00002.gguf`),
Q4_K_M when none is named (or `:latest`), as both of them do.

`user/repo` alone is also a transformers hub id: it names a GGUF only where the repository holds
GGUF files and no transformers weights (config.json, safetensors); any other stays a hub id, as
before, and transformers loads it. The prefixed and tagged forms always name a GGUF.

The files are listed on the hub (`HfApi.list_repo_files`) or, offline (`HF_HUB_OFFLINE=1`) or
when the hub cannot be reached, in huggingface_hub's cache (`scan_cache_dir`: the snapshot the
`main` ref names), and downloaded with `hf_hub_download` into that cache, `HF_TOKEN` sent for a
gated repository: huggingface_hub does all of it. The path handed on is the cache's, a file whose
name is the repository's (a link to its blob), so a split model's parts lie beside it by name.
"""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from engine.worker.loading.gguf_split import is_first_part, split_files

logger = logging.getLogger(__name__)

DEFAULT_QUANTIZATION = "Q4_K_M"  # Ollama's and llama.cpp's when a reference names none
HUB_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "https://hf.co/", "http://hf.co/",
                "huggingface.co/", "hf.co/")
FORMS = "user/repo:QUANT, hf.co/user/repo[:QUANT] or https://huggingface.co/user/repo[:QUANT]"
# a hub user or repository name: letters, digits, '-', '_', '.', starting and ending alphanumeric
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_REFERENCE = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?::(?P<quantization>[A-Za-z0-9][A-Za-z0-9._-]*))?")
# llama.cpp's type names as files carry them (`UD-` is unsloth's dynamic quants): for the refusals
_QUANTIZATION_IN_NAME = re.compile(r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q[1-8](?:_[A-Z0-9]+)*|TQ[12]_0|BF16|F16|F32|MXFP4))"
                                   r"(?![A-Za-z0-9_])", re.IGNORECASE)
TRANSFORMERS_FILES = ("config.json",)
TRANSFORMERS_SUFFIXES = (".safetensors",)


class HubReferenceError(ValueError):
    """A hub reference that names no GGUF file we can load: malformed, or not in the repository."""


@dataclass(frozen=True)
class HubReference:
    repo_id: str
    quantization: str | None  # upper-cased as written; None when none was named
    names_gguf: bool          # written with a hub prefix or a quantization: never a transformers hub id

    def __str__(self) -> str:
        return f"{self.repo_id}:{self.quantization or DEFAULT_QUANTIZATION}"


def parse_hub_reference(text: str) -> HubReference | None:
    """`text` as a hub reference; None when it is not written as one (a path, a plain name).
    Raises HubReferenceError for text that starts as a hub reference and then is not one."""
    prefix = next((p for p in HUB_PREFIXES if text.lower().startswith(p)), None)
    rest = text[len(prefix):].rstrip("/") if prefix else text
    match = _REFERENCE.fullmatch(rest)
    if match is None:
        if prefix or (":" in text and "/" in text.partition(":")[0] and not text.startswith((".", "/", "~"))):
            raise HubReferenceError(f"{text!r} is not a hub reference to a GGUF model: write {FORMS}")
        return None
    quantization = match["quantization"]
    if quantization is not None and quantization.lower() == "latest":  # Ollama's tag for its default
        quantization = None
    return HubReference(repo_id=match["repo"], quantization=quantization.upper() if quantization else None,
                        names_gguf=bool(prefix) or match["quantization"] is not None)


def names_hub_gguf(text: str) -> bool:
    """Whether `text` is written as a hub reference that can only name a GGUF model (no network)."""
    try:
        reference = parse_hub_reference(text)
    except HubReferenceError:
        return True  # resolving it says what is wrong
    return reference is not None and reference.names_gguf


def hub_gguf_file(text: str) -> str | None:
    """The local path of the GGUF model the hub reference `text` names, downloaded (every part of
    a split model) into huggingface_hub's cache; None when `text` is not a hub reference or is a
    transformers hub id. Resolved once per process for each reference, cache folder and mode."""
    reference = parse_hub_reference(text)
    if reference is None:
        return None
    from huggingface_hub import constants  # read here: a test or a caller may point them elsewhere

    return _resolve(reference, constants.HF_HUB_CACHE, bool(constants.HF_HUB_OFFLINE))


@functools.lru_cache(maxsize=None)
def _resolve(reference: HubReference, cache_folder: str, offline: bool) -> str | None:
    from huggingface_hub import hf_hub_download

    files, where = _repo_files(reference, cache_folder, offline)
    if files is None:
        return None
    models = gguf_models(files)
    if not reference.names_gguf and (not models or transformers_weights(files)):
        return None  # a transformers hub id
    parts = choose_gguf(models, reference.quantization, where)
    missing = [part for part in parts if part not in files]
    if missing:
        raise HubReferenceError(f"{parts[0]} is the first of {len(parts)} parts of a split GGUF model, and {where} "
                                f"lacks {', '.join(missing)}")
    logger.info("%s: %s%s", reference, parts[0], f" and {len(parts) - 1} more parts" if len(parts) > 1 else "")
    paths = [hf_hub_download(reference.repo_id, part, cache_dir=cache_folder) for part in parts]
    return paths[0]


def _repo_files(reference: HubReference, cache_folder: str, offline: bool) -> tuple[list[str] | None, str]:
    """(the repository's files, the repository as errors name it: with where its files were read
    when not on the hub), asking the hub unless offline; the cache's when the hub cannot be reached.
    (None, ...) for a transformers hub id: a bare `user/repo` the cache holds as a transformers
    model (the hub not asked: a listing that cannot connect retries for ~20 s), or one the hub does
    not know or nothing lists, which transformers' own loading then reports."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    unreachable = None
    if not reference.names_gguf:
        cached = _cached_files(reference.repo_id, cache_folder)
        if cached is not None and transformers_weights(cached):
            return None, reference.repo_id
    if not offline:
        try:
            return HfApi().list_repo_files(reference.repo_id), reference.repo_id
        except RepositoryNotFoundError:  # also a gated or private one without a token: its message says so
            if reference.names_gguf:
                raise
            return None, reference.repo_id
        except Exception as error:  # no connection, a timeout, the hub down: what the cache holds
            unreachable = error
    why = f"the hub could not be reached ({unreachable})" if unreachable else "offline (HF_HUB_OFFLINE is set)"
    files = _cached_files(reference.repo_id, cache_folder)
    if files is None and reference.names_gguf:
        raise HubReferenceError(f"cannot find {reference}: {why}, and huggingface_hub's cache ({cache_folder}) "
                                f"holds no snapshot of {reference.repo_id}") from unreachable
    return files, f"{reference.repo_id} (the files cached in {cache_folder}: {why})"


def _cached_files(repo_id: str, cache_folder: str) -> list[str] | None:
    """The files of the snapshot that `main` names in huggingface_hub's cache, by their paths in
    the repository; None when the cache holds none."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(cache_folder)
    except CacheNotFound:
        return None
    for repo in cache.repos:
        if repo.repo_id == repo_id and repo.repo_type == "model":
            for revision in repo.revisions:
                if "main" in revision.refs:
                    snapshot = revision.snapshot_path
                    return sorted(file.file_path.relative_to(snapshot).as_posix() for file in revision.files)
    return None


def transformers_weights(files: list[str]) -> bool:
    """Whether the repository holds a transformers model (its config or safetensors weights)."""
    return any(f in TRANSFORMERS_FILES or f.endswith(TRANSFORMERS_SUFFIXES) for f in files)


def gguf_models(files: list[str]) -> dict[str, list[str]]:
    """The repository's GGUF models: first file -> all of its files (one, or a split model's
    parts in order). Vision projectors (`mmproj-*.gguf`) are no language model: left out, as
    llama.cpp leaves them out."""
    ggufs = {f for f in files if f.lower().endswith(".gguf") and "mmproj" not in PurePosixPath(f).name.lower()}
    paths = [PurePosixPath(f) for f in sorted(ggufs)]
    return {str(path): [str(part) for part in split_files(path)] for path in paths if is_first_part(path)}


def quantization_of(path: str) -> str:
    """The quantization a GGUF file's name carries (its last llama.cpp type name), else its name."""
    found = _QUANTIZATION_IN_NAME.findall(re.sub(r"\.gguf$", "", path, flags=re.IGNORECASE))
    return found[-1].upper() if found else PurePosixPath(path).name


def choose_gguf(models: dict[str, list[str]], quantization: str | None, where: str) -> list[str]:
    """The files of the model in `models` (gguf_models) whose path names `quantization`
    (DEFAULT_QUANTIZATION when None, or the only model when there is just one), fewest folders deep
    first. Raises HubReferenceError naming the quantizations there are, when none names it."""
    if not models:
        raise HubReferenceError(f"{where} has no GGUF file")
    wanted = quantization or DEFAULT_QUANTIZATION
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(wanted)}(?![A-Za-z0-9_])", re.IGNORECASE)
    matches = sorted((f for f in models if pattern.search(f[:-len(".gguf")])), key=lambda f: (f.count("/"), f))
    if not matches and quantization is None and len(models) == 1:
        matches = list(models)
    if not matches:
        present = ", ".join(sorted({quantization_of(f) for f in models}))
        default = " (the default when none is named)" if quantization is None else ""
        raise HubReferenceError(f"no {wanted} file{default} in {where}; it has: {present}")
    return models[matches[0]]
