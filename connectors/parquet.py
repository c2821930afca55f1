"""Parquet files: pattern recovery log with idempotent apply (pyarrow).

- Writers (`ParquetWriter`, on Spark executors) stage each part of a transaction
  as a uniquely named file under `<path>/_staging/<pipeline>-<materialization>-<writer>/`
  (the writer: `<writer>-<shard>`, one folder per shard): nothing a reader looks at.
- `StartCommit` returns a driver checkpoint naming every staged file and the name
  it will have once applied; it commits to Kafka with the batch.
- `Acknowledge` (after the Kafka commit) applies: an atomic rename into
  `<path>/<target>/`. Applying again is a no-op (the file is already there), so
  `Open` + `Acknowledge` after a crash re-apply what the committed checkpoint
  names, and `Open` deletes staged files it does not name (a crashed or fenced
  instance's), which are never applied.

Applied file names sort in commit order: `<batch>-<I|F>-<part>-<id>@<writer>.parquet`
(`F`: a full refresh, which replaces everything its writer, i.e. its shard, applied
before it; files without `@` are from before shards). Shards own disjoint keys, so
their files fold in any order between them. A view file holds
`_key` (JSON list), the typed key columns, `_doc` (the row as JSON), `_deleted`
and `_batch`; a delta file the same without `_deleted`. `read_parquet_view`
folds a view folder into its rows; `read_parquet_deltas` lists delta rows.

    outputs:
      materialize:
        - {driver: parquet, path: out/, view: scores, delta: scores_delta}
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from refold.connectors.protocol import (
    Acknowledge,
    Acknowledged,
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
    by_binding,
)
from refold.connectors.settings import ParquetSettings

STAGING = "_staging"
Applied = list[str]  # [target, staged name, applied name]: one file of a committed batch


class ParquetWriter(SinkWriter):
    """Stages one part as one file per binding (picklable: it holds paths only)."""

    def __init__(self, root: str, compression: str) -> None:
        self.root = root
        self.compression = compression

    def prepare(self, txn: TxnInfo, part: int, stores: Sequence[Store]) -> CommitInfo:
        staging = Path(self.root) / STAGING / _staging_name(txn.pipeline, txn.materialization, txn.writer)
        staged: list[tuple[int, str]] = []
        grouped = by_binding(stores)
        for index, items in sorted(grouped.items()):
            binding = txn.bindings[index]
            name = f"{txn.batch:012d}-{part:04d}-{index}-{uuid.uuid4().hex[:12]}.parquet"
            _write(staging / name, _table(binding, items, txn.batch), self.compression)
            staged.append((index, name))
        return CommitInfo(part, len(stores), staged)

    def abort(self, infos: Sequence[CommitInfo]) -> None:
        for info in infos:
            for _index, name in info.data:
                for found in Path(self.root).glob(f"{STAGING}/*/{name}"):
                    found.unlink(missing_ok=True)


@dataclass
class _Session:
    """What exists between `open` and `close`. `lock` guards it: `acknowledge` runs on
    another thread while `load` and `start_commit` run."""

    bindings: tuple[Binding, ...]
    owner: str  # the shard's writer, `<writer>-<shard>`
    staging: Path  # <path>/_staging/<pipeline>-<materialization>-<owner>
    committed: list[Applied]  # the files of the last commit Kafka holds
    rows: dict[int, dict[Key, Row]]  # view bindings: the rows as of the last StartCommit
    committing: list[Applied] | None = None  # of the StartCommit not yet acknowledged
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        """Nothing to release: every file is closed once written."""


class ParquetDriver(SessionDriver[ParquetSettings, _Session]):
    pattern: ClassVar[Pattern] = "recovery_log_idempotent_apply"
    store_errors: ClassVar[tuple[type[Exception], ...]] = (OSError, pa.ArrowException)

    @property
    def root(self) -> Path:
        return Path(self.settings.path).expanduser()

    def sink(self) -> Sink:
        return Sink(ParquetWriter(str(self.root), self.settings.compression))

    def open(self, request: Open) -> Opened:
        root = self.root
        if not root.is_dir():
            raise self.config_error("path", f"the folder {str(root)!r} does not exist")
        staging = root / STAGING / _staging_name(request.pipeline, request.materialization, request.writer)
        staging.mkdir(parents=True, exist_ok=True)
        for binding in request.bindings:
            (root / binding.target).mkdir(exist_ok=True)
        checkpoint = orjson.loads(request.driver_checkpoint) if request.driver_checkpoint else {"files": []}
        committed: list[Applied] = checkpoint["files"]
        named = {staged for _target, staged, _final in committed}
        for leftover in staging.iterdir():  # a crashed or fenced instance's work: never applied
            if leftover.name not in named:
                leftover.unlink(missing_ok=True)
        rows = {}
        for index, binding in enumerate(request.bindings):
            if binding.kind == "view":
                # the applied files, then the committed ones not applied yet (by applied name)
                files = [(f.name, f) for f in _applied(root / binding.target)]
                files += [(final, staging / staged) for target, staged, final in committed
                          if target == binding.target and (staging / staged).exists()]
                rows[index] = fold_view_files(_since_refresh(files, request.writer))
        self._session = _Session(request.bindings, request.writer, staging, committed, rows)
        return Opened(None)

    def acknowledge(self, request: Acknowledge) -> Acknowledged:
        txn = self.opened()
        with txn.lock:
            if txn.committing is not None:
                txn.committed, txn.committing = txn.committing, None
            files = list(txn.committed)
        for target, staged, final in files:
            source, dest = txn.staging / staged, self.root / target / final
            if source.exists():
                os.replace(source, dest)  # atomic; once applied, the source is gone
            elif not dest.exists():
                raise DriverError(f"parquet: staged file {staged!r} of the committed batch is missing")
        for target in {target for target, _, _ in files}:
            _fsync_dir(self.root / target)
        return Acknowledged()

    def load(self, requests: Sequence[Load]) -> list[Loaded]:
        txn = self.opened()
        with txn.lock:
            found = []
            for request in requests:
                row = txn.rows.get(request.binding, {}).get(request.key)
                if row is not None:
                    found.append(Loaded(request.binding, request.key, row))
            return found

    def start_commit(self, request: StartCommit) -> StartedCommit:
        txn = self.opened()
        batch = request.runtime_checkpoint.batch
        kind = "F" if request.full_refresh else "I"
        staged: list[tuple[int, str]] = [item for info in request.prepared for item in info.data]
        if request.full_refresh:  # an empty view still needs its file: it resets the folder
            for index, binding in enumerate(txn.bindings):
                if binding.kind == "view" and not any(i == index for i, _ in staged):
                    name = f"{batch:012d}-0000-{index}-{uuid.uuid4().hex[:12]}.parquet"
                    _write(txn.staging / name, _table(binding, [], batch), self.settings.compression)
                    staged.append((index, name))
        files = []
        for index, name in staged:
            binding = txn.bindings[index]
            _, part, _, ident = name[: -len(".parquet")].split("-")
            files.append([binding.target, name, f"{batch:012d}-{kind}-{part}-{index}-{ident}@{txn.owner}.parquet"])
        with txn.lock:
            for index, binding in enumerate(txn.bindings):
                if binding.kind != "view":
                    continue
                mine = [txn.staging / name for i, name in staged if i == index]
                rows = {} if request.full_refresh else txn.rows.setdefault(index, {})
                txn.rows[index] = fold_view_files(mine, rows)
            txn.committing = files
        return StartedCommit(orjson.dumps({"batch": batch, "files": files}))



# Files -------------------------------------------------------------------------------------


def _table(binding: Binding, stores: Sequence[Store], batch: int) -> pa.Table:
    columns: dict[str, Any] = {"_key": [orjson.dumps(list(s.key), default=str).decode() for s in stores]}
    keys = {name: [s.key[i] for s in stores] for i, name in enumerate(binding.key)}
    for name, values in keys.items():
        try:
            pa.array(values)
            columns[name] = values
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            columns[name] = [orjson.dumps(v).decode() for v in values]  # mixed types: as JSON
    columns["_doc"] = [None if s.doc is None else orjson.dumps(s.doc).decode() for s in stores]
    if binding.kind == "view":
        columns["_deleted"] = [s.delete for s in stores]
    columns["_batch"] = [batch] * len(stores)
    schema_types = {"_key": pa.string(), "_doc": pa.string(), "_deleted": pa.bool_(), "_batch": pa.int64()}
    arrays = {
        name: pa.array(values, type=schema_types.get(name)) if name in schema_types else pa.array(values)
        for name, values in columns.items()
    }
    return pa.table(arrays)


def _write(path: Path, table: pa.Table, compression: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    pq.write_table(table, temporary, compression=compression)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _applied(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.parquet")) if folder.is_dir() else []


def fold_view_files(files: Iterable[Path], rows: dict[Key, Row] | None = None) -> dict[Key, Row]:
    """Fold view files in order into rows by key: later rows win, deletes remove."""
    out: dict[Key, Row] = {} if rows is None else rows
    for path in files:
        table = pq.read_table(path, columns=["_key", "_doc", "_deleted"])
        for key_json, doc, deleted in zip(
            table.column("_key").to_pylist(), table.column("_doc").to_pylist(), table.column("_deleted").to_pylist(),
            strict=True,
        ):
            key = tuple(orjson.loads(key_json))
            if deleted:
                out.pop(key, None)
            else:
                out[key] = orjson.loads(doc)
    return out


def _staging_name(pipeline: str, materialization: str, writer: str) -> str:
    return f"{pipeline}-{materialization}-{writer}"


def _owner(name: str) -> str:
    """The writer (shard) that applied a file: after `@`; '' for files from before shards."""
    stem = name.removesuffix(".parquet")
    return stem.rsplit("@", 1)[1] if "@" in stem else ""


def _since_refresh(files: list[tuple[str, Path]], only: str | None = None) -> list[Path]:
    """(applied name, where to read) in commit order, each writer's (shard's) from its
    last full refresh's batch on; with `only`, that writer's files alone."""
    files = sorted(f for f in files if only is None or _owner(f[0]) == only)
    refreshed: dict[str, str] = {}
    for name, _ in files:
        if name.split("-")[1] == "F":
            refreshed[_owner(name)] = name.split("-")[0]
    return [path for name, path in files if name.split("-")[0] >= refreshed.get(_owner(name), "")]


def read_parquet_view(path: str | Path, target: str) -> dict[Key, Row]:
    """The materialized view in `<path>/<target>/`: its applied files folded, from the
    last full refresh on."""
    return fold_view_files(_since_refresh([(f.name, f) for f in _applied(Path(path) / target)]))


def read_parquet_deltas(path: str | Path, target: str) -> list[Row]:
    """Every applied delta row in `<path>/<target>/`, in commit order."""
    rows: list[Row] = []
    for file in _applied(Path(path) / target):
        rows += [orjson.loads(doc) for doc in pq.read_table(file, columns=["_doc"]).column("_doc").to_pylist()]
    return rows
