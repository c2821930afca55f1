"""Upsert sources (`source.form: upsert`): key → latest row, a tombstone deletes.

The decoder and the reference's rules on their own, then random upsert streams
(repeats, identical re-writes, tombstones of absent keys, rows the view refuses,
interleaved keys over two partitions) through the engine's shard processors on the
real broker, in random batches with a restart (local stores kept, or deleted) in the
middle: the committed view equals `refold.reference.reference_table` (through
`refold verify`), every bad record is dead-lettered once, and the checkpoints count
every record once.
"""

from __future__ import annotations

import itertools
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from refold.codecs.base import BadRecord
from refold.codecs.upsert import upsert_decoder
from refold.config import Pipeline, ViewSpec, parse_pipeline
from refold.errors import ConfigError, UserError
from refold.kafka.io import ensure_topics, open_transactions, read_to_end
from refold.model.changelog import Op
from refold.model.reasons import Reason
from refold.ops.verify import verify
from refold.recovery.records import decode_dead_letter
from refold.recovery.restore import load_checkpoints
from refold.reference import reference_table
from refold.runtime.processor import BatchProcessor, InputRecord
from refold.spark.job import engine_topics

# The decoder ---------------------------------------------------------------------------


def test_an_upsert_record_is_its_key_and_its_row() -> None:
    decoder = upsert_decoder("jsonl", None, ["player"])
    got = decoder.decode(b'{"player": "ann"}', b'{"player":"ann","score":3,"offset":9,"event_time":5}')
    assert got.key == ("ann",) and got.row == {"player": "ann", "score": 3} and got.event_time == 5
    # the key columns a row lacks come from the key (Flink upsert-kafka's EXCEPT_KEY)
    assert decoder.decode(b'{"player":"bo"}', b'{"score":1}').row == {"score": 1, "player": "bo"}
    assert decoder.decode(b'{"player":"bo"}', None).row is None  # a tombstone


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        (None, b'{"score":1}', Reason.NULL_KEY),
        (b"ann", b'{"score":1}', Reason.KEY_MISMATCH),
        (b'{"name":"ann"}', b'{"score":1}', Reason.KEY_MISMATCH),
        (b'{"player":"ann"}', b'{"player":"bo","score":1}', Reason.KEY_MISMATCH),
        (b'{"player":1}', b'{"player":1.0}', Reason.KEY_MISMATCH),
        (b'{"player":"ann"}', b'{"op":"+A","player":"ann"}', Reason.SCHEMA_MISMATCH),
        (b'{"player":"ann"}', b"[1]", Reason.UNDECODABLE),
        (b'{"player":"ann"}', b"{", Reason.UNDECODABLE),
    ],
)
def test_a_bad_upsert_record_names_its_reason(key: bytes | None, value: bytes, reason: Reason) -> None:
    with pytest.raises(BadRecord) as caught:
        upsert_decoder("jsonl", None, ["player"]).decode(key, value)
    assert caught.value.reason == reason


def test_avro_upsert_rows_are_records_of_the_row_schema(tmp_path: Path) -> None:
    from io import BytesIO

    from fastavro import parse_schema, schemaless_writer

    schema = {"type": "record", "name": "Score", "fields": [
        {"name": "player", "type": "string"}, {"name": "score", "type": "long"}]}
    (tmp_path / "row.avsc").write_text(orjson.dumps(schema).decode())
    stream = BytesIO()
    schemaless_writer(stream, parse_schema(schema), {"player": "ann", "score": 7})
    decoder = upsert_decoder("avro", str(tmp_path / "row.avsc"), ["player"])
    assert decoder.decode(b'{"player":"ann"}', stream.getvalue()).row == {"player": "ann", "score": 7}
    with pytest.raises(BadRecord) as caught:
        decoder.decode(b'{"player":"ann"}', stream.getvalue() + b"\x00")
    assert caught.value.reason == Reason.UNDECODABLE
    with_op = {**schema, "fields": [{"name": "op", "type": "int"}, *schema["fields"]]}
    (tmp_path / "event.avsc").write_text(orjson.dumps(with_op).decode())
    with pytest.raises(ConfigError, match="without op"):
        upsert_decoder("avro", str(tmp_path / "event.avsc"), ["player"])


