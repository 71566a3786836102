"""The prefix cache's key: a chain of hashes, one per full block of tokens.

A block's hash covers its parent block's hash and its own token ids, so equal hashes mean
equal whole prefixes, not just equal blocks, and a hit is trusted without comparing tokens.
Two hashes are offered, as vLLM offers them (`--prefix-caching-hash-algo`):

- "xxh3" (the default): xxHash's 128-bit XXH3, fast and unkeyed. An accidental collision is
  about 2**-64 even after 2**32 blocks (the birthday bound), far less likely than a memory
  error; but anyone who knows the hash can search for token sequences that collide on purpose,
  and a collision would hand one user's cached K/V to another's prompt.
- "sha256": the digest of the parent's 32-byte digest (zeros for a first block), the token ids
  as little-endian int64 and, when salted, b"\\0salt\\0" and the salt in UTF-8. No collision of
  it is known, found or findable: for a server whose users may attack each other. It costs
  more per block (benchmarks/prefix_hash.py measures it, BENCHMARKS.md has the figures).

A request may carry a cache salt (its user): from the first block that is not wholly inside
the prefix its users share (a preset system prompt), that block's hash also covers the salt, so
everything after the shared prefix can only ever be hit by the same user's requests. The shared
blocks stay unsalted on purpose: hitting them for everyone is the point of the prefix cache, and
they hold nothing private. The block that straddles the boundary holds the user's first tokens,
so it is salted too. Since every hash chains its parent, salting that one block salts the rest.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence

import xxhash

ROOT_HASH = 0
HASH_ALGOS = ("xxh3", "sha256")
DEFAULT_HASH_ALGO = "xxh3"
_SALT_MARK = b"\0salt\0"
_BIG_ENDIAN = sys.byteorder == "big"


def _xxh3(parent_hash: int, data: bytes) -> int:
    return xxhash.xxh3_128_intdigest(parent_hash.to_bytes(16, "little") + data)


def _sha256(parent_hash: int, data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(parent_hash.to_bytes(32, "little") + data).digest(), "little")


_HASHES: dict[str, Callable[[int, bytes], int]] = {"xxh3": _xxh3, "sha256": _sha256}


def hash_block(parent_hash: int, token_ids: Sequence[int], salt: str | None = None, algo: str = DEFAULT_HASH_ALGO,
               ) -> int:
    tokens = array("q", token_ids)
    if _BIG_ENDIAN:
        tokens.byteswap()
    data = tokens.tobytes()
    if salt is not None:
        data += _SALT_MARK + salt.encode("utf-8", "surrogatepass")
    return _HASHES[algo](parent_hash, data)


def extend_block_hashes(block_hashes: list[int], token_ids: Sequence[int], block_size: int, num_blocks: int,
                        salt: str | None = None, salt_from: int = 0, algo: str = DEFAULT_HASH_ALGO) -> None:
    """Grow `block_hashes` in place to cover the first `num_blocks` full blocks of `token_ids`;
    with a salt, block `salt_from` (and through the chain every later one) is salted."""
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    for i in range(len(block_hashes), num_blocks):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt if i == salt_from else None,
                            algo)
        block_hashes.append(parent)
