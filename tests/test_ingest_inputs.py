"""Reading an ingest's input (no broker): positions, types, event times, tombstones."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from refold.errors import UserError
from refold.ingest import BadInput
from refold.ingest.inputs import content_hash, read_rows, resolve


def test_csv_rows_are_named_by_line_and_parquet_rows_by_number(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text('id,name\n1,x\n2,\n5,""\n')
    pq.write_table(pa.table({"id": [3, 4], "name": ["y", None]}), tmp_path / "b.parquet")
    rows = list(read_rows(resolve([str(tmp_path)]), None, now=7))
    assert [(r.row, r.where, r.event_time) for r in rows] == [
        ({"id": 1, "name": "x"}, f"{tmp_path}/a.csv:line 2", 7),
        ({"id": 2, "name": None}, f"{tmp_path}/a.csv:line 3", 7),
        ({"id": 5, "name": ""}, f"{tmp_path}/a.csv:line 4", 7),
        ({"id": 3, "name": "y"}, f"{tmp_path}/b.parquet: row 1", 7),
        ({"id": 4, "name": None}, f"{tmp_path}/b.parquet: row 2", 7),
    ]


def test_event_times_from_a_column(tmp_path: Path) -> None:
    pq.write_table(pa.table({
        "id": [1, 2],
        "at": pa.array([1_000, 2_500], pa.timestamp("ms", tz="Europe/Paris")),
        "day": pa.array([0, 1], pa.date32()),
    }), tmp_path / "t.parquet")
    rows = list(read_rows([tmp_path / "t.parquet"], None, now=0, event_time_column="at"))
    assert [r.event_time for r in rows] == [1_000, 2_500]
    assert rows[0].row == {"id": 1, "at": "1970-01-01T01:00:01+01:00", "day": "1970-01-01"}  # its zone kept
    (tmp_path / "e.jsonl").write_text('{"id": 1, "ts": "2026-01-01T00:00:00Z"}\n{"id": 2, "ts": "1970-01-01"}\n')
    (tmp_path / "f.jsonl").write_text('{"id": 3, "ts": 5}\n')
    with pytest.raises(BadInput, match="column 'ts' is number here but string at"):
        list(read_rows([tmp_path / "e.jsonl", tmp_path / "f.jsonl"], None, now=0, event_time_column="ts"))
    rows = list(read_rows([tmp_path / "e.jsonl"], None, now=0, event_time_column="ts"))
    assert [r.event_time for r in rows] == [1_767_225_600_000, 0]
    assert rows[0].row == {"id": 1, "ts": "2026-01-01T00:00:00Z"}
    rows = list(read_rows([tmp_path / "f.jsonl"], None, now=0, event_time_column="ts"))
    assert [r.event_time for r in rows] == [5] and rows[0].row == {"id": 3, "ts": 5}
    (tmp_path / "n.jsonl").write_text('{"id": 1, "ts": 5}\n{"id": 2, "ts": null}\n')
    with pytest.raises(BadInput, match=r"n\.jsonl:line 2: event time column 'ts' is null"):
        list(read_rows([tmp_path / "n.jsonl"], None, now=0, event_time_column="ts"))


def test_system_columns_and_changed_types_are_refused(tmp_path: Path) -> None:
    (tmp_path / "op.jsonl").write_text('{"op": "+A", "id": 1}\n')
    with pytest.raises(BadInput, match="column 'op' is a system column"):
        list(read_rows([tmp_path / "op.jsonl"], None, now=0))
    (tmp_path / "a.jsonl").write_text('{"id": 1, "v": 1.5}\n')
    (tmp_path / "b.jsonl").write_text('{"id": 2, "v": true}\n')
    with pytest.raises(BadInput, match=r"b\.jsonl:line 1: column 'v' is boolean here but number at .*a\.jsonl:line 1"):
        list(read_rows([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], None, now=0))
    (tmp_path / "c.jsonl").write_text('{"id": 3, "v": 2}\n')  # an integer after a float: one kind
    assert len(list(read_rows([tmp_path / "a.jsonl", tmp_path / "c.jsonl"], None, now=0))) == 2


def test_tombstones_only_for_upserts(tmp_path: Path) -> None:
    (tmp_path / "u.jsonl").write_text('{"k": 1, "v": "a"}\n{"key": {"k": 1}, "value": null}\n')
    rows = list(read_rows([tmp_path / "u.jsonl"], None, now=0, tombstones=True))
    assert [(r.row, r.deleted) for r in rows] == [({"k": 1, "v": "a"}, False), ({"k": 1}, True)]
    assert rows[1].where.endswith("u.jsonl:line 2")


def test_inputs_and_their_identity(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("id\n1\n")
    (tmp_path / "b.csv").write_text("id\n1\n")
    assert content_hash([tmp_path / "a.csv"], "snapshot") == content_hash([tmp_path / "b.csv"], "snapshot")
    assert content_hash([tmp_path / "a.csv"], "snapshot") != content_hash([tmp_path / "a.csv"], "append")
    assert resolve([str(tmp_path / "*.csv")]) == [tmp_path / "a.csv", tmp_path / "b.csv"]
    with pytest.raises(UserError, match="no such file"):
        resolve([str(tmp_path / "missing.csv")])
