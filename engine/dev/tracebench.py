"""How long `refold trace --key` takes on a big view topic (docs/provenance.md).

    python -m refold.dev.tracebench --bootstrap-servers HOST:PORT --records 10000000

Fills a one-partition view topic with `--records` view records over `--keys` keys
(each with its `refold.cause` header, pointing into a source topic of as many
records) and, as the engine's shard does, one trace index record (`P.trace`,
refold.runtime.traceindex) per batch of `--batch` view records; then times `trace_key`
of one key, cause fetches included, and `trace_input` of one event. A shard's view
partition is what the trace reads, so one partition stands for one shard. `--scan`
also times the full scan a pipeline without an index falls back to.
"""

from __future__ import annotations

import argparse
import random
import time
import uuid

import orjson
from confluent_kafka import Producer

from refold.cli.trace import trace_input, trace_key
from refold.config import parse_pipeline
from refold.kafka.io import TopicSpec, ensure_topics
from refold.plan import trace_topic
from refold.runtime.traceindex import build_entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=20_000, help="view records per engine batch (index record)")
    parser.add_argument("--scan", action="store_true", help="also time the scan without the index")
    args = parser.parse_args()
    settings = {"bootstrap.servers": args.bootstrap_servers}
    name = f"tb{uuid.uuid4().hex[:8]}"
    source, view = f"{name}.source", f"{name}.view"
    spec = {"pipeline": name, "kafka": settings, "source": {"topic": source},
            "view": {"key": ["player"], "columns": {"total": {"sum": "score"}}},
            "outputs": {"view": {"topic": view}}}
    pipeline = parse_pipeline(spec)
    index = trace_topic(pipeline)
    ensure_topics(settings, [TopicSpec(source, 1), TopicSpec(view, 1), TopicSpec(index, 1)])
    producer = Producer({**settings, "linger.ms": 50, "batch.num.messages": 10_000, "queue.buffering.max.messages": 500_000,
                         "message.max.bytes": 10_000_000})
    rng = random.Random(7)
    started = time.monotonic()
    view_bytes = index_bytes = 0
    batch: list[tuple[bytes]] = []
    for offset in range(args.records):
        player = f"p{rng.randrange(args.keys)}"
        producer.produce(source, orjson.dumps({"op": "+A", "player": player, "score": offset % 100}), None, 0)
        key, value, cause = orjson.dumps({"player": player}), orjson.dumps({"op": "+C", "player": player, "total": offset}), b"0:%d" % offset
        producer.produce(view, value, key, 0, headers=[("refold.cause", cause)])
        view_bytes += len(key) + len(value) + len("refold.cause") + len(cause)
        batch.append((key,))
        if len(batch) == args.batch or offset == args.records - 1:
            first = offset + 1 - len(batch)
            entry = build_entry(batch, 0, first, first // args.batch + 1, [(0, first, offset + 1)])
            producer.produce(index, entry, b"bench/0", 0)
            index_bytes += len(entry) + len(b"bench/0")
            batch = []
        if offset % 100_000 == 0:
            producer.poll(0)
    producer.flush(600)
    filled = time.monotonic() - started
    started = time.monotonic()
    found = trace_key(pipeline, settings, {"player": "p1"})
    took = time.monotonic() - started
    print(f"filled {args.records:,} view records ({view_bytes / 1e6:,.0f} MB of keys, values and headers) and "
          f"{-(-args.records // args.batch):,} index records ({index_bytes / 1e6:,.1f} MB, "
          f"{index_bytes / view_bytes:.1%}) in {filled:.1f}s")
    print(f"trace --key of one key through the index: {len(found)} records, {took:.2f}s")
    target = found[len(found) // 2]["cause"]["offset"] if found else args.records // 2
    started = time.monotonic()
    caused = trace_input(pipeline, settings, source, 0, target)
    print(f"trace --input of one event through the index: {len(caused)} records, {time.monotonic() - started:.2f}s")
    if args.scan:
        unindexed = parse_pipeline({**spec, "pipeline": f"{name}-noindex"})  # (no P.trace of that name)
        started = time.monotonic()
        scanned = trace_key(unindexed, settings, {"player": "p1"})
        took = time.monotonic() - started
        assert [(r["partition"], r["offset"]) for r in scanned] == [(r["partition"], r["offset"]) for r in found]
        print(f"trace --key of the same key by a scan: {len(scanned)} records, {took:.2f}s")


if __name__ == "__main__":
    main()
