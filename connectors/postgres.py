"""PostgreSQL (psycopg 3). Pattern: remote store authoritative.

The store holds the view rows, the runtime checkpoint and a fencing nonce, and
one database transaction commits a batch's rows with its checkpoint, through the
fence shared with SQLite (`refold.connectors.fence`):

- `Open` connects (a wrong DSN fails here, naming the `dsn` setting; the password
  never shows), creates the schema, the target tables and the checkpoints table
  when missing, bumps this materialization's nonce (one row per pipeline, writer
  and materialization) and returns the runtime checkpoint stored with it. It also
  drops staging tables older instances left behind.
- Writing follows SeaTunnel's split (`sink()`): each `PostgresWriter` (pickled to
  Spark executors) COPYs its part of the transaction's Stores into its own
  UNLOGGED staging table (`_rfs_…`, nothing in the targets changes); then
  `PostgresCommitter`, the aggregated committer, makes ONE database transaction:
  `SELECT … FOR UPDATE` the nonce row (a zombie whose nonce was bumped by a newer
  `Open` gets `DriverFencedError`), merge every staging table into the targets
  (`DELETE … USING` for deletes, `INSERT … ON CONFLICT DO UPDATE` for rows), write
  the runtime checkpoint, drop the staging tables, commit. `start_commit` finds
  that done; without a sink (`store` called directly) it does the same merge from
  a session-temporary staging table.
- `Load` reads stored rows by key, `batch_size` keys per query (a JSON array of keys).
- A view binding is a table `(_key jsonb PRIMARY KEY, _doc jsonb, _batch bigint)`:
  the key values as a JSON array in the binding's key order, the whole row (what
  `Load` returns; `_doc->>'total'` reads a column), and the batch that wrote it.
- A delta binding is an append-only table `(_writer, _batch, _part, _seq, _key, _doc)`.
  A replayed batch (the store committed, Kafka did not) first deletes the rows of the
  batches it replaces, so every delta row is there exactly once.
- Every row names the writer that stored it in `_writer` (`<writer>-<shard>`: a
  view's shards each commit their own rows, with their own checkpoint and nonce):
  a full refresh replaces the writer's view rows only (and rows from before shards,
  `_writer` null), a replayed batch only the writer's delta rows. Tables from before
  shards get the column at `Open` (a delta table's primary key gains it).
- Every row names the input event behind it in `_cause` (text), as its Kafka record's
  `refold.cause` header does (`<partition>:<offset>` of the source topic; null with
  `outputs.provenance: off`, after a full refresh, and for rows from before the column,
  which tables from before it get at `Open`).

    outputs:
      materialize:
        - {driver: postgres, dsn: "postgresql://user:pw@host/db", view: scores, delta: scores_delta}
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.types.json import set_json_loads
from pydantic import SecretStr

from refold.connectors.fence import POSTGRES, Fence, FencedSession, quote
from refold.connectors.protocol import (
    AggregatedCommitter,
    Binding,
    CommitInfo,
    DriverError,
    Key,
    Load,
    Loaded,
    Open,
    Opened,
    Pattern,
    Row,
    SessionDriver,
    Sink,
    SinkWriter,
    StartCommit,
    StartedCommit,
    Store,
    TxnInfo,
)
from refold.connectors.settings import PostgresSettings

Connection = psycopg.Connection[Any]

_STAGE_PREFIX = "_rfs_"
_STAGE_COLUMNS = ("(_binding int NOT NULL, _seq int NOT NULL, _key jsonb NOT NULL, _doc jsonb, _delete boolean NOT NULL, "
                  "_cause text)")
_LOCAL_STAGE = "_rfs_local"  # the session-temporary staging table of `store`


# Writers ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Staged:
    """What a writer staged: one staging table (in `CommitInfo.data`)."""

    table: str


class PostgresWriter(SinkWriter):
    """COPYs one part of a transaction's Stores into a fresh UNLOGGED staging table.
    Holds settings only (pickled to Spark executors); connects per call."""

    def __init__(self, dsn: SecretStr, schema: str, stem: str, connect_timeout: int) -> None:
        self.dsn = dsn
        self.schema = schema
        self.stem = stem  # _rfs_<materialization hash>_<instance token>_
        self.connect_timeout = connect_timeout

    def prepare(self, txn: TxnInfo, part: int, stores: Sequence[Store]) -> CommitInfo:
        table = f"{self.stem}{txn.batch}_{part}"
        name = sql.Identifier(self.schema, table)
        with _connect(self.dsn, self.connect_timeout, autocommit=False) as conn:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(name))  # a retried part
            conn.execute(sql.SQL("CREATE UNLOGGED TABLE {} " + _STAGE_COLUMNS).format(name))
            _copy(conn, name, stores)
            conn.commit()
        return CommitInfo(part, len(stores), Staged(table))

    def abort(self, infos: Sequence[CommitInfo]) -> None:
        """Drop what `infos` staged; with no infos, every staging table of this instance."""
        with _connect(self.dsn, self.connect_timeout) as conn:
            tables = [info.data.table for info in infos if isinstance(info.data, Staged)]
            _drop(conn, self.schema, tables if infos else _staging_tables(conn, self.schema, self.stem))


class PostgresCommitter(AggregatedCommitter):
    """The one global commit: the merge of every staging table, the checkpoint and
    the nonce check in one database transaction (on the Spark driver)."""

    def __init__(self, driver: PostgresDriver) -> None:
        self.driver = driver

    def commit(self, infos: Sequence[CommitInfo], start: StartCommit) -> None:
        self.driver._commit(start, [info for info in infos if isinstance(info.data, Staged)])


# The driver ------------------------------------------------------------------------------


@dataclass
class _Session(FencedSession[Connection]):
    stem: str  # this instance's staging tables: _rfs_<8 hex of the materialization>_<8 hex token>_
    local_rows: int = 0  # rows in the session-temporary staging table (the `store` path)
    committed: StartCommit | None = None  # what PostgresCommitter committed


class PostgresDriver(SessionDriver[PostgresSettings, _Session]):
    pattern: ClassVar[Pattern] = "remote_authoritative"
    store_errors: ClassVar[tuple[type[Exception], ...]] = (psycopg.Error,)

    # Open -------------------------------------------------------------------------------------

    def open(self, request: Open) -> Opened:
        self.close()
        conn = self._connect_checked()
        try:
            schema = self.settings.schema_
            with conn.transaction():
                conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
                for binding in request.bindings:
                    conn.execute(_create_target(schema, binding))
                    _add_writer_column(conn, schema, binding)
                    conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS _cause text").format(
                        sql.Identifier(schema, binding.target)))
            table = f"{quote(schema)}.{quote(self.settings.checkpoints_table)}"
            fence = Fence.open(conn, table, POSTGRES, request, f"schema {schema!r}")
            owner = f"{request.materialization}\0{request.writer}"  # one family per shard
            family = f"{_STAGE_PREFIX}{hashlib.sha256(owner.encode()).hexdigest()[:8]}_"
            # Older instances are fenced now: their staging tables are garbage.
            _drop(conn, schema, _staging_tables(conn, schema, family))
        except BaseException:
            conn.close()
            raise
        self._session = _Session(conn, fence, request.bindings, f"{family}{secrets.token_hex(4)}_")
        return Opened(fence.held)

    # Load / Store -------------------------------------------------------------------------------

    def load(self, requests: Sequence[Load]) -> list[Loaded]:
        txn = self.opened()
        by_binding: dict[int, dict[str, Key]] = {}
        for request in requests:
            by_binding.setdefault(request.binding, {})[_json(list(request.key))] = request.key
        loaded: list[Loaded] = []
        size = self.settings.batch_size
        for index, asked in by_binding.items():
            binding = txn.bindings[index]
            if binding.kind != "view":
                raise DriverError(f"Load for {binding.kind} binding {binding.target!r}: only view bindings load")
            # One JSON array of keys per query (cheap to send); the rows come back
            # with their key's position in it.
            query = sql.SQL(
                "SELECT k.i, t._doc FROM jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS k(key, i) "
                "JOIN {} AS t ON t._key = k.key"
            ).format(sql.Identifier(self.settings.schema_, binding.target))
            texts, keys = list(asked), list(asked.values())
            for start in range(0, len(texts), size):
                chunk = "[" + ",".join(texts[start : start + size]) + "]"
                for position, doc in txn.db.execute(query, (chunk,)):
                    loaded.append(Loaded(index, keys[start + position - 1], doc))
        return loaded

    def store(self, requests: Sequence[Store]) -> None:
        """The path without a sink: COPY into this database session's temporary staging table."""
        txn = self.opened()
        name = sql.Identifier(_LOCAL_STAGE)
        with txn.db.transaction():
            txn.db.execute(sql.SQL("CREATE TEMP TABLE IF NOT EXISTS {} " + _STAGE_COLUMNS).format(name))
            _copy(txn.db, name, requests, first_seq=txn.local_rows)
        txn.local_rows += len(requests)

    def sink(self) -> Sink:
        stem = self.opened().stem
        writer = PostgresWriter(self.settings.dsn, self.settings.schema_, stem, self.settings.connect_timeout)
        return Sink(writer=writer, aggregated=PostgresCommitter(self))

    # Commit ---------------------------------------------------------------------------------

    def start_commit(self, request: StartCommit) -> StartedCommit:
        txn = self.opened()
        if txn.committed is not request:  # not through PostgresCommitter (no sink)
            self._commit(request, [info for info in request.prepared if isinstance(info.data, Staged)])
        txn.committed = None
        return StartedCommit()

    def _commit(self, start: StartCommit, staged: Sequence[CommitInfo]) -> None:
        """Check the nonce, merge the staged rows, write the checkpoint: one transaction."""
        txn, schema = self.opened(), self.settings.schema_
        conn, checkpoint = txn.db, start.runtime_checkpoint
        with txn.fence.commit(conn, checkpoint) as held:
            sources = [(info.part, sql.Identifier(schema, info.data.table)) for info in staged]
            missing = [info.data.table for info in staged if not _exists(conn, schema, info.data.table)]
            if missing:
                if held == checkpoint.encode():
                    txn.committed = start
                    return  # a replay of a commit that went through
                raise DriverError(f"staging tables {missing} of batch {checkpoint.batch} are gone: prepare again")
            if txn.local_rows:
                sources.append((-1, sql.Identifier(_LOCAL_STAGE)))
            for index, binding in enumerate(txn.bindings):
                _merge(conn, sql.Identifier(schema, binding.target), binding, _union(sources, index), start)
            for _, table in sources:
                conn.execute(sql.SQL("DROP TABLE {}").format(table))
        txn.local_rows = 0
        txn.committed = start

    # Inside ---------------------------------------------------------------------------------


    def _connect_checked(self) -> Connection:
        """Connect, or fail naming the `dsn` setting (never showing the password)."""
        dsn = self.settings.dsn.get_secret_value()
        try:
            password = str(conninfo_to_dict(dsn).get("password") or "")
        except psycopg.ProgrammingError:
            raise self.config_error("dsn", "not a libpq connection string or postgresql:// URL") from None
        try:
            return _connect(self.settings.dsn, self.settings.connect_timeout)
        except psycopg.Error as exc:
            reason = str(exc).strip()
            for secret in (dsn, password):
                if secret:
                    reason = reason.replace(secret, "***")
            raise self.config_error("dsn", f"cannot connect to PostgreSQL: {reason}") from None


