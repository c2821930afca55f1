"""The real engine (Spark + the real broker) against the reference reducer."""

from __future__ import annotations

import gc
import shutil
import uuid
from typing import Any

import orjson
import pytest

from refold.cli.produce import produce
from refold.config import Pipeline, load_pipeline, parse_pipeline
from refold.dev.testing import Workload, generate
from refold.errors import RecordError, UserError
from refold.kafka.io import read_to_end
from refold.ops.status import pipeline_status
from refold.ops.verify import read_upsert_view, read_view_changes, verify
from refold.recovery.records import decode_checkpoint, decode_dead_letter
from refold.recovery.restore import load_checkpoint, load_checkpoints
from refold.reference import fold_changelog
from refold.runtime.shard import ShardProcessor
from refold.spark.job import (
    run_pipeline,
    spark_checkpoint_dir,
)

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

ALL_REDUCTIONS = {
    "total": {"sum": "score"},
    "games": {"count": "*"},
    "bonus_count": {"count": "bonus"},
    "mean": {"avg": "score"},
    "low": {"min": "score"},
    "best": {"max": "score"},
    "opener": {"first": "score"},
    "latest": {"last": "score"},
    "lww": {"last_write_wins": "team"},
    "teams": {"set": "team"},
    "bonus": {"sum": "bonus"},
}


def pipeline_for(source: str, view: dict[str, Any], *, tmp: Any, form: str = "changelog", delta: bool = True,
                 emit: str = "per_event", source_key: list[str] | None = None, source_form: str = "changelog",
                 **extra: Any) -> Pipeline:
    name = f"p{uuid.uuid4().hex[:10]}"
    outputs: dict[str, Any] = {"view": {"topic": f"{name}.view", "form": form, "emit": emit}}
    if delta and "top_n" not in view:
        outputs["delta"] = {"topic": f"{name}.delta"}
    return parse_pipeline(
        {
            "pipeline": name,
            "source": {"topic": source, "format": "jsonl", "form": source_form,
                       **({"key": source_key} if source_key else {})},
            "view": view,
            "outputs": outputs,
            "trigger": "200ms",
            "spark": {"checkpoint_dir": str(tmp / name)},
            **extra,
        }
    )


def produce_rows(settings: dict[str, Any], topic: str, rows: list[dict[str, Any]], key: str = "player_name") -> None:
    produce(settings, topic, [orjson.dumps(r) for r in rows], [key], progress=False, per_transaction=500)


def message_key(value: bytes, column: str = "player_name") -> bytes:
    """Refold's message key of a record (the JSON object of its key column); b"k" for one
    without (undecodable, a null key): those are dead letters before any key check."""
    try:
        row = orjson.loads(value)
    except orjson.JSONDecodeError:
        return b"k"
    return orjson.dumps({column: row[column]}) if isinstance(row, dict) and row.get(column) else b"k"


def run(pipeline: Pipeline, bootstrap: str, spark: Any, idle: float = 1.0) -> Any:
    # every test's input is in the source before the run: the run ends once Spark's query
    # has no data available and has had none for `idle` seconds
    return run_pipeline(pipeline, bootstrap, until_idle=idle, spark=spark, quiet=True)


def assert_verified(pipeline: Pipeline, settings: dict[str, Any], **kwargs: Any) -> Any:
    report = verify(pipeline, settings, **kwargs)
    assert report.anomalies == [], "\n".join(report.anomalies)
    assert report.view_records > 0
    return report


def test_grouped_view_equals_reference_over_many_batches(bootstrap_servers, topic, tmp_path, spark) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    rows = list(generate(Workload(events=4000, keys=300, seed=11)))
    produce_rows(settings, source, rows)
    pipeline = pipeline_for(source, {"key": ["player_name"], "columns": ALL_REDUCTIONS}, tmp=tmp_path,
                            max_batch_events=600)
    progress = run(pipeline, bootstrap_servers, spark)
    assert progress.batches >= 3
    report = assert_verified(pipeline, settings)
    assert report.events == len(rows)
    assert report.delta_records > 0
    checkpoint = load_checkpoint(pipeline, settings)
    assert checkpoint is not None and checkpoint.records_in == len(rows) and checkpoint.dlq == 0
    # `refold status`: every partition committed to its end, no lag
    status_checkpoint, partitions = pipeline_status(pipeline, settings)
    assert status_checkpoint == checkpoint
    assert len(partitions) == 3 and all(p.lag == 0 and p.exact and p.committed for p in partitions)


