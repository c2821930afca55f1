"""A pipeline on a real Spark standalone cluster (master + 2 workers on 127.0.0.1,
started by the same code as `refold spark start`), run through `refold run` with
`spark: {master: spark://…}`, equals the reference; and stays exactly once when a
Python worker, an executor JVM, a whole Spark worker or the driver is killed (-9)
while it runs.

The fault tests run `refold run` as a process of its own (its own session, so that
the driver's JVM dies with it) with small batches, inject the fault once the
pipeline has committed something, and check afterwards with `refold verify` and the
committed checkpoints that every event counted exactly once.

Three tests are marked slow (`make test-slow`, which CI runs after `make test`): each
repeats a proof that a faster test here makes in `make test`.

- A pipeline on the cluster, nothing killed: the Python-worker test runs the same
  pipeline on the cluster as an application of its own, its executors with Refold's
  JVM options, and checks it exact after its tasks ran again.
- The driver of a co-partitioned view killed mid-run: the regrouping view's driver
  is killed the same way (`test_a_regrouping_view_in_shards_survives_its_driver_killed`,
  which checks too that the cluster ends the killed run's executors), over two
  stages instead of one; kill -9 of the whole engine at each point of a batch is
  `test_crash.test_kill_9_at_each_point_then_restart`.
- An executor JVM killed mid-run: a whole Spark worker killed mid-run
  (`test_a_spark_worker_killed_mid_run_the_other_takes_over`) kills its executor with
  it, and the tasks run again on another executor; a Python worker killed inside a
  shard's transaction is `test_python_workers_killed_on_an_executor_are_run_again`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from engine_runs import assert_exact, load_source

from refold.config import Pipeline, load_pipeline
from refold.dev import localspark, sparkprocs
from refold.dev.sparkstate import master_state
from refold.recovery.restore import load_checkpoint, load_checkpoints
from refold.runtime.exchange import view_pipeline
from refold.runtime.hooks import worker_crash_marker

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

EXECUTOR_CONF = {"spark.executor.cores": "1", "spark.executor.memory": "512m", "spark.cores.max": "2"}
COLUMNS = {"total": {"sum": "score"}, "best": {"max": "score"}, "latest": {"last": "score"}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[localspark.ClusterInfo]:
    home = tmp_path_factory.mktemp("spark-home")
    info = localspark.start(2, 1, "1g", home=home, quiet=True, die_with_parent=True)
    try:
        yield info
    finally:
        localspark.stop(home)


# Helpers ------------------------------------------------------------------------------------


def write_pipeline(tmp: Path, source: str, bootstrap: str, cluster: localspark.ClusterInfo,
                   max_batch_events: int = 1000, regroup: bool = False, conf: dict[str, str] | None = None) -> Path:
    """The cluster's pipeline: a grouped view per player, or with `regroup` per team in 2 shards."""
    name = f"cluster{uuid.uuid4().hex[:8]}"
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "pipeline": name,
        "kafka": {"bootstrap.servers": bootstrap},
        "source": {"topic": source, "format": "jsonl", **({"key": ["player_name"]} if regroup else {})},
        **({"shards": 2} if regroup else {}),
        "view": {"key": ["team" if regroup else "player_name"], "columns": COLUMNS},
        "outputs": {"view": {"topic": f"{name}.view"}, "delta": {"topic": f"{name}.delta"}},
        "trigger": "200ms",
        "max_batch_events": max_batch_events,
        "spark": {"master": cluster.url, "checkpoint_dir": str(tmp / "spark" / name), "conf": {**EXECUTOR_CONF, **(conf or {})}},
    }))  # fmt: skip
    return path


def load(bootstrap: str, topic: Callable[..., str], events: int = 3000, seed: int = 23) -> tuple[str, int]:
    """A fresh 4-partition source with `events` events keyed by player_name."""
    return load_source(bootstrap, topic, partitions=4, events=events, keys=200, seed=seed, per_transaction=500)


def engine_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFOLD_TEST_")}
    env.update(extra)
    return env


def start_engine(path: Path, log: Path, idle: float, **extra_env: str) -> subprocess.Popen[bytes]:
    """`refold run` in a session of its own (its group holds the driver's JVM), stderr to `log`."""
    with log.open("ab") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "refold.cli", "run", str(path), "--until-idle", str(idle)],
            env=engine_env(**extra_env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            start_new_session=True,
        )  # fmt: skip


