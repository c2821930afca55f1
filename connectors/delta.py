"""Delta Lake tables (delta-rs, the `deltalake` package). Pattern: remote store authoritative.

Each binding is one Delta table, `<path>/<target>` (a local folder, or an object-store
URI with delta-rs `storage_options`), created at the first `Open` and partitioned by
`_writer`, the shard that owns the rows (`<writer>-<shard>`: shards own disjoint keys,
so each merges into its own partition and concurrent shards never conflict):

- **view table**: one row per live view key, merged on `_key` (the key values as a JSON
  list); `_doc` is the whole row as JSON (what `Load` returns, exactly). Each batch's
  net change per key is one MERGE: `Store.delete` deletes the row, any other Store
  updates or inserts it. `Load` reads `_doc` of the asked keys from the writer's
  partition (remote store authoritative: no copy kept in memory). A full refresh (a
  store behind Kafka) overwrites the writer's partition with the whole view in one
  commit (`replaceWhere _writer = …`).
- **delta table**: the delta rows, appended, each with its batch and place in it.

**Every commit carries the checkpoint.** Each table commit of a batch (the MERGE, the
append, or an empty commit when nothing changed: empty batches are transactions too)
states Delta *application transactions* (the log's `txn` action) and commit metadata:

    txn  <pipeline>/<materialization>/<writer>        version = the batch number
    txn  <pipeline>/<materialization>/<writer>#fence  version = this instance's nonce
    commitInfo  refold.app_id, refold.batch, refold.nonce,
                refold.checkpoint (the runtime checkpoint, JSON)

**The fence.** `Open` bumps the `#fence` transaction version of each table in a commit
of its own (nothing else in it) and keeps the new value, its nonce. Each batch commit
reads the table's latest snapshot and is refused (`DriverFencedError`, nothing
written) if the fence version moved; the commit restates `#fence` at our nonce, so
delta-rs's conflict check also refuses it (`Concurrent transaction failed`: a winning
commit changed an app id this one depends on) when a newer `Open` slips in between the
check and the commit. Two racing `Open`s conflict the same way and retry. So a zombie
(an instance whose successor opened) never commits, on either table.

**`Open`** returns the checkpoint of the last commit this writer made: the
`txn` version of its app id gives the batch; the commit with that `refold.batch` in
the table's history (read newest first) gives the whole runtime checkpoint. If the
history no longer has it (delta-rs removes log files past `delta.logRetentionDuration`,
30 days by default), it returns the batch with no offsets (the runtime only compares
batches) and the replay rule below re-applies instead of skipping.

**Two tables, two commits, exactly once.** A batch commits the delta table first and
the view table last, both at `StartCommit` (before Kafka). The view table's commit is
the materialization's commit point: `Open` returns *its* checkpoint (the delta table's
when there is no view binding), and a view table at batch N implies a delta table at
N. A crash can leave the store one batch ahead of Kafka, with both tables at N or the
delta table at N and the view table at N-1. Kafka then replays batch N, and each
table on its own:

- holds exactly this runtime checkpoint (same pipeline, writer, batch and offsets):
  the replay is a **no-op** for it: same input range from the same state, same rows,
  already there (the table is not touched);
- holds version ≥ N with another checkpoint (the batch is cut differently: Spark lost
  its offset log), or one it cannot read: it **re-applies**: the view MERGE of final
  rows is idempotent, and the delta rows of this writer with `_batch >= N` are replaced
  in the same commit (`replaceWhere`), so every delta row is there once;
- holds a version < N: it applies normally.

Kafka never commits a batch before both tables did (the runtime waits for
`StartCommit`), and a zombie is refused on both: exactly once per table.

The tables' columns, the typed columns' evolution rule, and reading the tables back
(`read_delta_view`, `read_delta_deltas`, re-exported here) are in
`refold.connectors.delta_tables`.

Not done yet: no parallel writers (`parallelism` is ignored: one writer per shard
writes its batch), no OPTIMIZE, VACUUM or Z-order (delta-rs writes a log checkpoint
every 100 commits), no deletion vectors, column mapping or type widening, one
pipeline per table (`_writer` does not name the pipeline).

    outputs:
      materialize:
        - {driver: delta, path: lake/, view: scores, delta: scores_delta}
        - {driver: delta, path: "s3://bucket/lake", view: scores,
           storage_options: {AWS_REGION: eu-west-1, AWS_ACCESS_KEY_ID: …, AWS_SECRET_ACCESS_KEY: …}}
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import orjson
import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError

from refold.connectors.delta_tables import (
    BATCH,
    DELETED,
    DELTA_SCHEMA,
    KEY,
    VIEW_SCHEMA,
    WRITER,
    arrow_rows,
    empty_rows,
    find_checkpoint,
    is_uri,
    key_json,
    read_delta_deltas,
    read_delta_view,
    read_docs,
    table_uri,
)
from refold.connectors.protocol import (
    Binding,
    DriverError,
    DriverFencedError,
    Load,
    Loaded,
    Open,
    Opened,
    Pattern,
    RuntimeCheckpoint,
    SessionDriver,
    StartCommit,
    StartedCommit,
    Store,
    by_binding,
)
from refold.connectors.settings import DeltaSettings

__all__ = ["DeltaDriver", "app_id", "fence_id", "key_json", "read_delta_deltas", "read_delta_view", "table_uri"]

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # delta-rs colours its error chains
_ATTEMPTS = 5  # per table commit (and per fence bump) on a commit conflict
_BACKOFF = 0.05  # seconds before the second attempt; doubles
_ERRORS: tuple[type[Exception], ...] = (DeltaError, OSError, pa.ArrowException)


def app_id(pipeline: str, materialization: str, writer: str) -> str:
    """The Delta application-transaction id of one shard's commits (its version: the batch)."""
    return f"{pipeline}/{materialization}/{writer}"