def _merge(conn: Connection, target: sql.Identifier, binding: Binding, rows: Any, start: StartCommit) -> None:
    """Merge one binding's staged rows (`rows`: a query, or None when none) into its table."""
    batch, owner = start.runtime_checkpoint.batch, start.runtime_checkpoint.writer
    if binding.kind == "view":
        if start.full_refresh:  # this writer's rows (a shard's keys), and those from before shards
            conn.execute(sql.SQL("DELETE FROM {} WHERE _writer = %s OR _writer IS NULL").format(target), (owner,))
        elif rows is not None:
            conn.execute(
                sql.SQL("DELETE FROM {t} USING ({rows}) s WHERE s._delete AND {t}._key = s._key").format(
                    t=target, rows=rows
                )
            )
        if rows is not None:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {t} (_key, _doc, _batch, _writer, _cause) SELECT _key, _doc, %s, %s, _cause "
                    "FROM ({rows}) s WHERE NOT _delete ON CONFLICT (_key) DO UPDATE "
                    "SET _doc = EXCLUDED._doc, _batch = EXCLUDED._batch, _writer = EXCLUDED._writer, "
                    "_cause = EXCLUDED._cause"
                ).format(t=target, rows=rows),
                (batch, owner),
            )
        return
    # a replayed batch replaces its rows (this writer's: batches are numbered per shard)
    conn.execute(sql.SQL("DELETE FROM {} WHERE _batch >= %s AND _writer = %s").format(target), (batch, owner))
    if rows is not None:
        conn.execute(
            sql.SQL(
                "INSERT INTO {t} (_writer, _batch, _part, _seq, _key, _doc, _cause) "
                "SELECT %s, %s, _part, _seq, _key, _doc, _cause FROM ({rows}) s"
            ).format(t=target, rows=rows),
            (owner, batch),
        )


