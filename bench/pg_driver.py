"""Rows/s of the PostgreSQL driver writing a 100k-row view: `python -m bench.pg_driver`.

Starts a local server (`refold.dev.localpg`, durable settings: fsync on) in a temporary
folder, or uses `$REFOLD_POSTGRES_DSN`. Measures, each on a fresh database:

- `sink`: the runtime's path: PostgresWriters COPY their parts into staging tables
  on threads, then one transaction merges them (INSERT … ON CONFLICT) with the
  checkpoint; first into an empty table, then updating every row (after a Load of
  every key, as the runtime does);
- `store`: the same through `store` (COPY into a session-temporary table) and one merge;
- `executemany`: for comparison, the plain way: `INSERT … ON CONFLICT DO UPDATE`
  per row through psycopg's `executemany` (pipelined), in one transaction.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import psycopg

from refold.connectors.postgres import PostgresDriver
from refold.connectors.protocol import (
    Binding,
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
from refold.dev import localpg

BINDINGS = (Binding("view", "view", "scores", ("player",), ("total", "best", "games", "latest")),)


def rows(count: int, version: int) -> list[Store]:
    return [
        Store(0, (f"player-{i:07d}",), {"player": f"player-{i:07d}", "total": i * version, "best": i,
                                        "games": version, "latest": float(i) / 3}, exists=version > 1)
        for i in range(count)
    ]  # fmt: skip


@contextmanager
def server() -> Iterator[str]:
    env = os.environ.get("REFOLD_POSTGRES_DSN")
    if env:
        yield env
        return
    folder = Path(tempfile.mkdtemp(prefix="refold-pgbench-"))
    folder.chmod(0o755)
    try:
        info = localpg.start(home=folder, quiet=True, die_with_parent=True)
        yield info.dsn()
    finally:
        localpg.stop(home=folder)
        shutil.rmtree(folder, ignore_errors=True)


def via_driver(dsn: str, count: int, use_sink: bool, parallelism: int) -> list[tuple[str, float]]:
    driver = build_driver({"driver": "postgres", "dsn": dsn, "view": "scores", "parallelism": parallelism})
    assert isinstance(driver, PostgresDriver)
    driver.open(Open("bench", "bench", "w", BINDINGS, None))
    timings = []
    for version in (1, 2):
        stores = rows(count, version)
        started = time.perf_counter()
        if version > 1:
            found = driver.load([Load(0, store.key) for store in stores])
            assert len(found) == count
        driver.flush(Flush())
        start = StartCommit(RuntimeCheckpoint("bench", "w", version, {0: count * version}))
        if use_sink:
            plan = driver.sink()
            parts: list[list[Store]] = [[] for _ in range(parallelism)]
            for store in stores:
                parts[zlib.crc32(store.key[0].encode()) % parallelism].append(store)
            txn = TxnInfo("bench", "bench", "w", version, BINDINGS)
            infos = ThreadExecutor(parallelism).prepare(plan.writer, txn, list(enumerate(parts)))
            start = StartCommit(start.runtime_checkpoint, tuple(infos))
            assert plan.aggregated is not None
            plan.aggregated.commit(infos, start)
        else:
            driver.store(stores)
        driver.start_commit(start)
        timings.append(("insert" if version == 1 else "load+update", time.perf_counter() - started))
    driver.close()
    return timings


def via_executemany(dsn: str, count: int) -> list[tuple[str, float]]:
    timings = []
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE scores (_key jsonb PRIMARY KEY, _doc jsonb NOT NULL, _batch bigint NOT NULL)")
        conn.commit()
        for version in (1, 2):
            stores = rows(count, version)
            started = time.perf_counter()
            with conn.cursor() as cursor:
                cursor.executemany(
                    "INSERT INTO scores VALUES (%s::jsonb, %s::jsonb, %s) "
                    "ON CONFLICT (_key) DO UPDATE SET _doc = EXCLUDED._doc, _batch = EXCLUDED._batch",
                    [(orjson.dumps(list(s.key)).decode(), orjson.dumps(s.doc).decode(), version) for s in stores],
                )
            conn.commit()
            timings.append(("insert" if version == 1 else "update", time.perf_counter() - started))
    return timings


def fresh(dsn: str, run: Callable[[str], list[tuple[str, float]]]) -> list[tuple[str, float]]:
    name = f"bench_{uuid.uuid4().hex[:8]}"
    target = localpg.create_database(dsn, name)
    try:
        return run(target)
    finally:
        localpg.drop_database(dsn, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--parallelism", type=int, default=2)
    args = parser.parse_args()
    count = args.rows
    with server() as dsn:
        results = {
            f"sink ({args.parallelism} writers)": fresh(dsn, lambda d: via_driver(d, count, True, args.parallelism)),
            "store (one connection)": fresh(dsn, lambda d: via_driver(d, count, False, args.parallelism)),
            "executemany (comparison)": fresh(dsn, lambda d: via_executemany(d, count)),
        }
    print(f"PostgreSQL driver, a {count:,}-row view, one transaction each")
    print(f"{'path':28} {'step':12} {'seconds':>8} {'rows/s':>10}")
    for path, timings in results.items():
        for step, seconds in timings:
            print(f"{path:28} {step:12} {seconds:8.2f} {count / seconds:10,.0f}")


if __name__ == "__main__":
    main()
