"""`ShardStore`: one state shard's `P.state` records in RocksDB on local disk, and
the stamp that says how far they are valid.

The store holds what partition p of `P.state` holds, read as a compacted topic is:
the latest value of each record key, a tombstone deleting it. Beside them, under
`STAMP_KEY` (which no `P.state` record key can equal: those are JSON arrays, so
they start with `[`), the `Stamp`: the committed checkpoint the records are exactly
as of, and the partition offset up to which they hold everything. Records and stamp
change together, in one write batch (`apply`).

Who writes, and when: the engine, after `commit_transaction` returned, with the
committed checkpoint's stamp (so the store is never ahead of Kafka); and
`refold.state.shard`, catching up from `P.state`. One process at a time: `open`
takes the shard's lock file (`<shard>.lock`, an flock the kernel drops when its
holder dies, even by kill -9) and waits for it up to a deadline; RocksDB's own
`LOCK` is never contended behind it. A process that keeps a store open between
batches (a shard host, `refold.spark.hosts`) lets go of it when another one asks:
a waiter touches `<shard>.want` while it waits (`wanted`). The store is a cache of
Kafka: a directory RocksDB cannot open is wiped and rebuilt from `P.state`, never
repaired.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import re
import shutil
import socket
import time
import weakref
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import orjson
from rocksdict import BlockBasedOptions, Cache, Options, Rdict, WriteBatch

from refold import environment
from refold.errors import InternalError, OperationalError, UserError

log = logging.getLogger(__name__)

STAMP_KEY = b"\x00refold.stamp"  # sorts before every `[`-key: scans from `[` never meet it
RECORD_FIRST = b"["  # every `P.state` record key starts with it (`refold.reduce.statecodec`)
VIEW_RECORD_FIRST = b"[["  # a view key's records (`[key]`, `[key, fp]`); an upsert source's last rows are `["u",…]`

CACHE_BYTES = 64 << 20  # RocksDB's block cache, shared by every store of a process
WRITE_BUFFER_BYTES = 16 << 20  # per store; at most two of them (memtables) in memory
_LOCK_POLL_SECONDS = (0.02, 0.5)  # the first and the longest wait between tries
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")  # as refold.config's pipeline names


@dataclass(frozen=True, slots=True)
class Stamp:
    """How far a store is valid. `batch`: the committed checkpoint's `batch` (batches
    this writer has committed) whose state the store holds exactly; -1 while a restore
    is under way. `state_end`: the `P.state` partition offset up to which the store
    holds every record (the next offset to read when catching up). `checkpoint_at`:
    that checkpoint's `committed_at` (epoch ms), so a store of another run that reached
    the same batch number (a pipeline recreated under its name) never passes as
    current; 0 while catching up."""

    batch: int
    state_end: int
    checkpoint_at: int = 0


@dataclass(frozen=True, slots=True)
class ShardId:
    """Whose state: one writer's shard of one pipeline (shard p = `P.state` partition p)."""

    pipeline: str
    writer: str
    shard: int

    def __post_init__(self) -> None:
        for what in (self.pipeline, self.writer):
            if not _NAME.match(what):
                raise UserError(f"{what!r} cannot name a state directory (letters, digits, '.', '_', '-')")
        if self.shard < 0:
            raise UserError(f"shard {self.shard} is not a partition number")

    def directory(self, root: Path) -> Path:
        """`<root>/<pipeline>/<writer>/<shard>`: the RocksDB directory."""
        return root / self.pipeline / self.writer / str(self.shard)

    def __str__(self) -> str:
        return f"shard {self.shard} of pipeline {self.pipeline!r} (writer {self.writer!r})"


def default_root() -> Path:
    """Where stores live unless the caller says otherwise: `<Refold home>/state`."""
    return environment.home() / "state"


class StoreLocked(OperationalError):
    """Another process (another attempt of this shard's task, most likely one that was
    fenced or is still finishing) kept the shard's store for longer than the deadline."""

    def __init__(self, directory: Path, shard: ShardId, waited: float, holder: str) -> None:
        self.directory = directory
        self.shard = shard
        self.holder = holder
        super().__init__(
            f"the state store {directory} of {shard} is held by another process ({holder or 'unknown'}), "
            f"most likely another attempt of this shard's task; gave up after {waited:.1f}s"
        )


