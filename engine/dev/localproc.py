"""Process plumbing shared by the local servers Refold starts (`localkafka`, `localpg`).

Both run a server as a child process group on 127.0.0.1 with its files under
a home folder: they need the same answers to "does it still run", "is the port
free", "stop together with me", and the same lock so that two commands never
start or stop one home's server at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from refold.errors import PrerequisiteError

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def alive(pid: int) -> bool:
    """Whether `pid` runs (reaping it first if it is our own exited child)."""
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: ask the system below
    else:
        # Our child: waitpid reports it only once every thread is gone (a JVM's main
        # thread may look like a zombie while the others still hold its sockets).
        return waited != pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
            return False  # a zombie: exited, not yet reaped by its parent
    return True


def signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def wait_gone(pid: int, timeout: float) -> bool:
    """Until `pid` has exited; False when it still runs after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@contextlib.contextmanager
def locked(base: Path) -> Iterator[None]:
    """Serialize start/stop/kill of one home's server across processes."""
    base.mkdir(parents=True, exist_ok=True)
    with (base / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def bindable(port: int, wait: float = 0.0) -> bool:
    """Whether a server could listen on `port` now (or within `wait` seconds)."""
    deadline = time.monotonic() + wait
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((HOST, port))
            except OSError:
                if time.monotonic() >= deadline:
                    return False
            else:
                return True
        time.sleep(0.1)


def listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return False
    return True


def parent_death_signal(parent: int, sig: signal.Signals = signal.SIGTERM) -> Callable[[], None]:
    """A preexec_fn that makes the child get `sig` when `parent` dies (Linux only)."""
    import ctypes
    import ctypes.util

    try:  # loaded here, before the fork: the child only calls it
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").prctl
    except (OSError, AttributeError):
        return lambda: None

    def arm() -> None:
        prctl(1, int(sig))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), sig)

    return arm


def tail(log_file: Path, lines: int = 25) -> str:
    """The last lines of a server's log, for error messages."""
    try:
        text = log_file.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def say(quiet: bool, message: str) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


class ServerStartError(PrerequisiteError):
    """A local server (the broker, PostgreSQL) did not come up. Keeps its log file and
    the log's last lines."""

    def __init__(self, message: str, *, log_file: Path, log_tail: str) -> None:
        self.log_file = log_file
        self.log_tail = log_tail
        super().__init__(f"{message}; the end of {log_file}:\n{log_tail}")
