"""The executors' local state: each shard's `P.state` records in RocksDB on local disk,
a cache of Kafka that is never ahead of it (DESIGN.md §3, docs/ENGINE.md "The local
state store").

`store` has `ShardStore` (the records of one shard and the `Stamp` that says how far
they are valid, written together; a lock file so one process at a time has it) and
`shard` has `open_shard`, which brings a store to the committed checkpoint: as it is,
caught up from `P.state` partition p, or restored from it.
"""

from refold.state.shard import Recovery, bring_to, open_shard
from refold.state.store import ShardId, ShardStore, Stamp, StoreLocked, default_root

__all__ = ["Recovery", "ShardId", "ShardStore", "Stamp", "StoreLocked", "bring_to", "default_root", "open_shard"]
