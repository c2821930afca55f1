"""A real local Spark standalone cluster: one master and N workers on 127.0.0.1.

For running the engine on a cluster rather than `local[N]`, and for fault tests
(kill -9 one worker while a job runs). `refold spark start|stop|status`.
The daemons come from the installed pyspark itself (`<pyspark>/bin/spark-class`
with the master's and the worker's main classes), so the cluster runs exactly the
Spark version of the driver. Everything lives under `<home>/spark/` (home:
`refold.environment.home()`, i.e. `.refold/`, or the `home` argument):

    conf/spark-defaults.conf   the daemons' settings (their SPARK_CONF_DIR: the caller's
                               SPARK_* variables and Spark conf are not passed on)
    cluster.json               ports and worker settings of the last start
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
import importlib.util
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refold.dev.localproc import HOST, ServerStartError, free_port
from refold.dev.localproc import alive as _alive
from refold.dev.localproc import bindable as _bindable
from refold.dev.localproc import locked as _locked
from refold.dev.localproc import parent_death_signal as _parent_death_signal
from refold.dev.localproc import say as _say
from refold.dev.localproc import signal_group as _signal_group
from refold.dev.localproc import tail as _tail
from refold.dev.localproc import wait_gone as _wait_gone
from refold.environment import home as project_home
from refold.errors import ConfigError, PrerequisiteError
from refold.spark.jars import require_java

DEFAULT_PORT = 7077
DEFAULT_UI_PORT = 8080
DAEMON_MEMORY = "512m"
# Small, quick-starting daemon JVMs: they only schedule, executors do the work.
DAEMON_JAVA_OPTIONS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:+ExitOnOutOfMemoryError")
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
_SETTINGS = {
    "spark.master.rest.enabled": "false",  # no submission server on 6066
    "spark.worker.timeout": "10",  # seconds without a heartbeat before a worker is DEAD
}
_MEMORY = re.compile(r"^[1-9][0-9]*[mMgG]$")
_LOG_ROTATE_BYTES = 20 * 1024 * 1024
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


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


def pyspark_home() -> Path:
    """The installed pyspark package, which is a Spark distribution (bin/, jars/)."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise PrerequisiteError("pyspark is not installed (pip install pyspark)")
    root = Path(spec.origin).parent
    if not (root / "bin" / "spark-class").is_file() or not (root / "jars").is_dir():
        raise PrerequisiteError(f"{root} has no bin/spark-class or jars/: reinstall pyspark")
    return root


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
            return _Launcher(base, die_with_parent).repair(running, timeout, quiet)
        _stop_all(base, 10.0)  # workers left over from a master that died
        master_port = _choose_port(port, DEFAULT_PORT, "port")
        chosen_ui = _choose_port(ui_port, DEFAULT_UI_PORT, "ui_port", avoid={master_port})
        used = {master_port, chosen_ui}
        specs = []
        for index in range(workers):
            worker_port = _free_port_but(used)
            used.add(worker_port)
            specs.append(_WorkerSpec(index, worker_port, cores_per_worker, memory_per_worker))
        layout = _Layout(master_port, chosen_ui, tuple(specs))
        return _Launcher(base, die_with_parent).launch(layout, timeout, quiet)


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
    layout = _read_layout(base)
    master = _running_pid(base, "master")
    if layout is None or master is None:
        return None
    view = master_state(layout.ui_port)
    listed = view.get("workers", []) if view is not None else []
    workers = tuple(
        WorkerInfo(
            spec.index, spec.port, spec.cores, spec.memory,
            _running_pid(base, f"worker-{spec.index}"),
            _listed_state(listed, spec.port), base,
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
        pid = _running_pid(base, name)
        if pid is None:
            return False
        if executors:
            _signal_group(pid, signal.SIGKILL)
            _wait_group_gone(pid, 10.0)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 10.0)
        _pid_file(base, name).unlink(missing_ok=True)
        return True


def kill_hard(home: Path | None = None) -> bool:
    """kill -9 every process group of the cluster (workers, executors, master), like a
    crash of the whole machine. False when nothing ran."""
    base = spark_home(home)
    with _locked(base):
        killed = False
        for name in [*_worker_names(base), "master"]:
            pid = _running_pid(base, name)
            if pid is not None:
                _signal_group(pid, signal.SIGKILL)
                _wait_group_gone(pid, 10.0)
                killed = True
            _pid_file(base, name).unlink(missing_ok=True)
        return killed


def master_state(ui_port: int, timeout: float = 2.0) -> dict[str, Any] | None:
    """The master UI's `/json/` view (status, workers with their states, apps), or
    None when it does not answer."""
    try:
        with _NO_PROXY.open(f"http://{HOST}:{ui_port}/json/", timeout=timeout) as response:
            state = json.load(response)
    except (OSError, ValueError):  # URLError is an OSError
        return None
    return state if isinstance(state, dict) else None


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
        print(f"  {worker.name}  {worker.address}  {_count(worker.cores, 'core')}, {worker.memory}  {pid}, {state}")
        print(f"            log {worker.log_file}  work {worker.work_dir}")


# Inside ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _WorkerSpec:
    index: int
    port: int
    cores: int
    memory: str


@dataclass(frozen=True, slots=True)
class _Layout:
    """What cluster.json records: the ports and each worker's settings."""

    port: int
    ui_port: int
    workers: tuple[_WorkerSpec, ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "port": self.port,
                "ui_port": self.ui_port,
                "workers": [
                    {"index": w.index, "port": w.port, "cores": w.cores, "memory": w.memory}
                    for w in self.workers
                ],
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> _Layout:
        data = json.loads(text)
        workers = tuple(
            _WorkerSpec(int(w["index"]), int(w["port"]), int(w["cores"]), str(w["memory"]))
            for w in data["workers"]
        )
        return cls(int(data["port"]), int(data["ui_port"]), workers)


class _Launcher:
    """Starts the daemons of one cluster folder and waits for them."""

    def __init__(self, base: Path, die_with_parent: bool) -> None:
        self.base = base
        self.die_with_parent = die_with_parent
        require_java()  # spark-class runs $JAVA_HOME/bin/java, else java on PATH
        self.root = pyspark_home()

    def launch(self, layout: _Layout, timeout: float, quiet: bool) -> ClusterInfo:
        started = time.monotonic()
        deadline = started + timeout
        conf = self.base / "conf"
        conf.mkdir(exist_ok=True)
        (conf / "spark-defaults.conf").write_text("".join(f"{k} {v}\n" for k, v in _SETTINGS.items()))
        (self.base / "cluster.json").write_text(layout.to_json() + "\n")
        url = f"spark://{HOST}:{layout.port}"
        _say(quiet, f"starting Spark at {url} with {_count(len(layout.workers), 'worker')} (in {self.base}) …")
        master = self._spawn(
            "master",
            [MASTER_CLASS, "--host", HOST, "--port", str(layout.port),
             "--webui-port", str(layout.ui_port)],
        )  # fmt: skip
        procs = {"master": master}
        while (master_state(layout.ui_port) or {}).get("status") != "ALIVE":
            self._check(procs, deadline, timeout)
            time.sleep(0.2)
        for spec in layout.workers:
            procs[f"worker-{spec.index}"] = self._spawn_worker(spec, url)
        self._await_workers(layout, procs, deadline, timeout)
        _say(quiet, f"Spark is ready at {url} ({time.monotonic() - started:.1f}s)")
        return self._running()

    def repair(self, running: ClusterInfo, timeout: float, quiet: bool) -> ClusterInfo:
        """Start the workers of `running` whose JVM is gone again, on new ports (the
        master may still list their dead selves at the old ones)."""
        deadline = time.monotonic() + timeout
        indexes = [w.index for w in running.workers if w.pid is None]
        used = {running.port, running.ui_port, *(w.port for w in running.workers)}
        specs = []
        for worker in running.workers:
            port = worker.port
            if worker.pid is None:
                port = _free_port_but(used)
                used.add(port)
            specs.append(_WorkerSpec(worker.index, port, worker.cores, worker.memory))
        layout = _Layout(running.port, running.ui_port, tuple(specs))
        (self.base / "cluster.json").write_text(layout.to_json() + "\n")
        url = f"spark://{HOST}:{layout.port}"
        _say(quiet, f"Spark runs at {url}; starting worker(s) {indexes} again …")
        procs = {
            f"worker-{spec.index}": self._spawn_worker(spec, url)
            for spec in layout.workers
            if spec.index in indexes
        }
        self._await_workers(layout, procs, deadline, timeout, only=set(indexes))
        _say(quiet, f"Spark is ready at {url}")
        return self._running()

    def _running(self) -> ClusterInfo:
        info = status(self.base.parent)
        if info is None:  # it answered a moment ago
            log_file = self.base / "master.log"
            raise ServerStartError("the Spark master stopped right after it started",
                                   log_file=log_file, log_tail=_tail(log_file))  # fmt: skip
        return info

    def _spawn_worker(self, spec: _WorkerSpec, url: str) -> subprocess.Popen[bytes]:
        name = f"worker-{spec.index}"
        work = self.base / "work" / name
        local = self.base / "local" / name
        work.mkdir(parents=True, exist_ok=True)
        local.mkdir(parents=True, exist_ok=True)
        return self._spawn(
            name,
            [WORKER_CLASS, "--host", HOST, "--port", str(spec.port), "--cores", str(spec.cores),
             "--memory", spec.memory, "--work-dir", str(work), "--webui-port", "0", url],
            cwd=work,
            env={"SPARK_LOCAL_DIRS": str(local)},
        )  # fmt: skip

    def _spawn(
        self, name: str, args: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        # --properties-file names this folder on the command line, so that a pid
        # can be told to be this cluster's daemon both before and after spark-class
        # execs the JVM.
        command = [
            str(self.root / "bin" / "spark-class"), args[0],
            "--properties-file", str(self.base / "conf" / "spark-defaults.conf"), *args[1:],
        ]  # fmt: skip
        log_file = self.base / f"{name}.log"
        _rotate(log_file)
        with log_file.open("ab") as log:
            log.write(f"--- refold: starting Spark {name} at {time.ctime()}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd or self.base,  # where a crashing JVM writes its hs_err file
                env={**self._environment(), **(env or {})},
                start_new_session=True,  # its own process group: stop/kill reach its executors
                preexec_fn=_parent_death_signal(os.getpid()) if self.die_with_parent else None,
            )
        _pid_file(self.base, name).write_text(f"{proc.pid}\n")
        return proc

    def _environment(self) -> dict[str, str]:
        """The caller's environment without its Spark settings, plus the cluster's."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
        env.update(
            SPARK_HOME=str(self.root),
            SPARK_CONF_DIR=str(self.base / "conf"),
            SPARK_LOCAL_IP=HOST,
            SPARK_MASTER_HOST=HOST,
            SPARK_PUBLIC_DNS=HOST,
            SPARK_DAEMON_MEMORY=DAEMON_MEMORY,
            SPARK_DAEMON_JAVA_OPTS=" ".join(DAEMON_JAVA_OPTIONS),
            SPARK_LAUNCHER_OPTS="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
            SPARK_LOCAL_DIRS=str(self.base / "local"),
        )
        return env

    def _await_workers(
        self,
        layout: _Layout,
        procs: dict[str, subprocess.Popen[bytes]],
        deadline: float,
        timeout: float,
        only: set[int] | None = None,
    ) -> None:
        waiting = [w for w in layout.workers if only is None or w.index in only]
        while True:
            listed = (master_state(layout.ui_port) or {}).get("workers", [])
            if all(_listed_state(listed, w.port) == "ALIVE" for w in waiting):
                return
            self._check(procs, deadline, timeout)
            time.sleep(0.2)

    def _check(self, procs: dict[str, subprocess.Popen[bytes]], deadline: float, timeout: float) -> None:
        """Raise ServerStartError, after killing every daemon in `procs` (what this call
        started), when one of them exited or the deadline passed."""
        exited = {name: code for name, proc in procs.items() if (code := proc.poll()) is not None}
        if not exited and time.monotonic() <= deadline:
            return
        for name, proc in reversed(procs.items()):  # workers first, the master last
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGKILL)
                _wait_group_gone(proc.pid, 10.0)
            proc.wait(10)
            _pid_file(self.base, name).unlink(missing_ok=True)
        if exited:
            name, code = next(iter(exited.items()))
            why = f"exited with {code}"
        else:  # the last one not ready
            name, why = list(procs)[-1], f"was not ready in {timeout:.0f}s"
        log_file = self.base / f"{name}.log"
        raise ServerStartError(f"Spark {name} {why}", log_file=log_file, log_tail=_tail(log_file))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


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


def _listed_state(listed: list[dict[str, Any]], port: int) -> str | None:
    """The state the master lists for the worker at HOST:`port` (ALIVE before any
    dead registration there), or None."""
    mine = [w for w in listed if w.get("host") == HOST and w.get("port") == port]
    if not mine:
        return None
    mine.sort(key=lambda w: (w.get("state") == "ALIVE", str(w.get("id"))))
    return str(mine[-1].get("state"))


def _stop_all(base: Path, timeout: float) -> bool:
    stopped = False
    for name in [*_worker_names(base), "master"]:
        pid = _running_pid(base, name)
        if pid is not None:
            _signal_group(pid, signal.SIGTERM)
            if not _wait_group_gone(pid, timeout):
                _signal_group(pid, signal.SIGKILL)
                _wait_group_gone(pid, 10.0)
            stopped = True
        _pid_file(base, name).unlink(missing_ok=True)
    return stopped


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    """Until no live process is left in group `pgid` (zombies do not count: their
    parent may never reap them); False after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    _alive(pgid)  # reaps the leader if it is our exited child
    while _group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
        _alive(pgid)
    return True


def _group_members(pgid: int) -> list[int]:
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


def _worker_names(base: Path) -> list[str]:
    """worker-<i> for every worker pid file, in index order."""
    names = [path.stem for path in base.glob("worker-*.pid")]
    return sorted(names, key=lambda name: int(name.rpartition("-")[2]) if name.rpartition("-")[2].isdigit() else -1)


def _read_layout(base: Path) -> _Layout | None:
    try:
        return _Layout.from_json((base / "cluster.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _pid_file(base: Path, name: str) -> Path:
    return base / f"{name}.pid"


def _running_pid(base: Path, name: str) -> int | None:
    """The pid in `name`'s pid file, if that process lives and is this cluster's daemon."""
    try:
        pid = int(_pid_file(base, name).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if not _alive(pid):
        return None
    cmdline = Path(f"/proc/{pid}/cmdline")
    if cmdline.exists():  # Linux: make sure the pid was not reused by another program
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            return None
        main_class = MASTER_CLASS if name == "master" else WORKER_CLASS
        marks = [main_class, str(base / "conf" / "spark-defaults.conf")]
        if name != "master":
            marks.append(str(base / "work" / name))
        if not all(mark.encode() in args for mark in marks):
            return None
    return pid


def _rotate(log_file: Path) -> None:
    with contextlib.suppress(OSError):
        if log_file.stat().st_size > _LOG_ROTATE_BYTES:
            log_file.replace(log_file.with_name(log_file.name + ".1"))
