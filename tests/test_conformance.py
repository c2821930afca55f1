"""One protocol conformance suite, run against every materialization driver.

The same test functions, parametrized by driver (`driver_case`), drive each driver
through the real runtime (`refold.connectors.runtime`) the way the batch processor
does, with the shipped test doubles (`refold.connectors.testing`): a real reducer
makes each batch's view changes and deltas, a small stand-in for Kafka keeps the
last committed checkpoint and state, and a crash is the runtime and driver objects
dropped at a chosen step, then a fresh instance opened from the last committed
checkpoint. Every message a driver sees is recorded and checked against the
protocol's ordering rules; the final store contents are checked against the
reference reducer (`refold.reference`).

The PostgreSQL cases are marked `postgres` (`pg_fixtures.POSTGRES_MARKS`): skipped
where no server can be had, but never in CI.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from pg_fixtures import POSTGRES_MARKS

from refold.config import Pipeline, load_pipeline, parse_pipeline
from refold.connectors import protocol as p
from refold.connectors.parquet import STAGING, read_parquet_deltas, read_parquet_view
from refold.connectors.sqlite import read_sqlite_deltas, read_sqlite_view
from refold.connectors.testing import Harness, WebhookReceiver, batches_of, changelog, serve_webhook
from refold.errors import ConfigError, OperationalError
from refold.model.changelog import Op
from refold.reduce import SourceEvent, make_reducer
from refold.reference import fold_deltas, reference_changelog

POSTGRES = pytest.param("postgres", marks=POSTGRES_MARKS)
# the lakehouse drivers' cases (each its own line: "delta" / "iceberg" once they take part)
DELTA: list[Any] = ["delta"]
DELTA_FENCED: list[Any] = ["delta"]
ICEBERG: list[Any] = ["iceberg"]
ICEBERG_FENCED: list[Any] = ["iceberg"]
VIEW_DRIVERS = ["sqlite", "parquet", POSTGRES, *DELTA, *ICEBERG]
ALL_DRIVERS = ["sqlite", "parquet", "webhook", POSTGRES, *DELTA, *ICEBERG]
# remote store authoritative: a nonce (or the table's own commit check) fences zombies
FENCED_DRIVERS = ["sqlite", POSTGRES, *DELTA_FENCED, *ICEBERG_FENCED]
COLUMNS = {"total": {"sum": "score"}, "best": {"max": "score"}, "n": {"count": "*"}, "latest": {"last": "score"}}
CRASH_STEPS = ["after_stores", "after_start_commit", "after_kafka_commit", "after_acknowledge"]


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with serve_webhook() as hook:
        yield hook


# Driver cases -------------------------------------------------------------------------------


@dataclass
class DriverCase:
    """How to configure one driver and read back what it stored."""

    name: str
    settings: dict[str, Any]
    read_view: Callable[[], dict[tuple[Any, ...], dict[str, Any]]] | None
    read_deltas: Callable[[], list[dict[str, Any]]]

    @property
    def has_view(self) -> bool:
        return self.read_view is not None


def _new_case(request: pytest.FixtureRequest, tmp_path: Path) -> DriverCase:
    return _case(request.param, request, tmp_path)


# A DriverCase per driver: every driver, those with a view binding, those with a fence.
driver_case = pytest.fixture(name="driver_case", params=ALL_DRIVERS)(_new_case)
view_case = pytest.fixture(name="view_case", params=VIEW_DRIVERS)(_new_case)
fenced_case = pytest.fixture(name="fenced_case", params=FENCED_DRIVERS)(_new_case)


def _case(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> DriverCase:
    if name == "sqlite":
        db = tmp_path / "view.db"
        return DriverCase(
            name,
            {"driver": "sqlite", "path": str(db), "view": "scores", "delta": "scores_delta"},
            lambda: read_sqlite_view(db, "scores"),
            lambda: read_sqlite_deltas(db, "scores_delta"),
        )
    if name == "parquet":
        root = tmp_path / "lake"
        root.mkdir()
        return DriverCase(
            name,
            {"driver": "parquet", "path": str(root), "view": "scores", "delta": "scores_delta", "parallelism": 3},
            lambda: read_parquet_view(root, "scores"),
            lambda: read_parquet_deltas(root, "scores_delta"),
        )
    if name == "webhook":
        hook: WebhookReceiver = request.getfixturevalue("receiver")
        return DriverCase(
            name,
            {"driver": "webhook", "url": hook.url, "delta": "scores_delta", "backoff": 0.01},
            None,
            hook.rows,
        )
    if name == "postgres":
        dsn: str = request.getfixturevalue("postgres_dsn")
        from refold.connectors import postgres

        return DriverCase(
            name,
            {"driver": "postgres", "dsn": dsn, "view": "scores", "delta": "scores_delta"},
            lambda: postgres.read_view(dsn, "scores"),
            lambda: postgres.read_deltas(dsn, "scores_delta"),
        )
    if name == "delta":
        from refold.connectors.delta import read_delta_deltas, read_delta_view

        lake = tmp_path / "delta"
        lake.mkdir()
        return DriverCase(
            name,
            {"driver": "delta", "path": str(lake), "view": "scores", "delta": "scores_delta"},
            lambda: read_delta_view(lake, "scores"),
            lambda: read_delta_deltas(lake, "scores_delta"),
        )
    if name == "iceberg":
        from refold.connectors.iceberg import read_iceberg_deltas, read_iceberg_view

        warehouse = tmp_path / "warehouse"
        warehouse.mkdir()
        return DriverCase(
            name,
            {"driver": "iceberg", "warehouse": str(warehouse), "view": "scores", "delta": "scores_delta"},
            lambda: read_iceberg_view(warehouse, "scores"),
            lambda: read_iceberg_deltas(warehouse, "scores_delta"),
        )
    raise AssertionError(name)


# Pipelines and expectations ---------------------------------------------------------------------


def make_pipeline(settings: dict[str, Any], view: dict[str, Any] | None = None) -> Pipeline:
    return parse_pipeline(
        {
            "pipeline": "conf",
            "source": {"topic": "scores"},
            "view": view or {"key": ["player_name"], "columns": COLUMNS},
            "outputs": {"materialize": [settings]},
        }
    )


def expected(pipeline: Pipeline, units: list[list[SourceEvent]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    return reference_changelog(pipeline.view, units).view


def assert_store_equals_reference(case: DriverCase, pipeline: Pipeline, units: list[list[SourceEvent]]) -> None:
    view = expected(pipeline, units)
    if case.read_view is not None:
        stored = case.read_view()
        assert stored.keys() == view.keys()
        assert stored == view
    deltas = case.read_deltas()
    assert fold_deltas(pipeline.view, deltas) == view  # every delta exactly once


# The suite ----------------------------------------------------------------------------------------


def test_ordering_rules(driver_case: DriverCase) -> None:
    pipeline = make_pipeline(driver_case.settings)
    harness = Harness(pipeline, ack_waits_for_load=driver_case.has_view)
    units = changelog(600, 60)
    batches = batches_of(units)
    live: set[tuple[Any, ...]] = set()
    for batch in batches:
        harness.batch(batch)
    harness.close()
    view_index = 0 if driver_case.has_view else None
    delta_index = 1 if driver_case.has_view else 0
    txns = harness.transactions()
    assert txns[0][0][0] == "Open" and ("Acknowledge", 0) in txns[0]
    assert len(txns) == len(batches) + 1
    log = harness.log
    unanswered = 0
    for entry in log:  # Flush never before every Acknowledge sent so far is Acknowledged
        unanswered += {"Acknowledge": 1, "Acknowledged": -1}.get(entry[0], 0)
        assert entry[0] != "Flush" or unanswered == 0
    assert [e for e in log if e[0] == "Acknowledge"] == [("Acknowledge", n) for n in range(len(batches) + 1)]
    if view_index is not None:  # the runtime did not wait for Acknowledged before Load
        for number in range(2, len(batches) + 1):
            sent = log.index(("Acknowledge", number - 1))
            answered = next(i for i in range(sent, len(log)) if log[i][0] == "Acknowledged")
            first_load = next(i for i in range(log.index(("-- batch", number)), len(log)) if log[i][0] == "Load")
            assert first_load < answered
    for txn, batch in zip(txns[1:], batches, strict=True):
        names = [entry[0] for entry in txn]
        flush = names.index("Flush")
        assert names.count("Flush") == 1 and names.count("StartCommit") == 1
        assert names.index("StartCommit") > max(i for i, n in enumerate(names) if n in ("Flush", "Store", "Load"))
        loads = [entry[2] for entry in txn if entry[0] == "Load"]
        loaded = {entry[2] for entry in txn if entry[0] == "Loaded"}
        assert all(entry[1] == view_index for entry in txn if entry[0] in ("Load", "Loaded"))  # never a delta binding
        assert len(loads) == len(set(loads))  # each key at most once
        stores = [entry for entry in txn if entry[0] == "Store"]
        if view_index is None:
            assert loads == []
        else:
            touched = {change for unit in batch for change in _keys(unit)}
            assert set(loads) <= touched
            assert loaded == set(loads) & live  # Loaded only for keys the store holds
            assert all(names.index("Load") < flush for _ in loads[:1])
            view_stores = {entry[2]: entry for entry in stores if entry[1] == view_index}
            assert set(view_stores) == set(loads)  # every loaded key stored once
            assert all(entry[3] == (entry[2] in loaded) for entry in view_stores.values())  # exists
            for key, entry in view_stores.items():
                if entry[4]:
                    live.discard(key)
                else:
                    live.add(key)
        assert any(entry[1] == delta_index for entry in stores)  # deltas are stored too
    assert_store_equals_reference(driver_case, pipeline, units)


def _keys(unit: Sequence[SourceEvent]) -> list[tuple[Any, ...]]:
    return [(event.row["player_name"],) for event in unit]


def test_missing_keys_are_not_loaded(view_case: DriverCase) -> None:
    pipeline = make_pipeline(view_case.settings)
    harness = Harness(pipeline)
    alice = SourceEvent(Op.APPEND, {"player_name": "alice", "score": 5}, (1, 0, 0))
    bob = SourceEvent(Op.APPEND, {"player_name": "bob", "score": 7}, (2, 0, 1))
    harness.batch([[alice]])
    harness.batch([[SourceEvent(Op.RETRACT, alice.row, (3, 0, 2))], [bob]])
    harness.close()
    first, second = harness.transactions()[1:]
    assert [e for e in first if e[0] == "Load"] == [("Load", 0, ("alice",))]
    assert [e for e in first if e[0] == "Loaded"] == []
    assert [e for e in second if e[0] == "Loaded"] == [("Loaded", 0, ("alice",))]
    stores = {e[2]: e for e in second if e[0] == "Store" and e[1] == 0}
    assert stores[("alice",)][3:] == (True, True)  # existed, deleted
    assert stores[("bob",)][3:] == (False, False)
    assert view_case.read_view is not None
    assert view_case.read_view() == {("bob",): {"player_name": "bob", "total": 7, "best": 7, "n": 1, "latest": 7}}


def test_empty_transactions(driver_case: DriverCase) -> None:
    pipeline = make_pipeline(driver_case.settings)
    harness = Harness(pipeline)
    units = changelog(200, 20)
    harness.batch(units)
    harness.runtime.settle()  # applied (parquet applies at Acknowledge)
    before = driver_case.read_view() if driver_case.read_view else None
    harness.batch([])
    harness.batch([])
    harness.close()
    for txn in harness.transactions()[2:]:
        names = [e[0] for e in txn]
        assert "Load" not in names and "Store" not in names
        assert names.count("Flush") == 1 and names.count("StartCommit") == 1
    assert harness.committed.batch == 3 and harness.driver.settings.materialization in harness.committed.driver_checkpoints
    if driver_case.read_view:
        assert driver_case.read_view() == before
    assert_store_equals_reference(driver_case, pipeline, units)


@pytest.mark.parametrize("step", CRASH_STEPS)
def test_restart_after_a_crash(driver_case: DriverCase, step: str) -> None:
    pipeline = make_pipeline(driver_case.settings)
    harness = Harness(pipeline)
    units = changelog(1200, 80, seed=3)
    batches = batches_of(units, seed=9)
    crash_at = 4
    for number, batch in enumerate(batches, start=1):
        if number == crash_at:
            crash = "after_start_commit" if step == "after_stores" else step
            if step == "after_stores":  # stores sent, StartCommit never answered: drop before it
                harness.driver.start_commit = _dies  # type: ignore[method-assign]
                with pytest.raises(_Crash):
                    harness.batch(batch)
                harness.crash()
            else:
                harness.batch(batch, crash=crash)
            if step in ("after_stores", "after_start_commit"):  # Kafka never committed: replay it
                harness.batch(batch)
        else:
            harness.batch(batch)
    harness.close()
    assert harness.log.count(("-- crash",)) == 1
    assert_store_equals_reference(driver_case, pipeline, units)


class _Crash(Exception):
    pass


def _dies(request: p.StartCommit) -> p.StartedCommit:
    raise _Crash


def test_a_zombie_cannot_commit(fenced_case: DriverCase) -> None:
    case = fenced_case
    pipeline = make_pipeline(case.settings)
    old = Harness(pipeline)
    units = changelog(300, 30)
    old.batch(units[:100])
    new = Harness(pipeline, kafka=old)  # a second instance opens: the nonce moves
    with pytest.raises(p.DriverFencedError):
        old.batch(units[100:200])
    new.batch(units[100:])
    new.close()
    assert case.read_view is not None
    assert case.read_view() == expected(pipeline, units), case.name


def test_parquet_staging_is_never_applied_twice(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    case = _case("parquet", request, tmp_path)
    root = Path(case.settings["path"])
    pipeline = make_pipeline(case.settings)
    units = changelog(400, 40)
    harness = Harness(pipeline)
    harness.batch(units[:150])
    harness.runtime.settle()
    applied = sorted(f.name for f in (root / "scores").iterdir())
    # A zombie stages a batch that Kafka never commits; a new instance opens meanwhile.
    zombie = Harness(pipeline, kafka=harness)
    zombie.runtime.commit(  # stages and references a batch that Kafka never commits
        replace(harness.committed, batch=2), [], [{"player_name": "z", "_count": 1}], zombie.reducer.view
    )
    staged_before = list((root / STAGING).rglob("*.parquet"))
    assert staged_before
    harness.start()  # the live instance re-opens: the zombie's staging is removed, not applied
    assert not any(f.exists() for f in staged_before)
    assert sorted(f.name for f in (root / "scores").iterdir()) == applied
    harness.runtime.acknowledge(harness.committed.batch)  # applying the committed batch again: a no-op
    harness.runtime.acknowledge(harness.committed.batch)
    harness.runtime.settle()
    assert sorted(f.name for f in (root / "scores").iterdir()) == applied
    harness.batch(units[150:])
    harness.close()
    assert_store_equals_reference(case, pipeline, units)


def test_matches_the_reference_on_a_random_changelog(driver_case: DriverCase) -> None:
    pipeline = make_pipeline(driver_case.settings)
    harness = Harness(pipeline)
    units = changelog(3000, 200, seed=23)
    for batch in batches_of(units, seed=2):
        harness.batch(batch)
    harness.close()
    assert_store_equals_reference(driver_case, pipeline, units)


def test_a_top_n_view(view_case: DriverCase) -> None:
    settings = {k: v for k, v in view_case.settings.items() if k != "delta"}
    pipeline = make_pipeline(settings, {"top_n": {"n": 3, "order_by": {"score": "desc"}}})
    harness = Harness(pipeline)
    units = changelog(500, 40, seed=4)
    for batch in batches_of(units, seed=4):
        harness.batch(batch)
    harness.close()
    assert view_case.read_view is not None
    assert view_case.read_view() == expected(pipeline, units)


def test_a_store_behind_kafka_is_backfilled(view_case: DriverCase, tmp_path: Path) -> None:
    """A materialization added to a running pipeline: the next batch stores the whole view."""
    pipeline_without = parse_pipeline(
        {"pipeline": "conf", "source": {"topic": "scores"}, "view": {"key": ["player_name"], "columns": COLUMNS},
         "outputs": {"view": {"topic": "conf.view"}}}
    )
    units = changelog(600, 50, seed=8)
    reducer = make_reducer(pipeline_without.view)
    for unit in units[:400]:
        reducer.apply(unit)
    reducer.take_deltas()
    pipeline = make_pipeline({k: v for k, v in view_case.settings.items() if k != "delta"})
    harness = Harness(pipeline)
    harness.committed = replace(harness.committed, batch=7)  # Kafka has 7 batches; the store none
    harness.state = dict((k, v) for k, v in reducer.take_state_changes() if v is not None)
    harness.start()
    harness.batch(units[400:])
    harness.close()
    assert ("StartCommit", 8, True) in harness.log  # a full refresh
    assert view_case.read_view is not None
    assert view_case.read_view() == expected(pipeline, units)


def _by_shard(units: list[list[SourceEvent]], shards: int = 2) -> list[list[list[SourceEvent]]]:
    """Units split as a co-partitioned view's shards see them: by key, in order."""
    parts: list[list[list[SourceEvent]]] = [[] for _ in range(shards)]
    for unit in units:
        parts[zlib.crc32(unit[0].row["player_name"].encode()) % shards].append(unit)
    return parts


