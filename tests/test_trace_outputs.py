"""`refold trace --input` on the delta and dead-letter topics: several shards write each
of their partitions, so no index names their offsets; they are read from the input
event's record timestamp on (less `CLOCK_SKEW_MS`), as the engine stamps what it writes
with its clock after it read the event. What that bounded read finds is what a full scan
finds, and it skips what the engine wrote before the event."""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer

from refold.cli import trace, traceread
from refold.config import Pipeline, parse_pipeline
from refold.kafka.io import ensure_topics, read_to_end
from refold.runtime.batch import InputRecord
from refold.runtime.processor import BatchProcessor
from refold.spark.job import engine_topics

pytestmark = pytest.mark.kafka

PARTITIONS = 2


def _pipeline(settings_: dict[str, Any], source: str) -> Pipeline:
    name = f"to{uuid.uuid4().hex[:8]}"
    pipeline = parse_pipeline({
        "pipeline": name, "kafka": settings_, "source": {"topic": source, "key": ["g"]},
        "view": {"key": ["g"], "columns": {"total": {"sum": "score"}}},
        "outputs": {"view": {"topic": f"{name}.view"}, "delta": {"topic": f"{name}.delta"}}})
    ensure_topics(settings_, engine_topics(pipeline, PARTITIONS))
    return pipeline


def _produce(settings_: dict[str, Any], source: str, rows: list[dict[str, Any]]) -> list[InputRecord]:
    producer = Producer({**settings_, "enable.idempotence": True})
    placed: list[Any] = []
    for row in rows:
        producer.produce(source, orjson.dumps(row), orjson.dumps({"g": row["g"]}), partition=row["g"] % PARTITIONS,
                         on_delivery=lambda err, msg: placed.append(msg))
    producer.flush(30)
    assert len(placed) == len(rows) and all(m.error() is None for m in placed)
    placed.sort(key=lambda m: (m.partition(), m.offset()))
    return [InputRecord(m.partition(), m.offset(), m.key(), m.value(), m.timestamp()[1]) for m in placed]


def _run(pipeline: Pipeline, settings_: dict[str, Any], records: list[InputRecord]) -> None:
    processor = BatchProcessor(pipeline, settings_)
    try:
        processor.process(records)
    finally:
        processor.close()


def test_input_reads_the_delta_and_dead_letters_from_the_event_on(bootstrap_servers: str, topic: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "CLOCK_SKEW_MS", 0)  # (one machine, one clock)
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    pipeline = _pipeline(settings_, source)
    assert pipeline.outputs.delta is not None
    _run(pipeline, settings_, _produce(settings_, source, [{"op": "+A", "g": g, "score": g} for g in range(8)]))
    time.sleep(0.05)
    later = _produce(settings_, source, [{"op": "+A", "g": 1, "score": 10}, {"op": "-R", "g": 2, "score": 99}])
    _run(pipeline, settings_, later)
    scanned: dict[bytes, list[tuple[str, int, int]]] = {}
    for output in (pipeline.outputs.delta.topic, pipeline.dlq_topic):
        for msg in read_to_end(settings_, output):
            scanned.setdefault(dict(msg.headers() or [])["refold.cause"], []).append(
                (msg.topic(), msg.partition(), msg.offset()))
    for record in later:  # an append (its delta row) and a retraction of no live row (a dead letter)
        notes: list[str] = []
        got = trace.trace_input(pipeline, settings_, source, record.partition, record.offset, note=notes.append)
        outs = sorted((r["topic"], r["partition"], r["offset"]) for r in got if r["output"] != "view")
        assert outs and outs == sorted(scanned[b"%d:%d" % (record.partition, record.offset)])
        assert notes == []
    # the read skipped what the first run wrote
    starts = traceread.written_since(settings_, pipeline.outputs.delta.topic, later[0].timestamp)
    read = list(read_to_end(settings_, pipeline.outputs.delta.topic, start=starts, only=list(starts)))
    assert len(list(read_to_end(settings_, pipeline.outputs.delta.topic))) == 9
    assert [orjson.loads(m.key()) for m in read] == [{"g": 1}]
