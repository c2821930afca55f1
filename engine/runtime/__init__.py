"""What runs one micro-batch: `BatchProcessor.process(records)` splits the batch by
shard (`shards`: one per source partition for a co-partitioned view, one otherwise);
each shard's `ShardProcessor` (`shard`) drops what its checkpoint covers, decodes,
checks message keys, pairs `-C`/`+C`, merges its partitions, reduces, renders the
outputs and commits them with its state and checkpoint records in its own Kafka
transaction. `hooks` are the injected test hooks (no-ops in production);
`collector` keeps Python's garbage collector off the hot path."""
