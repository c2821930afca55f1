"""The driver's hot path alone: CPU per event of `BatchProcessor` without Spark or a commit.

Spark only fetches records; the engine's time goes into the batch processor on the
driver (decode, pair, merge, reduce, render, state records). This runs exactly that
over a seeded changelog (`refold.dev.testing.Workload`) already in memory, with
`_commit` replaced by a count of what would be sent, and prints the process CPU
seconds of the best of `--repeat` runs. Use it to compare two versions of the code
(run it with each on the same machine, one after the other): CPU seconds are less
noisy than wall time on a shared machine, not free of noise.

Needs a broker only for the processor's start (its transactional producer):
the local one is started when none is running.

    python -m bench.hotpath [--events 200000] [--keys 20000] [--batch 100000] [--repeat 2]
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from typing import Any

import orjson

from bench.run import pipeline
from refold.dev.testing import Workload, generate
from refold.kafka.io import ensure_topics
from refold.recovery.records import Checkpoint
from refold.runtime.batch import InputRecord
from refold.runtime.batch import Outgoing as _Outgoing
from refold.runtime.processor import BatchProcessor, ShardProcessor
from refold.spark.job import engine_topics


class DryShard(ShardProcessor):
    """Reduces like the engine; counts the records of each batch instead of sending them."""

    sent = 0

    def _commit(self, out: _Outgoing, checkpoint: Checkpoint) -> None:
        self.sent += len(out.view) + len(out.delta) + len(out.state) + len(out.dlq)


class DryProcessor(BatchProcessor):
    """The engine's shards, each a `DryShard`."""

    shard_type = DryShard

    @property
    def sent(self) -> int:
        return sum(shard.sent for shard in self.shards.values() if isinstance(shard, DryShard))


def input_records(workload: Workload, partitions: int) -> list[InputRecord]:
    """The workload as the Spark job hands it over: keyed JSON records, partitioned by key."""
    records = []
    next_offset = [0] * partitions
    for event in generate(workload):
        key = orjson.dumps({workload.key_column: event[workload.key_column]})
        partition = zlib.crc32(key) % partitions
        records.append(InputRecord(partition, next_offset[partition], key, orjson.dumps(event), 0))
        next_offset[partition] += 1
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--retract", type=float, default=0.2)
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)

    from refold.dev.localkafka import ensure_broker

    bootstrap = ensure_broker(None, start_local=True)
    records = input_records(Workload(events=args.events, keys=args.keys, retract_share=args.retract), 4)
    spec = pipeline(f"hotpath-{time.strftime('%Y%m%d%H%M%S')}", "hotpath-source", bootstrap, args.batch)
    settings: dict[str, Any] = spec.kafka_settings(None)
    ensure_topics(settings, engine_topics(spec, 4))
    runs = []
    for attempt in range(1, args.repeat + 1):
        processor = DryProcessor(spec, settings)
        try:
            started = time.process_time()
            for start in range(0, len(records), args.batch):
                processor.process(records[start : start + args.batch])
            runs.append(time.process_time() - started)
        finally:
            processor.close()
        print(f"run {attempt}: {runs[-1]:.2f} CPU s, {processor.sent:,} records to send", file=sys.stderr)
    best = min(runs)
    print(f"hot path: {len(records):,} events, {args.keys:,} keys, batch {args.batch:,}: "
          f"{best:.2f} CPU s (best of {len(runs)}), {best / len(records) * 1e6:.1f} µs/event, "
          f"{len(records) / best:,.0f} events per CPU second")
    return 0


if __name__ == "__main__":
    sys.exit(main())
