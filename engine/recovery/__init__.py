"""The recovery log: what Kafka keeps so the engine can rebuild itself.

`records` encodes the `P.checkpoints` record of one shard (its committed input
offsets, held `-C`, counters, drivers' checkpoints) and the dead-letter value;
`restore` reads the shards' records in `P.checkpoints` (read_committed) into starting
offsets and held `-C`s (a shard's state comes from its local store, brought to its
checkpoint from `P.state` by `refold.state`), and keeps Spark's checkpoint directory
only while it agrees with Kafka, which is authoritative."""
