"""CPU-side decisions: requests, the scheduler, the KV-cache manager, the block pool, the prefix
cache's hash chain, snapshots. Pure Python and numpy: nothing here imports torch or the worker."""
