"""Estuary Flow's materialization protocol as Refold speaks it (DESIGN.md §4).

A *materialization* puts one pipeline's outputs into an external store through a
*driver*. It has one or more *bindings*: a **view** binding (standard updates: one
full row per key; the runtime `Load`s the keys a transaction touches) or a
**delta** binding (append-only delta updates; never `Load`ed). The runtime
(`refold.connectors.runtime`) drives every driver one transaction per
micro-batch, with the messages below as values:

    Open → Opened                                  once, at start (and after a failed batch)
    Acknowledge → Acknowledged                     the previous transaction committed to Kafka
    Load* → Loaded*                                keys this transaction touches (view bindings)
    Flush → Flushed                                never before Acknowledged
    Store*                                         final row per touched key; every delta row
    StartCommit{runtime checkpoint} → StartedCommit{driver checkpoint}

The driver checkpoint goes into the batch's Kafka transaction
(`Checkpoint.driver_checkpoints[<materialization name>]`) and comes back in the
next `Open`. Each driver names the Flow pattern it follows (`Driver.pattern`).

**SeaTunnel's commit split** for parallel writers is optional: a driver whose
`sink()` returns a `Sink` gets its `Store`s as parts, prepared by a picklable
`SinkWriter` on Spark executors (nothing visible), then committed on the
Spark driver by a `SinkCommitter` (idempotent, per writer; the runtime retries
the ones that failed a bounded number of times) and an `AggregatedCommitter`
(one global commit, where the store needs it), then `StartCommit`.
`SinkWriter.abort` cleans up prepared work when a transaction gives up.

Drivers are named in the pipeline file under `outputs.materialize` (a list of
mappings, each with `driver:` and the driver's settings). Each entry is validated
into its driver's settings model (`refold.connectors.settings`) when the file is
read; `build_driver` imports the class the model names and builds it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar

import orjson

from refold.connectors.settings import DriverSettings, parse_settings
from refold.errors import ConfigError, InternalError, OperationalError, UserError

Pattern = Literal[
    "remote_authoritative",  # rows + runtime checkpoint + fencing nonce in one store transaction
    "recovery_log_idempotent_apply",  # stage; reference in the driver checkpoint; apply after commit
    "recovery_log_non_transactional",  # at-least-once into a store without transactions
    "push_only_delta",  # delta updates pushed out; no Load; at-least-once
]
BindingKind = Literal["view", "delta"]
Key = tuple[Any, ...]  # key values, in the order of `Binding.key`
Row = dict[str, Any]  # a full row: key columns and value columns by name


class DriverError(OperationalError):
    """A driver failed at run time: the store refused a write or went away, a push kept
    failing. Not the user's fault and not a bug: nothing of the batch committed to
    Kafka, and a restart retries from the last commit (a remote-authoritative store
    may then be one batch ahead: the replay is idempotent). The store's own error,
    when there is one, is the `__cause__`."""

    def __init__(self, message: str, *, materialization: str | None = None) -> None:
        self.materialization = materialization
        super().__init__(message)


class DriverFencedError(UserError):
    """A newer instance opened this materialization: this one's commit is refused (two
    instances run the same pipeline writer: the user's to fix). Nothing was written."""


# Bindings and checkpoints -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Binding:
    """One output of the pipeline put into one target of the store (a table, a folder)."""

    name: str  # "view" or "delta"
    kind: BindingKind
    target: str  # the table / folder / resource name, from the settings
    key: tuple[str, ...]  # key column names; `Load.key`/`Store.key` values follow this order
    # Value columns known from the view spec, in order. A top_n view's rows also carry
    # the ranked row's own columns, known only at run time: () then; store the whole row.
    columns: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RuntimeCheckpoint:
    """Where the runtime is: the batch and the input offsets it covers. A
    remote-authoritative driver stores it (bytes from `encode`) with its rows and
    returns it in `Opened`."""

    pipeline: str
    writer: str
    batch: int  # batches committed by this writer, this one included
    offsets: dict[int, int]  # input partition -> next offset to read

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "pipeline": self.pipeline,
                "writer": self.writer,
                "batch": self.batch,
                "offsets": {str(p): o for p, o in sorted(self.offsets.items())},
            }
        )

    @staticmethod
    def decode(data: bytes) -> RuntimeCheckpoint:
        raw = orjson.loads(data)
        return RuntimeCheckpoint(
            raw["pipeline"], raw["writer"], int(raw["batch"]), {int(p): int(o) for p, o in raw["offsets"].items()}
        )


# The messages ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Open:
    """Runtime → driver, once before any transaction (again after a failed batch)."""

    materialization: str  # its name: the key of its driver checkpoint
    pipeline: str
    writer: str
    bindings: tuple[Binding, ...]
    driver_checkpoint: bytes | None  # the last one committed to Kafka; None at the very first start


@dataclass(frozen=True, slots=True)
class Opened:
    """Driver → runtime. A remote-authoritative driver returns the runtime checkpoint
    its store holds (None when the store is empty); other patterns return None."""

    runtime_checkpoint: RuntimeCheckpoint | None = None


