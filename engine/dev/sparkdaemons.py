"""The daemons of the local Spark cluster (`refold.dev.localspark`): how they are
started from the installed pyspark, told apart from other processes, and stopped.

Each daemon runs `<pyspark>/bin/spark-class` with the master's or the worker's main
class, in a process group of its own (a worker's executors run in its group), with
`<home>/spark/conf` as its SPARK_CONF_DIR and none of the caller's SPARK_* variables.
Its pid is in `<name>.pid`, its stdout and stderr in `<name>.log` (`master`,
`worker-<i>`); a worker works in `work/worker-<i>/` and spills to `local/worker-<i>/`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from pathlib import Path

from refold.dev.localproc import HOST, ServerStartError
from refold.dev.localproc import kill_group as _kill_group
from refold.dev.localproc import rotate as _rotate
from refold.dev.localproc import running_pid as _running_pid_in
from refold.dev.localproc import say as _say
from refold.dev.localproc import spawn as _spawn
from refold.dev.localproc import tail as _tail
from refold.dev.localproc import wait_group_gone as _wait_group_gone
from refold.dev.sparkstate import Layout, WorkerSpec, listed_state, master_state, write_layout
from refold.errors import PrerequisiteError
from refold.spark.jars import require_java

DAEMON_MEMORY = "512m"
# Small, quick-starting daemon JVMs: they only schedule, executors do the work.
DAEMON_JAVA_OPTIONS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:+ExitOnOutOfMemoryError")
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
_SETTINGS = {
    "spark.master.rest.enabled": "false",  # no submission server on 6066
    "spark.worker.timeout": "10",  # seconds without a heartbeat before a worker is DEAD
}


def pyspark_home() -> Path:
    """The installed pyspark package, which is a Spark distribution (bin/, jars/)."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise PrerequisiteError("pyspark is not installed (pip install pyspark)")
    root = Path(spec.origin).parent
    if not (root / "bin" / "spark-class").is_file() or not (root / "jars").is_dir():
        raise PrerequisiteError(f"{root} has no bin/spark-class or jars/: reinstall pyspark")
    return root


class Launcher:
    """Starts the daemons of one cluster folder and waits for them. Whatever one of its
    calls started is killed again when that call fails."""

    def __init__(self, base: Path, die_with_parent: bool) -> None:
        self.base = base
        self.die_with_parent = die_with_parent
        require_java()  # spark-class runs $JAVA_HOME/bin/java, else java on PATH
        self.root = pyspark_home()

    def launch(self, layout: Layout, timeout: float, quiet: bool) -> None:
        """Start the master and every worker of `layout`; wait until the workers are ALIVE."""
        started = time.monotonic()
        deadline = started + timeout
        conf = self.base / "conf"
        conf.mkdir(exist_ok=True)
        (conf / "spark-defaults.conf").write_text("".join(f"{k} {v}\n" for k, v in _SETTINGS.items()))
        write_layout(self.base, layout)
        url = f"spark://{HOST}:{layout.port}"
        _say(quiet, f"starting Spark at {url} with {count(len(layout.workers), 'worker')} (in {self.base}) …")
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

    def restart_workers(self, layout: Layout, indexes: list[int], timeout: float, quiet: bool) -> None:
        """Start the workers `indexes` of `layout` (the master runs) again; wait until
        they are ALIVE."""
        deadline = time.monotonic() + timeout
        write_layout(self.base, layout)
        url = f"spark://{HOST}:{layout.port}"
        _say(quiet, f"Spark runs at {url}; starting worker(s) {indexes} again …")
        procs = {
            f"worker-{spec.index}": self._spawn_worker(spec, url)
            for spec in layout.workers
            if spec.index in indexes
        }
        self._await_workers(layout, procs, deadline, timeout, only=set(indexes))
        _say(quiet, f"Spark is ready at {url}")

    def _spawn_worker(self, spec: WorkerSpec, url: str) -> subprocess.Popen[bytes]:
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
        return _spawn(
            command,
            what=f"Spark {name}",
            log_file=log_file,
            pid_file=pid_file(self.base, name),
            cwd=cwd or self.base,
            env={**self._environment(), **(env or {})},
            die_with_parent=self.die_with_parent,
        )

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
        layout: Layout,
        procs: dict[str, subprocess.Popen[bytes]],
        deadline: float,
        timeout: float,
        only: set[int] | None = None,
    ) -> None:
        waiting = [w for w in layout.workers if only is None or w.index in only]
        while True:
            listed = (master_state(layout.ui_port) or {}).get("workers", [])
            if all(listed_state(listed, w.port) == "ALIVE" for w in waiting):
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
                _kill_group(proc.pid, _wait_group_gone)
            proc.wait(10)
            pid_file(self.base, name).unlink(missing_ok=True)
        if exited:
            name, code = next(iter(exited.items()))
            why = f"exited with {code}"
        else:  # the last one not ready
            name, why = list(procs)[-1], f"was not ready in {timeout:.0f}s"
        log_file = self.base / f"{name}.log"
        raise ServerStartError(f"Spark {name} {why}", log_file=log_file, log_tail=_tail(log_file))


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def daemon_names(base: Path) -> list[str]:
    """worker-<i> for every worker pid file, in index order, then the master: the order
    to stop them in."""
    names = [path.stem for path in base.glob("worker-*.pid")]
    workers = sorted(names, key=lambda name: int(name.rpartition("-")[2]) if name.rpartition("-")[2].isdigit() else -1)
    return [*workers, "master"]


def pid_file(base: Path, name: str) -> Path:
    return base / f"{name}.pid"


def running_pid(base: Path, name: str) -> int | None:
    """The pid in `name`'s pid file, if that process lives and is this cluster's daemon."""
    main_class = MASTER_CLASS if name == "master" else WORKER_CLASS
    marks = [main_class, str(base / "conf" / "spark-defaults.conf")]
    if name != "master":
        marks.append(str(base / "work" / name))
    return _running_pid_in(pid_file(base, name), marks)
