"""The limit contender of `make bench`: consume → produce with no reduction at all.

What the broker and the Python Kafka client allow on this machine, exactly once:
read the source topic `read_committed` from the beginning, produce every record
(key and value as they are) to the output topic with a transactional producer, and
commit every `per_transaction` records together with the consumed offsets
(`send_offsets_to_transaction`, the consume-transform-produce pattern). It stops
when every source partition has reached its end and the last transaction is
committed. Any pipeline that reads and writes the same records through this client
can at best match it.

`make bench` runs it as its own process (so that its peak RSS is its own):

    python -m bench.limit --bootstrap H:P --source T --output T2 [--per-transaction N]

and reads the one JSON object it prints: events, seconds, events_per_s, transactions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from typing import Any

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from refold.kafka.io import consumer_config, delivery_failures, partitions_of, producer_config


def run_limit(settings: dict[str, Any], source: str, output: str, per_transaction: int = 100_000) -> dict[str, Any]:
    started = time.monotonic()
    partitions = partitions_of(settings, source)
    consumer = Consumer(consumer_config(settings, **{"group.id": f"bench-limit-{uuid.uuid4()}"}))
    consumer.assign([TopicPartition(source, p, 0) for p in partitions])  # from the beginning
    producer = Producer(producer_config(settings, **{"transactional.id": f"bench-limit-{uuid.uuid4()}",
                                                     "delivery.report.only.error": True}))  # as the engine
    producer.init_transactions(30)
    errors, on_delivery = delivery_failures()
    open_partitions = set(partitions)
    events = in_txn = transactions = 0
    positions: dict[int, int] = {}
    producer.begin_transaction()

    def commit() -> None:
        nonlocal in_txn, transactions
        producer.flush(60)
        if errors:
            raise SystemExit(f"limit: Kafka refused a record: {errors[0].str()}")
        offsets = [TopicPartition(source, p, o) for p, o in positions.items()]
        producer.send_offsets_to_transaction(offsets, consumer.consumer_group_metadata(), 30)
        producer.commit_transaction(60)
        transactions += 1
        in_txn = 0

    while open_partitions:
        for message in consumer.consume(10_000, 1.0):
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    open_partitions.discard(message.partition() or 0)
                    continue
                raise SystemExit(f"limit: {error.str()}")
            while True:
                try:
                    producer.produce(output, message.value(), message.key(), on_delivery=on_delivery)
                    break
                except BufferError:
                    producer.poll(0.05)
            partition, offset = message.partition(), message.offset()
            assert partition is not None and offset is not None
            positions[partition] = offset + 1
            events += 1
            in_txn += 1
            if in_txn >= per_transaction:
                commit()
                producer.begin_transaction()
    commit()
    seconds = time.monotonic() - started
    consumer.close()
    return {
        "events": events, "seconds": seconds, "events_per_s": events / seconds if seconds else 0.0,
        "transactions": transactions,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--per-transaction", type=int, default=100_000)
    args = parser.parse_args(argv)
    result = run_limit({"bootstrap.servers": args.bootstrap}, args.source, args.output, args.per_transaction)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
