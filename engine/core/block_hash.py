"""The prefix cache's key: a chain of 128-bit hashes, one per full block of tokens.

A block's hash covers its parent block's hash and its own token ids, so equal hashes mean
equal whole prefixes, not just equal blocks. 128 bits make an accidental collision
(about 2**-64 even after 2**32 blocks, by the birthday bound) far less likely than a memory
error, so a hit is trusted without comparing tokens.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

ROOT_HASH = 0
_ROOT_BYTES = ROOT_HASH.to_bytes(16, "little")


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    parent = _ROOT_BYTES if parent_hash == ROOT_HASH else parent_hash.to_bytes(16, "little")
    return xxhash.xxh3_128_intdigest(parent + array("q", token_ids).tobytes())


def extend_block_hashes(block_hashes: list[int], token_ids: Sequence[int], block_size: int, num_blocks: int) -> None:
    """Grow `block_hashes` in place to cover the first `num_blocks` full blocks of `token_ids`."""
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    for i in range(len(block_hashes), num_blocks):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        block_hashes.append(parent)
