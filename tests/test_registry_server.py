"""The engine against a real schema registry server: Apicurio Registry 3.3.3
(`refold.dev.localregistry`, from Maven Central) through its Confluent-compatible API.

A source subject evolves: its producers write with confluent-kafka's own
`AvroSerializer`, first under v1 (player_name, score), then under v2, which adds an
optional field (`bonus`, nullable, default null), with corrections and retractions
under v2 of rows appended under v1, and under v1 (a producer not yet upgraded) of
rows appended under v2. The pipeline names the registry and no reader schema: each
record is read as its writer schema says, so a row written under v1 has no `bonus`
and the same row under v2 a null one, and those must be the same row. Nothing may
be dead-lettered, and the view (Avro, registered by the engine in the same registry
and read back with confluent-kafka's `AvroDeserializer`) and its deltas must equal
the reference reducer's over the same events, record by record.

No registry server is a failure, never a skip.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext

from refold.codecs import unframe, with_system_fields
from refold.config import Pipeline, parse_pipeline
from refold.dev import localregistry
from refold.kafka.io import read_to_end
from refold.model.changelog import Op, message_key_bytes
from refold.ops.verify import Report, by_key, fold_delta_topic, output_key, read_source, same
from refold.recovery.restore import load_checkpoint
from refold.reduce import ViewChange
from refold.reference import fold_changelog, merge_partitions, reference_changelog
from refold.spark.job import run_pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

SCORE_V1 = {
    "type": "record",
    "name": "Score",
    "namespace": "test.registry",
    "fields": [{"name": "player_name", "type": "string"}, {"name": "score", "type": "long"}],
}
BONUS = {"name": "bonus", "type": ["null", "long"], "default": None}
SCORE_V2 = {**SCORE_V1, "fields": [*SCORE_V1["fields"], BONUS]}
# BACKWARD incompatible: a new field without a default cannot be read from v2 records
SCORE_BAD = {**SCORE_V1, "fields": [*SCORE_V2["fields"], {"name": "team", "type": "string"}]}
VIEW_ROW = {
    "type": "record",
    "name": "PlayerTotals",
    "namespace": "test.registry",
    "fields": [
        {"name": "player_name", "type": "string"},
        {"name": "total", "type": "long"},
        {"name": "games", "type": "long"},
        {"name": "bonuses", "type": "long"},
        {"name": "bonus_total", "type": ["null", "long"]},
        {"name": "best_bonus", "type": ["null", "long"]},
    ],
}
COLUMNS = {
    "total": {"sum": "score"},
    "games": {"count": "*"},
    "bonuses": {"count": "bonus"},
    "bonus_total": {"sum": "bonus"},
    "best_bonus": {"max": "bonus"},
}
KEY = ("player_name",)


@pytest.fixture(scope="module")
def registry(refold_home: Path) -> Iterator[localregistry.RegistryInfo]:
    try:
        info = localregistry.start(home=refold_home, quiet=True, die_with_parent=True)
    except Exception as exc:  # no registry at all: fail loudly, never skip
        pytest.fail(f"no schema registry server for this test: {exc}", pytrace=False)
    try:
        yield info
    finally:
        localregistry.stop(home=refold_home)


class Changelog:
    """Writes a valid changelog keyed by player_name in the Confluent wire format, with
    the serializer of the schema version in use, and remembers what it wrote: each
    event as its writer schema has it (`bonus` only under v2)."""

    def __init__(self, producer: Producer, topic: str, seed: int) -> None:
        self.producer = producer
        self.topic = topic
        self.rng = random.Random(seed)
        self.live: dict[str, list[dict[str, Any]]] = {}  # key -> its live rows, as last written
        self.written: list[tuple[Op, dict[str, Any]]] = []  # (op, row as written)
        self.ids: set[int] = set()
        self.time = 1_700_000_000_000

    def send(self, serialize: AvroSerializer, op: Op, row: dict[str, Any], *, v2: bool) -> None:
        written = {k: v for k, v in row.items() if v2 or k != "bonus"}
        if v2:
            written.setdefault("bonus", None)
        self.time += self.rng.randint(1, 20)
        value = serialize({"op": int(op), "event_time": self.time, **written},
                          SerializationContext(self.topic, MessageField.VALUE))
        assert value is not None
        self.ids.add(unframe(value)[0])
        self.producer.produce(self.topic, value, message_key_bytes(KEY, [row["player_name"]]))
        self.written.append((op, written))

    def append(self, serialize: AvroSerializer, key: str, *, v2: bool) -> None:
        row: dict[str, Any] = {"player_name": key, "score": self.rng.randint(0, 100)}
        if v2:
            row["bonus"] = None if self.rng.random() < 0.3 else self.rng.randint(1, 9)
        self.live.setdefault(key, []).append(row)
        self.send(serialize, Op.APPEND, row, v2=v2)

    def pick(self, *, v1_rows: bool | None = None, nullable: bool = False) -> tuple[str, int] | None:
        """A live row: (key, index). `v1_rows` True/False: only rows appended under v1
        (no `bonus`) / v2; `nullable`: only rows without a bonus value (which a v1
        producer can name)."""
        found = [(key, i) for key, rows in self.live.items() for i, row in enumerate(rows)
                 if (v1_rows is None or ("bonus" not in row) == v1_rows)
                 and (not nullable or row.get("bonus") is None)]
        return self.rng.choice(found) if found else None

    def retract(self, serialize: AvroSerializer, where: tuple[str, int], *, v2: bool) -> None:
        key, index = where
        row = self.live[key].pop(index)
        self.send(serialize, Op.RETRACT, row, v2=v2)

    def correct(self, serialize: AvroSerializer, where: tuple[str, int], *, v2: bool) -> None:
        key, index = where
        old = self.live[key].pop(index)
        new: dict[str, Any] = {"player_name": key, "score": self.rng.randint(0, 100)}
        if v2:
            new["bonus"] = self.rng.randint(1, 9)
        self.send(serialize, Op.CORRECT_FROM, old, v2=v2)
        self.send(serialize, Op.CORRECT_TO, new, v2=v2)
        self.live[key].append(new)


def make_pipeline(source: str, url: str, tmp_path: Path) -> Pipeline:
    name = f"reg{uuid.uuid4().hex[:8]}"
    row_schema = tmp_path / "view.avsc"
    row_schema.write_text(json.dumps(VIEW_ROW))
    return parse_pipeline({
        "pipeline": name,
        "source": {"topic": source, "format": "avro"},  # no `schema`: each record as written
        "view": {"key": list(KEY), "columns": COLUMNS},
        "outputs": {"view": {"topic": f"{name}.view", "format": "avro", "schema": str(row_schema)},
                    "delta": {"topic": f"{name}.delta"}},
        "schema_registry": {"url": url},
        "trigger": "200ms",
        "max_batch_events": 80,
        "spark": {"checkpoint_dir": str(tmp_path / name)},
    })


def test_an_evolved_source_subject_through_a_real_registry(registry, bootstrap_servers, topic, tmp_path, spark) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=2)
    subject = f"{source}-value"
    client = SchemaRegistryClient({"url": registry.url})
    assert client.get_compatibility() == "BACKWARD"  # as Confluent's registry, the launcher's default
    producer = Producer({**settings, "enable.idempotence": True})
    log = Changelog(producer, source, seed=21)

    # v1: appends, and corrections and retractions of v1 rows
    v1 = AvroSerializer(client, json.dumps(with_system_fields(SCORE_V1)))
    keys = [f"player{n:02d}" for n in range(12)]
    for _ in range(120):
        where = log.pick() if log.rng.random() < 0.2 else None
        if where is None:
            log.append(v1, log.rng.choice(keys), v2=False)
        elif log.rng.random() < 0.5:
            log.retract(v1, where, v2=False)
        else:
            log.correct(v1, where, v2=False)
    producer.flush(30)
    (id1,) = log.ids

    # v2: an optional field, accepted as version 2 under BACKWARD; an incompatible one is not
    v2_schema = Schema(json.dumps(with_system_fields(SCORE_V2)), "AVRO")
    assert client.test_compatibility(subject, v2_schema)
    id2 = client.register_schema(subject, v2_schema)
    assert id2 != id1
    assert client.get_versions(subject) == [1, 2]
    latest = client.get_latest_version(subject)
    assert (latest.version, latest.schema_id) == (2, id2)
    bad = Schema(json.dumps(with_system_fields(SCORE_BAD)), "AVRO")
    assert not client.test_compatibility(subject, bad)
    with pytest.raises(SchemaRegistryError) as refused:
        client.register_schema(subject, bad)
    assert refused.value.http_status_code == 409
    assert client.get_versions(subject) == [1, 2]

    # under v2 (looked up, not registered again): every key's v1 rows corrected or
    # retracted, new appends with and without a bonus, corrections of v2 rows
    v2 = AvroSerializer(client, v2_schema.schema_str, conf={"auto.register.schemas": False})
    for key in keys:
        while (index := next((i for i, row in enumerate(log.live.get(key, [])) if "bonus" not in row), None)) is not None:
            if log.rng.random() < 0.6:
                log.correct(v2, (key, index), v2=True)
            else:
                log.retract(v2, (key, index), v2=True)
        if log.rng.random() < 0.5:
            log.append(v2, key, v2=True)
    for _ in range(80):
        where = log.pick() if log.rng.random() < 0.3 else None
        if where is None:
            log.append(v2, log.rng.choice(keys), v2=True)
        elif log.rng.random() < 0.5:
            log.retract(v2, where, v2=True)
        else:
            log.correct(v2, where, v2=True)
    producer.flush(30)
    assert log.ids == {id1, id2}

    # a producer still on v1: retracts rows appended under v2 with a null bonus, appends
    lagging = 0
    for _ in range(20):
        where = log.pick(v1_rows=False, nullable=True)
        if where is not None and log.rng.random() < 0.6:
            log.retract(v1, where, v2=False)
            lagging += 1
        else:
            log.append(v1, log.rng.choice(keys), v2=False)
    producer.flush(30)
    assert lagging > 0
    assert client.get_versions(subject) == [1, 2]  # the v1 serializer found v1 again

    pipeline = make_pipeline(source, registry.url, tmp_path)
    progress = run_pipeline(pipeline, bootstrap_servers, until_idle=1.0, spark=spark, quiet=True)
    assert progress.batches >= 3

    # nothing dead-lettered, every event counted in once
    assert list(read_to_end(settings, pipeline.dlq_topic)) == []
    checkpoint = load_checkpoint(pipeline, settings)
    assert checkpoint is not None and checkpoint.dlq == 0 and checkpoint.records_in == len(log.written)

    # the source as the registry's schemas read it: exactly what was written
    partitions, undecodable = read_source(pipeline, settings)
    assert undecodable == 0
    read = by_key(ViewChange(e.op, (e.row["player_name"],), e.row) for p in partitions.values() for e in p)
    wrote = by_key(ViewChange(op, (row["player_name"],), row) for op, row in log.written)
    assert read == wrote

    # the view: Avro under `<view topic>-value` in the same registry, read by confluent-kafka
    assert pipeline.outputs.view is not None
    view_topic = pipeline.outputs.view.topic
    view_subject = client.get_latest_version(f"{view_topic}-value")
    deserialize = AvroDeserializer(client)
    changes: dict[int, list[ViewChange]] = {}
    for msg in read_to_end(settings, view_topic):
        value = msg.value()
        assert value is not None and unframe(value)[0] == view_subject.schema_id
        record = deserialize(value, SerializationContext(view_topic, MessageField.VALUE))
        op = Op(record.pop("op"))
        assert record.pop("event_time") is None
        changes.setdefault(msg.partition() or 0, []).append(ViewChange(op, output_key(pipeline, record), record))
    actual = [change for partition in sorted(changes) for change in changes[partition]]

    # ... equals the reference over the same events, record by record
    expected = reference_changelog(pipeline.view, merge_partitions(partitions))
    assert expected.rejected == []
    want, got = by_key(expected.changes), by_key(actual)
    assert want.keys() == got.keys()
    for key in want:
        assert len(want[key]) == len(got[key]) and all(
            a[0] == b[0] and same(dict(a[1]), dict(b[1])) for a, b in zip(want[key], got[key], strict=True)
        ), (key, want[key], got[key])
    folded = fold_changelog(actual)
    assert folded.keys() == expected.view.keys() and all(same(folded[k], expected.view[k]) for k in folded)
    deltas = fold_delta_topic(pipeline, settings, Report())
    assert deltas.keys() == expected.view.keys() and all(same(deltas[k], expected.view[k]) for k in deltas)
    # the bonus columns saw both versions' rows: some keys have a bonus, some rows had none
    assert any(row["bonuses"] for row in folded.values()) and any(row["games"] > row["bonuses"] for row in folded.values())
