"""The PostgreSQL driver against a real server (`postgres_dsn`: a fresh database per test).

Transactions are driven as the runtime drives them: Load, Flush, then the Stores
prepared by the driver's `PostgresWriter`s on threads (pickled, as Spark ships them)
and committed by its aggregated committer, then StartCommit; or, without the sink,
`store` and StartCommit. The protocol-wide checks are in test_conformance.py.
Marked `postgres`: the `pg_server` fixture skips without a server, except in CI.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

from refold.connectors.postgres import PostgresDriver, read_deltas, read_view
from refold.connectors.protocol import (
    Acknowledge,
    Acknowledged,
    Binding,
    DriverFencedError,
    Flush,
    Load,
    Open,
    RuntimeCheckpoint,
    StartCommit,
    Store,
    TxnInfo,
    build_driver,
)
from refold.connectors.runtime import ThreadExecutor
from refold.errors import ConfigError

pytestmark = pytest.mark.postgres

VIEW = Binding("view", "view", "scores", ("player",), ("total",))
DELTA = Binding("delta", "delta", "scores_delta", ("player",), ("_count", "total"))
BINDINGS = (VIEW, DELTA)


def make(dsn: str, **settings: Any) -> PostgresDriver:
    driver = build_driver({"driver": "postgres", "dsn": dsn, "view": "scores", "delta": "scores_delta", **settings})
    assert isinstance(driver, PostgresDriver)
    return driver


def open_(driver: PostgresDriver, bindings: tuple[Binding, ...] = BINDINGS) -> RuntimeCheckpoint | None:
    opened = driver.open(Open("pg", "p", "w", bindings, None))
    assert driver.acknowledge(Acknowledge(0)) == Acknowledged()
    return opened.runtime_checkpoint


def checkpoint(batch: int) -> RuntimeCheckpoint:
    return RuntimeCheckpoint("p", "w", batch, {0: batch * 10, 1: batch * 7})


def row(player: str, total: int) -> Store:
    return Store(0, (player,), {"player": player, "total": total}, exists=False)


def delete(player: str) -> Store:
    return Store(0, (player,), None, exists=True, delete=True)


def delta(player: str, total: int) -> Store:
    return Store(1, (player,), {"player": player, "_count": 1, "total": total}, exists=False)


def commit(
    driver: PostgresDriver, batch: int, stores: Sequence[Store], *, sink: bool = True, full_refresh: bool = False
) -> None:
    """One transaction after the Loads: Flush, Stores, StartCommit."""
    driver.flush(Flush())
    if not sink:
        if stores:
            driver.store(stores)
        driver.start_commit(StartCommit(checkpoint(batch), (), full_refresh))
        return
    parts: list[list[Store]] = [[], []]
    for store in stores:
        parts[zlib.crc32(repr(store.key).encode()) % 2].append(store)
    work = [(i, items) for i, items in enumerate(parts) if items]
    plan = driver.sink()
    infos = ThreadExecutor(2).prepare(plan.writer, TxnInfo("pg", "p", "w", batch, BINDINGS), work) if work else []
    start = StartCommit(checkpoint(batch), tuple(infos), full_refresh)
    assert plan.aggregated is not None
    plan.aggregated.commit(infos, start)
    assert driver.start_commit(start).driver_checkpoint == b""


def loaded(driver: PostgresDriver, *players: str) -> dict[str, Any]:
    answers = driver.load([Load(0, (p,)) for p in players])
    return {answer.key[0]: answer.doc for answer in answers}


def staging_tables(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [name for (name,) in conn.execute("SELECT tablename FROM pg_tables WHERE tablename LIKE '\\_rfs\\_%'")]


def test_open_creates_tables_and_restart_continues_from_the_stored_checkpoint(postgres_dsn: str) -> None:
    driver = make(postgres_dsn)
    assert open_(driver) is None  # an empty store
    commit(driver, 1, [row("alice", 10), row("bob", 5)])
    commit(driver, 2, [row("alice", 12)])
    driver.close()

    again = make(postgres_dsn)
    assert open_(again) == checkpoint(2)  # what the store holds, offsets included
    assert read_view(postgres_dsn, "scores") == {
        ("alice",): {"player": "alice", "total": 12},
        ("bob",): {"player": "bob", "total": 5},
    }
    commit(again, 3, [row("carol", 1)])
    again.close()
    assert open_(make(postgres_dsn)) == checkpoint(3)
    assert staging_tables(postgres_dsn) == []  # merged and dropped in the commit


def test_a_zombie_commit_is_refused_and_changes_nothing(postgres_dsn: str) -> None:
    zombie = make(postgres_dsn)
    open_(zombie)
    commit(zombie, 1, [row("alice", 1)])
    newer = make(postgres_dsn)
    assert open_(newer) == checkpoint(1)  # bumps the nonce

    for via_sink in (True, False):
        with pytest.raises(DriverFencedError, match=r"newer instance.*batch 2 is refused"):
            commit(zombie, 2, [row("alice", 666), row("mallory", 1)], sink=via_sink)
    assert read_view(postgres_dsn, "scores") == {("alice",): {"player": "alice", "total": 1}}

    commit(newer, 2, [row("alice", 2)])
    assert read_view(postgres_dsn, "scores") == {("alice",): {"player": "alice", "total": 2}}
    newer.close()
    assert open_(make(postgres_dsn)) == checkpoint(2)


def test_load_returns_stored_rows_and_omits_missing_keys(postgres_dsn: str) -> None:
    driver = make(postgres_dsn, batch_size=2)  # several Load queries
    open_(driver)
    assert loaded(driver, "alice", "bob") == {}  # empty table: nothing
    commit(driver, 1, [row("alice", 10), row("bob", 5), row("carol", 7)])
    assert loaded(driver, "alice", "nobody", "carol", "zed", "bob") == {
        "alice": {"player": "alice", "total": 10},
        "carol": {"player": "carol", "total": 7},
        "bob": {"player": "bob", "total": 5},
    }


@pytest.mark.parametrize("via_sink", [True, False], ids=["sink", "store"])
def test_stores_and_deletes_end_in_the_right_rows(postgres_dsn: str, via_sink: bool) -> None:
    driver = make(postgres_dsn)
    open_(driver)
    commit(driver, 1, [row("alice", 10), row("bob", 5), row("carol", 7), delta("alice", 10)], sink=via_sink)
    commit(
        driver, 2,
        [Store(0, ("bob",), {"player": "bob", "total": 6}, exists=True), delete("carol"), row("dave", 3),
         delta("bob", 1), delta("carol", -7), delta("dave", 3)],
        sink=via_sink,
    )  # fmt: skip
    commit(driver, 3, [], sink=via_sink)  # an empty transaction still moves the checkpoint
    assert read_view(postgres_dsn, "scores") == {
        ("alice",): {"player": "alice", "total": 10},
        ("bob",): {"player": "bob", "total": 6},
        ("dave",): {"player": "dave", "total": 3},
    }
    assert sorted((d["player"], d["total"]) for d in read_deltas(postgres_dsn, "scores_delta")) == [
        ("alice", 10), ("bob", 1), ("carol", -7), ("dave", 3),
    ]  # fmt: skip
    driver.close()
    assert open_(make(postgres_dsn)) == checkpoint(3)


def test_a_replayed_batch_replaces_its_delta_rows(postgres_dsn: str) -> None:
    """The store committed batch 2 but Kafka did not: batch 2 runs again (maybe over
    another input range); its deltas replace the first run's, never add to them."""
    first = make(postgres_dsn)
    open_(first)
    commit(first, 1, [delta("alice", 1)])
    commit(first, 2, [delta("alice", 2), delta("bob", 2)])
    first.close()
    second = make(postgres_dsn)
    assert open_(second) == checkpoint(2)  # ahead of Kafka's batch 1
    commit(second, 2, [delta("alice", 2)])
    assert [(d["player"], d["total"]) for d in read_deltas(postgres_dsn, "scores_delta")] == [
        ("alice", 1), ("alice", 2),
    ]  # fmt: skip


