"""Source `format: debezium-json`: envelopes to changelog events, bad envelopes as errors;
updates and deletes whose `before` is missing or key-only (PostgreSQL's default replica
identity) completed from the key's last row, through the engine."""

from __future__ import annotations

import random
import shutil
import uuid
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from refold.codecs import DebeziumJsonDecoder, OneEventPerRecord, source_decoder
from refold.codecs.base import BadRecord
from refold.codecs.debezium import debezium_key
from refold.config import ViewSpec, parse_pipeline
from refold.errors import ConfigError, DecodeError, RecordError
from refold.kafka.io import ensure_topics, read_to_end
from refold.model.changelog import ChangelogEvent, Op
from refold.model.reasons import Reason
from refold.ops.verify import read_view_changes, verify
from refold.reference import fold_changelog, reference_table
from refold.runtime.processor import BatchProcessor, InputRecord
from refold.spark.job import engine_topics

ALICE = {"id": 1, "player_name": "Alice", "score": 100}
ALICE2 = {"id": 1, "player_name": "Alice", "score": 120}


def envelope(op: str, before: Any = None, after: Any = None, *, ts: int | None = 1_700_000_000_000,
             wrapped: bool = False) -> bytes:
    body: dict[str, Any] = {"op": op, "before": before, "after": after, "source": {"ts_ms": 5, "table": "scores"}}
    if ts is not None:
        body["ts_ms"] = ts
    if wrapped:  # the JSON converter with schemas.enable=true
        return orjson.dumps({"schema": {"type": "struct", "name": "scores.Envelope"}, "payload": body})
    return orjson.dumps(body)


def decode(*values: bytes | None) -> list[list[ChangelogEvent] | RecordError]:
    return DebeziumJsonDecoder().decode_records(list(values), list(range(10, 10 + len(values))), topic="cdc", partition=2)


@pytest.mark.parametrize("wrapped", [False, True])
def test_ops_map_to_changelog_events(wrapped: bool) -> None:
    ts = 1_700_000_000_000
    got = decode(
        envelope("r", after=ALICE, wrapped=wrapped),
        envelope("c", after={**ALICE, "id": 2, "player_name": "Bob"}, wrapped=wrapped),
        envelope("u", before=ALICE, after=ALICE2, wrapped=wrapped),
        envelope("d", before=ALICE2, wrapped=wrapped),
    )
    assert got == [
        [ChangelogEvent(Op.APPEND, ALICE, ts)],
        [ChangelogEvent(Op.APPEND, {**ALICE, "id": 2, "player_name": "Bob"}, ts)],
        [ChangelogEvent(Op.CORRECT_FROM, ALICE, ts), ChangelogEvent(Op.CORRECT_TO, ALICE2, ts)],
        [ChangelogEvent(Op.RETRACT, ALICE2, ts)],
    ]


def test_event_time_falls_back_to_source_ts_ms() -> None:
    (events,) = decode(envelope("c", after=ALICE, ts=None))
    assert isinstance(events, list) and events[0].event_time == 5


@pytest.mark.parametrize(
    "value",
    [None, b"null", orjson.dumps({"schema": {"type": "struct"}, "payload": None})],
    ids=["null value", "json null", "wrapped null payload"],
)
def test_tombstones_decode_to_no_events(value: bytes | None) -> None:
    assert decode(value) == [[]]


@pytest.mark.parametrize(
    ("value", "reason", "detail"),
    [
        (b"\x00\x01binary", "undecodable", "not JSON"),
        (b"[1, 2]", "undecodable", "JSON list"),
        (orjson.dumps({"before": None, "after": ALICE}), "schema mismatch", "no 'op'"),
        (envelope("t"), "schema mismatch", "unsupported Debezium op 't'"),
        (envelope("u", after=ALICE2), "schema mismatch", "REPLICA IDENTITY FULL"),
        (envelope("d"), "schema mismatch", "without its 'before'"),
        (envelope("c", after=None), "schema mismatch", "without its 'after'"),
        (envelope("c", after=ALICE, ts="yesterday"), "schema mismatch", "ts_ms must be an integer"),  # type: ignore[arg-type]
        (envelope("c", after={**ALICE, "op": "x"}), "schema mismatch", "system columns ['op']"),
    ],
)
def test_bad_envelopes_are_record_errors(value: bytes, reason: str, detail: str) -> None:
    (error,) = decode(value)
    assert isinstance(error, DecodeError)
    assert error.reason == reason
    assert detail in (error.detail or "")
    assert (error.source.topic, error.source.partition, error.source.offset) == ("cdc", 2, 10)
    assert error.value == value  # the raw bytes travel to the dead-letter topic


