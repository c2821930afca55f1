"""Process plumbing shared by the local servers Refold starts (`localkafka`, `localpg`,
`localspark`).

Each runs a server as a child process group on 127.0.0.1 with its files under
a home folder: they need the same answers to "does it still run", "is the port
free", "stop together with me", and the same lock so that two commands never
start or stop one home's server at once. The broker and the Spark daemons are also
started, found again and stopped the same way: a pid file, a log file the process
appends to, a command line that tells it from a process that reused its pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from refold.errors import PrerequisiteError

HOST = "127.0.0.1"
LOG_ROTATE_BYTES = 20 * 1024 * 1024


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


def wait_group_gone(pgid: int, timeout: float) -> bool:
    """Until no live process is left in group `pgid` (zombies do not count: their
    parent may never reap them); False after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    alive(pgid)  # reaps the leader if it is our exited child
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
        alive(pgid)
    return True


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of group `pgid`, from /proc."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():  # not Linux: ask the kernel about the group
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def end_group(pgid: int, timeout: float, wait: Callable[[int, float], bool] = wait_gone) -> None:
    """SIGTERM to process group `pgid`; SIGKILL when `wait` (`wait_gone`: the leader,
    `wait_group_gone`: every member) has not seen it go within `timeout` seconds."""
    signal_group(pgid, signal.SIGTERM)
    if not wait(pgid, timeout):
        kill_group(pgid, wait)


def kill_group(pgid: int, wait: Callable[[int, float], bool] = wait_gone) -> None:
    """kill -9 process group `pgid`, like a crash, and wait (10 s at most) until `wait`
    sees it gone."""
    signal_group(pgid, signal.SIGKILL)
    wait(pgid, 10.0)


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


def stop_server(base: Path, pid_file: Path, running: Callable[[], int | None], timeout: float) -> bool:
    """Stop the server of home `base` whose process group `running()` finds (under the
    home's lock): SIGTERM, SIGKILL after `timeout` seconds; removes `pid_file`. Returns
    False when none ran."""
    with locked(base):
        pid = running()
        if pid is not None:
            end_group(pid, timeout)
        pid_file.unlink(missing_ok=True)
        return pid is not None


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


def _join_cgroup(procs: Path) -> Callable[[], None]:
    """A preexec_fn that moves the child into the cgroup whose `cgroup.procs` is `procs`."""
    target = os.fsencode(procs)

    def join() -> None:
        fd = os.open(target, os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    return join


def _each(steps: list[Callable[[], None]]) -> Callable[[], None]:
    def run() -> None:
        for step in steps:
            step()

    return run


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


def spawn(
    command: Sequence[str],
    *,
    what: str,
    log_file: Path,
    pid_file: Path,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    die_with_parent: bool = False,
    cgroup: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start `command` in a process group of its own (stop and kill reach all of it),
    its stdout and stderr appended to `log_file` after a line saying that `what`
    starts, and write its pid to `pid_file`. `env`: None passes ours on.
    `die_with_parent` (Linux): it gets SIGTERM when the calling thread's process dies.
    `cgroup`: a cgroup v2 directory it starts in (before it makes a socket, so that
    its sockets carry it: `refold.dev.netpartition`)."""
    steps = [parent_death_signal(os.getpid())] if die_with_parent else []
    if cgroup is not None:
        steps.append(_join_cgroup(cgroup / "cgroup.procs"))
    with log_file.open("ab") as log:
        log.write(f"--- refold: starting {what} at {time.ctime()}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,  # where a crashing JVM writes its hs_err file
            env=dict(env) if env is not None else None,
            start_new_session=True,  # its own process group
            preexec_fn=_each(steps) if steps else None,
        )
    pid_file.write_text(f"{proc.pid}\n")
    return proc


def running_pid(pid_file: Path, marks: Iterable[str]) -> int | None:
    """The pid in `pid_file`, if that process lives and (on Linux, where a pid may have
    been reused by another program) its command line holds every one of `marks`."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if not alive(pid):
        return None
    cmdline = Path(f"/proc/{pid}/cmdline")
    if cmdline.exists():
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            return None
        if not all(mark.encode() in args for mark in marks):
            return None
    return pid


def rotate(log_file: Path) -> None:
    """Move a log over LOG_ROTATE_BYTES aside (to <name>.1, replacing the one there)."""
    with contextlib.suppress(OSError):
        if log_file.stat().st_size > LOG_ROTATE_BYTES:
            log_file.replace(log_file.with_name(log_file.name + ".1"))


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
