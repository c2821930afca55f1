"""The Delta Lake driver (`refold.connectors.delta`) beyond the conformance suite:
the application transaction and commit metadata each commit carries, replays,
zombies (before and during a commit), the checkpoint `Open` reads back, typed
columns and their evolution, bad settings, and the tables read back by a second
reader: a few lines here that fold the `_delta_log` themselves and read the live
Parquet files with pyarrow, next to delta-rs's own `DeltaTable.to_pyarrow_table()`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from refold.connectors import protocol as p
from refold.connectors.delta import (
    DeltaDriver,
    app_id,
    fence_id,
    key_json,
    read_delta_deltas,
    read_delta_view,
)
from refold.errors import ConfigError

VIEW = p.Binding("view", "view", "scores", ("player_name",), ("total", "best"))
DELTA = p.Binding("delta", "delta", "scores_delta", ("player_name",), ("_count", "total"))
APP = app_id("pipe", "delta", "0-0")


@pytest.fixture
def lake(tmp_path: Path) -> Path:
    root = tmp_path / "lake"
    root.mkdir()
    return root


def opened(root: Path, writer: str = "0-0", bindings: tuple[p.Binding, ...] = (VIEW, DELTA),
           **settings: Any) -> tuple[DeltaDriver, p.Opened]:
    driver = p.build_driver({"driver": "delta", "path": str(root), "view": "scores", "delta": "scores_delta",
                             **settings})
    assert isinstance(driver, DeltaDriver)
    return driver, driver.open(p.Open("delta", "pipe", writer, bindings, None))


def checkpoint(batch: int, offset: int | None = None, writer: str = "0-0") -> p.RuntimeCheckpoint:
    return p.RuntimeCheckpoint("pipe", writer, batch, {0: batch * 10 if offset is None else offset})


def row(name: str, total: Any, best: Any = 1) -> dict[str, Any]:
    return {"player_name": name, "total": total, "best": best}


def commit(driver: DeltaDriver, cp: p.RuntimeCheckpoint, view: Sequence[p.Store] = (),
           deltas: Sequence[dict[str, Any]] = (), full_refresh: bool = False) -> p.StartedCommit:
    """One transaction: the view Stores (binding 0), the delta rows (binding 1), StartCommit."""
    stores = [*view, *(p.Store(1, (d["player_name"],), d, exists=False) for d in deltas)]
    if stores:
        driver.store(stores)
    return driver.start_commit(p.StartCommit(cp, (), full_refresh))


def put(name: str, total: Any, exists: bool = False, best: Any = 1) -> p.Store:
    return p.Store(0, (name,), row(name, total, best), exists)


def delete(name: str) -> p.Store:
    return p.Store(0, (name,), None, exists=True, delete=True)


def table(root: Path, target: str = "scores") -> DeltaTable:
    return DeltaTable(str(root / target))


# The log, read without delta-rs ------------------------------------------------------------------


def log_actions(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(version, action) of every commit file in `_delta_log`, in commit order."""
    for file in sorted((path / "_delta_log").glob("*.json")):
        version = int(file.name.split(".")[0])
        for line in file.read_text().splitlines():
            if line.strip():
                yield version, json.loads(line)


def second_reader(path: Path) -> pa.Table:
    """The live rows of a Delta table: the log's add/remove actions folded, then the
    live Parquet files read with pyarrow (partition values from the `add` actions)."""
    live: dict[str, dict[str, str]] = {}
    for _version, action in log_actions(path):
        if "add" in action:
            live[action["add"]["path"]] = action["add"]["partitionValues"]
        elif "remove" in action:
            live.pop(action["remove"]["path"], None)
    tables = []
    for name, partitions in sorted(live.items()):
        data = pq.read_table(path / name)
        data = data.cast(pa.schema([pa.field(f.name, pa.string() if pa.types.is_string_view(f.type) else f.type)
                                    for f in data.schema]))
        for column, value in partitions.items():
            data = data.append_column(column, pa.array([value] * data.num_rows, pa.string()))
        tables.append(data)
    return pa.concat_tables(tables, promote_options="default")


def txn_versions(path: Path) -> dict[str, int]:
    """The latest `txn` version of each application id, from the log."""
    out: dict[str, int] = {}
    for _version, action in log_actions(path):
        if "txn" in action:
            out[action["txn"]["appId"]] = action["txn"]["version"]
    return out


# The tests -------------------------------------------------------------------------------------------


