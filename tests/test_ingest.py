"""`refold ingest`, `refold correct`, `refold retract` on the real broker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from refold.ingest import BadInput, NoLiveRow, correct, ingest, retract
from refold.kafka.io import read_to_end
from refold.model.changelog import Op
from refold.reduce import ViewChange
from refold.reference import fold_changelog

pytestmark = pytest.mark.kafka

REFOLD = [sys.executable, "-m", "refold.cli.main"]


def _run(args: list[str], bootstrap: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*REFOLD, "--bootstrap-servers", bootstrap, *args], input=stdin,
                          capture_output=True, timeout=120, check=False)


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


def _events(settings: dict[str, Any], topic: str) -> list[tuple[bytes | None, dict[str, Any]]]:
    """(message key, record) of every committed record, partition by partition."""
    by_partition: dict[int, list[tuple[bytes | None, dict[str, Any]]]] = {}
    for msg in read_to_end(settings, topic):
        by_partition.setdefault(int(msg.partition() or 0), []).append((msg.key(), orjson.loads(msg.value() or b"null")))
    return [record for p in sorted(by_partition) for record in by_partition[p]]


def _ops(settings: dict[str, Any], topic: str) -> list[tuple[str, dict[str, Any]]]:
    """(op, row without event_time) of every record."""
    out = []
    for _key, record in _events(settings, topic):
        record.pop("event_time", None)
        out.append((record.pop("op"), record))
    return out


def _fold(settings: dict[str, Any], topic: str, key: list[str]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The topic's rows by primary key, folded by the reference."""
    return fold_changelog(
        ViewChange(Op.parse(op), tuple(row[c] for c in key), row, tuple(key))
        for op, row in _ops(settings, topic)
    )


ROWS = [
    {"id": 1, "name": "Alice", "score": 100},
    {"id": 2, "name": "Bob", "score": 80},
    {"id": 3, "name": "Charlie", "score": 90},
]


# Corrections and retractions by key ---------------------------------------------------------------


def test_correct_and_retract_write_the_exact_old_row(bootstrap_servers: str, topic, tmp_path: Path) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    name = topic(partitions=2)
    path = tmp_path / "rows.jsonl"
    path.write_bytes(_jsonl(ROWS))
    done = _run(["ingest", name, str(path), "--merge", "append", "--primary-key", "id"], bootstrap_servers)
    assert done.returncode == 0, done.stderr.decode()

    corrected = _run(["correct", name, "--primary-key", "id", "--key", '{"id": 2}', "--set", '{"score": 85}',
                      "--event-time", "5000"], bootstrap_servers)
    assert corrected.returncode == 0, corrected.stderr.decode()
    assert corrected.stdout.decode().splitlines() == [
        '-C {"id":2,"name":"Bob","score":80}', '+C {"id":2,"name":"Bob","score":85}']
    retracted = _run(["retract", name, "--primary-key", "id", "--key", '{"id": 1}'], bootstrap_servers)
    assert retracted.returncode == 0, retracted.stderr.decode()

    records = _events(settings, name)
    pair = [(key, r) for key, r in records if r["op"] in ("-C", "+C")]
    assert pair == [
        (b'{"id":2}', {"op": "-C", "event_time": 5000, "id": 2, "name": "Bob", "score": 80}),
        (b'{"id":2}', {"op": "+C", "event_time": 5000, "id": 2, "name": "Bob", "score": 85}),
    ]
    assert [(k, {c: v for c, v in r.items() if c != "event_time"}) for k, r in records if r["op"] == "-R"] == [
        (b'{"id":1}', {"op": "-R", "id": 1, "name": "Alice", "score": 100})]
    assert _fold(settings, name, ["id"]) == {(2,): {"id": 2, "name": "Bob", "score": 85},
                                             (3,): {"id": 3, "name": "Charlie", "score": 90}}

    # a second correction of the same key corrects the corrected row
    change = correct(settings, name, ["id"], {"id": 2}, {"score": 86, "name": "Robert"})
    assert change is not None and change.old == {"id": 2, "name": "Bob", "score": 85}
    assert _fold(settings, name, ["id"])[(2,)] == {"id": 2, "name": "Robert", "score": 86}
    assert correct(settings, name, ["id"], {"id": 2}, {"score": 86}) is None  # unchanged: nothing


