"""The prefix cache's key: a chain of 128-bit hashes, one per full block of tokens.

A block's hash covers its parent block's hash and its own token ids, so equal hashes mean
equal whole prefixes, not just equal blocks. 128 bits make an accidental collision
(about 2**-64 even after 2**32 blocks, by the birthday bound) far less likely than a memory
error, so a hit is trusted without comparing tokens.

A request may carry a cache salt (its user): from the first block that is not wholly inside
the prefix its users share (a preset system prompt), that block's hash also covers the salt, so
everything after the shared prefix can only ever be hit by the same user's requests. The shared
blocks stay unsalted on purpose: hitting them for everyone is the point of the prefix cache, and
they hold nothing private. The block that straddles the boundary holds the user's first tokens,
so it is salted too. Since every hash chains its parent, salting that one block salts the rest.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

ROOT_HASH = 0
_ROOT_BYTES = ROOT_HASH.to_bytes(16, "little")


def hash_block(parent_hash: int, token_ids: Sequence[int], salt: str | None = None) -> int:
    parent = _ROOT_BYTES if parent_hash == ROOT_HASH else parent_hash.to_bytes(16, "little")
    data = parent + array("q", token_ids).tobytes()
    if salt is not None:
        data += b"\0salt\0" + salt.encode("utf-8", "surrogatepass")
    return xxhash.xxh3_128_intdigest(data)


def extend_block_hashes(block_hashes: list[int], token_ids: Sequence[int], block_size: int, num_blocks: int,
                        salt: str | None = None, salt_from: int = 0) -> None:
    """Grow `block_hashes` in place to cover the first `num_blocks` full blocks of `token_ids`;
    with a salt, block `salt_from` (and through the chain every later one) is salted."""
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    for i in range(len(block_hashes), num_blocks):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt if i == salt_from else None)
        block_hashes.append(parent)