def test_each_commit_carries_the_app_transaction_and_the_checkpoint(lake: Path) -> None:
    driver, first = opened(lake)
    assert first.runtime_checkpoint is None
    commit(driver, checkpoint(1), [put("alice", 5), put("bob", 7)], [{"player_name": "alice", "_count": 1, "total": 5}])
    commit(driver, checkpoint(2))  # an empty transaction still commits its checkpoint
    for target in ("scores", "scores_delta"):
        versions = txn_versions(lake / target)
        assert versions[APP] == 2 and versions[fence_id(APP)] == 1
        assert table(lake, target).transaction_version(APP) == 2
        last = table(lake, target).history(1)[0]
        assert last["refold.app_id"] == APP and last["refold.batch"] == "2"
        assert p.RuntimeCheckpoint.decode(last["refold.checkpoint"].encode()) == checkpoint(2)
    driver.close()
    again, reopened = opened(lake)  # the checkpoint comes back, offsets and all
    assert reopened.runtime_checkpoint == checkpoint(2)
    assert txn_versions(lake / "scores")[fence_id(APP)] == 2  # Open took the fence
    again.close()


def test_a_replayed_commit_is_a_no_op(lake: Path) -> None:
    driver, _ = opened(lake)
    commit(driver, checkpoint(1), [put("alice", 5)], [{"player_name": "alice", "_count": 1, "total": 5}])
    commit(driver, checkpoint(2), [put("alice", 8, exists=True), put("bob", 1)],
           [{"player_name": "alice", "_count": 0, "total": 3}, {"player_name": "bob", "_count": 1, "total": 1}])
    versions = {t: table(lake, t).version() for t in ("scores", "scores_delta")}
    # the process dies before Kafka commits batch 2; the new instance replays it
    replay, held = opened(lake)
    assert held.runtime_checkpoint == checkpoint(2)
    assert replay.load([p.Load(0, ("alice",)), p.Load(0, ("bob",))]) == [
        p.Loaded(0, ("alice",), row("alice", 8)), p.Loaded(0, ("bob",), row("bob", 1))]
    commit(replay, checkpoint(2), [put("alice", 8, exists=True), put("bob", 1, exists=True)],
           [{"player_name": "alice", "_count": 0, "total": 3}, {"player_name": "bob", "_count": 1, "total": 1}])
    opens = 1  # the replaying instance's fence commit; nothing else
    assert {t: table(lake, t).version() for t in versions} == {t: v + opens for t, v in versions.items()}
    assert read_delta_view(lake, "scores") == {("alice",): row("alice", 8), ("bob",): row("bob", 1)}
    assert len(read_delta_deltas(lake, "scores_delta")) == 3  # every delta row once


def test_a_replay_cut_differently_replaces_the_batch(lake: Path) -> None:
    """The store holds batch 2 from offsets ..20; Kafka replays batch 2 cut at ..25 (Spark lost
    its offset log): the delta rows of batch 2 are replaced, the view re-merged."""
    driver, _ = opened(lake)
    commit(driver, checkpoint(1), [put("alice", 5)], [{"player_name": "alice", "_count": 1, "total": 5}])
    commit(driver, checkpoint(2, 20), [put("bob", 1)], [{"player_name": "bob", "_count": 1, "total": 1}])
    replay, _ = opened(lake)
    commit(replay, checkpoint(2, 25), [put("bob", 3, exists=True), put("carol", 2)],
           [{"player_name": "bob", "_count": 1, "total": 3}, {"player_name": "carol", "_count": 1, "total": 2}])
    assert read_delta_view(lake, "scores") == {("alice",): row("alice", 5), ("bob",): row("bob", 3),
                                                ("carol",): row("carol", 2)}
    deltas = read_delta_deltas(lake, "scores_delta")
    assert [d["player_name"] for d in deltas] == ["alice", "bob", "carol"] and deltas[1]["total"] == 3
    replay.close()
    assert opened(lake)[1].runtime_checkpoint == checkpoint(2, 25)


