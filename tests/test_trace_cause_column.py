"""The cause in materialized rows: the SQLite and PostgreSQL drivers keep `_cause`, the
input event behind each view row and delta row, equal to the `refold.cause` header of
the Kafka record that made it (the key's last view record; the delta record), through
the engine's shards on a real broker and the real databases; null with provenance off."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from refold.config import Pipeline, parse_pipeline
from refold.kafka.io import ensure_topics, read_to_end
from refold.runtime.batch import InputRecord
from refold.runtime.processor import BatchProcessor
from refold.spark.job import engine_topics

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]

PARTITIONS = 2


def _pipeline(settings_: dict[str, Any], source: str, db: Path, dsn: str | None, provenance: bool) -> Pipeline:
    name = f"tc{uuid.uuid4().hex[:8]}"
    drivers: list[dict[str, Any]] = [{"driver": "sqlite", "path": str(db), "view": "totals", "delta": "totals_delta"}]
    if dsn is not None:
        drivers.append({"driver": "postgres", "dsn": dsn, "view": "totals", "delta": "totals_delta"})
    pipeline = parse_pipeline({
        "pipeline": name, "kafka": settings_, "source": {"topic": source, "key": ["g"]},
        "view": {"key": ["g"], "columns": {"total": {"sum": "score"}, "n": {"count": "*"}}},
        "outputs": {"view": {"topic": f"{name}.view"}, "delta": {"topic": f"{name}.delta"},
                    "provenance": provenance, "materialize": drivers}})
    ensure_topics(settings_, engine_topics(pipeline, PARTITIONS))
    return pipeline


def _events() -> list[InputRecord]:
    """Appends, a retraction that empties a key, and a correction, over 4 keys."""
    offsets = [0] * PARTITIONS
    out: list[InputRecord] = []
    steps = [("+A", 0, 5), ("+A", 1, 3), ("+A", 2, 4), ("+A", 0, 7), ("+A", 3, 1), ("-R", 3, 1),
             ("-C", 1, 3), ("+C", 1, 30), ("+A", 2, 6), ("+A", 0, 1)]
    for op, g, score in steps:
        p = g % PARTITIONS
        out.append(InputRecord(p, offsets[p], orjson.dumps({"g": g}), orjson.dumps({"op": op, "g": g, "score": score}),
                               1_000 + len(out)))
        offsets[p] += 1
    return out


def _run(pipeline: Pipeline, settings_: dict[str, Any], records: list[InputRecord]) -> None:
    processor = BatchProcessor(pipeline, settings_)
    try:
        for start in range(0, len(records), 4):
            processor.process(records[start:start + 4])
    finally:
        processor.close()


def _headers(settings_: dict[str, Any], topic: str) -> tuple[dict[int, str | None], list[tuple[int, str | None]]]:
    """Per key g, the cause of its last view record; the delta records' (g, cause) in order
    per partition."""
    last: dict[int, str | None] = {}
    seq: list[tuple[int, str | None]] = []
    for msg in read_to_end(settings_, topic):
        cause = dict(msg.headers() or []).get("refold.cause")
        named = cause.decode() if isinstance(cause, bytes) else None
        g = orjson.loads(msg.key())["g"]
        if topic.endswith(".view"):
            last[g] = named
        else:
            seq.append((g, named))
    return last, seq


def test_materialized_rows_carry_their_cause(bootstrap_servers: str, topic: Any, tmp_path: Path,
                                             postgres_dsn: str) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    pipeline = _pipeline(settings_, topic(partitions=PARTITIONS), tmp_path / "t.db", postgres_dsn, True)
    _run(pipeline, settings_, _events())
    assert pipeline.outputs.view is not None and pipeline.outputs.delta is not None
    view_causes, _ = _headers(settings_, pipeline.outputs.view.topic)
    _, delta_causes = _headers(settings_, pipeline.outputs.delta.topic)
    del view_causes[3]  # (emptied: no row)
    assert all(view_causes.values()) and len(view_causes) == 3
    assert view_causes[1] == "1:3"  # the correction's -C (partition 1: g 1, g 3, g 3, then the -C)
    with sqlite3.connect(tmp_path / "t.db") as db:
        assert dict(db.execute("SELECT g, _cause FROM totals")) == view_causes
        stored = sorted(db.execute("SELECT g, _cause FROM totals_delta"), key=lambda r: (r[0], r[1]))
    assert stored == sorted(delta_causes, key=lambda r: (r[0], r[1] or ""))
    assert all(cause for _, cause in stored)
    with psycopg.connect(postgres_dsn) as conn:
        rows = conn.execute("SELECT (_key->>0)::int, _cause FROM totals").fetchall()
        deltas = conn.execute("SELECT (_key->>0)::int, _cause FROM totals_delta").fetchall()
    assert dict(rows) == view_causes
    assert sorted(deltas, key=lambda r: (r[0], r[1])) == stored


def test_without_provenance_the_cause_is_null(bootstrap_servers: str, topic: Any, tmp_path: Path) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    pipeline = _pipeline(settings_, topic(partitions=PARTITIONS), tmp_path / "t.db", None, False)
    _run(pipeline, settings_, _events())
    with sqlite3.connect(tmp_path / "t.db") as db:
        assert [cause for (cause,) in db.execute("SELECT _cause FROM totals")] == [None] * 3
        assert {cause for (cause,) in db.execute("SELECT _cause FROM totals_delta")} == {None}