class ShardStore:
    """One shard's records and stamp (see the module's docstring). Open it with `open`,
    and close it (it is a context manager): until then no other process can open it.
    Not thread-safe: one thread drives a store."""

    def __init__(self, shard: ShardId, directory: Path, lock: IO[str], cache_bytes: int) -> None:
        self.shard = shard
        self.directory = directory
        self.reset_reason: str | None = None  # set when `open` found the directory unusable
        self._lock: IO[str] | None = lock
        self._options = _options(cache_bytes)
        self._db: Rdict | None = None
        self._scans: weakref.WeakSet[Generator[Any, None, None]] = weakref.WeakSet()
        self.stamp: Stamp | None = None
        self.stamped_at: int | None = None  # epoch ms when the stamp was written

    @classmethod
    def open(
        cls, shard: ShardId, root: Path | None = None, *, lock_timeout: float = 60.0, cache_bytes: int = CACHE_BYTES
    ) -> ShardStore:
        """Take the shard's lock (waiting up to `lock_timeout` seconds, then StoreLocked)
        and open its RocksDB directory, creating it when missing. A directory RocksDB
        cannot open, or whose stamp does not decode, is wiped (`reset_reason` says why)."""
        directory = shard.directory(root if root is not None else default_root())
        directory.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + lock_timeout
        lock = _take_lock(directory, shard, deadline, lock_timeout)
        store = cls(shard, directory, lock, cache_bytes)
        try:
            store._open_db(deadline, lock_timeout)
        except BaseException:
            store.close()
            raise
        return store

    def _open_db(self, deadline: float, lock_timeout: float) -> None:
        try:
            self._db = _open_rocksdb(self.directory, self._options, self.shard, deadline, lock_timeout)
        except _Unreadable as exc:
            self._reset(f"RocksDB cannot open it: {exc}")
        try:
            self._read_stamp()
        except (ValueError, TypeError, KeyError) as exc:
            self._reset(f"its stamp is unreadable: {exc}")

    def _reset(self, reason: str) -> None:
        """Wipe the directory (under the shard's lock) and start empty."""
        log.warning("state store %s of %s: %s; wiping it (it is rebuilt from Kafka)", self.directory, self.shard, reason)
        self.reset_reason = reason
        self.clear()

    def _read_stamp(self) -> None:
        raw = self._rdb().get(STAMP_KEY)
        if raw is None:
            self.stamp = self.stamped_at = None
            return
        fields = orjson.loads(raw)
        self.stamp = Stamp(int(fields["batch"]), int(fields["state_end"]), int(fields.get("checkpoint_at", 0)))
        self.stamped_at = int(fields["at"])

    # Writing ----------------------------------------------------------------------------

    def apply(self, changes: Iterable[tuple[bytes, bytes | None]], stamp: Stamp) -> None:
        """Write `P.state` records (a value None deletes its key) and the stamp, in one
        write batch: all of it lands, or none of it. The stamp never goes back (`clear`
        first to start over); InternalError when it would, or when a key is not a
        `P.state` record key."""
        current = self.stamp
        if current is not None and (stamp.batch < current.batch or stamp.state_end < current.state_end):
            raise InternalError(f"state store of {self.shard}: stamp {stamp} is behind its stamp {current}")
        batch = WriteBatch(raw_mode=True)
        for key, value in changes:
            if key[:1] != RECORD_FIRST:
                raise InternalError(f"state store of {self.shard}: {key[:60]!r} is not a P.state record key")
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)
        now = int(time.time() * 1000)
        batch.put(STAMP_KEY, orjson.dumps(
            {"batch": stamp.batch, "state_end": stamp.state_end, "checkpoint_at": stamp.checkpoint_at, "at": now}
        ))
        self._rdb().write(batch)
        self.stamp, self.stamped_at = stamp, now

    def clear(self) -> None:
        """Delete every record and the stamp: the directory is removed and made again
        (the shard's lock, outside it, is held throughout)."""
        self._close_db()
        shutil.rmtree(self.directory, ignore_errors=True)
        if self.directory.exists():
            raise OperationalError(f"cannot remove the state store {self.directory}")
        self._db = Rdict(str(self.directory), self._options)
        self.stamp = self.stamped_at = None

    # Reading ----------------------------------------------------------------------------

    @property
    def wanted(self) -> bool:
        """Another process waits for this store (its `<shard>.want` file exists): a holder
        that keeps it open between batches closes it."""
        return _want_file(self.directory).exists()

    def records_of(self, key_json: bytes) -> list[tuple[bytes, bytes]]:
        """Every record of one view key (`key_json` = `key_bytes(key)`): its summary
        `[key]` and its rows `[key, fp]`, by record key."""
        return self.load_keys((key_json,))

    def get_many(self, record_keys: Iterable[bytes]) -> list[tuple[bytes, bytes]]:
        """(record key, value) of those of `record_keys` the store has (a table
        source's last rows, `refold.runtime.tables`: one record per key, no prefix scan)."""
        rdb = self._rdb()
        found = ((key, rdb.get(key)) for key in record_keys)
        return [(key, value) for key, value in found if value is not None]

    def load_keys(self, key_jsons: Iterable[bytes]) -> list[tuple[bytes, bytes]]:
        """Every record of each view key, ordered by record key: what a reducer's
        `restore` takes to hold exactly these keys. One iterator, seeking forward
        key by key (the keys are sorted first)."""
        out: list[tuple[bytes, bytes]] = []
        it = self._rdb().iter()
        try:
            for key_json in sorted(set(key_jsons)):
                # `[` + a complete JSON array: no other key's records share this prefix
                prefix = RECORD_FIRST + key_json
                it.seek(prefix)
                while it.valid():
                    record_key = it.key()
                    if not record_key.startswith(prefix):
                        break
                    out.append((record_key, it.value()))
                    it.next()
        finally:
            del it  # an open iterator keeps RocksDB (and its LOCK) alive
        return out

    def items(self, prefix: bytes = RECORD_FIRST) -> Iterator[tuple[bytes, bytes]]:
        """Every record whose key starts with `prefix` (default: all of them; a view's
        reducer state: `VIEW_RECORD_FIRST`), by record key, the stamp left out. A scan
        still open when the store closes is ended first."""
        scan = self._scan(prefix)
        self._scans.add(scan)
        return scan

    def _scan(self, prefix: bytes) -> Generator[tuple[bytes, bytes], None, None]:
        it = self._rdb().iter()
        try:
            it.seek(prefix)
            while it.valid():
                key = it.key()
                if not key.startswith(prefix):
                    break
                yield key, it.value()
                it.next()
        finally:
            del it

    def count(self) -> int:
        """How many records the store holds (a full scan)."""
        return sum(1 for _ in self.items())

    # Lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close RocksDB and let go of the shard's lock. Idempotent."""
        self._close_db()
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.close()  # drops the flock

    def _close_db(self) -> None:
        for scan in list(self._scans):
            scan.close()
        db, self._db = self._db, None
        if db is not None:
            db.close()
            del db

    def _rdb(self) -> Rdict:
        if self._db is None:
            raise InternalError(f"the state store of {self.shard} is closed")
        return self._db

    def __enter__(self) -> ShardStore:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