def test_full_refresh_removes_rows_not_stored(postgres_dsn: str) -> None:
    driver = make(postgres_dsn)
    open_(driver)
    commit(driver, 1, [row("alice", 1), row("stale", 9)])
    commit(driver, 2, [row("alice", 2), row("bob", 3)], full_refresh=True)
    assert set(read_view(postgres_dsn, "scores")) == {("alice",), ("bob",)}


def test_open_drops_staging_left_by_a_crashed_instance_and_abort_cleans_up(postgres_dsn: str) -> None:
    crashed = make(postgres_dsn)
    open_(crashed)
    plan = crashed.sink()
    txn = TxnInfo("pg", "p", "w", 1, BINDINGS)
    plan.writer.prepare(txn, 0, [row("alice", 1)])
    plan.writer.prepare(txn, 0, [row("alice", 1)])  # a retried part: same table, no error
    assert len(staging_tables(postgres_dsn)) == 1
    assert read_view(postgres_dsn, "scores") == {}  # staged: nothing visible
    open_(make(postgres_dsn))
    assert staging_tables(postgres_dsn) == []

    driver = make(postgres_dsn)
    open_(driver)
    plan = driver.sink()
    info = plan.writer.prepare(txn, 1, [row("bob", 1)])
    plan.writer.abort([info])
    assert staging_tables(postgres_dsn) == []
    plan.writer.prepare(txn, 0, [row("bob", 1)])
    plan.writer.abort([])  # the runtime's abort after a failed prepare: all of ours
    assert staging_tables(postgres_dsn) == []


