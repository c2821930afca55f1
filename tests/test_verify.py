"""The verifier's readers on a real broker."""

from __future__ import annotations

import itertools
import random

import orjson
import pytest
from confluent_kafka import Producer

from refold.config import parse_pipeline
from refold.kafka.io import producer_config, read_to_end
from refold.ops.verify import Report, _check_partitions, read_view_changes
from refold.reduce.values import key_bytes
from refold.reference import fold_changelog
from refold.runtime.exchange import shard_of

pytestmark = pytest.mark.kafka


def test_view_changes_keep_each_correction_pair_together(kafka_config, topic) -> None:
    """A read interleaves partitions wherever a fetch ends, so it can put another
    partition's record between a `-C` and its `+C`; the view reader must not."""
    view_topic = topic(partitions=2)
    pipeline = parse_pipeline({
        "pipeline": "verify-reader",
        "source": {"topic": "unused", "format": "jsonl"},
        "view": {"key": ["player_name"], "columns": {"total": {"sum": "score"}}},
        "outputs": {"view": {"topic": view_topic}},
    })
    # many small record batches (an odd size: pairs straddle them), so small fetches end between them
    producer = Producer(producer_config(kafka_config, **{"transactional.id": f"{view_topic}-writer",
                                                         "batch.num.messages": 7, "linger.ms": 0}))
    producer.init_transactions(30)
    rng = random.Random(3)
    pads = ["x" * rng.randrange(40) for _ in range(301)]  # rows of random length: fetches end after -C too
    producer.begin_transaction()
    for partition in (0, 1):
        key = f"k{partition}"
        row = {"op": "+A", "player_name": key, "total": 0, "pad": pads[0]}
        producer.produce(view_topic, orjson.dumps(row), partition=partition)
        producer.flush(30)
        for n in range(300):
            for op, total in (("-C", n), ("+C", n + 1)):
                row = {"op": op, "player_name": key, "total": total, "pad": pads[total]}
                producer.produce(view_topic, orjson.dumps(row), partition=partition)
                producer.poll(0)
    producer.commit_transaction(30)
    tiny_fetches = {**kafka_config, "max.partition.fetch.bytes": 2048}

    # a plain read switches partitions at fetch ends
    raw = [(m.partition(), orjson.loads(m.value() or b"")) for m in read_to_end(tiny_fetches, view_topic)]
    assert sum(1 for (a, _), (b, _) in itertools.pairwise(raw) if a != b) > 2

    changes = read_view_changes(pipeline, tiny_fetches)
    grouped = [row for _, row in sorted(raw, key=lambda item: item[0])]  # stable: offset order kept
    assert [(c.op.code, c.row["total"]) for c in changes] == [(row["op"], row["total"]) for row in grouped]
    folded = fold_changelog(changes)
    assert sorted(folded) == [("k0",), ("k1",)]
    assert all(row["total"] == 300 for row in folded.values())


def _partitioned(partitioning: str, **extra: object):
    return parse_pipeline({
        "pipeline": "verify-partitions", "source": {"topic": "s", "format": "jsonl", "key": ["player"]},
        "view": {"key": ["team"], "columns": {"n": {"count": "*"}}}, **extra,
        "outputs": {"view": {"topic": "v", "partitioning": partitioning}},
    })


@pytest.mark.parametrize("where", ["right", "wrong", "split"])
def test_the_verifier_finds_a_view_key_outside_its_writers_partition(where: str) -> None:
    """Partitioned by shard: a re-grouping view's key in its stage-2 shard's partition, a
    co-partitioned view's in its source partition; by key: in one partition, any."""
    regrouped = _partitioned("shard", shards=3)
    home = shard_of(key_bytes(("red",)), 3)
    elsewhere = (home + 1) % 3
    placed = {("red",): {"right": {home}, "wrong": {elsewhere}, "split": {home, elsewhere}}[where]}
    report = Report()
    _check_partitions(report, regrouped, {}, placed)
    assert len(report.anomalies) == (0 if where == "right" else 1), report.anomalies

    co_partitioned = _partitioned("shard").model_copy(update={"source": regrouped.source.model_copy(
        update={"key": ["team"]})})
    report = Report()
    _check_partitions(report, co_partitioned, {("red",): 2}, {("red",): {2 if where == "right" else 1}})
    assert len(report.anomalies) == (0 if where == "right" else 1), report.anomalies

    by_key = _partitioned("key", shards=3)
    report = Report()
    _check_partitions(report, by_key, {}, {("red",): {1, 2} if where == "split" else {1}})
    assert len(report.anomalies) == (1 if where == "split" else 0), report.anomalies