@dataclass(frozen=True, slots=True)
class Acknowledge:
    """Runtime → driver: the previous transaction (or, right after Open, the
    recovered one) is committed to Kafka."""

    batch: int  # the batch that committed (the recovered batch right after Open)


@dataclass(frozen=True, slots=True)
class Acknowledged:
    """Driver → runtime: the acknowledged transaction is applied (where it applies)."""


@dataclass(frozen=True, slots=True)
class Load:
    """Runtime → driver: read the stored row of `key` (view bindings only)."""

    binding: int  # index into Open.bindings
    key: Key


@dataclass(frozen=True, slots=True)
class Loaded:
    """Driver → runtime: the stored row of a loaded key. Omitted for missing keys."""

    binding: int
    key: Key
    doc: Row


@dataclass(frozen=True, slots=True)
class Flush:
    """Runtime → driver: no more Loads this transaction. Sent only after Acknowledged."""


@dataclass(frozen=True, slots=True)
class Flushed:
    """Driver → runtime: every Loaded of this transaction is returned."""


@dataclass(frozen=True, slots=True)
class Store:
    """Runtime → driver: the final row of a key this transaction (view binding), or
    one delta row (delta binding; `exists` is then always False)."""

    binding: int
    key: Key
    doc: Row | None  # None when `delete`
    exists: bool  # the key was Loaded this transaction (it is in the store)
    delete: bool = False  # the key has no live row any more: remove it
    cause: str | None = None  # `<partition>:<offset>` of the input event behind the row (its `refold.cause`)


@dataclass(frozen=True, slots=True)
class CommitInfo:
    """What a `SinkWriter` prepared for one part (picklable; nothing visible yet)."""

    part: int
    rows: int
    data: Any  # driver-specific: a staged file, a request body, a staging table name


@dataclass(frozen=True, slots=True)
class StartCommit:
    """Runtime → driver: commit this transaction's Stores with `runtime_checkpoint`."""

    runtime_checkpoint: RuntimeCheckpoint
    prepared: tuple[CommitInfo, ...] = ()  # the parts a Sink prepared (and committed) this transaction
    # True when this transaction's Stores are the whole current view of every view
    # binding (a backfill): rows the store holds but that were not stored must go.
    full_refresh: bool = False


@dataclass(frozen=True, slots=True)
class StartedCommit:
    """Driver → runtime: its checkpoint, committed to Kafka with the batch."""

    driver_checkpoint: bytes = b""


@dataclass(frozen=True, slots=True)
class TxnInfo:
    """What a SinkWriter knows about the transaction it prepares for (picklable)."""

    materialization: str
    pipeline: str
    writer: str
    batch: int
    bindings: tuple[Binding, ...]


# SeaTunnel's split ----------------------------------------------------------------------


class SinkWriter(ABC):
    """Prepares one part of a transaction's Stores. Pickled and run on Spark
    executors (or threads): it holds settings, never a connection."""

    @abstractmethod
    def prepare(self, txn: TxnInfo, part: int, stores: Sequence[Store]) -> CommitInfo:
        """Called once per part per transaction, possibly in parallel and possibly
        again for the same part after a failure (it must not matter). Nothing it
        does may be visible to readers of the store."""

    def abort(self, infos: Sequence[CommitInfo]) -> None:  # noqa: B027 - optional hook
        """Called on the Spark driver when the transaction gives up after `prepare`:
        remove what `infos` prepared. Idempotent."""


class SinkCommitter(ABC):
    """Commits each writer's prepared part, on the Spark driver."""

    @abstractmethod
    def commit(self, infos: Sequence[CommitInfo]) -> list[CommitInfo]:
        """Commit each part idempotently; return the ones that failed (the runtime
        retries them a bounded number of times, then aborts the transaction)."""


class AggregatedCommitter(ABC):
    """One global commit of every part, on the Spark driver, where the store needs one."""

    @abstractmethod
    def commit(self, infos: Sequence[CommitInfo], start: StartCommit) -> None:
        """Called once per transaction after every part committed, just before
        `Driver.start_commit`. Idempotent: a replayed transaction calls it again."""


@dataclass(frozen=True, slots=True)
class Sink:
    """A driver's parallel writing: a writer, and the committers it needs."""

    writer: SinkWriter
    committer: SinkCommitter | None = None
    aggregated: AggregatedCommitter | None = None


# The driver contract -------------------------------------------------------------------

S = TypeVar("S", bound=DriverSettings)


