"""SQLite: the embedded default driver (stdlib `sqlite3`). Pattern: remote store authoritative.

Each transaction's rows, the runtime checkpoint and the fencing check commit in
one SQLite transaction at `StartCommit`:

- `Open` bumps this materialization's nonce in `_refold_checkpoints` and returns
  the runtime checkpoint stored there; `StartCommit` refuses to commit
  (`DriverFencedError`) when the nonce moved since, so a zombie cannot write.
- A view binding is a table keyed by the view key: one column per view column
  (lists and objects as JSON text) plus `_doc`, the whole row as JSON (what
  `Load` returns, exactly). Columns a Top-N view's rows bring are added as they
  appear.
- A delta binding is an append-only table with `_batch`. A replayed batch (the
  store committed, Kafka did not) first deletes the rows of batches it replaces,
  so every delta row is there exactly once.

    outputs:
      materialize:
        - {driver: sqlite, path: scores.db, view: scores, delta: scores_delta}
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import orjson

from refold.connectors.protocol import (
    Acknowledge,
    Acknowledged,
    Binding,
    Driver,
    DriverError,
    DriverFencedError,
    DriverSettings,
    Flush,
    Flushed,
    Load,
    Loaded,
    Open,
    Opened,
    Pattern,
    Row,
    RuntimeCheckpoint,
    StartCommit,
    StartedCommit,
    Store,
)

_CHECKPOINTS = "_refold_checkpoints"
_LOAD_CHUNK = 500


class SQLiteSettings(DriverSettings):
    path: str  # the database file; its folder must exist
    view: str | None = "view"
    timeout: float = 30.0  # seconds to wait for a lock held by another connection


class SQLiteDriver(Driver):
    pattern: ClassVar[Pattern] = "remote_authoritative"
    Settings = SQLiteSettings

    def __init__(self, settings: DriverSettings, where: str = "outputs.materialize") -> None:
        super().__init__(settings, where)
        assert isinstance(settings, SQLiteSettings)
        self.config: SQLiteSettings = settings
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._nonce = 0
        self._name = ""
        self._bindings: tuple[Binding, ...] = ()
        self._columns: list[list[str]] = []  # per binding, the table's columns
        self._pending: list[Store] = []

    # Open ----------------------------------------------------------------------------------

    def open(self, request: Open) -> Opened:
        path = Path(self.config.path).expanduser()
        if not path.parent.is_dir():
            raise self.config_error("path", f"the folder {str(path.parent)!r} does not exist")
        try:
            db = sqlite3.connect(path, timeout=self.config.timeout, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
        except sqlite3.Error as exc:
            raise self.config_error("path", f"cannot open {str(path)!r} as an SQLite database: {exc}") from exc
        self._db, self._name, self._bindings, self._pending = db, request.materialization, request.bindings, []
        with self._transaction(db):
            db.execute(
                f"CREATE TABLE IF NOT EXISTS {_CHECKPOINTS} (materialization TEXT PRIMARY KEY, "
                "nonce INTEGER NOT NULL, runtime_checkpoint BLOB)"
            )
            db.execute(
                f"INSERT INTO {_CHECKPOINTS} (materialization, nonce) VALUES (?, 1) "
                "ON CONFLICT (materialization) DO UPDATE SET nonce = nonce + 1",
                (self._name,),
            )
            nonce, held = db.execute(
                f"SELECT nonce, runtime_checkpoint FROM {_CHECKPOINTS} WHERE materialization = ?", (self._name,)
            ).fetchone()
            self._columns = [self._create(db, binding) for binding in request.bindings]
        self._nonce = nonce
        return Opened(RuntimeCheckpoint.decode(held) if held is not None else None)

    def _create(self, db: sqlite3.Connection, binding: Binding) -> list[str]:
        table = _quote(binding.target)
        if binding.kind == "view":
            columns = [*binding.key, *binding.columns, "_doc"]
            keys = ", ".join(_quote(k) for k in binding.key)
            body = ", ".join(_quote(c) for c in columns)
            db.execute(f"CREATE TABLE IF NOT EXISTS {table} ({body}, PRIMARY KEY ({keys}))")
        else:
            columns = ["_batch", *binding.key, *binding.columns, "_doc"]
            body = ", ".join(_quote(c) for c in columns)
            db.execute(f"CREATE TABLE IF NOT EXISTS {table} ({body})")
            db.execute(f"CREATE INDEX IF NOT EXISTS {_quote(binding.target + '_batch')} ON {table} (_batch)")
        return [row[1] for row in db.execute(f"PRAGMA table_info({table})")]

    # The transaction ---------------------------------------------------------------------------

    def acknowledge(self, request: Acknowledge) -> Acknowledged:
        return Acknowledged()  # committed at StartCommit already

    def load(self, requests: Sequence[Load]) -> list[Loaded]:
        db = self._connection()
        found: list[Loaded] = []
        by_binding: dict[int, list[Load]] = {}
        for request in requests:
            by_binding.setdefault(request.binding, []).append(request)
        with self._lock:
            for index, loads in by_binding.items():
                binding = self._bindings[index]
                keys = ", ".join(_quote(k) for k in binding.key)
                one = "(" + ", ".join("?" for _ in binding.key) + ")"
                for start in range(0, len(loads), _LOAD_CHUNK):
                    chunk = loads[start : start + _LOAD_CHUNK]
                    params = [_cell(value) for load in chunk for value in load.key]
                    rows = db.execute(
                        f"SELECT {keys}, _doc FROM {_quote(binding.target)} WHERE ({keys}) IN "
                        f"(VALUES {', '.join(one for _ in chunk)})",
                        params,
                    ).fetchall()
                    stored = {tuple(row[:-1]): row[-1] for row in rows}
                    for load in chunk:
                        doc = stored.get(tuple(_cell(v) for v in load.key))
                        if doc is not None:
                            found.append(Loaded(index, load.key, orjson.loads(doc)))
        return found

    def flush(self, request: Flush) -> Flushed:
        return Flushed()

    def store(self, requests: Sequence[Store]) -> None:
        self._pending.extend(requests)  # written at StartCommit, in the one transaction

    def start_commit(self, request: StartCommit) -> StartedCommit:
        db = self._connection()
        stores, self._pending = self._pending, []
        checkpoint = request.runtime_checkpoint
        with self._lock, self._transaction(db):
            row = db.execute(f"SELECT nonce FROM {_CHECKPOINTS} WHERE materialization = ?", (self._name,)).fetchone()
            if row is None or row[0] != self._nonce:
                raise DriverFencedError(
                    f"materialization {self._name!r}: another instance opened {self.config.path!r} since "
                    f"(nonce {self._nonce} → {row[0] if row else 'gone'}); this one may not commit"
                )
            for index, binding in enumerate(self._bindings):
                mine = [s for s in stores if s.binding == index]
                if binding.kind == "view":
                    self._store_view(db, index, binding, mine, request.full_refresh)
                else:
                    self._store_deltas(db, index, binding, mine, checkpoint.batch)
            db.execute(
                f"UPDATE {_CHECKPOINTS} SET runtime_checkpoint = ? WHERE materialization = ?",
                (checkpoint.encode(), self._name),
            )
        return StartedCommit(b"")

    def _store_view(self, db: sqlite3.Connection, index: int, binding: Binding, stores: list[Store], full: bool) -> None:
        table = _quote(binding.target)
        keys = ", ".join(_quote(k) for k in binding.key)
        match = " AND ".join(f"{_quote(k)} = ?" for k in binding.key)
        if full:
            db.execute(f"DELETE FROM {table}")
        deletes = [[_cell(v) for v in s.key] for s in stores if s.delete]
        if deletes:
            db.executemany(f"DELETE FROM {table} WHERE {match}", deletes)
        upserts = [s for s in stores if not s.delete and s.doc is not None]
        if not upserts:
            return
        columns = self._ensure_columns(db, index, binding, upserts)
        names = ", ".join(_quote(c) for c in columns)
        marks = ", ".join("?" for _ in columns)
        updates = ", ".join(f"{_quote(c)} = excluded.{_quote(c)}" for c in columns if c not in binding.key)
        db.executemany(
            f"INSERT INTO {table} ({names}) VALUES ({marks}) ON CONFLICT ({keys}) DO UPDATE SET {updates}",
            [_values(columns, s.doc) for s in upserts if s.doc is not None],
        )

    def _store_deltas(self, db: sqlite3.Connection, index: int, binding: Binding, stores: list[Store], batch: int) -> None:
        table = _quote(binding.target)
        db.execute(f"DELETE FROM {table} WHERE _batch >= ?", (batch,))  # a replayed batch replaces its rows
        if not stores:
            return
        columns = self._ensure_columns(db, index, binding, stores)
        names = ", ".join(_quote(c) for c in columns)
        marks = ", ".join("?" for _ in columns)
        rows = []
        for s in stores:
            assert s.doc is not None
            values = _values(columns, s.doc)
            values[columns.index("_batch")] = batch
            rows.append(values)
        db.executemany(f"INSERT INTO {table} ({names}) VALUES ({marks})", rows)

    def _ensure_columns(self, db: sqlite3.Connection, index: int, binding: Binding, stores: list[Store]) -> list[str]:
        """Add the columns rows bring that the table lacks (a Top-N row's own columns)."""
        known = self._columns[index]
        have = set(known)
        for store in stores:
            for column in store.doc or ():
                if column not in have:
                    db.execute(f"ALTER TABLE {_quote(binding.target)} ADD COLUMN {_quote(column)}")
                    known.insert(len(known) - 1, column)  # before _doc
                    have.add(column)
        return known

    def close(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            db.close()

    # helpers -----------------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise DriverError("the SQLite driver is not open")
        return self._db

    @staticmethod
    @contextlib.contextmanager
    def _transaction(db: sqlite3.Connection) -> Iterator[None]:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _cell(value: Any) -> Any:
    """A value as SQLite keeps it: lists and objects as JSON text."""
    if isinstance(value, list | dict):
        return orjson.dumps(value).decode()
    return value


def _values(columns: list[str], doc: Row) -> list[Any]:
    values = [_cell(doc.get(c)) for c in columns]
    values[-1] = orjson.dumps(doc).decode()  # _doc
    return values


def read_sqlite_view(path: str | Path, table: str) -> dict[tuple[Any, ...], Row]:
    """The rows of a view table by key (from `_doc`, exactly as stored)."""
    db = sqlite3.connect(path)
    try:
        info = db.execute(f"PRAGMA table_info({_quote(table)})").fetchall()
        keys = [row[1] for row in sorted((r for r in info if r[5] > 0), key=lambda r: r[5])]
        out: dict[tuple[Any, ...], Row] = {}
        for (doc,) in db.execute(f"SELECT _doc FROM {_quote(table)}"):
            row = orjson.loads(doc)
            out[tuple(row[k] for k in keys)] = row
        return out
    finally:
        db.close()
