"""`python -m bench.hotpath --view join-shard`: a join shard's CPU per event as the engine
runs it, reading included: revenue per region over orders joined with customers
(`make bench-join`'s view, `refold.dev.joinload`), its records in memory as the Spark job
hands them over (JSON, both sources' 4 partitions, the right one's numbered
`RIGHT_PARTITIONS + p`), through a `BatchProcessor` that commits each batch to the local
broker (started when none runs): decode, join, reduce, render, the transaction, the trace
index and the stamp of the shard's store; the process's CPU seconds, the Kafka client's
threads' included, best of `--repeat`.

Cores, one after the other:

- `read`: both native cores, the view's reading each batch's records itself (`read_join`,
  `join_kept`): no Python object per event;
- `decode`: both native cores, the records decoded, paired and merged by the Python
  readers (`JoinUnitReader`), the joined records core to core (`join_read`);
- `python`: the Python join and grouped reducers.

    python -m bench.hotpath --view join-shard [--orders 200000] [--batch 50000] [--repeat 2]
                                              [--core read,decode,python]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
import zlib

import orjson

from refold.config import Pipeline, parse_pipeline
from refold.dev.joinload import CUSTOMERS, JOIN_VIEW, SIDE_NAMES, JoinWorkload, generate_join
from refold.kafka.io import TopicSpec, ensure_topics
from refold.plan import RIGHT_PARTITIONS
from refold.runtime.batch import InputRecord
from refold.runtime.joins import JoinShardProcessor
from refold.runtime.processor import BatchProcessor
from refold.spark.job import engine_topics

PARTITIONS = 4


class DecodingJoinShard(JoinShardProcessor):
    """A join shard whose batches the Python readers read (the native cores never do)."""

    core_reads = False


class DecodingProcessor(BatchProcessor):
    """The engine's shards, each a `DecodingJoinShard` (`shard_type`: the benchmarks' seam)."""

    shard_type = DecodingJoinShard


def input_records(workload: JoinWorkload) -> list[InputRecord]:
    """Both sides' records, each keyed by its `id` into one of 4 partitions by its hash."""
    offsets: dict[int, int] = {}
    records = []
    for side, record in generate_join(workload):
        key = orjson.dumps({"id": record["id"]})
        partition = zlib.crc32(key) % PARTITIONS + (RIGHT_PARTITIONS if side == CUSTOMERS else 0)
        offset = offsets[partition] = offsets.get(partition, -1) + 1
        records.append(InputRecord(partition, offset, key, orjson.dumps(record), 0))
    return records


def shard_pipeline(name: str, bootstrap: str, core: str, batch: int, state_dir: str) -> Pipeline:
    """The join's pipeline, merged: one shard joins every partition of both sources."""
    return parse_pipeline({
        "pipeline": name,
        "kafka": {"bootstrap.servers": bootstrap},
        "sources": {side: {"topic": f"{name}.{side}"} for side in SIDE_NAMES},
        "view": JOIN_VIEW,
        "outputs": {"view": {"topic": f"{name}.view"}},
        "max_batch_events": batch,
        "spark": {"core": "python" if core == "python" else "native", "state_dir": state_dir},
    })


def run(records: list[InputRecord], bootstrap: str, core: str, batch: int, name: str | None = None) -> float:
    """One run's CPU seconds, a pipeline `name` of its own (its transactional ids start anew)."""
    name = name or f"hotpath-join-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="refold-hotpath-") as state_dir:
        spec = shard_pipeline(name, bootstrap, core, batch, state_dir)
        settings = spec.kafka_settings(None)
        ensure_topics(settings, [TopicSpec(f"{name}.{side}", PARTITIONS) for side in SIDE_NAMES])
        ensure_topics(settings, engine_topics(spec, PARTITIONS))
        processor = BatchProcessor(spec, settings) if core == "read" else DecodingProcessor(spec, settings)
        try:
            started = time.process_time()
            for at in range(0, len(records), batch):
                processor.process(records[at:at + batch])
            return time.process_time() - started
        finally:
            processor.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hotpath --view join-shard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=200_000, help="order events (customers: a twentieth)")
    parser.add_argument("--batch", type=int, default=50_000, help="events per batch")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--core", default="read,decode,python")
    args = parser.parse_args(argv)
    from refold.dev.localkafka import ensure_broker

    bootstrap = ensure_broker(None, start_local=True)
    records = input_records(JoinWorkload(orders=args.orders, customers=max(1, args.orders // 20)))
    best: dict[str, float] = {}
    for core in [c.strip() for c in args.core.split(",") if c.strip()]:
        times = [run(records, bootstrap, core, args.batch) for _ in range(args.repeat)]
        best[core] = min(times)
        print(f"join shard ({core}): {len(records):,} events, batch {args.batch:,}: {best[core]:.2f} CPU s "
              f"(best of {args.repeat}), {best[core] / len(records) * 1e6:.1f} µs/event")
    if "read" in best and "decode" in best:
        print(f"native reading / Python reading CPU: {best['read'] / best['decode']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
