"""Paged-KV operations: Triton GPU kernels where available, the torch reference otherwise.

The engine calls these names only; which implementation runs is decided here.
"""
from kernels.reference import copy_blocks, paged_attention, store_kv, swap_blocks

__all__ = ["copy_blocks", "paged_attention", "store_kv", "swap_blocks"]