def fence_id(app: str) -> str:
    """The application-transaction id of the fence (its version: the nonce)."""
    return f"{app}#fence"


@dataclass
class _Table:
    """One binding's table as this instance knows it."""

    binding: Binding
    uri: str
    table: DeltaTable
    nonce: int  # the fence version this instance owns
    batch: int | None  # our app transaction's version in the table (the last batch committed)
    held: bytes | None  # the runtime checkpoint committed with it; None when unknown


@dataclass
class _Session:
    app_id: str
    writer: str
    tables: list[_Table]  # by binding index
    pending: list[Store] = field(default_factory=list)  # written at StartCommit

    def close(self) -> None:
        """Nothing is held open: delta-rs opens files per call."""


class DeltaDriver(SessionDriver[DeltaSettings, _Session]):
    pattern: ClassVar[Pattern] = "remote_authoritative"
    store_errors: ClassVar[tuple[type[Exception], ...]] = _ERRORS

    # Settings ---------------------------------------------------------------------------------

    def _storage(self) -> dict[str, str] | None:
        options = {name: value.get_secret_value() for name, value in self.settings.storage_options.items()}
        return options or None

    def _scrub(self, text: str) -> str:
        """`text` without terminal colours and with every storage option value (but
        trivial ones, shorter than 4 characters) replaced by ***."""
        text = _ANSI.sub("", text)
        for value in self.settings.storage_options.values():
            secret = value.get_secret_value()
            if len(secret) >= 4:
                text = text.replace(secret, "***")
        return text

    @contextlib.contextmanager
    def _failures(self, step: str) -> Iterator[None]:
        """delta-rs's, the file system's and Arrow's errors as DriverError, secrets scrubbed."""
        try:
            yield
        except _ERRORS as exc:
            message = str(exc)
            clean = self._scrub(message)
            error = DriverError(
                f"materialization {self.settings.materialization!r}: {step} failed: {type(exc).__name__}: {clean}",
                materialization=self.settings.materialization,
            )
            if clean != message:
                raise error from None  # the original text holds a secret
            raise error from exc

    # Open -------------------------------------------------------------------------------------

    def open(self, request: Open) -> Opened:
        self.close()
        path = self.settings.path
        if not is_uri(path) and not Path(path).expanduser().is_dir():
            raise self.config_error("path", f"the folder {path!r} does not exist")
        app = app_id(request.pipeline, request.materialization, request.writer)
        tables = [self._open_table(binding, app) for binding in request.bindings]
        self._session = _Session(app, request.writer, tables)
        main = next((t for t in tables if t.binding.kind == "view"), tables[0])
        if main.batch is None:
            return Opened(None)
        if main.held is not None:
            return Opened(RuntimeCheckpoint.decode(main.held))
        return Opened(RuntimeCheckpoint(request.pipeline, request.writer, main.batch, {}))

    def _open_table(self, binding: Binding, app: str) -> _Table:
        uri = table_uri(self.settings.path, binding.target)
        schema = VIEW_SCHEMA if binding.kind == "view" else DELTA_SCHEMA
        storage = self._storage()
        try:
            if not DeltaTable.is_deltatable(uri, storage_options=storage):
                if _foreign(None if is_uri(uri) else Path(uri)):
                    raise self.config_error(binding.name, f"{uri!r} exists and is not a Delta table")
                self._create(binding, uri, schema, storage)
            table = DeltaTable(uri, storage_options=storage)
        except _ERRORS as exc:
            clean = self._scrub(f"cannot open or create the Delta table {uri!r}: {type(exc).__name__}: {exc}")
            raise self.config_error("path", clean) from None
        have = pa.schema(table.schema().to_arrow())
        wrong = [f.name for f in schema if have.get_field_index(f.name) < 0 or not have.field(f.name).type.equals(f.type)]
        if wrong or list(table.metadata().partition_columns) != [WRITER]:
            raise self.config_error(
                binding.name,
                f"the Delta table {self._scrub(uri)!r} was not made by this driver: it needs the columns "
                f"{', '.join(f'{f.name} {f.type}' for f in schema)} and to be partitioned by {WRITER}",
            )
        with self._failures(f"Open of {self._scrub(uri)!r}"):
            nonce = self._bump(table, uri, fence_id(app))
            batch = table.transaction_version(app)
            held = None if batch is None else find_checkpoint(table, app, batch)
        return _Table(binding, uri, table, nonce, batch, held)

    @staticmethod
    def _create(binding: Binding, uri: str, schema: pa.Schema, storage: dict[str, str] | None) -> None:
        try:
            DeltaTable.create(
                uri, schema, mode="ignore", partition_by=[WRITER], storage_options=storage,
                name=binding.target, description=f"refold materialization: {binding.kind} binding",
            )
        except _ERRORS:
            if not DeltaTable.is_deltatable(uri, storage_options=storage):
                raise
            # another shard created it meanwhile

    def _bump(self, table: DeltaTable, uri: str, fence: str) -> int:
        """Take the fence: a commit of its own raising the fence version; ours is the new one."""
        failure: CommitFailedError | None = None
        for attempt in range(_ATTEMPTS):
            if attempt:
                time.sleep(_BACKOFF * 2 ** (attempt - 1))
            table.update_incremental()
            nonce = (table.transaction_version(fence) or 0) + 1
            properties = CommitProperties(
                app_transactions=[Transaction(fence, nonce, _now())],
                custom_metadata={"refold.fence": fence, "refold.nonce": str(nonce)},
            )
            try:
                write_deltalake(table, empty_rows(table), mode="append", commit_properties=properties)
                return nonce
            except CommitFailedError as exc:  # another Open raced us: read the fence again
                failure = exc
        raise DriverError(
            f"materialization {self.settings.materialization!r}: cannot take the fence of {self._scrub(uri)!r}: "
            f"{_ATTEMPTS} attempts conflicted with other commits ({self._scrub(str(failure))})",
            materialization=self.settings.materialization,
        )

    # The transaction --------------------------------------------------------------------------

    def load(self, requests: Sequence[Load]) -> list[Loaded]:
        session = self.opened()
        grouped = by_binding(requests)
        found: list[Loaded] = []
        for index, loads in grouped.items():
            with self._failures("Load"):
                docs = read_docs(session.tables[index].table, session.writer, {key_json(r.key) for r in loads})
            for request in loads:
                doc = docs.get(key_json(request.key))
                if doc is not None:
                    found.append(Loaded(index, request.key, doc))
        return found

    def store(self, requests: Sequence[Store]) -> None:
        self.opened().pending.extend(requests)  # written at StartCommit

    def start_commit(self, request: StartCommit) -> StartedCommit:
        session = self.opened()
        stores, session.pending = session.pending, []
        mine: dict[int, list[Store]] = {index: [] for index in range(len(session.tables))}
        for store in stores:
            mine[store.binding].append(store)
        versions: dict[str, int] = {}
        # delta tables first, the view table last: its commit is the materialization's
        for index in sorted(mine, key=lambda i: session.tables[i].binding.kind == "view"):
            table = session.tables[index]
            with self._failures(f"batch {request.runtime_checkpoint.batch} ({table.binding.target})"):
                versions[table.binding.target] = self._commit(session, table, mine[index], request)
        return StartedCommit(orjson.dumps({"batch": request.runtime_checkpoint.batch, "versions": versions}))

    def _commit(self, session: _Session, table: _Table, stores: list[Store], request: StartCommit) -> int:
        """Commit one table's part of the batch (fenced, with the checkpoint); its new version."""
        checkpoint = request.runtime_checkpoint
        encoded = checkpoint.encode()
        fence = fence_id(session.app_id)
        failure: CommitFailedError | None = None
        for attempt in range(_ATTEMPTS):
            if attempt:
                time.sleep(_BACKOFF * 2 ** (attempt - 1))
            table.table.update_incremental()
            self._check_fence(table, fence, checkpoint.batch)
            held = table.table.transaction_version(session.app_id)
            if held != table.batch:  # not our last commit (cannot happen while fenced): never skip
                table.batch, table.held = held, None
            if table.held == encoded:
                log.info("delta %s: batch %d is already committed with this checkpoint: the replay is a no-op",
                         table.binding.target, checkpoint.batch)
                return table.table.version()
            properties = CommitProperties(
                app_transactions=[
                    Transaction(session.app_id, checkpoint.batch, _now()),
                    Transaction(fence, table.nonce, _now()),
                ],
                custom_metadata={
                    "refold.app_id": session.app_id,
                    "refold.batch": str(checkpoint.batch),
                    "refold.nonce": str(table.nonce),
                    "refold.checkpoint": encoded.decode(),
                },
            )
            try:
                if table.binding.kind == "view":
                    _write_view(table, stores, checkpoint, request.full_refresh, properties)
                else:
                    _write_deltas(table, stores, checkpoint, properties)
            except CommitFailedError as exc:  # a concurrent commit won; a newer Open is found above
                failure = exc
                log.warning("delta %s: the commit of batch %d conflicted (%s); retrying",
                            table.binding.target, checkpoint.batch, self._scrub(str(exc)))
                continue
            table.batch, table.held = checkpoint.batch, encoded
            return table.table.version()
        table.table.update_incremental()
        self._check_fence(table, fence, checkpoint.batch)
        raise DriverError(
            f"materialization {self.settings.materialization!r}: the commit of batch {checkpoint.batch} to "
            f"{table.binding.target!r} conflicted {_ATTEMPTS} times ({self._scrub(str(failure))})",
            materialization=self.settings.materialization,
        )

    def _check_fence(self, table: _Table, fence: str, batch: int) -> None:
        found = table.table.transaction_version(fence)
        if found != table.nonce:
            raise DriverFencedError(
                f"materialization {self.settings.materialization!r}: the Delta table {self._scrub(table.uri)!r} "
                f"was opened by a newer instance (fence {found}, ours {table.nonce}): "
                f"the commit of batch {batch} is refused"
            )


