"""A real local Spark standalone cluster: one master and N workers on 127.0.0.1.

For running the engine on a cluster rather than `local[N]`, and for fault tests
(kill -9 one worker while a job runs). `refold spark start|stop|status`.
The daemons come from the installed pyspark itself (`<pyspark>/bin/spark-class`
with the master's and the worker's main classes, `refold.dev.sparkdaemons`), so the
cluster runs exactly the Spark version of the driver. Everything lives under `<home>/spark/` (home:
`refold.environment.home()`, i.e. `.refold/`, or the `home` argument):

    conf/spark-defaults.conf   the daemons' settings (their SPARK_CONF_DIR: the caller's
                               SPARK_* variables and Spark conf are not passed on)
    cluster.json               ports and worker settings of the last start
                               (`refold.dev.sparkstate`)
    master.log, master.pid     the master JVM's stdout+stderr and pid (its own process group)
    worker-<i>.log, .pid       the same for worker i; its executors run in its process group
    work/worker-<i>/           worker i's work dir: app-<id>/<executor>/ with executor logs
    local/worker-<i>/          worker i's scratch space (shuffle files, blocks)

The master listens on 127.0.0.1:7077 when that port is free (else a free port) and
serves its UI, with the `/json/` view `status` reads, on 8080 when free (else a free
port). Workers take free ports, their UIs port 0. The REST submission server is
off. Each daemon JVM gets 512 MiB (SPARK_DAEMON_MEMORY); `memory_per_worker` is what
a worker offers to executors. A worker the master has not heard from for
`spark.worker.timeout` (10 s here) is DEAD; one whose JVM died is DEAD at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from refold.dev.localproc import HOST, ServerStartError, free_port
from refold.dev.localproc import bindable as _bindable
from refold.dev.localproc import end_group as _end_group
from refold.dev.localproc import kill_group as _kill_group
from refold.dev.localproc import locked as _locked
from refold.dev.localproc import say as _say
from refold.dev.localproc import tail as _tail
from refold.dev.localproc import wait_gone as _wait_gone
from refold.dev.localproc import wait_group_gone as _wait_group_gone
from refold.dev.sparkdaemons import Launcher, count, daemon_names, pid_file, running_pid
from refold.dev.sparkstate import Layout, WorkerSpec, listed_state, master_state, read_layout
from refold.environment import home as project_home
from refold.errors import ConfigError, PrerequisiteError

DEFAULT_PORT = 7077
DEFAULT_UI_PORT = 8080
_MEMORY = re.compile(r"^[1-9][0-9]*[mMgG]$")


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One worker of the cluster: what it was started with, and how it is now."""

    index: int
    port: int  # its RPC port on 127.0.0.1
    cores: int
    memory: str  # what it offers to executors, e.g. "2g"
    pid: int | None  # its JVM; None when it does not run
    state: str | None  # the master's word: ALIVE, DEAD, …; None: not listed, or no answer
    home: Path  # the cluster's folder, <project home>/spark

    @property
    def name(self) -> str:
        return f"worker-{self.index}"

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.pid is not None and self.state == "ALIVE"

    @property
    def log_file(self) -> Path:
        return self.home / f"{self.name}.log"

    @property
    def work_dir(self) -> Path:
        return self.home / "work" / self.name


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """A running local cluster: the master and every worker it was started with."""

    pid: int  # the master's JVM
    port: int
    ui_port: int
    home: Path  # the cluster's folder, <project home>/spark
    workers: tuple[WorkerInfo, ...]

    @property
    def url(self) -> str:
        """The master URL for `SparkSession.builder.master(...)`."""
        return f"spark://{HOST}:{self.port}"

    @property
    def ui_url(self) -> str:
        return f"http://{HOST}:{self.ui_port}"

    @property
    def log_file(self) -> Path:
        return self.home / "master.log"

    @property
    def alive_workers(self) -> tuple[WorkerInfo, ...]:
        return tuple(worker for worker in self.workers if worker.alive)


def spark_home(home: Path | None = None) -> Path:
    """The cluster's folder inside a Refold home (default: `project_home()`)."""
    return (home if home is not None else project_home()).resolve() / "spark"


# Lifecycle ---------------------------------------------------------------------------