def test_pipelines_refuse_what_an_upsert_source_cannot_be() -> None:
    base = {"pipeline": "u", "view": {"key": ["team"], "columns": {"n": {"count": "*"}}},
            "outputs": {"view": {"topic": "u.view"}}}
    with pytest.raises(ConfigError, match="debezium-json events carry their own op"):
        parse_pipeline({**base, "source": {"topic": "t", "form": "upsert", "format": "debezium-json"}})
    top = {**base, "view": {"top_n": {"n": 3, "order_by": {"score": "desc"}}}}
    with pytest.raises(ConfigError, match=r"set source\.key"):
        parse_pipeline({**top, "source": {"topic": "t", "form": "upsert"}})
    assert parse_pipeline({**top, "source": {"topic": "t", "form": "upsert", "key": ["player"]}}).source.form == "upsert"


# The reference's rules -------------------------------------------------------------------

COUNTS = ViewSpec.model_validate({"key": ["team"], "columns": {"n": {"count": "*"}, "total": {"sum": "score"}}})


def test_the_reference_turns_upserts_into_the_changelog_they_mean() -> None:
    ann = ("ann",)
    records = [
        (ann, {"player": "ann", "team": "a", "score": 1}, (1, 0, 0)),  # +A
        (ann, {"player": "ann", "team": "a", "score": 1}, (2, 0, 1)),  # identical: nothing
        (ann, {"player": "ann", "team": "b", "score": 2}, (3, 0, 2)),  # -C/+C: moves to b
        (("bo",), None, (4, 0, 3)),  # a tombstone of an absent key: nothing
        (ann, None, (5, 0, 4)),  # -R
    ]
    result = reference_table(COUNTS, {0: [(k, "upsert", row, None, tag) for k, row, tag in records]})
    assert result.unchanged == 2 and result.view == {}
    assert [(c.op, c.key, c.row["n"]) for c in result.changes] == [
        (Op.APPEND, ("a",), 1),
        (Op.RETRACT, ("a",), 1),
        (Op.APPEND, ("b",), 1),
        (Op.RETRACT, ("b",), 1),
    ]


def test_a_row_the_view_refuses_leaves_the_keys_last_row() -> None:
    ann = ("ann",)
    records = [
        (ann, {"player": "ann", "team": "a", "score": 1}, (1, 0, 0)),
        (ann, {"player": "ann", "team": "a", "score": "ten"}, (2, 0, 1)),  # refused: sum of a string
        (ann, {"player": "ann", "team": "a", "score": 4}, (3, 0, 2)),  # -C the score-1 row, +C this
    ]
    result = reference_table(COUNTS, {0: [(k, "upsert", row, None, tag) for k, row, tag in records]})
    assert [reason for _, reason in result.rejected] == [Reason.SCHEMA_MISMATCH]
    assert result.view == {("a",): {"team": "a", "n": 1, "total": 4}}


# Through the engine ----------------------------------------------------------------------

VIEWS = {
    # keyed by the message key: one shard per partition
    "by_player": {"key": ["player"], "columns": {"n": {"count": "*"}, "total": {"sum": "score"},
                                                 "best": {"max": "score"}, "teams": {"set": "team"}}},
    # re-grouped: a correction moves a player between teams (one shard)
    "by_team": {"key": ["team"], "columns": {"n": {"count": "*"}, "total": {"sum": "score"},
                                             "worst": {"min": "score"}, "latest": {"last": "player"}}},
    "top_n": {"top_n": {"n": 2, "order_by": {"score": "desc"}, "partition_by": ["team"]}},
    # a row filter: a key's update across it is an append or a retraction of the view's
    # row; a score that is not a number cannot be compared (schema mismatch)
    "by_team_where": {"key": ["team"], "columns": {"n": {"count": "*"}, "total": {"sum": "score"}},
                      "where": "score >= 2"},
}
PARTITIONS = 2


def upsert_stream(seed: int, length: int) -> tuple[list[tuple[int, bytes, bytes | None]], int]:
    """(partition, key, value) records of a random upsert stream over 6 players, and how
    many of them are bad (dead letters before the view: undecodable, key mismatch)."""
    rng = random.Random(seed)
    last: dict[str, bytes | None] = {}
    out: list[tuple[int, bytes, bytes | None]] = []
    bad = 0
    for _ in range(length):
        player = f"p{rng.randrange(6)}"
        key = orjson.dumps({"player": player})
        partition = int(player[1:]) % PARTITIONS
        choice = rng.random()
        if choice < 0.15:
            value = None  # a tombstone (of an absent key, sometimes)
        elif choice < 0.25 and last.get(player) is not None:
            value = last[player]  # an identical re-write
        elif choice < 0.28:
            bad += 1
            out.append((partition, key, rng.choice([b"{", orjson.dumps({"player": "x", "score": 1})])))
            continue
        else:
            row: dict[str, Any] = {"player": player, "team": rng.choice("ab"), "score": rng.randrange(5)}
            if rng.random() < 0.05:
                row["score"] = "ten"  # the grouped views refuse it (a sum over a string)
            if rng.random() < 0.05:
                del row["team"]  # the by-team views refuse it (no view key)
            if rng.random() < 0.3:
                del row["player"]  # the key's column comes from the message key
            value = orjson.dumps(row)
        last[player] = value
        out.append((partition, key, value))
    return out, bad


