"""Shard hosts: each shard's processor in a process of its own beside the executor's
Python workers, so that a shard stays warm whichever worker Spark gives its task.

An executor runs several Python workers (one per core), and Spark gives a task to any
idle one: with 4 shards on 2 workers a shard moved to the other worker about every
second batch, and each move cost a new processor (a transactional producer fenced and
initialised, the checkpoint read, the store opened) and a reload of every key the
batch touched, from the store: 30-50 % of the workers' CPU at a 1 s trigger
(measured; docs/PERFORMANCE.md). So a task no longer reduces in its worker.
It hands each shard's records (Arrow, as Spark gave them) to the shard's host over a
Unix socket and relays the host's summary back. The host keeps the processor between
batches exactly as a worker kept it (`refold.spark.tasks`: `resume` still checks the
store's stamp first, so a host is a speed-up only, never trusted).

A host is keyed by its executor (the workers' daemon), the pipeline, the writer and
the shard: `/tmp/refold-hosts-<uid>/<digest>.sock`, in a directory only this user
can enter (requests are pickles). The first task that finds no host forks one from
its worker (every module already imported: a host listens within milliseconds),
holding `<socket>.spawn`'s flock so that two workers never start two; it is named
`refold-host` (`/proc/<pid>/comm`). A host serves one request at a time (a shard's tasks come
one after another; a second attempt waits its turn, and skips what the first
committed). It exits after `KEPT_IDLE_SECONDS` without a request, and at once when
its executor's daemon is gone (a watchdog thread waits on the daemon's pidfd, which
the daemon's end and its kill -9 alike make readable), removing its socket and spawn
file on the way. `refold.spark.daemon` makes the daemon its workers'
subreaper, and the host is forked through a middle process that exits at once, so
each host is the daemon's child, under the executor's process tree.

A host also keeps its shards' stores open between batches. A worker that closed its
shard's store after every batch, so that another worker could take it, made each open
replay RocksDB's log and flush it as one more level-0 file, and the compactions that would merge them were cut short by the next close: at a 1 s
trigger a shard's store had 16 level-0 files after a minute, and the shards' CPU per
event doubled (docs/PERFORMANCE.md). A process that waits for a store a host holds
(another executor's host on the same machine, a tool) says so in `<shard>.want`
(`ShardStore.wanted`); the host lets go of it within `WANT_POLL_SECONDS` when idle, after
its current batch otherwise.

A host that dies mid-batch (a crash, a kill -9) fails the task that waits on it,
with a plain error, and Spark runs the task again, which starts a new host: as a
worker killed mid-batch did. `REFOLD_SHARD_HOSTS=0` in the executors' environment
runs the shards in the Python workers themselves.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pickle
import select
import signal
import socket
import struct
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

    from refold.spark.tasks import ShardTask

_LENGTH = struct.Struct(">Q")


def hosting() -> bool:
    """This process is a shard host: it keeps its shards' stores open between batches."""
    return _HOSTING


_HOSTING = False
WANT_POLL_SECONDS = 0.25  # how soon an idle host lets go of a store another process waits for


def enabled() -> bool:
    """Whether this task's shards run in hosts: inside a Spark task (a PySpark worker),
    unless `REFOLD_SHARD_HOSTS=0`."""
    if os.environ.get("REFOLD_SHARD_HOSTS", "1") == "0":
        return False
    from pyspark import TaskContext

    return TaskContext.get() is not None


def socket_path(key: tuple[str, str, int], state_root: str) -> Path:
    """The host's socket for this executor (the worker's daemon), shard and state root."""
    folder = Path(tempfile.gettempdir()) / f"refold-hosts-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    found = folder.stat()
    if found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise PermissionError(f"{folder} is not this user's alone; shard hosts need it to be")
    name = f"{os.getppid()}\0{key[0]}\0{key[1]}\0{key[2]}\0{os.path.realpath(state_root)}"
    return folder / (hashlib.sha256(name.encode()).hexdigest()[:24] + ".sock")


def run_hosted(path: Path, task: ShardTask, index: int, table: pa.Table | None, attempt: int) -> pa.RecordBatch:
    """The shard's summary from its host (started first when there is none)."""
    request = pickle.dumps((task, index, table, attempt), protocol=pickle.HIGHEST_PROTOCOL)
    with _connected(path) as conn:
        _send(conn, request)
        status, payload = pickle.loads(_receive(conn, path))
    if status != "ok":
        raise RuntimeError(f"shard {index}'s host failed: {payload}")
    batch: pa.RecordBatch = payload
    return batch


@contextlib.contextmanager
def _connected(path: Path) -> Any:
    conn = _connect(path)
    if conn is None:
        with _spawn_lock(path):  # one starter at a time
            conn = _connect(path) or _start(path)
    try:
        yield conn
    finally:
        conn.close()