# RocksDB -------------------------------------------------------------------------------


@functools.cache
def _block_cache(size: int) -> Cache:
    return Cache(size)


def _options(cache_bytes: int) -> Options:
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    options.set_write_buffer_size(WRITE_BUFFER_BYTES)
    options.set_max_write_buffer_number(2)
    options.set_keep_log_file_num(2)
    table = BlockBasedOptions()
    table.set_block_cache(_block_cache(cache_bytes))
    options.set_block_based_table_factory(table)
    return options


class _Unreadable(Exception):
    """RocksDB refused to open a directory for a reason other than its lock."""


def _open_rocksdb(directory: Path, options: Options, shard: ShardId, deadline: float, waited_for: float) -> Rdict:
    """Open, retrying while RocksDB's own LOCK is held (only a process that skipped the
    shard's lock file can hold it). _Unreadable for any other refusal."""
    pause = _LOCK_POLL_SECONDS[0]
    while True:
        try:
            return Rdict(str(directory), options)
        except Exception as exc:  # rocksdict raises plain Exception("IO error: ...")
            text = str(exc)
            if "LOCK" not in text:
                raise _Unreadable(text) from exc
            if time.monotonic() >= deadline:
                raise StoreLocked(directory, shard, waited_for, f"RocksDB: {text}") from exc
        time.sleep(pause)
        pause = min(pause * 2, _LOCK_POLL_SECONDS[1])


def _want_file(directory: Path) -> Path:
    return directory.with_name(directory.name + ".want")


def _take_lock(directory: Path, shard: ShardId, deadline: float, waited_for: float) -> IO[str]:
    """The shard's lock file, flocked; its content names the holder (for messages).
    While it waits, `<shard>.want` says so to a holder that keeps the store open
    (touched again at every try: another waiter that got the lock removed it)."""
    path = directory.with_name(directory.name + ".lock")
    want = _want_file(directory)
    handle = open(path, "a+")  # noqa: SIM115 (held until the store closes)
    pause = _LOCK_POLL_SECONDS[0]
    waiting = False
    try:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            want.touch()
            waiting = True
            if time.monotonic() >= deadline:
                handle.seek(0)
                raise StoreLocked(directory, shard, waited_for, handle.read().strip())
            time.sleep(pause)
            pause = min(pause * 2, _LOCK_POLL_SECONDS[1])
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}")
        handle.flush()
    except BaseException:
        with contextlib.suppress(OSError):
            handle.close()
        raise
    finally:
        if waiting:
            with contextlib.suppress(OSError):
                want.unlink(missing_ok=True)
    return handle