@pytest.mark.parametrize("form", ["retract", "upsert"])
def test_other_forms_equal_reference(bootstrap_servers, topic, tmp_path, spark, form) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=2)
    produce_rows(settings, source, list(generate(Workload(events=1500, keys=100, seed=5))))
    pipeline = pipeline_for(source, {"key": ["player_name"], "columns": {"best": {"max": "score"}, "n": {"count": "*"}}},
                            tmp=tmp_path, form=form, delta=False, max_batch_events=400)
    run(pipeline, bootstrap_servers, spark)
    assert_verified(pipeline, settings)
    if form == "upsert":  # Refold reads its own upsert output as an upsert source
        assert pipeline.outputs.view is not None
        regroup = {"key": ["n"], "columns": {"players": {"count": "*"}, "top": {"max": "best"}}}
        second = pipeline_for(pipeline.outputs.view.topic, regroup, tmp=tmp_path, delta=False, max_batch_events=300,
                              source_key=["player_name"], source_form="upsert")
        run(second, bootstrap_servers, spark)
        assert_verified(second, settings)
        players = list(read_upsert_view(pipeline, settings).values())
        want = {(n,): {"n": n, "players": sum(1 for p in players if p["n"] == n),
                       "top": max(p["best"] for p in players if p["n"] == n)} for n in {p["n"] for p in players}}
        assert fold_changelog(read_view_changes(second, settings)) == want  # the re-grouped upsert view


def test_per_batch_emit_with_a_row_filter_folds_to_reference(bootstrap_servers, topic, tmp_path, spark) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=2)
    produce_rows(settings, source, list(generate(Workload(events=1500, keys=50, seed=8))))
    pipeline = pipeline_for(source, {"key": ["player_name"], "columns": {"latest": {"last": "score"}},
                                     "where": "score >= 300 AND team <> 'red'"},
                            tmp=tmp_path, emit="per_batch", max_batch_events=500)
    run(pipeline, bootstrap_servers, spark)
    assert_verified(pipeline, settings)


T1, T2, T3 = "2024-01-01T00:00:00Z", "2024-01-02T00:00:00Z", "2024-01-03T00:00:00Z"
# RFC-015's output tables for its leaderboard query: (op, place, match_time, player_name, score)
RFC015_TABLES = {
    "changelog": [("+A", 1, T1, "Alice", 100), ("+A", 2, T1, "Bob", 80),
                  ("-C", 2, T1, "Bob", 80), ("+C", 2, T2, "Charlie", 90),
                  ("-C", 1, T1, "Alice", 100), ("+C", 1, T3, "Charlie", 110),
                  ("-C", 2, T2, "Charlie", 90), ("+C", 2, T1, "Alice", 100)],
    "retract": [("+A", 1, T1, "Alice", 100), ("+A", 2, T1, "Bob", 80),
                ("-R", 2, T1, "Bob", 80), ("+A", 2, T2, "Charlie", 90),
                ("-R", 1, T1, "Alice", 100), ("-R", 2, T2, "Charlie", 90),
                ("+A", 1, T3, "Charlie", 110), ("+A", 2, T1, "Alice", 100)],
    "upsert": [("+A", 1, T1, "Alice", 100), ("+A", 2, T1, "Bob", 80), ("+A", 2, T2, "Charlie", 90),
               ("+A", 1, T3, "Charlie", 110), ("+A", 2, T1, "Alice", 100)],
}


@pytest.mark.parametrize("form", ["changelog", "retract", "upsert"])
def test_rfc015_query_gives_the_rfc_tables(form, bootstrap_servers, topic, tmp_path, spark) -> None:
    """The leaderboard query as RFC-015 writes it (examples/leaderboard.yaml), over its
    match scores, gives the RFC's changelog, retract and upsert tables, row for row."""
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=1)
    with open("examples/match_scores.jsonl", "rb") as handle:
        produce(settings, source, handle.read().splitlines(), ["player_name"], progress=False)
    sql = load_pipeline("examples/leaderboard.yaml").view.sql
    assert sql is not None
    pipeline = pipeline_for(source, {"sql": sql.replace("from match_scores\n", f"from `{source}`\n")},
                            tmp=tmp_path, form=form, delta=False)
    assert pipeline.view.top_n is not None and pipeline.view.top_n.columns == ["match_time", "player_name", "score"]
    run(pipeline, bootstrap_servers, spark)
    assert rfc015_table(pipeline, settings, form) == RFC015_TABLES[form]


