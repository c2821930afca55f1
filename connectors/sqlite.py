"""SQLite: the embedded default driver (stdlib `sqlite3`). Pattern: remote store authoritative.

Each transaction's rows, the runtime checkpoint and the fencing check commit in
one SQLite transaction at `StartCommit`, through the shared fence
(`refold.connectors.fence`):

- `Open` bumps this materialization's nonce in `_refold_checkpoints` (one row per
  pipeline, writer and materialization) and returns the runtime checkpoint stored
  there; `StartCommit` refuses to commit (`DriverFencedError`) when the nonce moved
  since, so a zombie cannot write. A `_refold_checkpoints` of the earlier layout
  (one row per materialization, the checkpoint in `runtime_checkpoint`) is
  migrated at `Open`: each row is keyed by the pipeline and writer of the
  checkpoint it holds (this instance's when it holds none), nonce kept.
- A view binding is a table keyed by the view key: one column per view column
  (lists and objects as JSON text) plus `_doc`, the whole row as JSON (what
  `Load` returns, exactly). Columns a Top-N view's rows bring are added as they
  appear.
- A delta binding is an append-only table with `_batch`. A replayed batch (the
  store committed, Kafka did not) first deletes the rows of batches it replaces,
  so every delta row is there exactly once.
- Every row names the writer that stored it in `_writer` (`<writer>-<shard>`: a
  view's shards each commit their own rows, with their own checkpoint and nonce):
  a full refresh replaces the writer's rows only (and rows from before shards,
  `_writer` null), a replayed batch only the writer's delta rows.
- Every row names the input event behind it in `_cause`, as its Kafka record's
  `refold.cause` header does (`<partition>:<offset>` of the source topic; null with
  `outputs.provenance: off`, after a full refresh, and for rows from before the column).

    outputs:
      materialize:
        - {driver: sqlite, path: scores.db, view: scores, delta: scores_delta}
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import orjson

from refold.connectors.fence import SQLITE, Fence, FencedSession, create_table, quote
from refold.connectors.protocol import (
    Binding,
    Load,
    Loaded,
    Open,
    Opened,
    Pattern,
    Row,
    RuntimeCheckpoint,
    SessionDriver,
    StartCommit,
    StartedCommit,
    Store,
    by_binding,
)
from refold.connectors.settings import SQLiteSettings

_CHECKPOINTS = "_refold_checkpoints"
_LOAD_CHUNK = 500


class _Connection:
    """An SQLite connection in autocommit mode, shaped as the fence wants it."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def execute(self, statement: str, params: Sequence[Any] = (), /) -> sqlite3.Cursor:
        return self.db.execute(statement, params)

    def executemany(self, statement: str, rows: Sequence[Sequence[Any]]) -> None:
        self.db.executemany(statement, rows)

    def close(self) -> None:
        self.db.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """BEGIN IMMEDIATE: the database's write lock from the first statement on."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")


@dataclass
class _Session(FencedSession[_Connection]):
    columns: list[list[str]]  # per binding, the table's columns
    pending: list[Store] = field(default_factory=list)  # written at StartCommit


class SQLiteDriver(SessionDriver[SQLiteSettings, _Session]):
    pattern: ClassVar[Pattern] = "remote_authoritative"
    store_errors: ClassVar[tuple[type[Exception], ...]] = (sqlite3.Error,)

    # Open ----------------------------------------------------------------------------------

    def open(self, request: Open) -> Opened:
        self.close()
        path = Path(self.settings.path).expanduser()
        if not path.parent.is_dir():
            raise self.config_error("path", f"the folder {str(path.parent)!r} does not exist")
        try:
            raw = sqlite3.connect(path, timeout=self.settings.timeout, isolation_level=None, check_same_thread=False)
            raw.execute("PRAGMA journal_mode=WAL")
        except sqlite3.Error as exc:
            raise self.config_error("path", f"cannot open {str(path)!r} as an SQLite database: {exc}") from exc
        db = _Connection(raw)
        try:  # a failure here closes the connection it opened
            _migrate_checkpoints(db, request)
            fence = Fence.open(db, _CHECKPOINTS, SQLITE, request, repr(self.settings.path))
            with db.transaction():
                columns = [self._create(db, binding) for binding in request.bindings]
        except BaseException:
            db.close()
            raise
        self._session = _Session(db, fence, request.bindings, columns)
        return Opened(fence.held)

    @staticmethod
    def _create(db: _Connection, binding: Binding) -> list[str]:
        table = quote(binding.target)
        if binding.kind == "view":
            columns = [*binding.key, *binding.columns, "_doc"]
            keys = ", ".join(quote(k) for k in binding.key)
            body = ", ".join(quote(c) for c in columns)
            db.execute(f"CREATE TABLE IF NOT EXISTS {table} ({body}, PRIMARY KEY ({keys}))")
        else:
            columns = ["_batch", *binding.key, *binding.columns, "_doc"]
            body = ", ".join(quote(c) for c in columns)
            db.execute(f"CREATE TABLE IF NOT EXISTS {table} ({body})")
            db.execute(f"CREATE INDEX IF NOT EXISTS {quote(binding.target + '_batch')} ON {table} (_batch)")
        columns = [row[1] for row in db.execute(f"PRAGMA table_info({table})")]
        for own in (_WRITER, _CAUSE):  # a new table, or one from before shards (before causes)
            if own not in columns:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {own}")
        # `_doc` last (columns added later come after it in the table); `_writer`, `_cause` apart
        return [c for c in columns if c not in (_WRITER, _CAUSE, "_doc")] + ["_doc"]

    # The transaction ---------------------------------------------------------------------------

    def load(self, requests: Sequence[Load]) -> list[Loaded]:
        txn = self.opened()
        found: list[Loaded] = []
        grouped = by_binding(requests)
        for index, loads in grouped.items():
            binding = txn.bindings[index]
            keys = ", ".join(quote(k) for k in binding.key)
            one = "(" + ", ".join("?" for _ in binding.key) + ")"
            for start in range(0, len(loads), _LOAD_CHUNK):
                chunk = loads[start : start + _LOAD_CHUNK]
                params = [_cell(value) for load in chunk for value in load.key]
                rows = txn.db.execute(
                    f"SELECT {keys}, _doc FROM {quote(binding.target)} WHERE ({keys}) IN "
                    f"(VALUES {', '.join(one for _ in chunk)})",
                    params,
                ).fetchall()
                stored = {tuple(row[:-1]): row[-1] for row in rows}
                for load in chunk:
                    doc = stored.get(tuple(_cell(v) for v in load.key))
                    if doc is not None:
                        found.append(Loaded(index, load.key, orjson.loads(doc)))
        return found

    def store(self, requests: Sequence[Store]) -> None:
        self.opened().pending.extend(requests)  # written at StartCommit, in the one transaction

    def start_commit(self, request: StartCommit) -> StartedCommit:
        txn = self.opened()
        stores, txn.pending = txn.pending, []
        with txn.fence.commit(txn.db, request.runtime_checkpoint):
            for index, binding in enumerate(txn.bindings):
                mine = [s for s in stores if s.binding == index]
                owner = request.runtime_checkpoint.writer
                if binding.kind == "view":
                    self._store_view(txn, index, mine, request.full_refresh, owner)
                else:
                    self._store_deltas(txn, index, mine, request.runtime_checkpoint.batch, owner)
        return StartedCommit(b"")

    @classmethod
    def _store_view(cls, txn: _Session, index: int, stores: list[Store], full: bool, owner: str) -> None:
        db, binding = txn.db, txn.bindings[index]
        table = quote(binding.target)
        keys = ", ".join(quote(k) for k in binding.key)
        match = " AND ".join(f"{quote(k)} = ?" for k in binding.key)
        if full:  # this writer's rows (a shard's keys), and those from before shards
            db.execute(f"DELETE FROM {table} WHERE {_WRITER} = ? OR {_WRITER} IS NULL", (owner,))
        deletes = [[_cell(v) for v in s.key] for s in stores if s.delete]
        if deletes:
            db.executemany(f"DELETE FROM {table} WHERE {match}", deletes)
        upserts = [s for s in stores if not s.delete and s.doc is not None]
        if not upserts:
            return
        columns = cls._ensure_columns(txn, index, upserts)
        names = ", ".join(quote(c) for c in [*columns, _WRITER, _CAUSE])
        marks = ", ".join("?" for _ in range(len(columns) + 2))
        updates = ", ".join(f"{quote(c)} = excluded.{quote(c)}" for c in [*columns, _WRITER, _CAUSE]
                            if c not in binding.key)
        db.executemany(
            f"INSERT INTO {table} ({names}) VALUES ({marks}) ON CONFLICT ({keys}) DO UPDATE SET {updates}",
            [[*_values(columns, s.doc), owner, s.cause] for s in upserts if s.doc is not None],
        )

    @classmethod
    def _store_deltas(cls, txn: _Session, index: int, stores: list[Store], batch: int, owner: str) -> None:
        db, table = txn.db, quote(txn.bindings[index].target)
        # a replayed batch replaces its rows (this writer's: batches are numbered per shard)
        db.execute(f"DELETE FROM {table} WHERE _batch >= ? AND {_WRITER} = ?", (batch, owner))
        if not stores:
            return
        columns = cls._ensure_columns(txn, index, stores)
        names = ", ".join(quote(c) for c in [*columns, _WRITER, _CAUSE])
        marks = ", ".join("?" for _ in range(len(columns) + 2))
        rows = []
        for s in stores:
            assert s.doc is not None
            values = _values(columns, s.doc)
            values[columns.index("_batch")] = batch
            rows.append([*values, owner, s.cause])
        db.executemany(f"INSERT INTO {table} ({names}) VALUES ({marks})", rows)

    @staticmethod
    def _ensure_columns(txn: _Session, index: int, stores: list[Store]) -> list[str]:
        """Add the columns rows bring that the table lacks (a Top-N row's own columns)."""
        known = txn.columns[index]
        have = set(known)
        for store in stores:
            for column in store.doc or ():
                if column not in have:
                    txn.db.execute(
                        f"ALTER TABLE {quote(txn.bindings[index].target)} ADD COLUMN {quote(column)}"
                    )
                    known.insert(len(known) - 1, column)  # before _doc
                    have.add(column)
        return known



def _migrate_checkpoints(db: _Connection, request: Open) -> None:
    """Move a `_refold_checkpoints` of the earlier layout (keyed by materialization,
    `runtime_checkpoint`) to the fence's (keyed by pipeline, writer, materialization;
    `checkpoint`), nonces kept, so an instance of either layout stays fenced."""
    with db.transaction():
        columns = {row[1] for row in db.execute(f"PRAGMA table_info({_CHECKPOINTS})")}
        if "runtime_checkpoint" not in columns:
            return
        rows = db.execute(f"SELECT materialization, nonce, runtime_checkpoint FROM {_CHECKPOINTS}").fetchall()
        db.execute(f"DROP TABLE {_CHECKPOINTS}")
        create_table(db, _CHECKPOINTS, SQLITE)
        for materialization, nonce, held in rows:
            owner = RuntimeCheckpoint.decode(held) if held is not None else request
            db.execute(
                f"INSERT INTO {_CHECKPOINTS} (pipeline, writer, materialization, nonce, checkpoint) "
                "VALUES (?, ?, ?, ?, ?)",
                (owner.pipeline, owner.writer, materialization, nonce, held),
            )


def _cell(value: Any) -> Any:
    """A value as SQLite keeps it: lists and objects as JSON text."""
    if isinstance(value, list | dict):
        return orjson.dumps(value).decode()
    return value


_WRITER = "_writer"  # the writer (shard) that stored a row
_CAUSE = "_cause"  # the input event behind a row (its record's `refold.cause`)


def _values(columns: list[str], doc: Row) -> list[Any]:
    values = [_cell(doc.get(c)) for c in columns]
    values[-1] = orjson.dumps(doc).decode()  # _doc
    return values


def read_sqlite_view(path: str | Path, table: str) -> dict[tuple[Any, ...], Row]:
    """The rows of a view table by key (from `_doc`, exactly as stored)."""
    db = sqlite3.connect(path)
    try:
        info = db.execute(f"PRAGMA table_info({quote(table)})").fetchall()
        keys = [row[1] for row in sorted((r for r in info if r[5] > 0), key=lambda r: r[5])]
        out: dict[tuple[Any, ...], Row] = {}
        for (doc,) in db.execute(f"SELECT _doc FROM {quote(table)}"):
            row = orjson.loads(doc)
            out[tuple(row[k] for k in keys)] = row
        return out
    finally:
        db.close()


def read_sqlite_deltas(path: str | Path, table: str) -> list[Row]:
    """A delta binding's rows in the order they were written (from `_doc`)."""
    db = sqlite3.connect(path)
    try:
        return [orjson.loads(doc) for (doc,) in db.execute(f"SELECT _doc FROM {quote(table)} ORDER BY rowid")]
    finally:
        db.close()