class Driver(ABC, Generic[S]):
    """One materialization's driver, generic over its settings model: one method per
    protocol message.

    The runtime calls these from the engine's Spark driver, one transaction at a
    time, in the order of the module docstring. `acknowledge` may run on another
    thread while `load` runs (Flow does not wait for Acknowledged before Load):
    a driver whose two touch the same state guards it. Every other call comes
    after the previous one returned. `acknowledge` and `flush` are no-ops unless a
    driver overrides them; `load` and `store` exist only for drivers that take
    Loads (view bindings) and that write without a `Sink`.

    A driver connects in `open`, not in `__init__`: building one (at start, from
    validated settings) touches nothing outside the process.
    """

    pattern: ClassVar[Pattern]
    # The store's own errors (e.g. `sqlite3.Error`): the runtime reports them as a
    # DriverError (an OperationalError), chained, instead of an internal error.
    store_errors: ClassVar[tuple[type[Exception], ...]] = ()

    def __init__(self, settings: S, where: str = "outputs.materialize[0]") -> None:
        self.settings = settings
        self.where = where  # the settings' path in the pipeline file, for error messages

    def config_error(self, setting: str, message: str) -> ConfigError:
        """A ConfigError naming the setting (`outputs.materialize[0].path: …`)."""
        return ConfigError(message, where=f"{self.where}.{setting}")

    def sink(self) -> Sink | None:
        """The driver's parallel writer, or None: then the runtime calls `store`.
        Called after each `open`."""
        return None

    @abstractmethod
    def open(self, request: Open) -> Opened:
        """Called first, once per runtime start (and again after the engine re-initialises
        from Kafka). Connect; create targets that are missing; fence older instances
        (remote-authoritative: bump the nonce); forget staged work the driver
        checkpoint does not name. Bad settings (a wrong DSN, a missing folder, an
        unreachable URL) fail here with `config_error(setting, …)`."""

    def acknowledge(self, request: Acknowledge) -> Acknowledged:
        """Called after each transaction committed to Kafka, and right after `open`
        for the recovered transaction. Apply what the committed driver checkpoint
        names (recovery-log drivers), idempotently: it may already be applied.
        Default: nothing to apply (the store committed at StartCommit, or nothing
        is kept)."""
        return Acknowledged()

    def load(self, requests: Sequence[Load]) -> list[Loaded]:
        """Called with the transaction's Loads (view bindings only; each key at most
        once per transaction), possibly before Acknowledged. Return a Loaded for each
        key the store holds, none for missing keys. A driver that takes a view
        binding overrides it; the default refuses (no view binding, nothing to load)."""
        raise InternalError(f"{type(self).__name__} takes no view binding: Load was sent to it")

    def flush(self, request: Flush) -> Flushed:
        """Called once per transaction after Acknowledged and after every Load.
        Default: nothing pending."""
        return Flushed()

    def store(self, requests: Sequence[Store]) -> None:
        """Called after Flushed (never for a driver with a `sink()`): the transaction's
        Stores, view bindings first. Nothing may be visible before `start_commit`
        (push-only drivers excepted: at-least-once). A driver without a sink
        overrides it; the default refuses."""
        raise InternalError(f"{type(self).__name__} writes through its Sink: store() was called")

    @abstractmethod
    def start_commit(self, request: StartCommit) -> StartedCommit:
        """Called once per transaction after every Store, before the Kafka commit.
        Remote-authoritative: commit the rows and `request.runtime_checkpoint` in one
        store transaction, refusing (DriverFencedError) if the nonce moved.
        Recovery-log: return a driver checkpoint naming the staged work."""

    def close(self) -> None:
        """Called at the end (or before a re-Open); release connections. Idempotent."""


class Session(Protocol):
    def close(self) -> None:
        """Release what the session holds (a connection); called once."""
        ...


T = TypeVar("T", bound=Session)


class SessionDriver(Driver[S], Generic[S, T]):
    """A driver whose state exists only between `open` and `close`, kept in one session
    object (its connection, the bindings, what `open` learned). `open` sets
    `self._session`; every later step gets it from `opened()`, which raises DriverError
    before `open` or after `close`; `close` closes it once. A re-`open` must `close`
    first, or the old session's connection leaks."""

    _session: T | None = None

    def opened(self) -> T:
        if self._session is None:
            raise DriverError(f"{type(self).__name__} is not open")
        return self._session

    def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()


# Building drivers -------------------------------------------------------------------------


R = TypeVar("R", Load, Store)


def by_binding(requests: Iterable[R]) -> dict[int, list[R]]:
    """Loads or Stores grouped by their binding, each group in the requests' order."""
    grouped: dict[int, list[R]] = {}
    for request in requests:
        grouped.setdefault(request.binding, []).append(request)
    return grouped


def build_driver(entry: DriverSettings | Mapping[str, Any], where: str = "outputs.materialize[0]") -> Driver[Any]:
    """The driver of one `outputs.materialize` entry; nothing connects yet. A mapping
    (tests, benchmarks) is validated first, failing with a ConfigError that names
    the setting; a pipeline's entries are validated already."""
    settings = entry if isinstance(entry, DriverSettings) else parse_settings(entry, where)
    module_name, _, class_name = settings.implementation.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"driver {settings.driver!r} cannot be loaded: {exc}", where=f"{where}.driver") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Driver)):
        raise InternalError(f"{settings.implementation} is not a Driver")
    return cls(settings, where)


def build_drivers(entries: Sequence[DriverSettings]) -> list[Driver[Any]]:
    """The driver of every `outputs.materialize` entry, in order."""
    return [build_driver(entry, f"outputs.materialize[{i}]") for i, entry in enumerate(entries)]