def rfc015_table(pipeline: Pipeline, settings: dict[str, Any], form: str) -> list[tuple[Any, ...]]:
    """The leaderboard's view topic as RFC-015's tables show it: (op, place, match_time,
    player_name, score) per record (an upsert record as `+A`)."""
    assert pipeline.outputs.view is not None
    if form == "upsert":
        records = [orjson.loads(m.value()) for m in read_to_end(settings, pipeline.outputs.view.topic)]
        return [("+A", r["place"], r["match_time"], r["player_name"], r["score"]) for r in records]
    changes = read_view_changes(pipeline, settings)
    assert all(set(c.row) == {"place", "match_time", "player_name", "score"} for c in changes)  # the query's columns
    return [(c.op.code, c.row["place"], c.row["match_time"], c.row["player_name"], c.row["score"]) for c in changes]


def test_top_n_with_retractions_equals_reference(bootstrap_servers, topic, tmp_path, spark) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    produce_rows(settings, source, list(generate(Workload(events=2000, keys=200, seed=3))))
    pipeline = pipeline_for(source, {"top_n": {"n": 3, "order_by": {"score": "desc"}, "partition_by": ["team"]}},
                            tmp=tmp_path, source_key=["player_name"])  # one batch: the merge order equals the reference's
    run(pipeline, bootstrap_servers, spark)
    assert_verified(pipeline, settings, exact_order=True)


def test_restart_continues_exactly_once(bootstrap_servers, topic, tmp_path, spark) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    rows = list(generate(Workload(events=3000, keys=200, seed=21)))
    pipeline = pipeline_for(source, {"key": ["player_name"], "columns": ALL_REDUCTIONS}, tmp=tmp_path,
                            max_batch_events=500)
    produce_rows(settings, source, rows[:1000])
    run(pipeline, bootstrap_servers, spark)
    first_commit = spark_checkpoint_dir(pipeline) / "commits" / "0"
    written = first_commit.stat().st_mtime_ns
    produce_rows(settings, source, rows[1000:2000])
    run(pipeline, bootstrap_servers, spark)
    # Spark's checkpoint agrees with Kafka (only the last transaction marker between them): kept
    assert first_commit.stat().st_mtime_ns == written
    shutil.rmtree(spark_checkpoint_dir(pipeline))
    produce_rows(settings, source, rows[2000:])
    run(pipeline, bootstrap_servers, spark)  # no Spark checkpoint: state from P.state
    report = assert_verified(pipeline, settings)
    assert report.events == len(rows)
    # the driver reduces nothing: every shard ran in a Spark task, in a Python worker
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, ShardProcessor)]


def test_bad_records_go_to_the_dead_letter_topic(bootstrap_servers, topic, tmp_path, spark) -> None:
    from confluent_kafka import Producer

    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=1)
    good = {"op": "+A", "event_time": 1, "player_name": "Alice", "score": 10}
    bad = [
        (b"\x00\xffnot json", "undecodable"),
        (orjson.dumps({"op": 7, "player_name": "Al", "score": 1}), "op out of range"),
        (orjson.dumps({"op": "+A", "player_name": None, "score": 1}), "null key"),
        (orjson.dumps({"op": "-R", "player_name": "Zed", "score": 1}), "not live"),
        (orjson.dumps({"op": "+C", "player_name": "Alice", "score": 12}), "+C without a preceding -C"),
        (orjson.dumps({"op": "-C", "player_name": "Alice", "score": 10}), "-C not immediately followed by its +C"),
    ]
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    producer.produce(source, orjson.dumps(good), message_key(orjson.dumps(good)))
    for value, _reason in bad:
        producer.produce(source, value, message_key(value))
    producer.produce(source, orjson.dumps({**good, "score": 20}), message_key(orjson.dumps(good)))
    producer.flush(30)

    pipeline = pipeline_for(source, {"key": ["player_name"], "columns": {"total": {"sum": "score"}}}, tmp=tmp_path)
    run(pipeline, bootstrap_servers, spark)
    letters = [decode_dead_letter(m.value()) for m in read_to_end(settings, pipeline.dlq_topic)]
    assert [letter.reason for letter in letters] == [reason for _value, reason in bad]
    assert [letter.offset for letter in letters] == [1, 2, 3, 4, 5, 6]
    assert all(letter.topic == source and letter.partition == 0 for letter in letters)
    assert letters[0].value == b"\x00\xffnot json"
    headers = dict(next(iter(read_to_end(settings, pipeline.dlq_topic))).headers())
    assert headers["refold.reason"] == b"undecodable" and headers["refold.offset"] == b"1"
    view = [c.row for c in read_view_changes(pipeline, settings)]
    assert view == [{"player_name": "Alice", "total": 10}, {"player_name": "Alice", "total": 10},
                    {"player_name": "Alice", "total": 30}]
    checkpoint = load_checkpoint(pipeline, settings)
    assert checkpoint is not None and checkpoint.dlq == len(bad)


