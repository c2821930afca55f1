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
mappings, each with `driver:` and the driver's settings, validated by its
pydantic `Settings` model). The registry `DRIVERS` maps a name to
`"module:Class"`, imported on first use.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from refold.errors import ConfigError, RefoldError, UserError

Pattern = Literal[
    "remote_authoritative",  # rows + runtime checkpoint + fencing nonce in one store transaction
    "recovery_log_idempotent_apply",  # stage; reference in the driver checkpoint; apply after commit
    "recovery_log_non_transactional",  # at-least-once into a store without transactions
    "push_only_delta",  # delta updates pushed out; no Load; at-least-once
]
BindingKind = Literal["view", "delta"]
Key = tuple[Any, ...]  # key values, in the order of `Binding.key`
Row = dict[str, Any]  # a full row: key columns and value columns by name


class DriverError(RefoldError):
    """A driver failed at run time (the store refused a write, a push kept failing)."""


class DriverFencedError(UserError):
    """A newer instance opened this materialization: this one's commit is refused."""


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


# Settings ---------------------------------------------------------------------------


class DriverSettings(BaseModel):
    """The settings every driver takes; a driver's `Settings` subclasses this.
    Secrets are `SecretStr`; unknown settings are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    driver: str
    name: str | None = None  # the materialization name (its driver-checkpoint key); default: driver
    view: str | None = None  # the target of the view binding; None: no view binding
    delta: str | None = None  # the target of the delta binding; None: no delta binding
    parallelism: int = Field(default=2, ge=1, le=256)  # parts per transaction (drivers with a Sink)

    @field_validator("name", "view", "delta")
    @classmethod
    def _plain(cls, value: str | None) -> str | None:
        if value is not None and not _is_plain_name(value):
            raise ValueError(f"{value!r}: use letters, digits and '_' (start with a letter or '_')")
        return value

    @property
    def materialization(self) -> str:
        return self.name or self.driver


def _is_plain_name(value: str) -> bool:
    return bool(value) and (value[0].isalpha() or value[0] == "_") and all(c.isalnum() or c == "_" for c in value)


# The driver contract -------------------------------------------------------------------


class Driver(ABC):
    """One materialization's driver: one method per protocol message.

    The runtime calls these from the engine's Spark driver, one transaction at a
    time, in the order of the module docstring. `acknowledge` may run on another
    thread while `load` runs (Flow does not wait for Acknowledged before Load):
    a driver whose two touch the same state guards it. Every other call comes
    after the previous one returned.
    """

    pattern: ClassVar[Pattern]
    Settings: ClassVar[type[DriverSettings]] = DriverSettings

    def __init__(self, settings: DriverSettings, where: str = "outputs.materialize") -> None:
        self.settings = settings
        self.where = where  # the settings' path in the pipeline file, for error messages

    def config_error(self, setting: str, message: str) -> ConfigError:
        """A ConfigError naming the setting (`outputs.materialize[0].path: …`)."""
        return ConfigError(message, where=f"{self.where}.{setting}")

    def sink(self) -> Sink | None:
        """The driver's parallel writer, or None: then the runtime calls `store`."""
        return None

    @abstractmethod
    def open(self, request: Open) -> Opened:
        """Called first, once per runtime start (and again after the engine re-initialises
        from Kafka). Connect; create targets that are missing; fence older instances
        (remote-authoritative: bump the nonce); forget staged work the driver
        checkpoint does not name. Bad settings (a wrong DSN, a missing folder, an
        unreachable URL) fail here with `config_error(setting, …)`."""

    @abstractmethod
    def acknowledge(self, request: Acknowledge) -> Acknowledged:
        """Called after each transaction committed to Kafka, and right after `open`
        for the recovered transaction. Apply what the committed driver checkpoint
        names (recovery-log drivers), idempotently: it may already be applied."""

    @abstractmethod
    def load(self, requests: Sequence[Load]) -> list[Loaded]:
        """Called with the transaction's Loads (view bindings only; each key at most
        once per transaction), possibly before Acknowledged. Return a Loaded for each
        key the store holds, none for missing keys."""

    @abstractmethod
    def flush(self, request: Flush) -> Flushed:
        """Called once per transaction after Acknowledged and after every Load."""

    @abstractmethod
    def store(self, requests: Sequence[Store]) -> None:
        """Called after Flushed (not at all for a driver with a `sink()`): the
        transaction's Stores, view bindings first. Nothing may be visible before
        `start_commit` (push-only drivers excepted: at-least-once)."""

    @abstractmethod
    def start_commit(self, request: StartCommit) -> StartedCommit:
        """Called once per transaction after every Store, before the Kafka commit.
        Remote-authoritative: commit the rows and `request.runtime_checkpoint` in one
        store transaction, refusing (DriverFencedError) if the nonce moved.
        Recovery-log: return a driver checkpoint naming the staged work."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Called at the end (or before a re-Open); release connections. Idempotent."""


# The registry ---------------------------------------------------------------------------

DRIVERS: dict[str, str] = {
    "sqlite": "refold.connectors.sqlite:SQLiteDriver",
    "parquet": "refold.connectors.parquet:ParquetDriver",
    "webhook": "refold.connectors.webhook:WebhookDriver",
    "postgres": "refold.connectors.postgres:PostgresDriver",
}


def register_driver(name: str, target: str) -> None:
    """Name a driver class: `register_driver("mystore", "my.module:MyDriver")`."""
    DRIVERS[name] = target


def driver_class(name: str, where: str = "outputs.materialize") -> type[Driver]:
    target = DRIVERS.get(name)
    if target is None:
        raise ConfigError(f"unknown driver {name!r}; known: {', '.join(sorted(DRIVERS))}", where=f"{where}.driver")
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"driver {name!r} cannot be loaded: {exc}", where=f"{where}.driver") from exc
    cls = getattr(module, class_name)
    assert isinstance(cls, type) and issubclass(cls, Driver)
    return cls


def build_driver(settings: Mapping[str, Any], where: str = "outputs.materialize[0]") -> Driver:
    """Validate one `outputs.materialize` entry and build its driver (nothing connects yet)."""
    if not isinstance(settings, Mapping) or "driver" not in settings:
        raise ConfigError("each materialization needs a driver: setting (e.g. driver: sqlite)", where=where)
    cls = driver_class(str(settings["driver"]), where)
    try:
        parsed = cls.Settings.model_validate(dict(settings))
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            location = ".".join(str(part) for part in error["loc"])
            message = {"extra_forbidden": "unknown setting", "missing": "missing setting"}.get(
                error["type"], error["msg"]
            )
            problems.append(f"{where}.{location}: {message}" if location else f"{where}: {message}")
        raise ConfigError("; ".join(problems)) from exc
    return cls(parsed, where)


def build_drivers(entries: Sequence[Mapping[str, Any]]) -> list[Driver]:
    """Every `outputs.materialize` entry as a driver; names must be distinct."""
    drivers = [build_driver(entry, f"outputs.materialize[{i}]") for i, entry in enumerate(entries)]
    seen: set[str] = set()
    for driver in drivers:
        name = driver.settings.materialization
        if name in seen:
            raise ConfigError(f"two materializations are named {name!r}: give one a name:", "outputs.materialize")
        seen.add(name)
    return drivers