def finish(proc: subprocess.Popen[bytes], log: Path, timeout: float = 300) -> tuple[int, str]:
    """Its exit code and stderr; a run that does not end in `timeout` is killed and fails the test."""
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        pytest.fail(f"`refold run` did not end in {timeout:.0f}s:\n{log.read_text(errors='replace')[-4000:]}")
    return code, log.read_text(errors="replace")


def kill_session(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


@contextlib.contextmanager
def running(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """Whatever happens in the block, the engine's session does not outlive the test."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            kill_session(proc)


def wait_for(what: str, check: Callable[[], Any], proc: subprocess.Popen[bytes] | None = None,
             log: Path | None = None, timeout: float = 120, every: float = 0.2) -> Any:
    """`check()`'s first true value; fails when `timeout` passes, or the engine ends first."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        tail = log.read_text(errors="replace")[-3000:] if log is not None else ""
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"`refold run` ended (exit {proc.returncode}) before {what}:\n{tail}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout:.0f}s:\n{tail}")
        time.sleep(every)


def committed(pipeline: Pipeline, settings: dict[str, Any]) -> tuple[int, int]:
    """(batches, records in) the pipeline's shards have committed so far; (0, 0) before
    the engine made its topics."""
    try:
        checkpoint = load_checkpoint(pipeline, settings)
    except Exception:  # P.checkpoints does not exist yet
        return 0, 0
    return (checkpoint.batch, checkpoint.records_in) if checkpoint is not None else (0, 0)


def first_commit(pipeline: Pipeline, settings: dict[str, Any]) -> tuple[int, int] | None:
    """`committed()` once at least one batch has committed, else None."""
    batches, records = committed(pipeline, settings)
    return (batches, records) if batches > 0 else None


def app_id(cluster: localspark.ClusterInfo, pipeline: Pipeline) -> str | None:
    """The id of the pipeline's running application, as the master lists it."""
    return sparkprocs.application_id(cluster.ui_port, f"refold-{pipeline.pipeline}")


def executors(cluster: localspark.ClusterInfo, app: str) -> dict[int, str]:
    """The executor JVMs of application `app` of this cluster: pid -> its worker."""
    return sparkprocs.executors(app, cluster.home / "work")


def executor_dirs(cluster: localspark.ClusterInfo, app: str) -> list[Path]:
    """The folders the workers made for the app's executors (one per executor launched)."""
    return sorted(p for p in (cluster.home / "work").glob(f"worker-*/{app}/*") if p.is_dir())


def executor_logs(cluster: localspark.ClusterInfo, app: str) -> str:
    return "".join(
        (folder / name).read_text(errors="replace")
        for folder in executor_dirs(cluster, app)
        for name in ("stderr", "stdout")
        if (folder / name).is_file()
    )


# Tests --------------------------------------------------------------------------------------


@pytest.mark.slow  # the Python-worker test below runs the same pipeline on the cluster (module docstring)
def test_a_pipeline_runs_on_the_standalone_cluster(
    cluster: localspark.ClusterInfo, bootstrap_servers: str, topic, tmp_path: Path
) -> None:
    source, events = load(bootstrap_servers, topic)
    path = write_pipeline(tmp_path, source, bootstrap_servers, cluster)
    name = load_pipeline(path).pipeline
    done = subprocess.run(
        [sys.executable, "-m", "refold.cli", "run", str(path), "--until-idle", "4"],
        env=engine_env(), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    assert_exact(load_pipeline(path), bootstrap_servers, events)
    # the query ran as an application of the cluster, with executors on its workers
    apps = master_state(cluster.ui_port) or {}
    ran = [a for a in apps.get("completedapps", []) + apps.get("activeapps", []) if a.get("name") == f"refold-{name}"]
    assert ran, apps
    # its executors ran with Refold's cluster JVM options (C1 only: job.java_options)
    launches = [line for line in executor_logs(cluster, ran[0]["id"]).splitlines()
                if line.startswith("Spark Executor Command:")]
    assert launches and all('"-XX:TieredStopAtLevel=1"' in line for line in launches), launches


def test_python_workers_killed_on_an_executor_are_run_again(
    cluster: localspark.ClusterInfo, bootstrap_servers: str, topic, tmp_path: Path
) -> None:
    # The first Python worker to reach each point (inside batch 2's transaction; right
    # after batch 4's commit) kills itself; Spark runs the task again on the executor,
    # which settles the dead worker's transaction and commits what is not committed yet.
    points = ("in_txn:2", "after_commit:4")
    source, events = load(bootstrap_servers, topic)
    path = write_pipeline(tmp_path, source, bootstrap_servers, cluster, max_batch_events=300)
    pipeline = load_pipeline(path)
    log = tmp_path / "engine.log"
    with running(start_engine(path, log, idle=4, REFOLD_TEST_CRASH_WORKER=",".join(points))) as proc:
        app = wait_for("application on the cluster", lambda: app_id(cluster, pipeline), proc, log)
        code, err = finish(proc, log)
    assert code == 0, err[-4000:]
    base = Path(os.environ["REFOLD_HOME"]) / f"crash-worker-{proc.pid}"
    for point in points:
        assert worker_crash_marker(base, point).exists(), f"no Python worker reached {point}"
    logs = executor_logs(cluster, app)
    # its executors ran with Refold's cluster JVM options (C1 only: job.java_options)
    launches = [line for line in logs.splitlines() if line.startswith("Spark Executor Command:")]
    assert launches and all('"-XX:TieredStopAtLevel=1"' in line for line in launches), launches
    assert logs.count("kill -9 of Python worker") >= len(points), logs[-3000:]
    assert len(re.findall(r"Running task \d+\.1 in stage", logs)) >= len(points), logs[-3000:]  # second attempts
    assert_exact(pipeline, bootstrap_servers, events)


@pytest.mark.slow  # a Spark worker killed mid-run kills its executor too (module docstring)
def test_an_executor_jvm_killed_mid_run_is_replaced(
    cluster: localspark.ClusterInfo, bootstrap_servers: str, topic, tmp_path: Path
) -> None:
    # kill -9 of one of the application's two executor JVMs once a batch has committed:
    # its tasks fail, the master launches a new executor on the freed worker core, the
    # tasks run again, and the run ends normally.
    settings = {"bootstrap.servers": bootstrap_servers}
    source, events = load(bootstrap_servers, topic)
    path = write_pipeline(tmp_path, source, bootstrap_servers, cluster, max_batch_events=250)
    pipeline = load_pipeline(path)
    log = tmp_path / "engine.log"
    with running(start_engine(path, log, idle=8)) as proc:
        app = wait_for("application on the cluster", lambda: app_id(cluster, pipeline), proc, log)
        wait_for("two executors", lambda: len(executors(cluster, app)) == 2, proc, log)
        batches, _ = wait_for("committed batch", lambda: first_commit(pipeline, settings), proc, log, every=0.3)
        os.kill(min(executors(cluster, app)), signal.SIGKILL)
        _, records = committed(pipeline, settings)  # at most what was committed at the kill
        replaced = wait_for("new executor", lambda: len(executor_dirs(cluster, app)) > 2, proc, log)
        code, err = finish(proc, log)
    assert code == 0, err[-4000:]
    assert records < events, f"the run had committed everything ({records}) before the kill: nothing was tested"
    assert replaced and len(executor_dirs(cluster, app)) >= 3
    assert_exact(pipeline, bootstrap_servers, events)
    assert committed(pipeline, settings)[0] > batches


@pytest.mark.slow  # the regrouping view's driver is killed the same way (module docstring)
def test_the_driver_killed_mid_run_then_run_again(
    cluster: localspark.ClusterInfo, bootstrap_servers: str, topic, tmp_path: Path
) -> None:
    # kill -9 of `refold run` (its whole session: the Python driver and its JVM) once a
    # batch has committed; the cluster ends the application and its executors; a new
    # run fences the shards, continues from their checkpoints and counts every event once.
    settings = {"bootstrap.servers": bootstrap_servers}
    source, events = load(bootstrap_servers, topic)
    path = write_pipeline(tmp_path, source, bootstrap_servers, cluster, max_batch_events=300)
    pipeline = load_pipeline(path)
    log = tmp_path / "engine.log"
    with running(start_engine(path, log, idle=4)) as proc:
        app = wait_for("application on the cluster", lambda: app_id(cluster, pipeline), proc, log)
        wait_for("committed batch", lambda: committed(pipeline, settings)[0] > 0, proc, log, every=0.3)
        kill_session(proc)
    _, records = committed(pipeline, settings)
    assert 0 < records < events, f"{records} of {events} events committed at the kill: nothing was tested"
    wait_for("the killed run's executors to end", lambda: not executors(cluster, app), timeout=60)

    log2 = tmp_path / "engine-again.log"
    with running(start_engine(path, log2, idle=3)) as again:
        code, err = finish(again, log2)
    assert code == 0, err[-4000:]
    assert_exact(pipeline, bootstrap_servers, events)


def test_a_regrouping_view_in_shards_survives_its_driver_killed(
    cluster: localspark.ClusterInfo, bootstrap_servers: str, topic, tmp_path: Path
) -> None:
    # stage 1 per source partition, the close, stage 2 per shard, as tasks on the
    # cluster's executors; kill -9 of `refold run` (its whole session: the Python driver
    # and its JVM) mid-run: the cluster ends the application and its executors; a new
    # run fences the shards, closes and reduces what the old run's stage 1 committed,
    # and counts every event once.
    # In the new run, stage 2's tasks (no input of Spark's) each prefer executor (shard
    # mod 2) (refold.spark.placement), so batch after batch a shard runs in the same
    # host, which starts once. Both executors registered before the first job, as the
    # test asks Spark.
    settings = {"bootstrap.servers": bootstrap_servers}
    source, events = load(bootstrap_servers, topic)
    path = write_pipeline(tmp_path, source, bootstrap_servers, cluster, max_batch_events=300, regroup=True,
                          conf={"spark.scheduler.minRegisteredResourcesRatio": "1.0"})
    pipeline = load_pipeline(path)
    stage2 = view_pipeline(pipeline)
    log = tmp_path / "engine.log"
    with running(start_engine(path, log, idle=4)) as proc:
        app = wait_for("application on the cluster", lambda: app_id(cluster, pipeline), proc, log)
        wait_for("committed batch", lambda: committed(pipeline, settings)[0] > 0, proc, log, every=0.3)
        kill_session(proc)
    _, records = committed(pipeline, settings)
    assert 0 < records < events, f"{records} of {events} events committed at the kill: nothing was tested"
    before = max((c.batch for c in load_checkpoints(stage2, settings).values()), default=0)
    wait_for("the killed run's executors to end", lambda: not executors(cluster, app), timeout=60)
    log2 = tmp_path / "engine-again.log"
    with running(start_engine(path, log2, idle=3)) as again:
        code, err = finish(again, log2)
    assert code == 0, err[-4000:]
    assert_exact(pipeline, bootstrap_servers, events)
    shards = load_checkpoints(stage2, settings)
    assert sorted(shards) == [0, 1], shards  # stage 2: both shards
    assert min(c.batch for c in shards.values()) >= before + 3, (before, shards)  # ran often enough to move
    starts = re.findall(r"stage 2 shard (\d) started on worker pid (\d+)", err)
    assert sorted(shard for shard, _ in starts) == ["0", "1"], (starts, err[-3000:])
    assert len({pid for _, pid in starts}) == 2, starts


def test_a_spark_worker_killed_mid_run_the_other_takes_over(
    cluster: localspark.ClusterInfo, bootstrap_servers: str, topic, tmp_path: Path
) -> None:
    # kill -9 of a whole worker (its JVM and its executor, one process group) once a batch
    # has committed: the master marks it DEAD, the tasks run again on the other worker's
    # executor. The worker is started again afterwards (same master), for later tests.
    settings = {"bootstrap.servers": bootstrap_servers}
    source, events = load(bootstrap_servers, topic)
    path = write_pipeline(tmp_path, source, bootstrap_servers, cluster, max_batch_events=250)
    pipeline = load_pipeline(path)
    log = tmp_path / "engine.log"
    home = cluster.home.parent
    try:
        with running(start_engine(path, log, idle=8)) as proc:
            app = wait_for("application on the cluster", lambda: app_id(cluster, pipeline), proc, log)
            wait_for("an executor on each worker", lambda: len(set(executors(cluster, app).values())) == 2, proc, log)
            wait_for("committed batch", lambda: committed(pipeline, settings)[0] > 0, proc, log, every=0.3)
            assert localspark.kill_worker(0, home=home)
            _, records = committed(pipeline, settings)
            # nothing of worker 0 is left: no executor, no Python worker in its work dir
            work = f"{cluster.home / 'work' / 'worker-0'}{os.sep}"
            wait_for("worker-0's processes to end",
                     lambda: not [proc for proc in sparkprocs.processes() if proc.cwd.startswith(work)], proc, log, timeout=30)
            code, err = finish(proc, log)
        assert code == 0, err[-4000:]
        assert records < events, f"the run had committed everything ({records}) before the kill: nothing was tested"
        state = localspark.status(home)
        assert state is not None and state.workers[0].pid is None and state.workers[1].alive
        assert_exact(pipeline, bootstrap_servers, events)
    finally:
        again = localspark.start(home=home, quiet=True, die_with_parent=True)
    assert len(again.alive_workers) == 2 and again.url == cluster.url
