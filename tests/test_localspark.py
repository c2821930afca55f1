"""The local Spark standalone cluster: it starts, runs a job on two executors, loses a
worker to kill -9, starts it again and stops without leaving a process behind."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from refold.cli.main import main as cli_main
from refold.dev import localspark
from refold.dev.localproc import ServerStartError, free_port
from refold.errors import ConfigError, PrerequisiteError

# The driver runs in a process of its own: a session-wide local SparkSession of
# other tests must not answer getOrCreate(). Each task reports where its Python
# worker ran: the working folder its executor gave it (<work dir>/<app>/<executor>).
_DRIVER = """
import json, os, sys, time
from pyspark.sql import SparkSession

spark = (
    SparkSession.builder.master(sys.argv[1]).appName("refold-localspark-test")
    .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    .config("spark.driver.memory", "512m").config("spark.ui.enabled", "false")
    .config("spark.executor.cores", "1").config("spark.executor.memory", "512m")
    .config("spark.cores.max", "2")
    # schedule only once both executors are there, so that both get tasks
    .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
    .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "60s")
    .getOrCreate()
)

def where(rows):
    count = sum(1 for _ in rows)
    time.sleep(0.5)  # hold the core: the other executor takes the next task
    yield os.getcwd(), os.getpid(), count

print(json.dumps(spark.sparkContext.parallelize(range(100), 4).mapPartitions(where).collect()))
spark.stop()
"""


def _run_driver(url: str) -> list[tuple[str, int, int]]:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    env.pop("SPARK_HOME", None)
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, url], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(row) for row in json.loads(done.stdout.strip().splitlines()[-1])]


def _processes_in(home: Path) -> list[str]:
    """Live processes whose command line or working folder is inside `home`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "stat").read_text().rpartition(")")[2].split()[0] == "Z":
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if str(home) in cmdline or cwd.startswith(str(home)):
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def _when_marked_dead(home: Path, index: int, timeout: float = 20.0) -> localspark.ClusterInfo:
    """The cluster's status once the master lists worker `index` as DEAD."""
    deadline = time.monotonic() + timeout
    while True:
        info = localspark.status(home)
        assert info is not None, "the master is gone"
        if info.workers[index].state == "DEAD":
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"worker-{index} still {info.workers[index].state} after {timeout}s")
        time.sleep(0.2)


@pytest.mark.spark
def test_cluster_runs_a_job_on_two_executors_survives_kill_9_and_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    assert localspark.status(home) is None
    assert not localspark.stop(home)

    info = localspark.start(
        2, 1, "1g", home=home, quiet=True, port=free_port(), ui_port=free_port(), die_with_parent=True
    )
    try:
        assert info.url == f"spark://127.0.0.1:{info.port}"
        assert [w.state for w in info.workers] == ["ALIVE", "ALIVE"] and len(info.alive_workers) == 2
        assert localspark.start(home=home, quiet=True) == info  # already runs: as it is
        assert localspark.status(home) == info
        master = localspark.master_state(info.ui_port)
        assert master is not None and master["status"] == "ALIVE" and master["aliveworkers"] == 2
        assert "Starting Spark master at " + info.url in info.log_file.read_text()
        for worker in info.workers:  # the master lists a worker before its log says so
            assert _eventually_in(worker.log_file, "Successfully registered with master")

        rows = _run_driver(info.url)
        assert sum(count for _, _, count in rows) == 100
        executors = {Path(cwd).relative_to(info.home / "work").parts for cwd, _, _ in rows}
        assert len(executors) == 2, rows  # two executors …
        assert {parts[0] for parts in executors} == {"worker-0", "worker-1"}  # … one on each worker
        assert len({pid for _, pid, _ in rows}) >= 2

        # kill -9 worker 0 (and its executors): the master marks it DEAD
        assert localspark.kill_worker(0, home=home)
        assert not localspark.kill_worker(0, home=home)
        now = localspark.status(home)
        assert now is not None and now.workers[0].pid is None and now.workers[1].alive
        dead = _when_marked_dead(home, 0)
        assert [w.name for w in dead.alive_workers] == ["worker-1"]
        monkeypatch.setenv("REFOLD_HOME", str(home))
        assert localspark.cli(argparse.Namespace(action="status")) == 1  # degraded
        out = capsys.readouterr().out
        assert "1 of 2 workers alive" in out and "not running, DEAD" in out

        # start brings the lost worker back, on a new port
        again = localspark.start(home=home, quiet=True, die_with_parent=True)
        assert again.pid == info.pid and len(again.alive_workers) == 2
        assert again.workers[0].pid not in (None, info.workers[0].pid)
        assert again.workers[0].port != info.workers[0].port
        assert again.workers[1] == info.workers[1]

        assert cli_main(["spark", "status"]) == 0
        assert f"Spark runs at {info.url}" in capsys.readouterr().out
        assert cli_main(["spark", "stop"]) == 0
        assert "Spark stopped" in capsys.readouterr().out
        assert cli_main(["spark", "status"]) == 1
        assert "Spark is not running" in capsys.readouterr().out
    finally:
        localspark.stop(home)
    assert localspark.status(home) is None
    assert not list(info.home.glob("*.pid"))
    assert _processes_in(info.home) == []


@pytest.mark.spark
def test_start_fails_with_the_log_and_leaves_nothing_running(tmp_path: Path) -> None:
    with pytest.raises(ServerStartError) as failure:
        localspark.start(1, home=tmp_path, quiet=True, port=free_port(), ui_port=free_port(), timeout=0.5)
    assert "master was not ready" in str(failure.value)
    assert failure.value.log_file == tmp_path / "spark" / "master.log"
    assert "refold: starting Spark master" in failure.value.log_tail
    assert localspark.status(tmp_path) is None
    assert not list((tmp_path / "spark").glob("*.pid"))
    assert _processes_in(tmp_path / "spark") == []


def test_start_checks_sizes_and_ports_before_starting_anything(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="memory_per_worker"):
        localspark.start(memory_per_worker="2 GB", home=tmp_path)
    with pytest.raises(ConfigError, match="workers"):
        localspark.start(0, home=tmp_path)
    with pytest.raises(ConfigError, match="cores_per_worker"):
        localspark.start(cores_per_worker=0, home=tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(PrerequisiteError, match="is taken"):
            localspark.start(home=tmp_path, quiet=True, port=sock.getsockname()[1])
    assert localspark.status(tmp_path) is None
    assert not list((tmp_path / "spark").glob("*.pid"))


def test_nothing_runs_in_a_fresh_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert localspark.status(tmp_path) is None
    assert not localspark.stop(tmp_path)
    assert not localspark.kill_worker(0, home=tmp_path)
    assert not localspark.kill_hard(tmp_path)
    monkeypatch.setenv("REFOLD_HOME", str(tmp_path))
    assert cli_main(["spark", "status"]) == 1
    assert f"Spark is not running (logs in {tmp_path.resolve() / 'spark'})" in capsys.readouterr().out
    assert cli_main(["spark", "stop"]) == 0
    assert "Spark was not running" in capsys.readouterr().out
    assert cli_main(["spark", "start", "--memory", "lots"]) == 2
    assert "memory_per_worker" in capsys.readouterr().err


def _eventually_in(log: Path, text: str, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text():
            return True
        time.sleep(0.2)
    return text in log.read_text()