def test_strict_mode_fails_naming_the_record(bootstrap_servers, topic, tmp_path, spark) -> None:
    from confluent_kafka import Producer

    source = topic(partitions=1)
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    producer.produce(source, orjson.dumps({"op": "+A", "player_name": "A", "score": 1}), b'{"player_name":"A"}')
    producer.produce(source, orjson.dumps({"op": 9, "player_name": "A", "score": 1}), b'{"player_name":"A"}')
    producer.flush(30)
    pipeline = pipeline_for(source, {"key": ["player_name"], "columns": {"total": {"sum": "score"}}}, tmp=tmp_path,
                            strict=True)
    with pytest.raises(RecordError) as failure:
        run(pipeline, bootstrap_servers, spark)
    assert failure.value.reason == "op out of range"
    assert f"{source}[0]@1" in str(failure.value)
    settings = {"bootstrap.servers": bootstrap_servers}
    assert load_checkpoint(pipeline, settings) is None  # nothing of the failed batch committed


def test_a_co_partitioned_view_commits_one_checkpoint_per_shard(bootstrap_servers, topic, tmp_path, spark) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    rows = list(generate(Workload(events=1200, keys=90, seed=21)))
    produce_rows(settings, source, rows)
    pipeline = pipeline_for(source, {"key": ["player_name"], "columns": {"n": {"count": "*"}, "t": {"sum": "score"}}},
                            tmp=tmp_path, max_batch_events=400)
    run(pipeline, bootstrap_servers, spark)
    assert_verified(pipeline, settings)
    shards = load_checkpoints(pipeline, settings)
    assert sorted(shards) == [0, 1, 2]
    assert all(set(c.offsets) == {n} and c.shard == n for n, c in shards.items())  # its own partition only
    assert sum(c.records_in for c in shards.values()) == len(rows)
    # one record per writer and shard; the shard names its transactional id P-<writer>-<shard>
    records = list(read_to_end(settings, pipeline.checkpoints_topic))
    assert {(m.key(), m.partition()) for m in records} == {(b"0/0", 0), (b"0/1", 1), (b"0/2", 2)}
    assert {pipeline.transactional_id(decode_checkpoint(m.value() or b"").shard) for m in records} == {
        f"{pipeline.pipeline}-0-{n}" for n in range(3)}


def test_a_global_top_n_runs_as_one_shard(bootstrap_servers, topic, tmp_path, spark) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    produce_rows(settings, source, list(generate(Workload(events=800, keys=80, seed=4))))
    pipeline = pipeline_for(source, {"top_n": {"n": 3, "order_by": {"score": "desc"}}}, tmp=tmp_path)
    run(pipeline, bootstrap_servers, spark)
    assert_verified(pipeline, settings, exact_order=True)
    shards = load_checkpoints(pipeline, settings)
    assert list(shards) == [0] and set(shards[0].offsets) == {0, 1, 2}


def test_messages_keyed_otherwise_stop_the_engine_before_it_commits(bootstrap_servers, topic, tmp_path, spark) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=2)
    produce_rows(settings, source, list(generate(Workload(events=50, keys=10, seed=2, retract_share=0.0))), key="team")
    pipeline = pipeline_for(source, {"key": ["player_name"], "columns": {"n": {"count": "*"}}}, tmp=tmp_path)
    with pytest.raises(UserError, match=r"fields \['team'\].*set source\.key"):
        run(pipeline, bootstrap_servers, spark)
    assert load_checkpoint(pipeline, settings) is None
    assert list(read_to_end(settings, f"{pipeline.pipeline}.view")) == []
    assert list(read_to_end(settings, pipeline.dlq_topic)) == []