def test_values_round_trip_as_json(postgres_dsn: str) -> None:
    driver = make(postgres_dsn)
    open_(driver, (Binding("view", "view", "scores", ("k", "n"), ()),))
    doc = {"k": "x'\"\\\n\t", "n": 2**70, "f": 0.1, "b": True, "none": None, "set": ["a", "b"], "u": "é☃"}
    key = (doc["k"], doc["n"])
    driver.flush(Flush())
    driver.store([Store(0, key, doc, exists=False)])
    driver.start_commit(StartCommit(checkpoint(1)))
    assert driver.load([Load(0, key)])[0].doc == doc
    assert read_view(postgres_dsn, "scores") == {key: doc}


def test_a_wrong_dsn_fails_at_open_naming_the_setting(pg_server: Any, postgres_dsn: str) -> None:
    from refold.dev.localpg import free_port

    secret = "s3cr3t-Pa55"
    for dsn in (
        f"postgresql://refold:{secret}@127.0.0.1:{free_port()}/nothing",  # nobody listens
        psycopg.conninfo.make_conninfo(postgres_dsn, password=secret),  # wrong password
        f"host=127.0.0.1 password={secret} bogus_option=1",
    ):
        driver = make(dsn, connect_timeout=2)
        with pytest.raises(ConfigError) as caught:
            driver.open(Open("pg", "p", "w", BINDINGS, None))
        assert caught.value.where == "outputs.materialize[0].dsn"
        assert secret not in str(caught.value)
        assert secret not in repr(driver.settings)


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"outputs.materialize\[0\].tabel: unknown setting"):
        build_driver({"driver": "postgres", "dsn": "postgresql:///x", "tabel": "t"})
    with pytest.raises(ConfigError, match=r"outputs.materialize\[0\].dsn: missing setting"):
        build_driver({"driver": "postgres"})
    with pytest.raises(ConfigError, match=r"outputs.materialize\[0\].schema"):
        build_driver({"driver": "postgres", "dsn": "postgresql:///x", "schema": "a; DROP"})
    driver = build_driver({"driver": "postgres", "dsn": "postgresql:///x", "schema": "views", "batch_size": 10})
    assert isinstance(driver, PostgresDriver)
    assert (driver.settings.schema_, driver.settings.batch_size, driver.pattern) == ("views", 10, "remote_authoritative")


def test_tables_from_before_shards_gain_the_writer_column(postgres_dsn: str) -> None:
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE scores (_key jsonb PRIMARY KEY, _doc jsonb NOT NULL, _batch bigint NOT NULL)")
        conn.execute("INSERT INTO scores VALUES ('[\"old\"]', '{\"player\": \"old\", \"total\": 1}', 3)")
        conn.execute("CREATE TABLE scores_delta (_batch bigint NOT NULL, _part int NOT NULL, _seq int NOT NULL, "
                     "_key jsonb NOT NULL, _doc jsonb NOT NULL, PRIMARY KEY (_batch, _part, _seq))")
        conn.execute("INSERT INTO scores_delta VALUES (1, 0, 0, '[\"old\"]', "
                     "'{\"player\": \"old\", \"_count\": 1, \"total\": 1}')")
    driver = make(postgres_dsn)
    open_(driver)
    commit(driver, 1, [row("alice", 2), delta("alice", 2)])  # batch 1 again, by writer "w": no conflict
    driver.close()
    assert read_view(postgres_dsn, "scores") == {("old",): {"player": "old", "total": 1},
                                                 ("alice",): {"player": "alice", "total": 2}}
    assert len(read_deltas(postgres_dsn, "scores_delta")) == 2
    with psycopg.connect(postgres_dsn) as conn:
        key = conn.execute(
            "SELECT array_agg(a.attname ORDER BY a.attname) FROM pg_index i JOIN pg_attribute a "
            "ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
            "WHERE i.indrelid = 'scores_delta'::regclass AND i.indisprimary"
        ).fetchone()
    assert key == (["_batch", "_part", "_seq", "_writer"],)