def test_a_batch_goes_on_past_bad_records() -> None:
    got = decode(b"{", envelope("c", after=ALICE), None)
    assert isinstance(got[0], RecordError) and got[0].source.offset == 10
    assert got[1] == [ChangelogEvent(Op.APPEND, ALICE, 1_700_000_000_000)]
    assert got[2] == []


def test_pipeline_format_selects_the_decoder() -> None:
    base = {"pipeline": "p", "view": {"key": ["id"], "columns": {"n": {"count": "*"}}}, "outputs": {"view": {"topic": "v"}}}
    debezium = parse_pipeline({**base, "source": {"topic": "cdc", "format": "debezium-json"}})
    assert isinstance(source_decoder(debezium), DebeziumJsonDecoder)
    jsonl = parse_pipeline({**base, "source": {"topic": "in"}})
    assert isinstance(source_decoder(jsonl), OneEventPerRecord)
    (events,) = source_decoder(jsonl).decode_records([b'{"op": "+A", "id": 1}'])
    assert events == [ChangelogEvent(Op.APPEND, {"id": 1})]
    with pytest.raises(ConfigError, match=r"source\.format"):
        parse_pipeline({**base, "source": {"topic": "cdc", "format": "debezium-avro"}})


# Key-only and missing `before` images, completed from the key's last row ---------------
# (refold.runtime.tables; the reference: refold.reference.reference_table)

CUSTOMERS = {"key": ["last_name"], "columns": {"customers": {"count": "*"}, "emails": {"set": "email"}}}


def test_debeziums_key_is_its_table_key_with_or_without_the_envelope() -> None:
    plain = debezium_key(b'{"id": 1001}')
    assert plain == debezium_key(orjson.dumps({"schema": {"type": "struct"}, "payload": {"id": 1001}}))
    assert debezium_key(None) is None
    with pytest.raises(BadRecord):
        debezium_key(b"[1]")


def test_an_update_without_before_and_a_key_only_delete_take_the_keys_row() -> None:
    key = debezium_key(b'{"id":1}')
    sally = {"id": 1, "first_name": "Sally", "last_name": "Thomas", "email": "sally@example.com"}
    moved = {**sally, "last_name": "Kim"}
    records = [
        (key, "c", sally, None, (1, 0, 0)),
        (key, "u", moved, None, (2, 0, 1)),  # REPLICA IDENTITY DEFAULT: no before
        (key, "d", None, {"id": 1}, (3, 0, 2)),  # key columns only
    ]
    result = reference_table(ViewSpec.model_validate(CUSTOMERS), {0: records})
    assert result.rejected == [] and result.view == {}
    assert [(c.op, c.key) for c in result.changes] == [
        (Op.APPEND, ("Thomas",)), (Op.APPEND, ("Kim",)), (Op.RETRACT, ("Thomas",)), (Op.RETRACT, ("Kim",)),
    ]


def test_a_before_that_is_not_the_keys_row_is_refused() -> None:
    key = debezium_key(b'{"id":1}')
    sally = {"id": 1, "last_name": "Thomas", "email": "s@x"}
    records = [
        (key, "c", sally, None, (1, 0, 0)),
        (key, "u", {**sally, "email": "t@x"}, {**sally, "email": "other@x"}, (2, 0, 1)),  # before differs
        # no row of key 2: the before stands for it, and the view refuses a key-only row
        (debezium_key(b'{"id":2}'), "d", None, {"id": 2}, (3, 0, 2)),
        (debezium_key(b'{"id":3}'), "u", {**sally, "id": 3}, None, (4, 0, 3)),  # no row, no before
    ]
    result = reference_table(ViewSpec.model_validate(CUSTOMERS), {0: records})
    assert [reason for _, reason in result.rejected] == [Reason.BEFORE_DIFFERS, Reason.NULL_KEY, Reason.NOT_LIVE]
    assert result.view == {("Thomas",): {"last_name": "Thomas", "customers": 1, "emails": [["s@x", 1]]}}