def test_two_shards_of_one_driver_commit_independently(driver_case: DriverCase) -> None:
    """Two shards (writers `0-0`, `0-1`) of one materialization: each commits its own
    rows with its own checkpoint, nonce and batch numbers; one crashes and replays."""
    pipeline = make_pipeline(driver_case.settings)
    units = changelog(1200, 90, seed=31)
    parts = _by_shard(units)
    shards = [Harness(pipeline, writer=f"0-{n}") for n in range(2)]
    batches = [batches_of(part, seed=n + 1) for n, part in enumerate(parts)]
    for i in range(max(len(b) for b in batches)):
        for n, shard in enumerate(shards):
            if i < len(batches[n]):
                crash = "after_start_commit" if (n, i) == (1, 2) else None
                shard.batch(batches[n][i], crash=crash)
                if crash:  # Kafka never committed it: the shard replays it
                    shard.batch(batches[n][i])
    for shard in shards:
        shard.close()
    assert shards[0].committed.batch == len(batches[0]) and shards[1].committed.batch == len(batches[1])
    assert_store_equals_reference(driver_case, pipeline, units)


def test_a_backfilled_shard_leaves_the_other_shards_rows(view_case: DriverCase) -> None:
    pipeline = make_pipeline({k: v for k, v in view_case.settings.items() if k != "delta"})
    units = changelog(800, 60, seed=12)
    parts = _by_shard(units)
    first = Harness(pipeline, writer="0-0")
    for batch in batches_of(parts[0], seed=3):
        first.batch(batch)
    first.close()
    reducer = make_reducer(pipeline.view)  # shard 1: Kafka has 5 batches, the store none
    half = len(parts[1]) // 2
    for unit in parts[1][:half]:
        reducer.apply(unit)
    reducer.take_deltas()
    second = Harness(pipeline, writer="0-1")
    second.committed = replace(second.committed, batch=5)
    second.state = {k: v for k, v in reducer.take_state_changes() if v is not None}
    second.start()
    second.batch(parts[1][half:])
    second.close()
    assert ("StartCommit", 6, True) in second.log  # shard 1's full refresh: its own rows only
    assert view_case.read_view is not None
    assert view_case.read_view() == expected(pipeline, units)