# Writing -----------------------------------------------------------------------------------------


def _write_view(
    table: _Table, stores: list[Store], checkpoint: RuntimeCheckpoint, full_refresh: bool, properties: CommitProperties
) -> None:
    writer = _literal(checkpoint.writer)
    if full_refresh:  # the whole view of this shard replaces its partition, in one commit
        rows = [s for s in stores if not s.delete and s.doc is not None]
        data = arrow_rows(table.table, table.binding, rows, checkpoint)
        write_deltalake(table.table, data, mode="overwrite", predicate=f"{WRITER} = {writer}",
                        schema_mode="merge", commit_properties=properties)
        return
    if stores:
        before = table.table.version()
        (
            table.table.merge(
                arrow_rows(table.table, table.binding, stores, checkpoint, deleted=True),
                predicate=f"t.{WRITER} = {writer} AND t.{KEY} = s.{KEY}",
                source_alias="s",
                target_alias="t",
                merge_schema=True,
                commit_properties=properties,
            )
            .when_matched_delete(f"s.{DELETED}")
            .when_matched_update_all(f"NOT s.{DELETED}", except_cols=[DELETED])
            .when_not_matched_insert_all(f"NOT s.{DELETED}", except_cols=[DELETED])
            .execute()
        )
        if table.table.version() != before:
            return
    # nothing to change (or deletes of rows that are not there): delta-rs makes no commit
    # for that, but the transaction still commits its checkpoint
    write_deltalake(table.table, empty_rows(table.table), mode="append", commit_properties=properties)


