"""A Spark application's processes on this machine, for fault injection (`make chaos`,
the cluster tests): its executor JVMs and the Python workers under them (Linux /proc).

An executor of a standalone cluster is a JVM running
`org.apache.spark.executor.CoarseGrainedExecutorBackend … --app-id <app>`; it starts
PySpark's worker daemon (`python -m refold.spark.daemon`, which runs `pyspark.daemon`),
which forks one Python worker
per task it runs (same command line, the daemon its parent). In local mode the daemon
hangs under the driver's JVM instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from refold.dev.sparkstate import master_state

EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"
DAEMONS = ("pyspark.daemon", "refold.spark.daemon")  # the daemon's module, in its command line
_PROC = Path("/proc")


class Process(NamedTuple):
    pid: int
    args: list[str]  # the command line
    cwd: str  # the working folder ("" when unreadable)


def processes() -> Iterator[Process]:
    """Every live process this user can see (zombies left out)."""
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "stat").read_text().rpartition(")")[2].split()[0] == "Z":
                continue
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            cwd = ""
        yield Process(int(entry.name), [part.decode(errors="replace") for part in raw.split(b"\0") if part], cwd)


def parent_of(pid: int) -> int | None:
    try:
        fields = (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1])


def application_id(ui_port: int, name: str) -> str | None:
    """The id of the running application called `name` (the master's UI lists it)."""
    view = master_state(ui_port) or {}
    for app in view.get("activeapps", []):
        if app.get("name") == name:
            return str(app.get("id"))
    return None


def executors(app_id: str, work: Path | None = None) -> dict[int, str]:
    """The executor JVMs of the application `app_id`: pid -> the worker whose work
    folder it runs in (`<work>/worker-<i>/<app>/<executor>`; "" when not under `work`).
    With `work` (a cluster's work folder) only that cluster's executors."""
    found: dict[int, str] = {}
    for proc in processes():
        args = proc.args
        if EXECUTOR_CLASS not in args or "--app-id" not in args or args[args.index("--app-id") + 1:][:1] != [app_id]:
            continue
        inside = work is not None and proc.cwd.startswith(f"{work}{os.sep}")
        if work is None or inside:
            found[proc.pid] = Path(proc.cwd).parent.parent.name if inside else ""
    return found


def python_workers(under: int) -> list[int]:
    """The Python workers (forked by PySpark's daemon, each running a task or idle)
    among the descendants of `under` (an executor JVM, or a local-mode driver)."""
    table = {proc.pid: proc.args for proc in processes()}
    parents = {pid: parent_of(pid) for pid in table}

    def pyspark(pid: int | None) -> bool:
        return pid is not None and any(part in DAEMONS for part in table.get(pid, []))

    def descends(pid: int) -> bool:
        seen = 0
        current: int | None = pid
        while current is not None and current > 1 and seen < 64:
            if current == under:
                return True
            current = parents.get(current)
            seen += 1
        return False

    return sorted(pid for pid in table if pyspark(pid) and pyspark(parents.get(pid)) and descends(pid))


def kill(pids: list[int]) -> int:
    """SIGKILL each; how many were still there."""
    killed = 0
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed
