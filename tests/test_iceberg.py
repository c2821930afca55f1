"""The Iceberg driver's own guarantees, below the conformance suite: the fence, replays,
the checkpoint in the table, the schema it writes, its errors.

The drivers are driven message by message (no runtime) against pyiceberg's SQL
catalog in a SQLite file under `tmp_path`."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.types import DoubleType, LongType, NestedField, StringType

from refold.config import parse_pipeline
from refold.connectors import protocol as p
from refold.connectors.iceberg import (
    RETRIES,
    SUMMARY_CHECKPOINT,
    SUMMARY_WRITER,
    IcebergDriver,
    fence_property,
    open_catalog,
    read_iceberg_deltas,
    read_iceberg_view,
)
from refold.connectors.testing import Harness, changelog
from refold.errors import ConfigError

VIEW = p.Binding("view", "view", "scores", ("player_name",), ("total", "n"))
DELTA = p.Binding("delta", "delta", "scores_delta", ("player_name",), ("_count", "total", "n"))


def _driver(folder: Path, **settings: Any) -> IcebergDriver:
    driver = p.build_driver({"driver": "iceberg", "warehouse": str(folder), "view": "scores", **settings})
    assert isinstance(driver, IcebergDriver)
    return driver


def _open(driver: IcebergDriver, writer: str = "0", bindings: tuple[p.Binding, ...] = (VIEW,)) -> p.Opened:
    return driver.open(p.Open("iceberg", "conf", writer, bindings, None))


def _checkpoint(batch: int, writer: str = "0") -> p.RuntimeCheckpoint:
    return p.RuntimeCheckpoint("conf", writer, batch, {0: batch * 10})


def _row(name: str, total: Any, n: int = 1) -> dict[str, Any]:
    return {"player_name": name, "total": total, "n": n}


def _commit(driver: IcebergDriver, batch: int, stores: list[p.Store], writer: str = "0", full: bool = False) -> None:
    driver.store(stores)
    driver.start_commit(p.StartCommit(_checkpoint(batch, writer), full_refresh=full))


def _put(name: str, total: Any, *, exists: bool = False, n: int = 1) -> p.Store:
    return p.Store(0, (name,), _row(name, total, n), exists)


def _table(warehouse: Path, name: str = "scores") -> Table:
    catalog = open_catalog(str(warehouse))
    try:
        return catalog.load_table(("refold", name))
    finally:
        catalog.close()


@pytest.fixture
def warehouse(tmp_path: Path) -> Path:
    folder = tmp_path / "warehouse"
    folder.mkdir()
    return folder


def test_the_checkpoint_comes_back_at_open_per_shard(warehouse: Path) -> None:
    shards = {writer: _driver(warehouse) for writer in ("0-0", "0-1")}
    for writer, driver in shards.items():
        assert _open(driver, writer).runtime_checkpoint is None  # a new table holds nothing
    _commit(shards["0-0"], 1, [_put("alice", 5)], "0-0")
    _commit(shards["0-1"], 1, [_put("bob", 7)], "0-1")
    _commit(shards["0-1"], 2, [_put("bob", 9, exists=True)], "0-1")
    for driver in shards.values():
        driver.close()
    again = _driver(warehouse)
    assert _open(again, "0-0").runtime_checkpoint == _checkpoint(1, "0-0")
    again.close()
    assert _open(again, "0-1").runtime_checkpoint == _checkpoint(2, "0-1")
    again.close()
    # the batch's snapshot summary carries the same checkpoint, and names the shard
    table = _table(warehouse)
    written = [s.summary for s in table.metadata.snapshots if s.summary and s.summary.get(SUMMARY_CHECKPOINT)]
    last = written[-1]
    assert last[SUMMARY_WRITER] == fence_property("conf", "0-1", "iceberg")
    assert p.RuntimeCheckpoint.decode(str(last[SUMMARY_CHECKPOINT]).encode()) == _checkpoint(2, "0-1")
    assert read_iceberg_view(warehouse, "scores") == {("alice",): _row("alice", 5), ("bob",): _row("bob", 9)}


def test_shards_opening_at_once_on_a_new_warehouse_all_open(tmp_path: Path) -> None:
    """The engine's shards Open at the same moment: on a fresh warehouse each may find no
    catalog tables, no namespace and no table, and try to create them; every loser of
    those races must go on with what the winner made (seen in loaded CI runs)."""
    for round_ in range(3):
        folder = tmp_path / f"warehouse{round_}"
        folder.mkdir()
        writers = [f"0-{n}" for n in range(4)]
        drivers = {writer: _driver(folder) for writer in writers}
        start = threading.Barrier(len(writers))

        def open_one(writer: str, start: threading.Barrier = start, drivers: dict[str, IcebergDriver] = drivers) -> p.Opened:
            start.wait()
            return _open(drivers[writer], writer)

        try:
            with ThreadPoolExecutor(len(writers)) as pool:
                opened = list(pool.map(open_one, writers))
            assert [o.runtime_checkpoint for o in opened] == [None] * len(writers)
            for n, writer in enumerate(writers):
                _commit(drivers[writer], 1, [_put(f"p{n}", n)], writer)
        finally:
            for driver in drivers.values():
                driver.close()
        props = _table(folder).properties
        assert all(fence_property("conf", writer, "iceberg") in props for writer in writers)
        assert read_iceberg_view(folder, "scores") == {(f"p{n}",): _row(f"p{n}", n) for n in range(len(writers))}


def test_without_the_property_open_walks_the_snapshots(warehouse: Path) -> None:
    driver = _driver(warehouse)
    _open(driver)
    _commit(driver, 4, [_put("alice", 5)])
    driver.close()
    prop = fence_property("conf", "0", "iceberg")
    table = _table(warehouse)
    nonce = table.properties[prop]
    table.transaction().remove_properties(prop).commit_transaction()
    assert _open(driver).runtime_checkpoint == _checkpoint(4)
    assert _table(warehouse).properties[prop] != nonce  # the nonce went on from the snapshots' (1 -> 2)
    driver.close()


def test_a_replayed_batch_is_a_no_op(warehouse: Path) -> None:
    driver = _driver(warehouse, delta="scores_delta")
    _open(driver, bindings=(VIEW, DELTA))
    delta = p.Store(1, ("alice",), {"player_name": "alice", "_count": 1, "total": 5, "n": 1}, False)
    _commit(driver, 1, [_put("alice", 5), delta])
    driver.close()  # crash after StartCommit: Kafka never committed batch 1
    snapshots = {name: len(_table(warehouse, name).metadata.snapshots) for name in ("scores", "scores_delta")}
    replay = _driver(warehouse, delta="scores_delta")
    assert _open(replay, bindings=(VIEW, DELTA)).runtime_checkpoint == _checkpoint(1)  # the store is ahead
    assert replay.load([p.Load(0, ("alice",))]) == [p.Loaded(0, ("alice",), _row("alice", 5))]
    _commit(replay, 1, [_put("alice", 5, exists=True), delta])  # the same batch again
    for name, before in snapshots.items():  # only Open's empty snapshot was added: nothing written
        assert len(_table(warehouse, name).metadata.snapshots) == before + 1
    assert read_iceberg_view(warehouse, "scores") == {("alice",): _row("alice", 5)}
    assert read_iceberg_deltas(warehouse, "scores_delta") == [delta.doc]
    # the same batch number over other input (Spark's offset log lost): rewritten, not doubled
    replay.store([_put("alice", 6, exists=True), p.Store(1, ("alice",), {**(delta.doc or {}), "total": 6}, False)])
    replay.start_commit(p.StartCommit(p.RuntimeCheckpoint("conf", "0", 1, {0: 11})))
    assert read_iceberg_view(warehouse, "scores") == {("alice",): _row("alice", 6)}
    assert [row["total"] for row in read_iceberg_deltas(warehouse, "scores_delta")] == [6]
    replay.close()


def test_a_zombie_commit_is_refused(warehouse: Path) -> None:
    zombie = _driver(warehouse)
    _open(zombie)
    _commit(zombie, 1, [_put("alice", 5)])
    newer = _driver(warehouse)
    _open(newer)  # bumps the nonce: the zombie is fenced from now on
    before = len(_table(warehouse).metadata.snapshots)
    with pytest.raises(p.DriverFencedError, match=r"opened by a newer instance .* batch 2 is refused"):
        _commit(zombie, 2, [_put("alice", 50, exists=True)])
    assert len(_table(warehouse).metadata.snapshots) == before  # nothing landed
    _commit(newer, 2, [_put("alice", 6, exists=True)])
    assert read_iceberg_view(warehouse, "scores") == {("alice",): _row("alice", 6)}
    zombie.close()
    newer.close()


def test_a_zombie_that_checked_before_the_newer_open_is_refused_by_the_catalog(warehouse: Path) -> None:
    """The race: the zombie reloads the table and finds its nonce still current, then a
    newer instance opens, then the zombie commits. The catalog refuses the commit (the
    newer Open moved `main`), the zombie reloads, sees the newer nonce, and gives up."""
    zombie = _driver(warehouse)
    _open(zombie)
    newer = _driver(warehouse)
    catalog = zombie.opened().catalog
    loads = 0
    real_load = catalog.load_table

    def load_then_open(identifier: Any) -> Table:
        nonlocal loads
        table = real_load(identifier)
        loads += 1
        if loads == 1:
            _open(newer)  # between the zombie's check and its commit
        return table

    catalog.load_table = load_then_open
    with pytest.raises(p.DriverFencedError):
        _commit(zombie, 1, [_put("alice", 50)])
    assert loads >= 2
    table = _table(warehouse)
    assert table.properties[RETRIES] == "0"  # pyiceberg's own retry would have re-applied it
    assert not any(s.summary and s.summary.get(SUMMARY_CHECKPOINT) for s in table.metadata.snapshots)
    assert read_iceberg_view(warehouse, "scores") == {}
    newer.close()
    zombie.close()


def test_a_commit_that_loses_to_another_shard_is_redone(warehouse: Path, caplog: pytest.LogCaptureFixture) -> None:
    first, second = _driver(warehouse), _driver(warehouse)
    _open(first, "0-0")
    _open(second, "0-1")
    catalog = first.opened().catalog
    loads = 0
    real_load = catalog.load_table

    def load_then_other_commits(identifier: Any) -> Table:
        nonlocal loads
        table = real_load(identifier)
        loads += 1
        if loads == 1:
            _commit(second, 1, [_put("bob", 7)], "0-1")
        return table

    catalog.load_table = load_then_other_commits
    with caplog.at_level("INFO", logger="refold.connectors.iceberg"):
        _commit(first, 1, [_put("alice", 5)], "0-0")
    # the first attempt lost to shard 0-1's commit; the second, on a fresh reload, landed
    assert [r.message for r in caplog.records if "lost to another commit" in r.message]
    assert read_iceberg_view(warehouse, "scores") == {("alice",): _row("alice", 5), ("bob",): _row("bob", 7)}
    first.close()
    second.close()


def test_typed_columns_and_the_evolution_rule(warehouse: Path) -> None:
    driver = _driver(warehouse)
    _open(driver)
    table = _table(warehouse)
    assert [f.name for f in table.schema().fields] == ["_key", "_doc", "_writer", "_batch"]
    _commit(driver, 1, [_put("alice", 5), _put("bob", 2.5)])
    _commit(driver, 2, [p.Store(0, ("carol",), {**_row("carol", 1), "extra": [1, 2]}, False),
                        _put("dave", 1.5, n=2)])
    _commit(driver, 3, [_put("alice", 1.25, exists=True, n=3), _put("erin", "x")])
    driver.close()
    table = _table(warehouse)
    types = {f.name: f.field_type for f in table.schema().fields}
    assert [f.name for f in table.schema().fields] == \
        ["_key", "player_name", "total", "n", "extra", "_doc", "_writer", "_batch"]
    assert types["total"] == DoubleType() and types["n"] == LongType() and types["extra"] == StringType()
    assert table.schema().identifier_field_names() == {"_key"}
    rows = {r["player_name"]: r for r in table.scan().to_arrow().to_pylist()}  # the typed columns
    assert {name: (r["total"], r["n"], r["extra"]) for name, r in rows.items()} == {
        "alice": (1.25, 3, None), "bob": (2.5, 1, None), "carol": (1.0, 1, "[1,2]"),
        "dave": (1.5, 2, None), "erin": (None, 1, None),  # a string in a double column: null there
    }
    assert read_iceberg_view(warehouse, "scores")[("erin",)] == _row("erin", "x")  # _doc is exact
    assert {r["_writer"] for r in rows.values()} == {"0"}


def test_a_full_refresh_replaces_its_shards_rows(warehouse: Path) -> None:
    first, second = _driver(warehouse), _driver(warehouse)
    _open(first, "0-0")
    _open(second, "0-1")
    _commit(first, 1, [_put("alice", 5), _put("amy", 1)], "0-0")
    _commit(second, 1, [_put("bob", 7)], "0-1")
    _commit(first, 2, [_put("alice", 6)], "0-0", full=True)  # amy is gone from the view
    assert read_iceberg_view(warehouse, "scores") == {("alice",): _row("alice", 6), ("bob",): _row("bob", 7)}
    first.close()
    second.close()


def test_through_the_runtime_a_second_reader_sees_the_view(warehouse: Path) -> None:
    pipeline = parse_pipeline({
        "pipeline": "conf", "source": {"topic": "scores"},
        "view": {"key": ["player_name"], "columns": {"total": {"sum": "score"}, "n": {"count": "*"}}},
        "outputs": {"materialize": [{"driver": "iceberg", "warehouse": str(warehouse), "view": "scores"}]},
    })
    harness = Harness(pipeline)
    units = changelog(300, 25)
    harness.batch(units[:150])
    harness.batch(units[150:])
    harness.close()
    view = read_iceberg_view(warehouse, "scores")
    typed = _table(warehouse).scan(selected_fields=("player_name", "total", "n")).to_arrow().to_pylist()
    assert {(r["player_name"],): {"player_name": r["player_name"], "total": r["total"], "n": r["n"]}
            for r in typed} == view


def test_bad_settings(warehouse: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]\.warehouse: the folder .* does not exist"):
        _open(_driver(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]\.uri: .*a catalog URI of scheme 'thrift'"):
        _driver(warehouse, uri="thrift://h:9083")
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]\.uri: a warehouse that is not a local folder"):
        _open(_driver(warehouse, warehouse="s3://bucket/lake"))
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]\.namespace: "):
        _driver(warehouse, namespace="a..b")
    secret = "hunter2-secret"
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]\.uri: cannot open the Iceberg catalog "
                       r"postgresql\+psycopg://127\.0\.0\.1:9/db") as caught:
        _open(_driver(warehouse, uri=f"postgresql+psycopg://user:{secret}@127.0.0.1:9/db",
                      properties={"token": secret}))
    assert secret not in str(caught.value)
    assert secret not in repr(_driver(warehouse, properties={"token": secret}).settings)
    # a table of the same name that is not ours
    catalog: Catalog = open_catalog(str(warehouse))
    catalog.create_namespace_if_not_exists("refold")
    catalog.create_table(("refold", "other"), Schema(NestedField(1, "id", LongType(), required=False)))
    catalog.close()
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]\.view: the table 'refold\.other' exists"):
        _open(_driver(warehouse, view="other"), bindings=(p.Binding("view", "view", "other", ("id",)),))


def test_the_tables_read_back_as_arrow(warehouse: Path) -> None:
    driver = _driver(warehouse, delta="scores_delta")
    _open(driver, bindings=(VIEW, DELTA))
    rows = [{"player_name": "alice", "_count": 1, "total": 5, "n": 1}, {"player_name": "alice", "_count": 1,
                                                                       "total": 2, "n": 1}]
    _commit(driver, 1, [_put("alice", 7, n=2), *[p.Store(1, ("alice",), row, False) for row in rows]])
    driver.close()
    deltas = _table(warehouse, "scores_delta").scan().to_arrow()
    assert isinstance(deltas, pa.Table)
    assert deltas.sort_by("_seq").select(["_batch", "_seq", "player_name", "_count", "total"]).to_pylist() == [
        {"_batch": 1, "_seq": 0, "player_name": "alice", "_count": 1, "total": 5},
        {"_batch": 1, "_seq": 1, "player_name": "alice", "_count": 1, "total": 2},
    ]
    assert read_iceberg_deltas(warehouse, "scores_delta") == rows