def start(
    workers: int = 2,
    cores_per_worker: int = 1,
    memory_per_worker: str = "2g",
    home: Path | None = None,
    quiet: bool = False,
    *,
    port: int | None = None,
    ui_port: int | None = None,
    timeout: float = 90.0,
    die_with_parent: bool = False,
) -> ClusterInfo:
    """Start a master and `workers` workers; wait until every worker is registered ALIVE.

    Harmless when the cluster already runs: it is returned as it is (whatever its
    size and ports), after starting again, on new ports, any of its workers whose JVM
    is gone. `port`, `ui_port`: None takes 7077 and 8080 when free, else free ports.
    `die_with_parent` (Linux) sends every daemon SIGTERM when the calling thread's
    process dies, for test sessions that may be killed; call it from the main thread.
    Raises ConfigError (bad sizes), PrerequisiteError (no Java or pyspark, port
    taken) or ServerStartError (a daemon exited or the workers were not ALIVE within
    `timeout` seconds; what this call started is then killed).
    """
    _check_sizes(workers, cores_per_worker, memory_per_worker)
    base = spark_home(home)
    base.mkdir(parents=True, exist_ok=True)
    with _locked(base):
        running = status(home)
        if running is not None:
            if all(worker.pid is not None for worker in running.workers):
                _say(quiet, f"Spark already runs at {running.url} (master pid {running.pid})")
                return running
            launcher = Launcher(base, die_with_parent)
            layout, indexes = _repaired(running)
            launcher.restart_workers(layout, indexes, timeout, quiet)
            return _running(base)
        _stop_all(base, 10.0)  # workers left over from a master that died
        layout = _new_layout(workers, cores_per_worker, memory_per_worker, port, ui_port)
        Launcher(base, die_with_parent).launch(layout, timeout, quiet)
        return _running(base)


def stop(home: Path | None = None, *, timeout: float = 30.0) -> bool:
    """Stop the workers (and their executors), then the master: SIGTERM to each
    process group, SIGKILL after `timeout` seconds. Removes the pid files.
    Returns False when nothing ran."""
    base = spark_home(home)
    with _locked(base):
        return _stop_all(base, timeout)


def status(home: Path | None = None) -> ClusterInfo | None:
    """The running cluster, or None when its master does not run. Asks the master's
    UI for the workers' states (2 s at most); a worker's `pid` is None when its JVM
    is gone, its `state` None when the master does not list it or did not answer."""
    base = spark_home(home)
    layout = read_layout(base)
    master = running_pid(base, "master")
    if layout is None or master is None:
        return None
    view = master_state(layout.ui_port)
    listed = view.get("workers", []) if view is not None else []
    workers = tuple(
        WorkerInfo(
            spec.index, spec.port, spec.cores, spec.memory,
            running_pid(base, f"worker-{spec.index}"),
            listed_state(listed, spec.port), base,
        )
        for spec in layout.workers
    )  # fmt: skip
    return ClusterInfo(master, layout.port, layout.ui_port, base, workers)


def kill_worker(index: int = 0, *, home: Path | None = None, executors: bool = True) -> bool:
    """kill -9 worker `index`, like a crash: with its executors (the whole process
    group, as when a machine is lost), or its JVM alone (`executors=False`: Spark's
    executors then exit when they lose their worker). False when it did not run."""
    base = spark_home(home)
    with _locked(base):
        name = f"worker-{index}"
        pid = running_pid(base, name)
        if pid is None:
            return False
        if executors:
            _kill_group(pid, _wait_group_gone)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 10.0)
        pid_file(base, name).unlink(missing_ok=True)
        return True


def kill_hard(home: Path | None = None) -> bool:
    """kill -9 every process group of the cluster (workers, executors, master), like a
    crash of the whole machine. False when nothing ran."""
    base = spark_home(home)
    with _locked(base):
        killed = False
        for name in daemon_names(base):
            pid = running_pid(base, name)
            if pid is not None:
                _kill_group(pid, _wait_group_gone)
                killed = True
            pid_file(base, name).unlink(missing_ok=True)
        return killed


# Command line --------------------------------------------------------------------------


