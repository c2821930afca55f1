"""The fence of the remote-store-authoritative pattern (DESIGN.md §4), shared by the
SQL drivers (SQLite, PostgreSQL).

The store keeps one row per (pipeline, writer, materialization) in a checkpoints
table of its own:

    pipeline, writer, materialization   the key
    nonce                               bumped by every Open
    checkpoint                          the runtime checkpoint of the last commit (bytes)
    updated_at                          when the row last changed

- `Fence.open` (its own store transaction) creates the table when missing, bumps the
  row's nonce (a first Open inserts it at 1) and keeps the nonce this instance now
  owns and the runtime checkpoint the row holds (`held`: what `Opened` returns).
- `Fence.commit(db, checkpoint)` wraps the driver's writing of one batch: it begins
  the store transaction, reads the row (locked) and refuses with DriverFencedError
  when the nonce moved since our Open: a newer instance opened, so this one is a
  zombie and writes nothing. Then the driver writes its rows, the fence writes the
  runtime checkpoint, and the one transaction commits: rows and checkpoint together
  or neither. An exception inside rolls everything back.

Traps: the driver's rows must go through the same connection, inside `commit`'s
block, or they are not in the fenced transaction. The lock that keeps a newer Open
from slipping in between the check and the commit is the store's: PostgreSQL's
`SELECT … FOR UPDATE` on the row, SQLite's write lock taken by `BEGIN IMMEDIATE`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from refold.connectors.protocol import Binding, DriverFencedError, Open, RuntimeCheckpoint


class Database(Protocol):
    """What the fence needs of a connection: psycopg's Connection as it is; SQLite's
    through an adapter whose `transaction()` is BEGIN IMMEDIATE … COMMIT."""

    def execute(self, statement: str, params: Sequence[Any], /) -> Any:
        """Run one statement; the result has `fetchone()`."""
        ...

    def transaction(self) -> AbstractContextManager[Any]:
        """One store transaction: committed when the block ends, rolled back on an exception."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Dialect:
    """Where the two stores' SQL differs."""

    placeholder: str  # "?" or "%s"
    blob: str  # the type of the checkpoint column
    timestamp: str  # the type of updated_at
    lock: str  # appended to the SELECT of the row at commit ("" where the transaction holds the lock)


SQLITE = Dialect(placeholder="?", blob="BLOB", timestamp="TEXT", lock="")
POSTGRES = Dialect(placeholder="%s", blob="bytea", timestamp="timestamptz", lock=" FOR UPDATE")

_KEY = "pipeline = {p} AND writer = {p} AND materialization = {p}"


def quote(name: str) -> str:
    """An SQL identifier, quoted (both stores: double quotes, inner ones doubled)."""
    return '"' + name.replace('"', '""') + '"'


def create_table(db: Database, table: str, dialect: Dialect) -> None:
    """The checkpoints table, when missing. `table` is quoted (and qualified) already."""
    db.execute(
        f"CREATE TABLE IF NOT EXISTS {table} (pipeline text NOT NULL, writer text NOT NULL, "
        f"materialization text NOT NULL, nonce bigint NOT NULL, checkpoint {dialect.blob}, "
        f"updated_at {dialect.timestamp} NOT NULL DEFAULT CURRENT_TIMESTAMP, "
        "PRIMARY KEY (pipeline, writer, materialization))",
        (),
    )


@dataclass(frozen=True, slots=True)
class Fence:
    """One opened instance's fence: the nonce it owns, the checkpoint its store held."""

    table: str  # quoted (and qualified)
    dialect: Dialect
    key: tuple[str, str, str]  # (pipeline, writer, materialization)
    nonce: int
    held: RuntimeCheckpoint | None
    store: str  # how messages name the store (a path, a schema)

    @classmethod
    def open(cls, db: Database, table: str, dialect: Dialect, request: Open, store: str) -> Fence:
        """Create the table when missing and bump this materialization's nonce: every
        older instance is fenced from now on."""
        key = (request.pipeline, request.writer, request.materialization)
        p = dialect.placeholder
        with db.transaction():
            create_table(db, table, dialect)
            db.execute(
                f"INSERT INTO {table} AS c (pipeline, writer, materialization, nonce) VALUES ({p}, {p}, {p}, 1) "
                "ON CONFLICT (pipeline, writer, materialization) "
                "DO UPDATE SET nonce = c.nonce + 1, updated_at = CURRENT_TIMESTAMP",
                key,
            )
            nonce, held = db.execute(
                f"SELECT nonce, checkpoint FROM {table} WHERE {_KEY.format(p=p)}", key
            ).fetchone()
        return cls(table, dialect, key, int(nonce), _decode(held), store)

    @contextmanager
    def commit(self, db: Database, checkpoint: RuntimeCheckpoint) -> Iterator[bytes | None]:
        """One fenced store transaction for the batch of `checkpoint`: yields the
        checkpoint the row held before (bytes, or None), for the driver to write its
        rows; then writes `checkpoint` and commits. Raises DriverFencedError, having
        written nothing, when a newer instance opened."""
        p = self.dialect.placeholder
        with db.transaction():
            found = db.execute(
                f"SELECT nonce, checkpoint FROM {self.table} WHERE {_KEY.format(p=p)}{self.dialect.lock}", self.key
            ).fetchone()
            if found is None or int(found[0]) != self.nonce:
                pipeline, writer, materialization = self.key
                raise DriverFencedError(
                    f"materialization {materialization!r} of pipeline {pipeline!r} (writer {writer!r}) in "
                    f"{self.store} was opened by a newer instance (nonce {'gone' if found is None else found[0]}, "
                    f"ours {self.nonce}): the commit of batch {checkpoint.batch} is refused"
                )
            yield None if found[1] is None else bytes(found[1])
            db.execute(
                f"UPDATE {self.table} SET checkpoint = {p}, updated_at = CURRENT_TIMESTAMP WHERE {_KEY.format(p=p)}",
                (checkpoint.encode(), *self.key),
            )


def _decode(held: Any) -> RuntimeCheckpoint | None:
    return None if held is None else RuntimeCheckpoint.decode(bytes(held))


D = TypeVar("D", bound=Database)


@dataclass
class FencedSession(Generic[D]):
    """What a fenced driver holds between `open` and `close` (`SessionDriver`): its
    connection, its fence, the bindings `Open` named. Drivers add their own fields."""

    db: D
    fence: Fence
    bindings: tuple[Binding, ...]

    def close(self) -> None:
        self.db.close()