def test_bad_settings_fail_at_open(tmp_path: Path) -> None:
    cases = {
        "path": {"driver": "sqlite", "path": str(tmp_path / "missing" / "x.db")},
        "path ": {"driver": "parquet", "path": str(tmp_path / "missing")},
        "url": {"driver": "webhook", "url": "http://127.0.0.1:9/hook", "timeout": 2},
    }
    for setting, settings in cases.items():
        harness_pipeline = make_pipeline(settings)
        with pytest.raises(ConfigError, match=rf"outputs\.materialize\[0\]\.{setting.strip()}: "):
            Harness(harness_pipeline)
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]\.pathh: unknown setting"):
        Harness(make_pipeline({"driver": "sqlite", "pathh": "x.db"}))
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]\.driver: unknown driver 'oracle'"):
        Harness(make_pipeline({"driver": "oracle"}))
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]: .*view.*webhook takes delta updates only"):
        Harness(make_pipeline({"driver": "webhook", "url": "http://127.0.0.1:9/", "view": "v"}))


def test_webhook_retries_and_the_idempotency_key(receiver: WebhookReceiver) -> None:
    case_settings = {"driver": "webhook", "url": receiver.url, "delta": "d", "backoff": 0.01, "parallelism": 2}
    pipeline = make_pipeline(case_settings)
    harness = Harness(pipeline)
    receiver.fail_next = 3  # the first three POSTs get 503: retried with backoff
    units = changelog(200, 30)
    harness.batch(units[:100])
    harness.batch(units[100:])
    harness.close()
    keys = [key for key, _ in receiver.posts]
    assert sorted(keys) == ["conf-0-1-0", "conf-0-1-1", "conf-0-2-0", "conf-0-2-1"]
    assert fold_deltas(pipeline.view, receiver.rows()) == expected(pipeline, units)
    receiver.fail_next = 10_000  # a part that never goes through fails the transaction
    harness = Harness(make_pipeline({**case_settings, "attempts": 2}))
    with pytest.raises(p.DriverError, match="failed to commit"):
        harness.batch(units[:10])
    harness.close()