def postgres_events() -> list[tuple[bytes, bytes | None]]:
    """Debezium's documented PostgreSQL events for its `customers` table (postgresql.adoc,
    default replica identity, JSON converter with schemas): create, update (`before`
    null), delete (`before` the key only) and the tombstone after it; keys with schemas."""
    schema = {"type": "struct", "name": "PostgreSQL_server.inventory.customers.Envelope"}
    source = {"version": "2.5.0.Final", "connector": "postgresql", "name": "PostgreSQL_server",
              "ts_ms": 1559033904863, "snapshot": "false", "db": "postgres", "schema": "public",
              "table": "customers", "txId": 555, "lsn": 24023128, "xmin": None}

    def key(id_: int) -> bytes:
        return orjson.dumps({"schema": {"type": "struct", "name": "PostgreSQL_server.public.customers.Key",
                                        "fields": [{"type": "int32", "optional": False, "field": "id"}]},
                             "payload": {"id": id_}})

    def value(op: str, before: Any, after: Any, ts: int) -> bytes:
        return orjson.dumps({"schema": schema, "payload": {"before": before, "after": after, "source": source,
                                                           "op": op, "ts_ms": ts}})

    annie = {"id": 1, "first_name": "Anne", "last_name": "Kretchmar", "email": "annek@noanswer.org"}
    sally = {"id": 2, "first_name": "Sally", "last_name": "Thomas", "email": "sally.thomas@acme.com"}
    return [
        (key(1), value("r", None, annie, 1559033904860)),  # the snapshot
        (key(2), value("c", None, sally, 1559033904863)),
        (key(1), value("u", None, {**annie, "first_name": "Anne Marie"}, 1559033904870)),
        (key(2), value("u", None, {**sally, "email": "noreply@example.com"}, 1559033904875)),
        (key(2), value("d", {"id": 2}, None, 1559033904880)),
        (key(2), None),  # the tombstone
    ]


@pytest.mark.kafka
def test_debeziums_postgresql_events_with_the_default_replica_identity_give_their_view(
    bootstrap_servers: str, topic: Any, tmp_path: Any
) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=1)
    producer = Producer(settings)
    for key, value in postgres_events():
        producer.produce(source, value, key)
    producer.flush(30)
    name = f"dbz{uuid.uuid4().hex[:8]}"
    pipeline = parse_pipeline({
        "pipeline": name, "source": {"topic": source, "format": "debezium-json", "key": ["id"]},
        "view": {"key": ["id"], "columns": {"first_name": {"last": "first_name"}, "email": {"last": "email"}}},
        "outputs": {"view": {"topic": f"{name}.view"}}, "spark": {"state_dir": str(tmp_path)},
        "kafka": {"bootstrap.servers": bootstrap_servers},
    })
    ensure_topics(settings, engine_topics(pipeline, 1))
    records = [InputRecord(m.partition() or 0, m.offset() or 0, m.key(), m.value(), m.timestamp()[1])
               for m in read_to_end(settings, source)]
    processor = BatchProcessor(pipeline, settings)
    try:
        processor.process(records[:3])
        processor.close()
        shutil.rmtree(tmp_path)  # the update and delete find their rows in P.state
        processor = BatchProcessor(pipeline, settings)
        processor.process(records[3:])
    finally:
        processor.close()
    assert list(read_to_end(settings, pipeline.dlq_topic)) == []  # nothing dead-lettered
    report = verify(pipeline, settings)
    assert report.anomalies == [], "\n".join(report.anomalies)
    view = fold_changelog(read_view_changes(pipeline, settings))
    assert view == {(1,): {"id": 1, "first_name": "Anne Marie", "email": "annek@noanswer.org"}}