def pipeline_for(source: str, bootstrap: str, view: dict[str, Any], state_dir: Path) -> Pipeline:
    name = f"up{uuid.uuid4().hex[:10]}"
    outputs: dict[str, Any] = {"view": {"topic": f"{name}.view"}}
    if "key" in view:
        outputs["delta"] = {"topic": f"{name}.delta"}
    return parse_pipeline({
        "pipeline": name, "kafka": {"bootstrap.servers": bootstrap},
        "source": {"topic": source, "form": "upsert", "key": ["player"]},
        "view": view, "outputs": outputs, "spark": {"state_dir": str(state_dir)},
    })


@pytest.mark.kafka
@pytest.mark.parametrize("view", list(VIEWS))
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    length=st.integers(1, 60),
    cuts=st.lists(st.integers(0, 60), max_size=3),
    restart=st.sampled_from(["none", "kept", "stores_lost"]),
)
# every restart's last rows are used: the second half updates and deletes the first half's keys
@example(seed=3, length=40, cuts=[20], restart="stores_lost")
@example(seed=4, length=40, cuts=[10, 20, 30], restart="kept")
def test_upsert_streams_through_the_engine_equal_the_reference(
    bootstrap_servers: str, topic: Any, tmp_path_factory: Any, view: str, seed: int, length: int,
    cuts: list[int], restart: str,
) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    stream, bad = upsert_stream(seed, length)
    producer = Producer(settings_)
    for partition, key, value in stream:
        producer.produce(source, value, key, partition=partition)
    producer.flush(30)

    state_dir = tmp_path_factory.mktemp("state")
    pipeline = pipeline_for(source, bootstrap_servers, VIEWS[view], state_dir)
    ensure_topics(settings_, engine_topics(pipeline, PARTITIONS))
    records = [
        InputRecord(m.partition() or 0, m.offset() or 0, m.key(), m.value(), m.timestamp()[1])
        for m in read_to_end(settings_, source)
    ]
    assert len(records) == len(stream)
    records.sort(key=lambda r: (r.offset, r.partition))  # batches cut across both partitions
    bounds = sorted({0, len(records), *(c for c in cuts if c < len(records))})
    middle = bounds[len(bounds) // 2]
    processor = BatchProcessor(pipeline, settings_)
    try:
        for start, end in itertools.pairwise(bounds):
            if start == middle and restart != "none":
                processor.close()  # a restart: last rows come back from the stores, or from P.state
                if restart == "stores_lost":
                    shutil.rmtree(state_dir)
                processor = BatchProcessor(pipeline, settings_)
            processor.process(records[start:end])
    finally:
        processor.close()

    assert not open_transactions(settings_, [t.name for t in engine_topics(pipeline, PARTITIONS)], timeout=30)
    report = verify(pipeline, settings_)
    assert report.anomalies == [], "\n".join(report.anomalies)
    letters = [decode_dead_letter(m.value()) for m in read_to_end(settings_, pipeline.dlq_topic)]
    assert len(letters) == report.dead_letters and len(letters) >= bad
    assert len({(letter.partition, letter.offset) for letter in letters}) == len(letters)  # each once
    checkpoints = load_checkpoints(pipeline, settings_)
    assert sum(c.records_in for c in checkpoints.values()) == len(records)


@pytest.mark.kafka
def test_the_first_upsert_record_keyed_otherwise_stops_the_run(bootstrap_servers: str, topic: Any,
                                                               tmp_path: Path) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=1)
    pipeline = pipeline_for(source, bootstrap_servers, VIEWS["by_team"], tmp_path)
    ensure_topics(settings_, engine_topics(pipeline, 1))
    processor = BatchProcessor(pipeline, settings_)
    try:
        with pytest.raises(UserError, match=r"keyed by a JSON object of the fields \['name'\]"):
            processor.process([InputRecord(0, 0, b'{"name":"ann"}', b'{"team":"a","score":1}', 1)])
    finally:
        processor.close()
    assert load_checkpoints(pipeline, settings_) == {}  # nothing committed