# Settings at load time, store failures, the SQLite layout ---------------------------------------


def test_a_bad_entry_fails_when_the_pipeline_is_read(tmp_path: Path) -> None:
    """Each entry is validated by its driver's settings model in `load_pipeline`: before
    any topic, connection or Spark session exists (nothing is created)."""
    database = tmp_path / "views.db"
    path = tmp_path / "pipeline.yaml"
    entries = [
        f"{{driver: sqlite, path: {database}, view: scores}}",
        f"{{driver: parquet, pathh: {tmp_path}}}",
        "{driver: oracle}",
        "{driver: webhook, url: 'ftp://x', delta: d}",
    ]
    path.write_text(
        "pipeline: p\nsource: {topic: t}\nview: {key: [k], columns: {n: {count: '*'}}}\n"
        "outputs:\n  materialize:\n" + "".join(f"    - {entry}\n" for entry in entries)
    )
    with pytest.raises(ConfigError) as caught:
        load_pipeline(path)
    assert caught.value.where == str(path)
    message = str(caught.value)
    assert "outputs.materialize[1].pathh: unknown setting" in message
    assert "outputs.materialize[1].path: missing setting" in message
    assert "outputs.materialize[2].driver: unknown driver 'oracle'" in message
    assert "outputs.materialize[3].url: " in message and "write http(s)://" in message
    assert "materialize[0]" not in message
    assert not database.exists()
    top_n = {"top_n": {"n": 3, "order_by": {"score": "desc"}}}
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]\.delta: delta updates are defined for grouped"):
        make_pipeline({"driver": "sqlite", "path": str(database), "delta": "d"}, top_n)
    with pytest.raises(ConfigError, match=r"materialize\[1\]: another materialization is named 'sqlite'"):
        parse_pipeline({"pipeline": "p", "source": {"topic": "t"}, "view": {"key": ["k"], "columns": COLUMNS},
                        "outputs": {"materialize": [{"driver": "sqlite", "path": "a"}, {"driver": "sqlite", "path": "b"}]}})
    pipeline = make_pipeline({"driver": "postgres", "dsn": "postgresql://u:secret@h/db", "schema": "views"})
    (entry,) = pipeline.outputs.materialize
    assert entry.driver == "postgres" and entry.materialization == "postgres"
    assert "secret" not in repr(pipeline)