def test_a_key_without_a_live_row_is_refused_and_nothing_written(bootstrap_servers: str, topic,
                                                                  tmp_path: Path) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    name = topic(partitions=1)
    path = tmp_path / "rows.jsonl"
    path.write_bytes(_jsonl(ROWS))
    ingest(settings, name, [str(path)], merge_strategy="append", primary_key=["id"])
    retract(settings, name, ["id"], {"id": 3})
    before = _events(settings, name)

    for args in (["correct", name, "--primary-key", "id", "--key", '{"id": 9}', "--set", '{"score": 1}'],
                 ["retract", name, "--primary-key", "id", "--key", '{"id": 3}']):  # 3: retracted already
        refused = _run(args, bootstrap_servers)
        assert refused.returncode == 2
        assert "has no live row for key" in refused.stderr.decode(), refused.stderr.decode()
        assert "nothing written" in refused.stderr.decode()
    with pytest.raises(NoLiveRow):
        correct(settings, name, ["id"], {"id": 4}, {"score": 1})
    bad_key = _run(["correct", name, "--primary-key", "id", "--key", '{"name": "Bob"}', "--set", '{"score": 1}'],
                   bootstrap_servers)
    assert bad_key.returncode == 2 and "--key must give exactly the primary-key columns" in bad_key.stderr.decode()
    key_change = _run(["correct", name, "--primary-key", "id", "--key", '{"id": 1}', "--set", '{"id": 5}'],
                      bootstrap_servers)
    assert key_change.returncode == 2 and "cannot change primary-key columns" in key_change.stderr.decode()
    assert _events(settings, name) == before


# Ingest: the merge strategies ------------------------------------------------------------------------


def _first_three() -> list[tuple[str, dict[str, Any]]]:
    return [("+A", {"id": 1, "name": "Alice", "score": 100}), ("+A", {"id": 2, "name": "Bob", "score": 80}),
            ("+A", {"id": 3, "name": "Charlie", "score": 90})]


def test_snapshot_by_primary_key(bootstrap_servers: str, topic, tmp_path: Path) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    name = topic(partitions=3)
    first = tmp_path / "day1.csv"
    first.write_text("id,name,score\n1,Alice,100\n2,Bob,80\n3,Charlie,90\n")
    result = ingest(settings, name, [str(first)], merge_strategy="snapshot", primary_key=["id"], now=1000)
    assert dict(result.changes) == {"+A": 3}
    second = tmp_path / "day2.csv"
    second.write_text("id,name,score\n1,Alice,100\n3,Charlie,95\n4,Dana,70\n")  # 2 vanished, 3 changed, 4 new
    done = _run(["ingest", name, str(second), "--merge", "snapshot", "--primary-key", "id"], bootstrap_servers)
    assert done.returncode == 0, done.stderr.decode()
    assert "wrote 1 +A, 1 -R, 1 -C, 1 +C" in done.stdout.decode()
    changes = [c for c in _ops(settings, name) if c not in _first_three()]
    assert sorted(changes, key=lambda c: (c[1]["id"], c[0])) == [
        ("-R", {"id": 2, "name": "Bob", "score": 80}),
        ("+C", {"id": 3, "name": "Charlie", "score": 95}),
        ("-C", {"id": 3, "name": "Charlie", "score": 90}),
        ("+A", {"id": 4, "name": "Dana", "score": 70}),
    ]
    assert _fold(settings, name, ["id"]) == {
        (1,): {"id": 1, "name": "Alice", "score": 100},
        (3,): {"id": 3, "name": "Charlie", "score": 95},
        (4,): {"id": 4, "name": "Dana", "score": 70},
    }
    # the same snapshot again: already committed, nothing written
    again = _run(["ingest", name, str(second), "--merge", "snapshot", "--primary-key", "id"], bootstrap_servers)
    assert again.returncode == 0 and "already committed" in again.stdout.decode()
    assert len(_ops(settings, name)) == 7
    # compare columns: a change of name only is no change
    third = tmp_path / "day3.csv"
    third.write_text("id,name,score\n1,Alicia,100\n3,Charlie,95\n4,Dana,71\n")
    result = ingest(settings, name, [str(third)], merge_strategy="snapshot", primary_key=["id"],
                    compare_columns=["score"], now=3000)
    assert dict(result.changes) == {"-C": 1, "+C": 1}
    assert _fold(settings, name, ["id"])[(1,)]["name"] == "Alice"


def test_snapshot_without_key_is_a_multiset_diff(bootstrap_servers: str, topic, tmp_path: Path) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    name = topic(partitions=2)
    first = tmp_path / "a.jsonl"
    first.write_bytes(_jsonl([{"v": 1}, {"v": 1}, {"v": 2}]))
    ingest(settings, name, [str(first)], merge_strategy="snapshot", now=1)
    second = tmp_path / "b.jsonl"
    second.write_bytes(_jsonl([{"v": 1}, {"v": 3}, {"v": 3}]))
    result = ingest(settings, name, [str(second)], merge_strategy="snapshot", now=2)
    assert dict(result.changes) == {"-R": 2, "+A": 2}
    assert sorted((op, r["v"]) for op, r in _ops(settings, name)) == [
        ("+A", 1), ("+A", 1), ("+A", 2), ("+A", 3), ("+A", 3), ("-R", 1), ("-R", 2)]