def debezium_stream(seed: int, length: int) -> list[tuple[int, bytes | None, bytes | None]]:
    """(partition, key, value) of a random Debezium stream over 6 ids: snapshots and
    creates, updates with no, key-only or full `before` (now and then a wrong one),
    deletes with key-only or full `before`, tombstones, and a few records without a key
    (full images) or with a bad envelope."""
    rng = random.Random(seed)
    rows: dict[int, dict[str, Any]] = {}
    out: list[tuple[int, bytes | None, bytes | None]] = []

    def before_of(row: dict[str, Any]) -> dict[str, Any] | None:
        shape = rng.random()
        if shape < 0.3:
            return None
        if shape < 0.6:
            return {"id": row["id"]}
        if shape < 0.65:
            return {**row, "score": -1}  # not the row: before differs
        return dict(row)

    for _ in range(length):
        id_ = rng.randrange(6)
        key = orjson.dumps({"id": id_}) if rng.random() < 0.5 else orjson.dumps(
            {"schema": {"type": "struct"}, "payload": {"id": id_}})
        partition = id_ % 2
        new = {"id": id_, "team": rng.choice("ab"), "score": rng.randrange(5)}
        choice = rng.random()
        if choice < 0.05 and any(p == partition for p, _, _ in out):
            out.append((partition, key, b"{not json"))
            continue
        if choice < 0.08 and any(p == partition for p, _, _ in out):  # keyless, of its own ids (not first)
            out.append((partition, None, envelope("c", after={**new, "id": 100 + id_})))
            continue
        if id_ not in rows or choice < 0.15:
            op = "r" if rng.random() < 0.3 else "c"
            rows[id_] = new
            out.append((partition, key, envelope(op, after=new)))
        elif choice < 0.7:
            before = before_of(rows[id_])
            if before is None or before == {"id": id_} or before == rows[id_]:
                rows[id_] = new
            out.append((partition, key, envelope("u", before=before, after=new, wrapped=rng.random() < 0.5)))
        else:
            before = before_of(rows[id_])
            if before is None or before == {"id": id_} or before == rows[id_]:
                del rows[id_]
            out.append((partition, key, envelope("d", before=before)))
            if rng.random() < 0.5:
                out.append((partition, key, None))
    return out


@pytest.mark.kafka
@pytest.mark.parametrize("view", ["by_id", "by_team"])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), length=st.integers(1, 50), cut=st.integers(0, 50))
@example(seed=7, length=50, cut=25)
def test_debezium_streams_with_key_only_and_full_befores_equal_the_reference(
    bootstrap_servers: str, topic: Any, tmp_path_factory: Any, view: str, seed: int, length: int, cut: int
) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=2)
    producer = Producer(settings_)
    for partition, key, value in debezium_stream(seed, length):
        producer.produce(source, value, key, partition=partition)
    producer.flush(30)
    name = f"dbz{uuid.uuid4().hex[:8]}"
    views = {"by_id": {"key": ["id"], "columns": {"n": {"count": "*"}, "best": {"max": "score"}}},
             "by_team": {"key": ["team"], "columns": {"n": {"count": "*"}, "total": {"sum": "score"}}}}
    pipeline = parse_pipeline({
        "pipeline": name, "source": {"topic": source, "format": "debezium-json", "key": ["id"]},
        "view": views[view], "outputs": {"view": {"topic": f"{name}.view"}, "delta": {"topic": f"{name}.delta"}},
        "spark": {"state_dir": str(tmp_path_factory.mktemp("state"))},
        "kafka": {"bootstrap.servers": bootstrap_servers},
    })
    ensure_topics(settings_, engine_topics(pipeline, 2))
    records = sorted((InputRecord(m.partition() or 0, m.offset() or 0, m.key(), m.value(), m.timestamp()[1])
                      for m in read_to_end(settings_, source)), key=lambda r: (r.offset, r.partition))
    processor = BatchProcessor(pipeline, settings_)
    try:
        processor.process(records[:cut])
        processor.close()
        processor = BatchProcessor(pipeline, settings_)  # the last rows come back from the stores
        processor.process(records[cut:])
    finally:
        processor.close()
    report = verify(pipeline, settings_)
    assert report.anomalies == [], "\n".join(report.anomalies)
    letters = list(read_to_end(settings_, pipeline.dlq_topic))
    assert len(letters) == report.dead_letters
