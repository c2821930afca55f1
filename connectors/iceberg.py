"""Apache Iceberg tables (pyiceberg). Pattern: remote store authoritative.

One Iceberg table per binding, in a catalog: by default pyiceberg's SQL catalog in
a SQLite file `<warehouse>/catalog.db`, or a REST catalog (`uri: https://…`), or
a SQL catalog elsewhere. Each batch is ONE table commit per table (a new snapshot,
atomic: rows, schema change and the shard's checkpoint together or nothing),
made at `StartCommit`, before the Kafka commit. This module is the driver (its
session, the checkpoint, the fence, the commits); the catalog, the tables'
columns, their evolution rule, rows as Arrow and reading the tables back are in
`refold.connectors.iceberg_tables`.

**The checkpoint.** Each shard of a pipeline writer (`<writer>-<shard>`) keeps, per
table, a table property `refold.fence.<pipeline>/<writer>/<materialization>`
(the parts URL-quoted) = `{"nonce": N, "checkpoint": <runtime checkpoint>}`, set
in the same commit as the batch's rows; the batch's snapshot summary carries the
same (`refold.writer`, `refold.nonce`, `refold.checkpoint`), so a reader of the
table's history sees which batch of which shard made each snapshot. `Open` reads
the property back (several shards write one table: each has its own); were it
removed, `Open` walks the snapshots back to the shard's newest one instead.

**The fence.** `Open` bumps the shard's nonce in a commit of its own that also
adds an empty snapshot (summary `refold.open`), so the table's `main` branch moves.
Every later commit reloads the table, refuses (`DriverFencedError`) when the
nonce is no longer ours, and is sent with the requirement that `main` is still the
snapshot it reloaded (Iceberg's optimistic concurrency: pyiceberg's SQL catalog
checks it and swaps the metadata pointer atomically; a REST catalog checks it
server-side). A zombie's commit thus either sees the newer nonce or fails the
requirement because the newer `Open` moved `main`: it never lands. A commit that
lost to another shard's commit is redone from a fresh reload (`commit_attempts`
times). pyiceberg's own retry (table property `commit.retry.num-retries`) is set
to 0 on our tables: it would re-apply a failed commit on top of the newer
snapshot without our nonce check.

**Replays.** When the table already holds this shard's checkpoint of the batch
(the store committed, Kafka did not), the batch's commit is a no-op: nothing is
written, no snapshot. Otherwise view rows are a pure function of the input and
deltas are replaced by batch number, so a batch cut differently under the same
number (Spark's offset log lost) is still stored exactly once.

**Tables.** A view table and a delta table per binding (their columns and the
evolution rule: `refold.connectors.iceberg_tables`). A table is created at the
first `Open`; an existing table that is not a refold table of the binding's kind is
refused there, naming the setting. Each commit first adds the typed columns its
rows bring. View commits copy-on-write: delete the stored keys' old rows (pyiceberg
rewrites the files holding them) and append the new rows; a full refresh first
deletes every row of its shard (and rows without `_writer`). A replayed delta
batch (the table holds a checkpoint at or past it) first deletes its shard's
rows of the batches it replaces. `Load` scans the view table for the keys asked.
`read_iceberg_view` and `read_iceberg_deltas` (re-exported here) read the tables back.

    outputs:
      materialize:
        - {driver: iceberg, warehouse: lake/, view: scores, delta: scores_delta}
        - {driver: iceberg, warehouse: "s3://bucket/lake", uri: "https://catalog.example/api",
           properties: {credential: "id:secret"}, view: scores}
"""

from __future__ import annotations

import functools
import logging
import random
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar
from urllib.parse import quote, urlsplit

import orjson
import pyarrow as pa
import sqlalchemy.exc
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import (
    BadRequestError,
    CommitFailedException,
    ForbiddenError,
    NoSuchNamespaceError,
    NoSuchTableError,
    RESTError,
    UnauthorizedError,
    ValidationException,
)
from pyiceberg.expressions import (
    And,
    BooleanExpression,
    EqualTo,
    GreaterThanOrEqual,
    In,
    IsNull,
    Or,
    Reference,
)
from pyiceberg.expressions.literals import literal
from pyiceberg.table import Table, Transaction