def _write_deltas(table: _Table, stores: list[Store], checkpoint: RuntimeCheckpoint, properties: CommitProperties) -> None:
    data = arrow_rows(table.table, table.binding, stores, checkpoint, seq=True)
    if table.batch is not None and table.batch >= checkpoint.batch:
        # a replay the table may hold rows of: this writer's rows of the batches it replaces go
        predicate = f"{WRITER} = {_literal(checkpoint.writer)} AND {BATCH} >= {checkpoint.batch}"
        write_deltalake(table.table, data, mode="overwrite", predicate=predicate, schema_mode="merge",
                        commit_properties=properties)
    else:
        write_deltalake(table.table, data, mode="append", schema_mode="merge", commit_properties=properties)


def _literal(text: str) -> str:
    """A SQL string literal for delta-rs predicates."""
    return "'" + text.replace("'", "''") + "'"


def _now() -> int:
    return int(time.time() * 1000)


def _foreign(local: Path | None) -> bool:
    """A local folder that holds something other than a Delta log: not ours to create a table in.

    A folder with only `_delta_log` is a table another shard is creating right now (delta-rs
    writes its first commit there as a temporary file, then renames it) or whose create failed.
    """
    if local is None or not local.exists():
        return False
    return not local.is_dir() or any(entry.name != "_delta_log" for entry in local.iterdir())
