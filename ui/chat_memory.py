"""The strip under the message box: this chat's KV blocks, from its backend's block map.

A chat's requests are named `chat<id>/<turn>` (ui/stream.py), and the block map lists each
block's owners, so the chat's blocks are those an owner of it holds. On the device, "shared"
are the blocks holding its preset system prompt: the engine hashes those without the user's
salt, so every chat on that preset reads the same blocks from the prefix cache, and the block
map flags them (`BlockInfo.shared_prefix`). They count as shared even while this chat is the
only one holding them, since that is what the prefix cache keeps for the next chat. "Own" are
the rest of its device blocks: its messages and replies, which only its user's requests can
hit. On the host: its blocks swapped out under memory pressure. Between replies a chat holds
no block (what it wrote stays in the prefix cache, free until evicted).
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass

from engine import BlockMap
from ui.panel.block_grid import owner_key

MAX_SQUARES = 64  # beyond this, the squares stand for several blocks each


@dataclass(frozen=True)
class ChatMemory:
    shared: int      # device blocks holding its preset system prompt, the same for every chat on it
    own: int         # its other device blocks
    host: int        # its blocks swapped to host memory
    block_size: int

    @property
    def total(self) -> int:
        return self.shared + self.own + self.host


KEY = re.compile(r"chat(\d+|-new-[0-9a-f]+)")


def conversation_key(conversation_id: int) -> str:
    """What its requests' ids start with (before the '/'); a new chat's first reply is sent
    before the chat exists, as `chat-new-<hex>` (ui/stream.py)."""
    return f"chat{int(conversation_id)}"


def chat_memory(block_map: BlockMap, keys: set[str]) -> ChatMemory:
    """The blocks held by requests whose ids start with one of `keys`."""

    def mine(owners: tuple[str, ...]) -> bool:
        return any(owner_key(owner) in keys for owner in owners)

    shared = own = 0
    for block in block_map.device:
        if block.owners and mine(block.owners):
            if block.shared_prefix:
                shared += 1
            else:
                own += 1
    host = sum(1 for block in block_map.host if block.owners and mine(block.owners))
    return ChatMemory(shared, own, host, block_map.block_size)


def strip_html(memory: ChatMemory | None, key: str | None) -> str:
    """The strip: one square per block (or per few, for a long chat), then the counts and a link
    to the panel with this chat's blocks marked. Every number is also in a `data-` attribute."""
    if key is None or not KEY.fullmatch(key):
        return '<div class="pc-memory" data-shared="0" data-own="0" data-host="0">KV blocks: none yet</div>'
    link = f'<a href="panel?chat={key}" target="_blank">see them in the panel</a>'
    if memory is None:
        return (f'<div class="pc-memory" data-shared="0" data-own="0" data-host="0">KV blocks: this backend shows '
                f"no block map · {link}</div>")
    per = max(1, -(-memory.total // MAX_SQUARES))
    squares = "".join(f'<span class="pc-kv pc-kv-{kind}"></span>' * -(-count // per)
                      for kind, count in (("shared", memory.shared), ("own", memory.own), ("host", memory.host)))
    if memory.total:
        # A chat without a preset has nothing to share: it is not told about "0 shared".
        preset = (f"{memory.shared} shared (the preset system prompt, the same blocks for every chat on it) · "
                  if memory.shared else "")
        words = (f"KV blocks of {memory.block_size} tokens: {preset}{memory.own} its own · "
                 f"{memory.host} swapped to the host")
        if per > 1:
            words += f" (a square is {per} blocks)"
    else:
        words = "KV blocks: none held now (between replies its blocks wait in the prefix cache)"
    return (f'<div class="pc-memory" data-shared="{memory.shared}" data-own="{memory.own}" '
            f'data-host="{memory.host}"><span class="pc-kv-squares">{squares}</span> {html.escape(words)} · '
            f"{link}</div>")