def cli(args: argparse.Namespace) -> int:
    """`refold spark start|stop|status`. Exit 1 from `status` when the master does not
    run or a worker is not ALIVE."""
    action = args.action
    if action == "start":
        info = start(
            args.workers,
            args.cores,
            args.memory,
            port=args.port,
            ui_port=args.ui_port,
        )
        _describe(info)
        return 0
    if action == "stop":
        print("Spark stopped" if stop() else "Spark was not running")
        return 0
    if action == "status":
        found = status()
        if found is None:
            print(f"Spark is not running (logs in {spark_home()})")
            return 1
        _describe(found)
        return 0 if len(found.alive_workers) == len(found.workers) else 1
    raise ValueError(f"unknown action {action!r}: start, stop or status")


def _describe(info: ClusterInfo) -> None:
    alive = len(info.alive_workers)
    print(f"Spark runs at {info.url} (master pid {info.pid}, {alive} of {len(info.workers)} workers alive)")
    print(f"  ui      {info.ui_url}")
    print(f"  log     {info.log_file}")
    for worker in info.workers:
        pid = f"pid {worker.pid}" if worker.pid is not None else "not running"
        state = worker.state or "not registered"
        print(f"  {worker.name}  {worker.address}  {count(worker.cores, 'core')}, {worker.memory}  {pid}, {state}")
        print(f"            log {worker.log_file}  work {worker.work_dir}")


# Inside ----------------------------------------------------------------------------------


def _new_layout(
    workers: int, cores: int, memory: str, port: int | None, ui_port: int | None
) -> Layout:
    """The ports and workers of a new cluster: `port`, `ui_port` as `start` takes them,
    each worker on a free port."""
    master_port = _choose_port(port, DEFAULT_PORT, "port")
    chosen_ui = _choose_port(ui_port, DEFAULT_UI_PORT, "ui_port", avoid={master_port})
    used = {master_port, chosen_ui}
    specs = []
    for index in range(workers):
        worker_port = _free_port_but(used)
        used.add(worker_port)
        specs.append(WorkerSpec(index, worker_port, cores, memory))
    return Layout(master_port, chosen_ui, tuple(specs))


def _repaired(running: ClusterInfo) -> tuple[Layout, list[int]]:
    """The layout of `running` with new ports for the workers whose JVM is gone (the
    master may still list their dead selves at the old ones), and their indexes."""
    indexes = [w.index for w in running.workers if w.pid is None]
    used = {running.port, running.ui_port, *(w.port for w in running.workers)}
    specs = []
    for worker in running.workers:
        port = worker.port
        if worker.pid is None:
            port = _free_port_but(used)
            used.add(port)
        specs.append(WorkerSpec(worker.index, port, worker.cores, worker.memory))
    return Layout(running.port, running.ui_port, tuple(specs)), indexes


def _running(base: Path) -> ClusterInfo:
    """The cluster just started in `base`."""
    info = status(base.parent)
    if info is None:  # it answered a moment ago
        log_file = base / "master.log"
        raise ServerStartError("the Spark master stopped right after it started",
                               log_file=log_file, log_tail=_tail(log_file))  # fmt: skip
    return info


def _check_sizes(workers: int, cores: int, memory: str) -> None:
    if workers < 1:
        raise ConfigError(f"{workers}: a cluster needs at least one worker", where="workers")
    if cores < 1:
        raise ConfigError(f"{cores}: a worker needs at least one core", where="cores_per_worker")
    if not _MEMORY.match(memory):
        raise ConfigError(f"{memory!r}: a size like 512m or 2g", where="memory_per_worker")


def _choose_port(port: int | None, default: int, what: str, avoid: Collection[int] = ()) -> int:
    if port is None:
        return default if default not in avoid and _bindable(default) else _free_port_but(avoid)
    if port in avoid or not _bindable(port):
        raise PrerequisiteError(f"{what} {port} on {HOST} is taken by another program; choose another")
    return port


def _free_port_but(used: Collection[int]) -> int:
    while True:
        port = free_port()
        if port not in used:
            return port


def _stop_all(base: Path, timeout: float) -> bool:
    stopped = False
    for name in daemon_names(base):
        pid = running_pid(base, name)
        if pid is not None:
            _end_group(pid, timeout, _wait_group_gone)
            stopped = True
        pid_file(base, name).unlink(missing_ok=True)
    return stopped