def test_a_crash_between_the_two_tables_is_exactly_once(lake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The delta table committed batch 2, the view table did not: `Open` returns the view
    table's batch 1; the replay skips the delta table (already there) and commits the view."""
    driver, _ = opened(lake)
    commit(driver, checkpoint(1), [put("alice", 5)], [{"player_name": "alice", "_count": 1, "total": 5}])
    from refold.connectors import delta as module

    def dies(*args: Any) -> None:
        raise KeyboardInterrupt  # the process is killed here

    monkeypatch.setattr(module, "_write_view", dies)
    with pytest.raises(KeyboardInterrupt):
        commit(driver, checkpoint(2), [put("bob", 1)], [{"player_name": "bob", "_count": 1, "total": 1}])
    monkeypatch.undo()
    assert table(lake, "scores_delta").transaction_version(APP) == 2
    assert table(lake, "scores").transaction_version(APP) == 1
    replay, held = opened(lake)
    assert held.runtime_checkpoint == checkpoint(1)  # the view table is the commit point
    delta_version = table(lake, "scores_delta").version()
    commit(replay, checkpoint(2), [put("bob", 1)], [{"player_name": "bob", "_count": 1, "total": 1}])
    assert table(lake, "scores_delta").version() == delta_version  # skipped: already there
    assert read_delta_view(lake, "scores") == {("alice",): row("alice", 5), ("bob",): row("bob", 1)}
    assert [d["player_name"] for d in read_delta_deltas(lake, "scores_delta")] == ["alice", "bob"]


def test_a_zombie_cannot_commit(lake: Path) -> None:
    old, _ = opened(lake)
    commit(old, checkpoint(1), [put("alice", 5)], [{"player_name": "alice", "_count": 1, "total": 5}])
    new, held = opened(lake)
    assert held.runtime_checkpoint == checkpoint(1)
    versions = {t: table(lake, t).version() for t in ("scores", "scores_delta")}
    with pytest.raises(p.DriverFencedError, match=r"opened by a newer instance \(fence 2, ours 1\)"):
        commit(old, checkpoint(2), [put("zombie", 1)], [{"player_name": "zombie", "_count": 1, "total": 1}])
    assert {t: table(lake, t).version() for t in versions} == versions  # nothing written
    commit(new, checkpoint(2), [put("bob", 1)], [{"player_name": "bob", "_count": 1, "total": 1}])
    assert read_delta_view(lake, "scores") == {("alice",): row("alice", 5), ("bob",): row("bob", 1)}


def test_a_newer_open_between_the_check_and_the_commit_refuses_it(lake: Path) -> None:
    """The zombie read the fence before the newer Open committed: delta-rs's conflict check
    (the commit restates the fence's app id) refuses the commit; the retry sees the fence."""
    old, _ = opened(lake, bindings=(VIEW,))
    commit(old, checkpoint(1), [put("alice", 5)])
    session = old.opened()
    stale = session.tables[0].table
    refreshes: list[int] = []
    original = stale.update_incremental

    def late_refresh() -> None:
        if not refreshes:  # the first refresh happens, then the newer instance opens
            original()
            opened(lake, bindings=(VIEW,))
        else:
            original()
        refreshes.append(1)

    stale.update_incremental = late_refresh
    with pytest.raises(p.DriverFencedError):
        commit(old, checkpoint(2), [put("zombie", 1)])
    assert len(refreshes) == 2  # the first attempt was refused by the conflict check
    assert read_delta_view(lake, "scores") == {("alice",): row("alice", 5)}


def test_typed_columns_evolve_and_a_second_reader_agrees(lake: Path) -> None:
    driver, _ = opened(lake, bindings=(VIEW,))
    commit(driver, checkpoint(1), [put("alice", 5, best=None), put("bob", 7, best=None)])
    schema = pa.schema(table(lake).schema().to_arrow())
    assert schema.get_field_index("best") < 0  # no value yet: no column yet
    assert schema.field("total").type == pa.int64() and schema.field("player_name").type == pa.string()
    commit(driver, checkpoint(2), [put("alice", 5.5, exists=True, best=[1, 2]), put("carol", 1, best=[3])])
    commit(driver, checkpoint(3), [delete("bob")])
    schema = pa.schema(table(lake).schema().to_arrow())
    assert schema.field("best").type == pa.string()  # lists: JSON text
    expected = {("alice",): row("alice", 5.5, [1, 2]), ("carol",): row("carol", 1, [3])}
    assert read_delta_view(lake, "scores") == expected  # _doc: exact
    by_delta_rs = {r["player_name"]: r for r in table(lake).to_pyarrow_table().to_pylist()}
    by_log = {r["player_name"]: r for r in second_reader(lake / "scores").to_pylist()}
    for rows in (by_delta_rs, by_log):
        assert sorted(rows) == ["alice", "carol"]
        assert rows["alice"]["total"] is None  # 5.5 does not fit the long column: null, _doc has it
        assert rows["alice"]["best"] == "[1,2]" and rows["carol"]["total"] == 1
        assert rows["alice"]["_writer"] == "0-0" and rows["alice"]["_key"] == key_json(("alice",))
        assert json.loads(rows["alice"]["_doc"]) == row("alice", 5.5, [1, 2])


def test_a_full_refresh_replaces_only_its_shards_partition(lake: Path) -> None:
    first, _ = opened(lake, writer="0-0", bindings=(VIEW,))
    second, _ = opened(lake, writer="0-1", bindings=(VIEW,))
    commit(first, checkpoint(1, writer="0-0"), [put("alice", 5), put("bob", 7)])
    commit(second, checkpoint(1, writer="0-1"), [put("carol", 1)])
    commit(first, checkpoint(5, writer="0-0"), [put("dave", 2)], full_refresh=True)
    assert read_delta_view(lake, "scores") == {("dave",): row("dave", 2), ("carol",): row("carol", 1)}
    assert sorted(Path(lake / "scores").glob("_writer=*")) == [lake / "scores" / "_writer=0-0",
                                                               lake / "scores" / "_writer=0-1"]


def at_once(work: Callable[[int], object], count: int) -> list[BaseException]:
    """`work(0)` … `work(count - 1)`, each in a thread of its own, all at once: what they raised."""
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            work(n)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_shards_open_and_commit_concurrently_without_conflicts(lake: Path) -> None:
    """Two shards create the tables at once (one create wins, the other opens it), then
    commit in parallel: each merges into its own partition, neither is refused."""
    drivers: dict[int, DeltaDriver] = {}

    def run(n: int) -> None:
        drivers[n] = opened(lake, writer=f"0-{n}")[0]
        for batch in range(1, 6):
            name = f"p{n}-{batch}"
            commit(drivers[n], checkpoint(batch, writer=f"0-{n}"), [put(name, batch)],
                   [{"player_name": name, "_count": 1, "total": batch}])

    assert at_once(run, 2) == []
    assert len(read_delta_view(lake, "scores")) == 10 and len(read_delta_deltas(lake, "scores_delta")) == 10
    for n in range(2):
        assert table(lake).transaction_version(app_id("pipe", "delta", f"0-{n}")) == 5


def test_a_table_another_shard_is_creating_is_opened_not_refused(tmp_path: Path) -> None:
    """Mid-create a table folder holds only `_delta_log` (delta-rs renames its first commit in
    last): a shard that looks then must create or open it, never call it a foreign folder."""
    lake = tmp_path / "half"
    (lake / "scores" / "_delta_log").mkdir(parents=True)
    driver, _ = opened(lake, bindings=(VIEW,))
    assert table(lake).version() >= 0
    driver.close()
    for round_ in range(6):  # three shards race the create of fresh tables
        root = tmp_path / f"race{round_}"
        root.mkdir()
        assert at_once(lambda n, root=root: opened(root, writer=f"0-{n}")[0].close(), 3) == []


def test_bad_settings_fail_at_open_naming_the_setting(lake: Path) -> None:
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]\.path: the folder .* does not exist"):
        opened(lake / "missing")
    (lake / "scores").mkdir()
    (lake / "scores" / "notes.txt").write_text("not a table")
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]\.view: .* exists and is not a Delta table"):
        opened(lake)
    DeltaTable.create(str(lake / "scores_delta"), pa.schema([("x", pa.int64())]))
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]\.delta: .* was not made by this driver"):
        opened(lake, bindings=(DELTA,))
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]\.storage_options\.x: "):
        p.build_driver({"driver": "delta", "path": str(lake), "storage_options": {"x": 1}})


