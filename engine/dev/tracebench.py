"""How long `refold trace --key` takes on a big view topic (docs/provenance.md).

    python -m refold.dev.tracebench --bootstrap-servers HOST:PORT --records 10000000

Fills a one-partition view topic with `--records` view records over `--keys` keys
(each with its `refold.cause` header, pointing into a source topic of as many
records) and, as the engine's shard does, one trace index record (`P.trace`,
refold.runtime.traceindex) per batch of `--batch` view records; then times `trace_key`
of one key, cause fetches included, and `trace_input` of one event. A shard's view
partition is what the trace reads, so one partition stands for one shard. `--scan`
also times the full scan a pipeline without an index falls back to.

`--join`: the view is a grouped view over a join (`orders ⋈ customers`, per customer):
its records' causes name either source (`<topic>:<partition>:<offset>`), one in
`--customer-every` a customer record's correction (the customers topic holds those),
the rest an order's; the index's source ranges number the customers' partition as a
join's shards do (`RIGHT_PARTITIONS + p`); `trace_input` traces a customer record.
"""

from __future__ import annotations

import argparse
import random
import time
import uuid
from typing import Any

import orjson
from confluent_kafka import Producer

from refold.cli.trace import trace_input, trace_key
from refold.config import parse_pipeline
from refold.kafka.io import TopicSpec, ensure_topics
from refold.plan import RIGHT_PARTITIONS, trace_topic
from refold.runtime.traceindex import build_entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=20_000, help="view records per engine batch (index record)")
    parser.add_argument("--scan", action="store_true", help="also time the scan without the index")
    parser.add_argument("--join", action="store_true", help="a grouped view over a join (causes name either source)")
    parser.add_argument("--customer-every", type=int, default=50, help="with --join: one view record in N a customer's")
    args = parser.parse_args()
    settings = {"bootstrap.servers": args.bootstrap_servers}
    name = f"tb{uuid.uuid4().hex[:8]}"
    source, view, right = f"{name}.source", f"{name}.view", f"{name}.customers"
    spec: dict[str, Any] = {"pipeline": name, "kafka": settings, "source": {"topic": source},
                            "view": {"key": ["player"], "columns": {"total": {"sum": "score"}}},
                            "outputs": {"view": {"topic": view}}}
    if args.join:
        join = {"left": "orders", "right": "customers", "on": [["player", "player"]], "type": "inner",
                "columns": {"player": "orders.player", "score": "orders.score", "name": "customers.name"}}
        spec = {**{k: v for k, v in spec.items() if k != "source"},
                "sources": {"orders": {"topic": source}, "customers": {"topic": right}},
                "view": {"join": join, "key": ["player"], "columns": {"total": {"sum": "score"}}}}
    pipeline = parse_pipeline(spec)
    index = trace_topic(pipeline)
    ensure_topics(settings, [TopicSpec(source, 1), TopicSpec(view, 1), TopicSpec(index, 1)]
                  + ([TopicSpec(right, 1)] if args.join else []))
    producer = Producer({**settings, "linger.ms": 50, "batch.num.messages": 10_000, "queue.buffering.max.messages": 500_000,
                         "message.max.bytes": 10_000_000})
    rng = random.Random(7)
    started = time.monotonic()
    view_bytes = index_bytes = 0
    batch: list[tuple[bytes]] = []
    customers = batch_customers = 0  # (--join: the customer records written so far, before the batch)
    for offset in range(args.records):
        if not batch:
            batch_customers = customers
        player = f"p{rng.randrange(args.keys)}"
        producer.produce(source, orjson.dumps({"op": "+A", "player": player, "score": offset % 100}), None, 0)
        key, value, cause = orjson.dumps({"player": player}), orjson.dumps({"op": "+C", "player": player, "total": offset}), b"0:%d" % offset
        if args.join:
            cause = b"%s:%s" % (source.encode(), cause)
            if offset % args.customer_every == 0:
                producer.produce(right, orjson.dumps({"op": "-C", "player": player, "name": f"n{offset}"}), None, 0)
                cause, customers = b"%s:0:%d" % (right.encode(), customers), customers + 1
        producer.produce(view, value, key, 0, headers=[("refold.cause", cause)])
        view_bytes += len(key) + len(value) + len("refold.cause") + len(cause)
        batch.append((key,))
        if len(batch) == args.batch or offset == args.records - 1:
            first = offset + 1 - len(batch)
            sources = [(0, first, offset + 1)]
            if args.join:  # the customer records of this batch
                sources.append((RIGHT_PARTITIONS, batch_customers, customers))
            entry = build_entry(batch, 0, first, first // args.batch + 1, sources)
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
    if args.join:  # a customer's record
        picked = [r["cause"] for r in found if r["cause"]["topic"] == right] or [{"topic": right, "offset": 0}]
    else:
        picked = [r["cause"] for r in found] or [{"topic": source, "offset": args.records // 2}]
    target = picked[len(picked) // 2]
    started = time.monotonic()
    caused = trace_input(pipeline, settings, target["topic"], 0, target["offset"])
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