def read_view(dsn: str, table: str, schema: str = "public") -> dict[Key, Row]:
    """A view binding's table as {key: row} (for tests and users)."""
    with _connect(SecretStr(dsn), 10) as conn:
        rows = conn.execute(sql.SQL("SELECT _key, _doc FROM {}").format(sql.Identifier(schema, table)))
        return {tuple(key): doc for key, doc in rows}


def read_deltas(dsn: str, table: str, schema: str = "public") -> list[Row]:
    """A delta binding's rows in commit order (batch, part, sequence)."""
    with _connect(SecretStr(dsn), 10) as conn:
        query = sql.SQL("SELECT _doc FROM {} ORDER BY _batch, _writer, _part, _seq").format(
            sql.Identifier(schema, table)
        )
        return [doc for (doc,) in conn.execute(query)]


def _connect(dsn: SecretStr, timeout: int, *, autocommit: bool = True) -> Connection:
    conn = psycopg.connect(
        dsn.get_secret_value(), autocommit=autocommit, connect_timeout=timeout, application_name="refold"
    )
    set_json_loads(_loads, conn)
    return conn


def _create_target(schema: str, binding: Binding) -> sql.Composed:
    table = sql.Identifier(schema, binding.target)
    if binding.kind == "view":
        return sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (_key jsonb PRIMARY KEY, _doc jsonb NOT NULL, _batch bigint NOT NULL, "
            "_writer text, _cause text)"
        ).format(table)
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} (_writer text NOT NULL DEFAULT '', _batch bigint NOT NULL, "
        "_part int NOT NULL, _seq int NOT NULL, _key jsonb NOT NULL, _doc jsonb NOT NULL, _cause text, "
        "PRIMARY KEY (_writer, _batch, _part, _seq))"
    ).format(table)