def test_secrets_stay_out_of_reprs_and_messages() -> None:
    secret = "s3cr3t-Value-42"
    options = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1",
               "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": secret, "timeout": "2s"}
    driver = p.build_driver({"driver": "delta", "path": "s3://bucket/lake", "view": "scores",
                             "storage_options": options})
    assert secret not in repr(driver.settings)
    with pytest.raises(ConfigError) as caught:  # nothing listens on port 9: refused at once
        driver.open(p.Open("delta", "pipe", "0-0", (VIEW,), None))
    message = str(caught.value)
    assert message.startswith("outputs.materialize[0].path: cannot open or create the Delta table")
    assert secret not in message and "127.0.0.1:9" not in message and "\x1b[" not in message
    assert caught.value.__cause__ is None


def test_a_process_that_read_the_tables_exits_cleanly(lake: Path) -> None:
    """`read_delta_view` and `read_delta_deltas` leave no Arrow I/O thread behind: with
    Arrow's dataset scan 4 of 30 such processes aborted at exit ("terminate called
    without an active exception"), the demo one run in five; with `use_threads=False`
    too, on a busy machine, this test failed in 2 runs of 3."""
    driver, _ = opened(lake)
    for batch in range(1, 7):  # a file per commit: the scan reads them at once
        commit(driver, checkpoint(batch), [put(f"p{batch}", batch)], [{"player_name": f"p{batch}", "_count": 1, "total": 5}])
    driver.close()
    script = ("import sys; from refold.connectors.delta import read_delta_view, read_delta_deltas; "
              "print(len(read_delta_view(sys.argv[1], 'scores')), len(read_delta_deltas(sys.argv[1], 'scores_delta')))")
    for _ in range(20):  # (the abort came in about one process of ten: 20 catch it 9 times in 10)
        done = subprocess.run([sys.executable, "-c", script, str(lake)], capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stdout.strip()) == (0, "6 6"), done.stderr[-2000:]