def test_reading_a_pipeline_imports_no_driver() -> None:
    """The settings models are light: `refold.config` loads no driver and no store client."""
    code = "import sys, refold.config; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('psycopg', 'pyarrow', 'sqlite3') or m.startswith('refold.connectors.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "['refold.connectors.settings']"


def test_a_store_failure_is_an_operational_error(tmp_path: Path) -> None:
    """A store that refuses (here: SQLite's write lock held by someone else) fails the
    batch with DriverError, an OperationalError chained to the store's error."""
    database = tmp_path / "view.db"
    pipeline = make_pipeline({"driver": "sqlite", "path": str(database), "view": "scores", "timeout": 0.1})
    harness = Harness(pipeline)
    units = changelog(100, 10)
    harness.batch(units[:50])
    other = sqlite3.connect(database, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # holds the write lock
    try:
        with pytest.raises(p.DriverError) as caught:
            harness.batch(units[50:])
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert isinstance(caught.value, OperationalError) and caught.value.materialization == "sqlite"
    assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
    assert "materialization 'sqlite': batch 2 failed" in str(caught.value)
    harness.close()


def test_sqlite_checkpoints_of_the_earlier_layout_are_migrated(tmp_path: Path) -> None:
    """`_refold_checkpoints` keyed by materialization alone becomes the fence's table keyed by
    (pipeline, writer, materialization); the stored checkpoint and the nonce carry over."""
    database = tmp_path / "view.db"
    held = p.RuntimeCheckpoint("conf", "0", 3, {0: 30})
    db = sqlite3.connect(database, isolation_level=None)
    db.execute("CREATE TABLE _refold_checkpoints (materialization TEXT PRIMARY KEY, "
               "nonce INTEGER NOT NULL, runtime_checkpoint BLOB)")
    db.execute("INSERT INTO _refold_checkpoints VALUES ('sqlite', 7, ?), ('other', 2, NULL)", (held.encode(),))
    db.close()
    driver = p.build_driver({"driver": "sqlite", "path": str(database), "view": "scores"})
    binding = p.Binding("view", "view", "scores", ("player_name",), ("total",))
    opened = driver.open(p.Open("sqlite", "conf", "0", (binding,), None))
    assert opened.runtime_checkpoint == held
    driver.close()
    db = sqlite3.connect(database)
    rows = db.execute("SELECT pipeline, writer, materialization, nonce, checkpoint FROM _refold_checkpoints "
                      "ORDER BY materialization").fetchall()
    db.close()
    assert rows == [("conf", "0", "other", 2, None), ("conf", "0", "sqlite", 8, held.encode())]
