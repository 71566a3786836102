"""What the chat page accepts from a user (or an API caller) before it acts: text of a sane
length that is valid Unicode, a conversation id that is a whole number, sliders in range, a file
to import of a sane size. Anything else raises `ChatInputError`, whose text the page shows as is.

A conversation id that is another user's, missing or no id at all reads the same (`NOT_YOURS`):
the store's `NotFound` is worded so as never to say which (`found`, `owned`).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

from engine import SamplingParams
from storage import NotFound
from ui import params

# Longer text is refused before it is tokenized (on the engine's thread) or stored. 100k
# characters is ~25k tokens, beyond the context of the models this app serves; the engine refuses
# a shorter prompt that still does not fit its KV cache.
MAX_TEXT_CHARS = 100_000
MAX_CONVERSATION_ID = 2**63 - 1  # SQLite's largest integer: beyond it no row can exist
MAX_IMPORT_BYTES = 5_000_000  # an exported chat of ~1,000 long turns
NOT_YOURS = "That conversation doesn't exist or isn't yours."

# (temperature, top_p, max new tokens) as the sliders give them; checked by `checked_sampling`.
Sliders = tuple[float, float, float]


class ChatInputError(ValueError):
    """Something the user must change before the page can act; its text is shown to them."""


@contextmanager
def found() -> Iterator[None]:
    """The store's `NotFound` as the one message a user sees: it never says whether the
    conversation exists for someone else."""
    try:
        yield
    except NotFound:
        raise ChatInputError(NOT_YOURS) from None


def owned(method):
    """A controller method whose `NotFound` the user sees as `NOT_YOURS`."""
    @functools.wraps(method)
    def checked(*args, **kwargs):
        with found():
            return method(*args, **kwargs)
    return checked


def checked_id(conversation_id: object) -> int | None:
    """A conversation id as the page or an API caller gives it: None (no chat open yet) or a
    whole number. One that no row can have reads as any missing conversation does."""
    if conversation_id is None:
        return None
    if isinstance(conversation_id, bool) or not isinstance(conversation_id, (int, float)) \
            or (isinstance(conversation_id, float) and not conversation_id.is_integer()):
        raise ChatInputError(f"A conversation id is a whole number, not {conversation_id!r}.")
    if not 1 <= conversation_id <= MAX_CONVERSATION_ID:
        raise ChatInputError(NOT_YOURS)
    return int(conversation_id)


def checked_text(value: object, what: str) -> str:
    """Text from the page or an API caller; None reads as "". Text that is not valid Unicode
    (a lone surrogate, which JSON can carry) could be neither tokenized nor stored."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ChatInputError(f"The {what} must be text.")
    if len(value) > MAX_TEXT_CHARS:
        raise ChatInputError(f"The {what} is {len(value):,} characters long; the limit is {MAX_TEXT_CHARS:,}. "
                             "Shorten it and try again.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ChatInputError(f"The {what} has characters that are not valid text (lone surrogates): "
                             "remove them and try again.") from None
    return value


def checked_sampling(sliders: Sliders) -> SamplingParams:
    try:
        return params.sampling_params(*sliders)
    except ValueError as error:
        raise ChatInputError(str(error)) from None


def checked_import_size(path: str | os.PathLike) -> None:
    """A file to import is at most MAX_IMPORT_BYTES (the server also refuses a larger upload)."""
    size = os.path.getsize(path)
    if size > MAX_IMPORT_BYTES:
        raise ChatInputError(f"The file is {size:,} bytes; a chat to import is at most {MAX_IMPORT_BYTES:,}.")
