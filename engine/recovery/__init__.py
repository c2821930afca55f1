"""The recovery log: what Kafka keeps so the engine can rebuild itself.

`records` encodes the `P.checkpoints` record (committed input offsets, held `-C`,
counters, drivers' checkpoints) and the dead-letter value; `restore` reads
`P.checkpoints` and `P.state` to their end (read_committed) into starting offsets
and a reducer's state, and keeps Spark's checkpoint directory only while it agrees
with Kafka, which is authoritative."""