@contextlib.contextmanager
def _spawn_lock(path: Path, wait: float | None = None) -> Any:
    """The flock of `<socket>.spawn` (the file the path names when locked: a host that
    leaves removes it under the lock). Raises TimeoutError after `wait` seconds."""
    name = f"{path}.spawn"
    deadline = None if wait is None else time.monotonic() + wait
    while True:
        spawn = open(name, "a")  # noqa: SIM115 (closed below, or by the with's end)
        try:
            if deadline is None:
                fcntl.flock(spawn, fcntl.LOCK_EX)
            else:
                while True:
                    try:
                        fcntl.flock(spawn, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise TimeoutError(name) from None
                        time.sleep(0.01)
            with contextlib.suppress(FileNotFoundError):
                if os.stat(name).st_ino == os.fstat(spawn.fileno()).st_ino:
                    break
        except BaseException:
            spawn.close()
            raise
        spawn.close()
    try:
        yield
    finally:
        spawn.close()


def _leave(path: Path) -> None:
    """Remove the host's socket and spawn file (under the spawn lock: no worker is
    starting a host for it meanwhile)."""
    with contextlib.suppress(TimeoutError), _spawn_lock(path, wait=2.0):
        for name in (str(path), f"{path}.spawn"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)


def _connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        conn.close()
        return None
    return conn


def _start(path: Path) -> socket.socket:
    """Fork the shard's host from this worker (which has every module imported, as the
    daemon forked it), through a middle process that exits at once: the host is
    re-parented to the daemon (its subreaper), never the worker's zombie. The host says
    on a pipe when it listens; a pipe closed without a word is a host that died."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a dead host's
    daemon = os.getppid()
    ready_r, ready_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        _become_host(path, daemon, ready_w)  # never returns
    os.close(ready_w)
    try:
        os.waitpid(middle, 0)
        said = os.read(ready_r, 1)
    finally:
        os.close(ready_r)
    conn = _connect(path) if said == b"1" else None
    if conn is None:
        raise RuntimeError(f"the shard host for {path.name} ended as it started (its error is in the executor's log)")
    return conn


def _become_host(path: Path, daemon: int, ready: int) -> None:
    code = 0
    try:
        if os.fork() != 0:
            os._exit(0)  # the middle process
        os.closerange(3, ready)  # the worker's sockets to Spark, and the rest
        os.closerange(ready + 1, 1 << 20)
        _name(b"refold-host")
        serve(path, daemon, ready)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)  # never the worker's exit handlers


def _name(name: bytes) -> None:
    """This process's name (`/proc/<pid>/comm`: what ps and the benches' samplers show)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME


def _send(conn: socket.socket, data: bytes) -> None:
    conn.sendall(_LENGTH.pack(len(data)))
    conn.sendall(data)


def _receive(conn: socket.socket, path: Path) -> bytes:
    head = _exactly(conn, _LENGTH.size, path)
    return _exactly(conn, _LENGTH.unpack(head)[0], path)


def _exactly(conn: socket.socket, size: int, path: Path) -> bytes:
    out = bytearray(size)
    view, got = memoryview(out), 0
    while got < size:
        n = conn.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError(f"the shard host {path.name} closed the connection mid-batch (it died?)")
        got += n
    return bytes(out)


# The host ------------------------------------------------------------------------------


def serve(path: Path, daemon: int, ready: int) -> None:
    """Answer requests on `path` until idle for `KEPT_IDLE_SECONDS` or the daemon is gone;
    `ready`: a pipe to say "1" on once listening."""
    from refold.spark.tasks import KEPT_IDLE_SECONDS, close_kept, release_wanted, run_request

    global _HOSTING
    _HOSTING = True

    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the daemon's at its shutdown: the watchdog ends the host
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _watch(daemon, path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    listener.settimeout(WANT_POLL_SECONDS)
    os.write(ready, b"1")
    os.close(ready)
    _sweep(path)
    last = time.monotonic()
    try:
        while time.monotonic() - last < KEPT_IDLE_SECONDS:
            release_wanted()
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(None)
                try:
                    task, index, table, attempt = pickle.loads(_receive(conn, path))
                    answer: tuple[str, Any] = ("ok", run_request(task, index, table, attempt))
                except Exception:  # the task fails with it; Spark runs it again
                    answer = ("error", traceback.format_exc(limit=20))
                with contextlib.suppress(OSError):  # the waiting worker may be gone
                    _send(conn, pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
            last = time.monotonic()
    finally:
        _leave(path)
        listener.close()
        close_kept()


def _sweep(own: Path) -> None:
    """Remove what hosts killed with -9 left beside `own`: sockets nothing listens on,
    whose spawn lock is free (a host being started holds its starter's lock until it
    listens)."""
    for spawn in own.parent.glob("*.sock.spawn"):
        path = spawn.with_suffix("")
        if path == own:
            continue
        with contextlib.suppress(TimeoutError, OSError), _spawn_lock(path, wait=0.0):
            conn = _connect(path)
            if conn is not None:
                conn.close()
                continue
            for name in (path, spawn):
                with contextlib.suppress(FileNotFoundError):
                    name.unlink()


def _watch(daemon: int, path: Path) -> None:
    """End this process (at once, even mid-batch: Kafka aborts what is open) when the
    executor's daemon is gone."""
    try:
        fd = os.pidfd_open(daemon)
    except ProcessLookupError:
        _leave(path)
        os._exit(0)

    def wait() -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not poller.poll(60_000):
            pass
        _leave(path)
        os._exit(0)

    threading.Thread(target=wait, name="refold-host-watchdog", daemon=True).start()
