"""A GGUF model split over several files, as llama.cpp's gguf-split (and gguf-py's GGUFWriter with
`split_max_tensors` / `split_max_size`) writes it: `{prefix}-00001-of-00003.gguf` and its siblings
beside it, each a GGUF file of its own that holds some of the tensors and the keys `split.no`
(0-based), `split.count` and `split.tensors.count`; only the first part carries the model's
metadata. Read as one model, as llama.cpp's loader reads it: the first part's fields, every
part's tensors in order. gguf-py's GGUFReader reads one file; this joins its readers."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, TypeVar

SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS_COUNT = "split.tensors.count"
SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)  # llama.cpp's "%s-%05d-of-%05d.gguf"

P = TypeVar("P", bound=PurePath)


def split_files(path: P) -> list[P]:
    """Every part of the split model that `path` names a part of (by its name alone, whichever
    part it names), first to last; [path] for a name that is not a split part's."""
    match = SPLIT_NAME.search(path.name)
    if match is None or int(match[2]) < 2:
        return [path]
    prefix, count = path.name[:match.start()], int(match[2])
    return [path.with_name(f"{prefix}-{number:05d}-of-{count:05d}.gguf") for number in range(1, count + 1)]


def is_first_part(path: PurePath) -> bool:
    """Whether `path` is a model of its own: a file that is not split, or a split model's first part."""
    return split_files(path)[0] == path


@dataclass(frozen=True)
class SplitGGUF:
    """A split model's parts read as one: what the loaders read of a GGUFReader."""
    paths: list[Path]
    fields: dict[str, Any]
    tensors: list[Any]


def open_split(path: Path, open_file: Callable[[Path], Any]):
    """The GGUF at `path` opened with `open_file` (a reader from a path); when it is the first part
    of a split model, its parts opened the same way and joined (SplitGGUF). Refuses a later part
    (naming the first), a missing part, and parts whose split keys disagree."""
    first = open_file(path)
    count, number = _split_key(first, SPLIT_COUNT, 1), _split_key(first, SPLIT_NO, 0)
    if count < 2:
        return first
    paths = split_files(path)
    if len(paths) != count:
        raise ValueError(f"{path.name} is part {number + 1} of a GGUF model split in {count} files, but its name "
                         f"does not say where the others are: llama.cpp names them "
                         f"{{prefix}}-00001-of-{count:05d}.gguf, ...")
    if number != 0:
        raise ValueError(f"{path.name} is part {number + 1} of {count} of a split GGUF model: name its first part, "
                         f"{paths[0].name}")
    missing = [part.name for part in paths if not part.is_file()]
    if missing:
        raise FileNotFoundError(f"{path.name} is the first of {count} parts of a split GGUF model; missing beside it: "
                                f"{', '.join(missing)}")
    readers = [first] + [open_file(part) for part in paths[1:]]
    for index, (part, reader) in enumerate(zip(paths, readers)):
        if (_split_key(reader, SPLIT_NO, None), _split_key(reader, SPLIT_COUNT, None)) != (index, count):
            raise ValueError(f"{part.name} should be part {index + 1} of {count} of {paths[0].name}, but its "
                             f"{SPLIT_NO}/{SPLIT_COUNT} say {_split_key(reader, SPLIT_NO, None)}/"
                             f"{_split_key(reader, SPLIT_COUNT, None)}")
    tensors = [tensor for reader in readers for tensor in reader.tensors]
    expected = _split_key(first, SPLIT_TENSORS_COUNT, len(tensors))
    if len(tensors) != expected:
        raise ValueError(f"{paths[0].name}: its {count} parts hold {len(tensors)} tensors; {SPLIT_TENSORS_COUNT} "
                         f"says {expected}")
    return SplitGGUF(paths=paths, fields=first.fields, tensors=tensors)


def _split_key(reader, key: str, default):
    field = reader.fields.get(key)
    return default if field is None else int(field.contents())
