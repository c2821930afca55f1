"""How long `refold trace --key` takes on a big view topic (docs/provenance.md).

    python -m refold.dev.tracebench --bootstrap-servers HOST:PORT --records 1000000

Fills a one-partition view topic with `--records` view records over `--keys` keys
(each with its `refold.cause` header, pointing into a source topic of as many
records), then times `trace_key` of one key, cause fetches included. A shard's view
partition is what the trace scans, so one partition stands for one shard.
"""

from __future__ import annotations

import argparse
import random
import time
import uuid

import orjson
from confluent_kafka import Producer

from refold.cli.trace import trace_key
from refold.config import parse_pipeline
from refold.kafka.io import TopicSpec, ensure_topics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    args = parser.parse_args()
    settings = {"bootstrap.servers": args.bootstrap_servers}
    name = f"tb{uuid.uuid4().hex[:8]}"
    source, view = f"{name}.source", f"{name}.view"
    ensure_topics(settings, [TopicSpec(source, 1), TopicSpec(view, 1)])
    producer = Producer({**settings, "linger.ms": 50, "batch.num.messages": 10_000, "queue.buffering.max.messages": 500_000})
    rng = random.Random(7)
    started = time.monotonic()
    for offset in range(args.records):
        player = f"p{rng.randrange(args.keys)}"
        row = {"op": "+A", "player": player, "score": offset % 100}
        producer.produce(source, orjson.dumps(row), None, 0)
        producer.produce(view, orjson.dumps({"op": "+C", "player": player, "total": offset}),
                         orjson.dumps({"player": player}), 0, headers=[("refold.cause", b"0:%d" % offset)])
        if offset % 100_000 == 0:
            producer.poll(0)
    producer.flush(600)
    filled = time.monotonic() - started
    pipeline = parse_pipeline({"pipeline": name, "kafka": settings, "source": {"topic": source},
                               "view": {"key": ["player"], "columns": {"total": {"sum": "score"}}},
                               "outputs": {"view": {"topic": view}}})
    started = time.monotonic()
    found = trace_key(pipeline, settings, {"player": "p1"})
    took = time.monotonic() - started
    print(f"filled {args.records:,} view records in {filled:.1f}s; trace --key of one key: "
          f"{len(found)} records, {took:.2f}s ({args.records / took:,.0f} view records scanned a second)")


if __name__ == "__main__":
    main()