from refold.connectors.iceberg_tables import (
    arrow_rows,
    base_schema,
    evolve,
    key_json,
    local_folder,
    open_catalog,
    read_iceberg_deltas,
    read_iceberg_view,
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
from refold.connectors.settings import IcebergSettings

# read_iceberg_view, read_iceberg_deltas and open_catalog are re-exported: the driver's users
# read its tables back from here
__all__ = [
    "FENCE",
    "RETRIES",
    "SUMMARY_CHECKPOINT",
    "SUMMARY_NONCE",
    "SUMMARY_OPEN",
    "SUMMARY_WRITER",
    "IcebergDriver",
    "fence_property",
    "held_by",
    "open_catalog",
    "read_iceberg_deltas",
    "read_iceberg_view",
]

log = logging.getLogger(__name__)

FENCE = "refold.fence."  # table property prefix: one per pipeline, writer (shard) and materialization
RETRIES = "commit.retry.num-retries"  # pyiceberg's own commit retry: off on our tables
SUMMARY_WRITER = "refold.writer"  # snapshot summary: whose snapshot (the fence key, as in the property)
SUMMARY_NONCE = "refold.nonce"
SUMMARY_CHECKPOINT = "refold.checkpoint"  # the runtime checkpoint of the batch the snapshot writes
SUMMARY_OPEN = "refold.open"  # on the empty snapshot an Open commits
_NO_MATCH = "Delete operation did not match any records"
# what a catalog answers to a request it refuses (the settings' fault, not the store's state)
_REFUSED = (BadRequestError, ForbiddenError, UnauthorizedError, ValueError)


# The checkpoint -------------------------------------------------------------------------------


def fence_property(pipeline: str, writer: str, materialization: str) -> str:
    """The table property holding one shard's nonce and checkpoint."""
    return FENCE + "/".join(quote(part, safe="") for part in (pipeline, writer, materialization))


def held_by(table: Table, prop: str) -> tuple[int, RuntimeCheckpoint | None]:
    """(nonce, runtime checkpoint) the table holds for the shard of `prop`: from the
    property; were it removed, from the shard's newest snapshots."""
    raw = table.properties.get(prop)
    if raw is not None:
        data = orjson.loads(raw)
        checkpoint = data.get("checkpoint")
        return int(data["nonce"]), None if checkpoint is None else RuntimeCheckpoint.decode(orjson.dumps(checkpoint))
    nonce: int | None = None
    for snapshot in reversed(table.metadata.snapshots):  # newest first
        summary = snapshot.summary
        if summary is None or summary.get(SUMMARY_WRITER) != prop:
            continue
        if nonce is None:
            nonce = int(summary.get(SUMMARY_NONCE) or 0)
        found = summary.get(SUMMARY_CHECKPOINT)
        if found is not None:
            return nonce, RuntimeCheckpoint.decode(found.encode())
    return nonce or 0, None


def _property_value(nonce: int, checkpoint: RuntimeCheckpoint | None) -> str:
    encoded = None if checkpoint is None else orjson.loads(checkpoint.encode())
    return orjson.dumps({"nonce": nonce, "checkpoint": encoded}).decode()


# The session ----------------------------------------------------------------------------------


@dataclass
class _Target:
    """One binding's table."""

    binding: Binding
    ident: tuple[str, ...]  # namespace levels, table name
    uuid: str  # the table's, at Open: a table dropped and re-created since is not ours
    nonce: int  # ours, from Open's bump
    held: RuntimeCheckpoint | None  # what the table held at Open

    @property
    def name(self) -> str:
        return ".".join(self.ident)


@dataclass
class _Session:
    catalog: Catalog
    prop: str  # the fence property of this shard
    targets: list[_Target]
    pending: list[Store] = field(default_factory=list)  # written at StartCommit

    def close(self) -> None:
        self.catalog.close()


class IcebergDriver(SessionDriver[IcebergSettings, _Session]):
    pattern: ClassVar[Pattern] = "remote_authoritative"
    store_errors: ClassVar[tuple[type[Exception], ...]] = (
        OSError,
        pa.ArrowException,
        sqlalchemy.exc.SQLAlchemyError,
        RESTError,
        NoSuchTableError,
        NoSuchNamespaceError,
        ValidationException,
    )

    # Open ----------------------------------------------------------------------------------

    def open(self, request: Open) -> Opened:
        self.close()
        catalog = self._catalog()
        try:  # a failure here closes the catalog it opened
            namespace = tuple(self.settings.namespace.split("."))
            self._create_namespace(catalog, namespace)
            prop = fence_property(request.pipeline, request.writer, request.materialization)
            targets = [self._open_table(catalog, namespace, binding, prop) for binding in request.bindings]
        except BaseException:
            catalog.close()
            raise
        self._session = _Session(catalog, prop, targets)
        view = next((t for t in targets if t.binding.kind == "view"), targets[0] if targets else None)
        return Opened(None if view is None else view.held)

    def _catalog(self) -> Catalog:
        settings = self.settings
        local = local_folder(settings.warehouse)
        if local is not None and not local.is_dir():
            raise self.config_error("warehouse", f"the folder {str(local)!r} does not exist")
        uri = settings.uri.get_secret_value() if settings.uri is not None else None
        if uri is None and local is None:
            raise self.config_error(
                "uri", "a warehouse that is not a local folder needs a catalog: set uri (http(s)://… or a SQL URI)"
            )
        properties = {name: value.get_secret_value() for name, value in settings.properties.items()}
        try:
            try:
                return open_catalog(settings.warehouse, uri, settings.catalog, properties)
            except Exception as exc:
                if "already exists" not in str(exc):
                    raise
                # shards opening at once on a new SQL catalog: another one created its tables
                # between this one's check and its CREATE TABLE; they are there now
                return open_catalog(settings.warehouse, uri, settings.catalog, properties)
        except Exception as exc:
            raise self.config_error(
                "uri" if uri is not None else "warehouse",
                f"cannot open the Iceberg catalog {self._describe_catalog()}: {self._scrub(exc)}",
            ) from None

    def _describe_catalog(self) -> str:
        """The catalog as messages name it: no user, password or query."""
        if self.settings.uri is None:
            return f"{self.settings.warehouse}/catalog.db"
        parts = urlsplit(self.settings.uri.get_secret_value())
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{host}{port}{parts.path}"

    def _scrub(self, exc: BaseException) -> str:
        """An error as text, without the settings' secrets."""
        text = f"{type(exc).__name__}: {exc}"
        secrets = [value.get_secret_value() for value in self.settings.properties.values()]
        if self.settings.uri is not None:
            uri = self.settings.uri.get_secret_value()
            secrets += [uri, urlsplit(uri).password or ""]
        for secret in sorted((s for s in secrets if s), key=len, reverse=True):
            text = text.replace(secret, "***")
        return text

    def _create_namespace(self, catalog: Catalog, namespace: tuple[str, ...]) -> None:
        """Create the namespace when missing. The shards open at once: when another
        shard's create wins the race, the SQL catalog's insert fails on its unique key
        (sqlalchemy's IntegrityError, which pyiceberg passes on), and the namespace is there."""
        try:
            if not catalog.namespace_exists(namespace):
                try:
                    catalog.create_namespace_if_not_exists(namespace)
                except Exception:
                    if not catalog.namespace_exists(namespace):
                        raise
        except _REFUSED as exc:
            raise self.config_error(
                "namespace", f"cannot create the namespace {'.'.join(namespace)!r}: {self._scrub(exc)}"
            ) from None

    def _open_table(self, catalog: Catalog, namespace: tuple[str, ...], binding: Binding, prop: str) -> _Target:
        """Create the binding's table when missing; bump this shard's nonce in it."""
        ident = (*namespace, binding.target)
        try:
            table = catalog.create_table_if_not_exists(ident, base_schema(binding.kind), properties={RETRIES: "0"})
        except _REFUSED as exc:
            raise self.config_error(binding.name, f"cannot create the table {'.'.join(ident)!r}: {self._scrub(exc)}") from None
        names = {f.name for f in table.schema().fields}
        if not {"_key", "_doc"} <= names or ("_seq" in names) != (binding.kind == "delta"):
            what = "delta rows (_seq)" if binding.kind == "delta" else "view rows (no _seq)"
            raise self.config_error(
                binding.name,
                f"the table {'.'.join(ident)!r} exists and is not a refold table of {what} with _key and _doc: "
                "name another table",
            )
        for attempt in range(self.settings.commit_attempts):
            table = self._no_library_retries(catalog, ident, table)
            nonce, held = held_by(table, prop)
            nonce += 1
            txn = table.transaction()
            txn.set_properties({prop: _property_value(nonce, held)})
            txn.append(table.schema().as_arrow().empty_table(),
                       snapshot_properties={SUMMARY_WRITER: prop, SUMMARY_NONCE: str(nonce), SUMMARY_OPEN: "1"})
            try:
                txn.commit_transaction()
            except CommitFailedException:
                _backoff(attempt)
                table = catalog.load_table(ident)
                continue
            return _Target(binding, ident, str(table.metadata.table_uuid), nonce, held)
        raise DriverError(
            f"iceberg: opening the table {'.'.join(ident)!r} failed {self.settings.commit_attempts} times: "
            "other commits kept coming first",
            materialization=self.settings.materialization,
        )

    @staticmethod
    def _no_library_retries(catalog: Catalog, ident: tuple[str, ...], table: Table) -> Table:
        """Turn pyiceberg's own commit retry off on the table (a commit of its own, with
        no snapshot: nothing to retry): it would re-apply our commits past the fence."""
        if table.properties.get(RETRIES) != "0":
            table.transaction().set_properties({RETRIES: "0"}).commit_transaction()
            table = catalog.load_table(ident)
        return table

    # The transaction ---------------------------------------------------------------------------

    def load(self, requests: Sequence[Load]) -> list[Loaded]:
        session = self.opened()
        found: list[Loaded] = []
        grouped = by_binding(requests)
        for index, loads in grouped.items():
            target = session.targets[index]
            wanted = {key_json(load.key): load.key for load in loads}
            table = session.catalog.load_table(target.ident)
            rows = table.scan(row_filter=_in("_key", wanted), selected_fields=("_key", "_doc")).to_arrow()
            seen: set[str] = set()
            for stored, doc in zip(rows.column("_key").to_pylist(), rows.column("_doc").to_pylist(), strict=True):
                if stored in wanted and stored not in seen and doc is not None:
                    seen.add(stored)
                    found.append(Loaded(index, wanted[stored], orjson.loads(doc)))
        return found

    def store(self, requests: Sequence[Store]) -> None:
        self.opened().pending.extend(requests)  # written at StartCommit, in each table's one commit

    def start_commit(self, request: StartCommit) -> StartedCommit:
        session = self.opened()
        stores, session.pending = session.pending, []
        for index, target in enumerate(session.targets):
            self._commit(session, target, [s for s in stores if s.binding == index], request)
        return StartedCommit(b"")

    def _commit(self, session: _Session, target: _Target, stores: list[Store], request: StartCommit) -> None:
        """One fenced table commit of the batch (redone from a fresh reload when another
        shard committed first)."""
        checkpoint = request.runtime_checkpoint
        for attempt in range(self.settings.commit_attempts):
            table = session.catalog.load_table(target.ident)
            if str(table.metadata.table_uuid) != target.uuid:
                raise DriverError(
                    f"iceberg: the table {target.name!r} was dropped and re-created since Open",
                    materialization=self.settings.materialization,
                )
            table = self._no_library_retries(session.catalog, target.ident, table)
            nonce, held = held_by(table, session.prop)
            if nonce != target.nonce:
                raise DriverFencedError(
                    f"materialization {self.settings.materialization!r} of pipeline {checkpoint.pipeline!r} "
                    f"(writer {checkpoint.writer!r}): the Iceberg table {target.name!r} was opened by a newer "
                    f"instance (nonce {nonce}, ours {target.nonce}): the commit of batch {checkpoint.batch} is refused"
                )
            if held == checkpoint:
                log.info("iceberg: table %s holds batch %d of %s already: its replay writes nothing",
                         target.name, checkpoint.batch, checkpoint.writer)
                return
            txn = table.transaction()
            self._write(txn, target, stores, request, session.prop, held)
            try:
                txn.commit_transaction()
                return
            except CommitFailedException as exc:
                log.info("iceberg: commit of batch %d to %s lost to another commit (%s); retrying",
                         checkpoint.batch, target.name, exc)
                _backoff(attempt)
        raise DriverError(
            f"iceberg: the commit of batch {checkpoint.batch} to the table {target.name!r} failed "
            f"{self.settings.commit_attempts} times: other commits kept coming first",
            materialization=self.settings.materialization,
        )

    def _write(
        self,
        txn: Transaction,
        target: _Target,
        stores: list[Store],
        request: StartCommit,
        prop: str,
        held: RuntimeCheckpoint | None,
    ) -> None:
        """Stage the batch on `txn`: new columns, deletes, rows, the shard's checkpoint."""
        checkpoint = request.runtime_checkpoint
        binding, owner, batch = target.binding, checkpoint.writer, checkpoint.batch
        summary = {
            SUMMARY_WRITER: prop,
            SUMMARY_NONCE: str(target.nonce),
            SUMMARY_CHECKPOINT: checkpoint.encode().decode(),
        }
        rows = [s for s in stores if not s.delete and s.doc is not None]
        evolve(txn, binding, [s.doc for s in rows if s.doc is not None])
        before = txn.table_metadata.current_snapshot_id
        gone: list[BooleanExpression] = []
        if binding.kind == "view":
            if request.full_refresh:  # this shard's rows (and those of no shard)
                gone += [_equal("_writer", owner), IsNull(term=Reference("_writer"))]
            if stores:
                gone.append(_in("_key", [key_json(s.key) for s in stores]))
        elif held is not None and held.batch >= batch:  # a replay: its batches' rows go first
            gone.append(And(_equal("_writer", owner), GreaterThanOrEqual(term=Reference("_batch"), value=literal(batch))))
        if gone:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_NO_MATCH)
                txn.delete(functools.reduce(Or, gone), snapshot_properties=summary)
        if rows or txn.table_metadata.current_snapshot_id == before:  # a snapshot per commit, always
            txn.append(arrow_rows(txn.table_metadata.schema(), rows, owner, batch), snapshot_properties=summary)
        txn.set_properties({prop: _property_value(target.nonce, checkpoint)})


def _in(column: str, values: Iterable[str]) -> BooleanExpression:
    return In(term=Reference(column), values={literal(v) for v in values})


def _equal(column: str, value: str) -> BooleanExpression:
    return EqualTo(term=Reference(column), value=literal(value))


def _backoff(attempt: int) -> None:
    time.sleep(min(2.0, 0.05 * 2**attempt) * (1 + random.random() / 2))
