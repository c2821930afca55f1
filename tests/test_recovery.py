"""Spark's checkpoint directory against Kafka's committed offsets, on a real broker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer

from refold.kafka.io import next_visible_offsets, producer_config, read_to_end
from refold.recovery.restore import reconcile_spark_checkpoint

pytestmark = pytest.mark.kafka


def transactions(settings: dict[str, Any], topic: str, sizes: list[int], *, abort_last: bool = False) -> None:
    """One transaction per size, each of that many records on partition 0."""
    producer = Producer(producer_config(settings, **{"transactional.id": f"{topic}-writer"}))
    producer.init_transactions(30)
    for i, size in enumerate(sizes):
        producer.begin_transaction()
        for n in range(size):
            producer.produce(topic, orjson.dumps({"txn": i, "n": n}), partition=0)
        if abort_last and i == len(sizes) - 1:
            producer.flush(30)  # on the broker first: abort_transaction drops unsent records
            producer.abort_transaction(30)
        else:
            producer.commit_transaction(30)


def spark_directory(root: Path, topic: str, offsets: dict[int, int], *, committed: bool = True) -> Path:
    """A Spark checkpoint directory whose batch 0 read `topic` up to `offsets`."""
    directory = root / "spark"
    (directory / "offsets").mkdir(parents=True)
    (directory / "commits").mkdir()
    line = orjson.dumps({topic: {str(p): o for p, o in offsets.items()}}).decode()
    (directory / "offsets" / "0").write_text(f'v1\n{{"batchWatermarkMs":0}}\n{line}\n')
    if committed:
        (directory / "commits" / "0").write_text('v1\n{"nextBatchWatermarkMs":0}\n')
    return directory


def record_offsets(settings: dict[str, Any], topic: str) -> list[int]:
    return [int(m.offset() or 0) for m in read_to_end(settings, topic)]


def test_markers_only_between_the_offsets_keep_the_directory(kafka_config, topic, tmp_path) -> None:
    source = topic(partitions=1)
    transactions(kafka_config, source, [3, 2])  # records 0-2, marker 3, records 4-5, marker 6
    assert record_offsets(kafka_config, source) == [0, 1, 2, 4, 5]
    # Refold stopped after record 5; Spark read up to the end, past the marker
    assert next_visible_offsets(kafka_config, source, {0: 6}) == {0: 7}
    directory = spark_directory(tmp_path, source, {0: 7})
    assert reconcile_spark_checkpoint(directory, source, {0: 6}, kafka_config)
    assert directory.exists()


def test_a_record_between_the_offsets_discards_it(kafka_config, topic, tmp_path) -> None:
    source = topic(partitions=1)
    transactions(kafka_config, source, [3, 2])
    # Refold committed up to record 2 only (its marker at 3): records 4-5 are not reduced
    assert next_visible_offsets(kafka_config, source, {0: 3}) == {0: 4}
    directory = spark_directory(tmp_path, source, {0: 7})
    assert not reconcile_spark_checkpoint(directory, source, {0: 3}, kafka_config)
    assert not directory.exists()


def test_an_aborted_transaction_counts_as_markers(kafka_config, topic, tmp_path) -> None:
    source = topic(partitions=1)
    transactions(kafka_config, source, [2, 4], abort_last=True)  # records 0-1, marker 2, aborted 3-6, marker 7
    assert record_offsets(kafka_config, source) == [0, 1]
    directory = spark_directory(tmp_path, source, {0: 8})
    assert reconcile_spark_checkpoint(directory, source, {0: 2}, kafka_config)


@pytest.mark.parametrize(
    ("spark", "kafka", "committed"),
    [
        ({0: 2}, {0: 6}, True),  # Spark behind Kafka
        ({0: 7}, {0: 6}, False),  # Spark planned a batch it never committed
        ({0: 9}, {0: 6}, True),  # Spark past the end of the log
    ],
)
def test_other_disagreements_discard_it(kafka_config, topic, tmp_path, spark, kafka, committed) -> None:
    source = topic(partitions=1)
    transactions(kafka_config, source, [3, 2])
    directory = spark_directory(tmp_path, source, spark, committed=committed)
    assert not reconcile_spark_checkpoint(directory, source, kafka, kafka_config)
    assert not directory.exists()