def test_ledger_upsert_append(bootstrap_servers: str, topic, tmp_path: Path) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    ledger = topic(partitions=1)
    one = tmp_path / "l1.jsonl"
    one.write_bytes(_jsonl([{"tx": "a", "amount": 5}, {"tx": "b", "amount": 7}]))
    two = tmp_path / "l2.jsonl"  # re-delivers a and b (b with another amount), adds c
    two.write_bytes(_jsonl([{"tx": "a", "amount": 5}, {"tx": "b", "amount": 8}, {"tx": "c", "amount": 1}]))
    ingest(settings, ledger, [str(one)], merge_strategy="ledger", primary_key=["tx"])
    done = _run(["ingest", ledger, str(two), "--merge", "ledger", "--primary-key", "tx"], bootstrap_servers)
    assert done.returncode == 0, done.stderr.decode()
    assert "l2.jsonl:line 2: primary key {\"tx\":\"b\"} is already in the ledger with other values" in \
        done.stderr.decode()
    assert [(op, r["tx"]) for op, r in _ops(settings, ledger)] == [("+A", "a"), ("+A", "b"), ("+A", "c")]

    upserts = topic(partitions=2)
    batch = tmp_path / "u.csv"
    batch.write_text("k,v,gone\n1,a,false\n2,b,false\n1,c,false\n2,,true\n3,x,true\n")
    result = ingest(settings, upserts, [str(batch)], merge_strategy="upsert", primary_key=["k"],
                    deleted_column="gone")
    assert dict(result.changes) == {"+A": 2, "-C": 1, "+C": 1, "-R": 1}
    assert sorted((op, r["k"], r["v"]) for op, r in _ops(settings, upserts)) == [
        ("+A", 1, "a"), ("+A", 2, "b"), ("+C", 1, "c"), ("-C", 1, "a"), ("-R", 2, "b")]
    assert _fold(settings, upserts, ["k"]) == {(1,): {"k": 1, "v": "c"}}

    appends = topic(partitions=1)
    table = pa.table({"sensor": ["s1", "s1", "s2"], "reading": [1.5, 1.5, 2.0],
                      "at": pa.array([1_000, 2_000, 3_000], pa.timestamp("ms", tz="UTC"))})
    pq.write_table(table, tmp_path / "r.parquet")
    result = ingest(settings, appends, [str(tmp_path / "r.parquet")], merge_strategy="append", event_time_column="at")
    assert dict(result.changes) == {"+A": 3}
    records = [r for _k, r in _events(settings, appends)]
    assert [r["event_time"] for r in records] == [1_000, 2_000, 3_000]
    assert records[0] == {"op": "+A", "event_time": 1_000, "sensor": "s1", "reading": 1.5,
                          "at": "1970-01-01T00:00:01+00:00"}


# Bad input: named, nothing written --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("id,score\n1,5\n,6\n", "line 3", "primary key column 'id' is null"),
        ("id,score\n1,5\n2,6\n1,7\n", "line 4", "appears twice in the snapshot (first at"),
    ],
)
def test_bad_snapshot_is_named_and_nothing_written(bootstrap_servers: str, topic, tmp_path: Path,
                                                   text: str, where: str, problem: str) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    name = topic(partitions=1)
    path = tmp_path / "bad.csv"
    path.write_text(text)
    refused = _run(["ingest", name, str(path), "--merge", "snapshot", "--primary-key", "id"], bootstrap_servers)
    assert refused.returncode == 2
    err = refused.stderr.decode()
    assert f"bad.csv:{where}" in err and problem in err and "nothing written" in err, err
    assert _events(settings, name) == []


def test_a_column_whose_type_changed_is_named(bootstrap_servers: str, topic, tmp_path: Path) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    name = topic(partitions=1)
    (tmp_path / "a.csv").write_text("id,score\n1,5\n")
    (tmp_path / "b.csv").write_text("id,score\n2,high\n")
    with pytest.raises(BadInput) as caught:
        ingest(settings, name, [str(tmp_path / "a.csv"), str(tmp_path / "b.csv")], merge_strategy="snapshot",
               primary_key=["id"])
    assert caught.value.where.endswith("b.csv:line 2")
    assert "column 'score' is string here but number at" in str(caught.value)
    assert _events(settings, name) == []