def _add_writer_column(conn: Connection, schema: str, binding: Binding) -> None:
    """A table from before shards gets `_writer` (null for its view rows, '' for its delta
    rows), and a delta table's primary key gains it."""
    found = conn.execute(
        "SELECT 1 FROM information_schema.columns WHERE table_schema = %s AND table_name = %s "
        "AND column_name = '_writer'",
        (schema, binding.target),
    ).fetchone()
    if found is not None:
        return
    table = sql.Identifier(schema, binding.target)
    if binding.kind == "view":
        conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN _writer text").format(table))
        return
    (constraint,) = conn.execute(
        "SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'p'",
        (f"{quote(schema)}.{quote(binding.target)}",),
    ).fetchone() or (None,)
    conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN _writer text NOT NULL DEFAULT ''").format(table))
    if constraint is not None:
        conn.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(table, sql.Identifier(constraint)))
    conn.execute(sql.SQL("ALTER TABLE {} ADD PRIMARY KEY (_writer, _batch, _part, _seq)").format(table))


def _copy(conn: Connection, table: sql.Identifier, stores: Iterable[Store], first_seq: int = 0) -> None:
    statement = sql.SQL("COPY {} (_binding, _seq, _key, _doc, _delete, _cause) FROM STDIN").format(table)
    with conn.cursor() as cursor, cursor.copy(statement) as copy:
        for seq, store in enumerate(stores, first_seq):
            doc = None if store.delete or store.doc is None else _json(store.doc)
            copy.write_row((store.binding, seq, _json(list(store.key)), doc, store.delete, store.cause))


def _union(sources: Sequence[tuple[int, sql.Identifier]], binding: int) -> sql.Composed | None:
    """The staged rows of one binding from every staging table, or None when none."""
    if not sources:
        return None
    return sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT {part}::int AS _part, _seq, _key, _doc, _delete, _cause FROM {t} WHERE _binding = {b}").format(
            part=sql.Literal(part), t=table, b=sql.Literal(binding)
        )
        for part, table in sources
    )


def _staging_tables(conn: Connection, schema: str, prefix: str) -> list[str]:
    pattern = prefix.replace("\\", "\\\\").replace("_", "\\_").replace("%", "\\%") + "%"
    rows = conn.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = %s AND tablename LIKE %s", (schema, pattern)
    )
    return [name for (name,) in rows]


def _exists(conn: Connection, schema: str, table: str) -> bool:
    row = conn.execute(
        "SELECT 1 FROM pg_tables WHERE schemaname = %s AND tablename = %s", (schema, table)
    ).fetchone()
    return row is not None


def _drop(conn: Connection, schema: str, tables: Iterable[str]) -> None:
    for table in tables:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(schema, table)))


_LONG_NUMBER = re.compile(rb"\d{19}")


def _loads(data: bytes | str) -> Any:
    """jsonb to Python: orjson, but the stdlib where a number may not fit 64 bits
    (orjson would make it a float)."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    return json.loads(raw) if _LONG_NUMBER.search(raw) else orjson.loads(raw)


def _json(value: Any) -> str:
    """JSON text of a row or key (orjson; the stdlib for integers beyond 64 bits)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, default=str)
