"""The recovery log: what Kafka keeps so the engine can rebuild itself.

`records` encodes the `P.checkpoints` record of one shard (its committed input
offsets, held `-C`, counters, drivers' checkpoints) and the dead-letter value;
`restore` reads a shard's record in `P.checkpoints` and its `P.state` partition to
their end (read_committed) into starting offsets and a reducer's state, and keeps
Spark's checkpoint directory only while it agrees with Kafka, which is
authoritative."""