def test_upsert_tombstones_in_json_lines_and_standard_input(bootstrap_servers: str, topic) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    name = topic(partitions=2)
    lines = _jsonl([{"k": 1, "v": "a"}, {"k": 2, "v": "b"}, {"key": {"k": 1}, "value": None},
                    {"k": 2, "v": "c"}, {"key": {"k": 3}, "value": None}])
    done = _run(["ingest", name, "-", "--format", "jsonl", "--merge", "upsert", "--primary-key", "k"],
                bootstrap_servers, stdin=lines)
    assert done.returncode == 0, done.stderr.decode()
    assert "wrote 2 +A, 1 -R, 1 -C, 1 +C" in done.stdout.decode()
    assert _fold(settings, name, ["k"]) == {(2,): {"k": 2, "v": "c"}}
    assert ("-R", {"k": 1, "v": "a"}) in _ops(settings, name)
    # the same bytes again: the same identity, already committed
    again = _run(["ingest", name, "--format", "jsonl", "--merge", "upsert", "--primary-key", "k"],
                 bootstrap_servers, stdin=lines)
    assert again.returncode == 0 and "already committed" in again.stdout.decode(), again.stderr.decode()


def test_a_name_is_one_ingest(bootstrap_servers: str, topic, tmp_path: Path) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    name = topic(partitions=1)
    (tmp_path / "a.jsonl").write_bytes(_jsonl([{"id": 1}]))
    (tmp_path / "b.jsonl").write_bytes(_jsonl([{"id": 2}]))
    first = ingest(settings, name, [str(tmp_path / "a.jsonl")], merge_strategy="append", name="batch-1")
    assert first.identity == "batch-1" and first.written == 1
    refused = _run(["ingest", name, str(tmp_path / "b.jsonl"), "--merge", "append", "--name", "batch-1"],
                   bootstrap_servers)
    assert refused.returncode == 2
    assert "ingest 'batch-1'" in refused.stderr.decode() and "was committed with other input" in \
        refused.stderr.decode()
    second = ingest(settings, name, [str(tmp_path / "a.jsonl")], merge_strategy="append", name="batch-2")
    assert second.written == 1 and not second.already
    assert [r for _op, r in _ops(settings, name)] == [{"id": 1}, {"id": 1}]


def test_the_live_rows_are_kept_and_caught_up(bootstrap_servers: str, topic, tmp_path: Path) -> None:
    from refold.ingest.store import store_directory

    settings = {"bootstrap.servers": bootstrap_servers}
    name = topic(partitions=2)

    def snapshot(number: int, rows: list[dict[str, Any]]) -> Any:
        path = tmp_path / f"s{number}.jsonl"
        path.write_bytes(_jsonl(rows))
        return ingest(settings, name, [str(path)], merge_strategy="snapshot", primary_key=["id"], now=number)

    first = snapshot(1, ROWS)
    assert first.fold is not None and first.fold.records == 0
    second = snapshot(2, [*ROWS[:2], {"id": 4, "name": "Dana", "score": 70}])
    assert second.fold is not None and second.fold.records == 3  # the first ingest's records, no more
    third = snapshot(3, ROWS[:1])
    assert third.fold is not None and third.fold.records == second.written == 2
    stamp = store_directory(settings, name, ["id"]) / "stamp.json"
    kept = orjson.loads(stamp.read_bytes())
    assert kept["topic_id"] and set(kept["ends"]) == {"0", "1"}

    # a stamp of another topic (deleted and created again), or past the end, or none: rebuilt
    for bad in ({**kept, "topic_id": "another"}, {**kept, "ends": {"0": 10_000}}, None):
        if bad is None:
            stamp.unlink()
        else:
            stamp.write_bytes(orjson.dumps(bad))
        change = correct(settings, name, ["id"], {"id": 1}, {"score": 101 + len(_ops(settings, name))})
        assert change is not None
    assert len(_ops(settings, name)) == 7 + 6
    view = _fold(settings, name, ["id"])
    assert list(view) == [(1,)] and view[(1,)]["score"] == 101 + 11


def test_the_fold_refuses_what_the_engine_refuses(bootstrap_servers: str, topic, tmp_path: Path) -> None:
    from refold.cli.produce import produce

    settings = {"bootstrap.servers": bootstrap_servers}
    name = topic(partitions=1)
    events = [{"op": "+A", "id": 1, "v": "a"}, {"op": "-R", "id": 2, "v": "b"},  # not live
              {"op": "-C", "id": 1, "v": "zz"}, {"op": "+C", "id": 1, "v": "c"},  # -C of a row not live
              {"op": "+A", "id": 3, "v": "d"}]
    produce(settings, name, [orjson.dumps(e) for e in events], ["id"], progress=False)
    path = tmp_path / "s.jsonl"
    path.write_bytes(_jsonl([{"id": 1, "v": "a"}, {"id": 3, "v": "e"}]))
    done = _run(["ingest", name, str(path), "--merge", "snapshot", "--primary-key", "id"], bootstrap_servers)
    assert done.returncode == 0, done.stderr.decode()
    err = done.stderr.decode()
    assert "2 records of" in err and f"(first: {name}[0]@1: not live)" in err, err
    assert "wrote 0 +A, 0 -R, 1 -C, 1 +C" in done.stdout.decode()  # only id 3 changed
