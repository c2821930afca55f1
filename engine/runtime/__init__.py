"""What runs one micro-batch: `BatchProcessor.process(records)` drops what the
checkpoint covers, decodes, pairs `-C`/`+C`, merges partitions, reduces, renders
the outputs and commits them with the state and checkpoint records in one Kafka
transaction. `hooks` are the injected test hooks (no-ops in production);
`collector` keeps Python's garbage collector off the hot path."""
