"""The shards' Spark tasks under failure: a Python worker killed mid-batch, a task run
again after its transaction committed, two attempts of one shard at once, a newer
engine run taking the shards over. Exactly once after each, checked against the
reference (`refold verify`)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import engine_runs
import orjson
import pyarrow as pa
import pytest
from engine_runs import assert_exact, load_source

from refold.cli.produce import produce
from refold.config import Pipeline, load_pipeline
from refold.dev.testing import Workload, generate
from refold.errors import UserError
from refold.kafka.io import ensure_topics, read_to_end
from refold.kafka.transactions import TransactionalWriter
from refold.ops.verify import verify
from refold.recovery.claims import _claim, claim_shards
from refold.recovery.restore import load_checkpoints
from refold.runtime.hooks import NO_HOOKS
from refold.spark.job import engine_topics
from refold.spark.tasks import ShardTask, check_files

pytestmark = [pytest.mark.kafka, pytest.mark.spark]



def write_pipeline(tmp: Path, source: str, bootstrap: str, **spark: Any) -> Path:
    return engine_runs.write_pipeline(tmp, source, bootstrap, spark=spark, trigger="200ms", max_batch_events=300)


def run_engine(path: Path, env: dict[str, str] | None = None, idle: float = 1.0) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("REFOLD_TEST_")}
    clean.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "refold.cli", "run", str(path), "--until-idle", str(idle)],
        env=clean, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


@pytest.fixture
def loaded_source(bootstrap_servers: str, topic) -> tuple[str, int]:
    return load_source(bootstrap_servers, topic, partitions=3, events=1500, keys=100, seed=7)


@pytest.mark.parametrize("where", ["mid_batch:2"])  # in_txn and after_commit: tests/test_cluster.py
def test_a_python_worker_killed_in_a_shards_task_is_run_again(bootstrap_servers, loaded_source, tmp_path,
                                                              where) -> None:
    # The first worker to reach the point kills itself (kill -9); Spark runs the task
    # again on a new worker, which fences the dead one's transaction, reads the shard's
    # checkpoint and store, and commits what is not committed yet. The engine goes on.
    source, events = loaded_source
    path = write_pipeline(tmp_path, source, bootstrap_servers)
    done = run_engine(path, {"REFOLD_TEST_CRASH_WORKER": where})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kill -9 of Python worker" in done.stderr, done.stderr[-3000:]
    assert "ran again as attempt 1 of its task" in done.stderr, done.stderr[-3000:]  # the driver says so
    assert_exact(load_pipeline(path), bootstrap_servers, events)


@pytest.mark.parametrize("hosted", [True, False])
def test_each_shard_stays_in_one_host_whichever_worker_runs_its_task(bootstrap_servers, loaded_source, tmp_path,
                                                                     hosted) -> None:
    # local[2]: one executor, two Python workers, 3 shards, 5 batches. Spark gives each
    # task to either worker; the shard's host (refold.spark.hosts) keeps its processor,
    # so each shard starts once, and its store open: no store is opened again (which
    # flushes RocksDB's log as one more file) at each batch. With REFOLD_SHARD_HOSTS=0
    # the workers run the shards themselves, as before (shards then move between them,
    # and close their stores after each batch). Exact either way.
    source, events = loaded_source
    path = write_pipeline(tmp_path, source, bootstrap_servers, state_dir=str(tmp_path / "state"))
    done = run_engine(path, {} if hosted else {"REFOLD_SHARD_HOSTS": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    starts = [line for line in done.stderr.splitlines() if " started on worker pid " in line]
    shards = sorted(int(line.split("shard ")[1].split()[0]) for line in starts)
    if hosted:
        assert shards == [0, 1, 2], "\n".join(starts)
    else:
        assert set(shards) == {0, 1, 2}, "\n".join(starts)
    assert_exact(load_pipeline(path), bootstrap_servers, events)
    assert _hosts_without_daemon(deadline=10.0) == []  # a host ends with its executor
    stores = sorted((tmp_path / "state").glob("*/*/[0-9]"))
    files = {store.name: len(list(store.glob("*.sst"))) for store in stores}
    assert len(files) == 3, stores
    if hosted:
        assert max(files.values()) <= 1, files
    else:
        assert min(files.values()) >= 2, files  # opened again at every batch


def _hosts_without_daemon(deadline: float) -> list[str]:
    """Shard hosts (processes named `refold-host`) whose parent is no longer an executor's
    daemon (they are its children while it lives), still there after `deadline` seconds."""
    import time

    def read(path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError:
            return b""

    ends = time.monotonic() + deadline
    while True:
        orphans = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if read(f"/proc/{pid}/comm").strip() != b"refold-host":
                continue
            parent = read(f"/proc/{pid}/stat").rsplit(b")", 1)[-1].split()[1:2]
            if parent and b"daemon" not in read(f"/proc/{parent[0].decode()}/cmdline"):
                orphans.append(f"pid {pid}, parent {parent[0].decode()}")
        if not orphans or time.monotonic() >= ends:
            return orphans
        time.sleep(0.2)


def _task_in_a_process(pipeline_json: str, settings: dict[str, Any], records: list[tuple[int, int, bytes, bytes]],
                       run: int, state_dir: str, out: Any) -> None:
    """One attempt of shard 0's task, in a process of its own (as on another executor)."""
    pipeline = Pipeline.model_validate_json(pipeline_json)
    pipeline = pipeline.model_copy(update={"spark": pipeline.spark.model_copy(update={"state_dir": state_dir})})
    batch = pa.RecordBatch.from_pylist(
        [{"partition": p, "offset": o, "key": k, "value": v, "ts": 0} for p, o, k, v in records],
        schema=pa.schema([("partition", pa.int32()), ("offset", pa.int64()), ("key", pa.binary()),
                          ("value", pa.binary()), ("ts", pa.int64())]),
    )
    task = ShardTask(pipeline, settings, NO_HOOKS, run, 1, first_of_run=False)
    rows = [row for summary in task(iter([batch])) for row in summary.to_pylist()]
    out.put(rows)


@pytest.mark.parametrize("same_machine", [True, False])
def test_two_attempts_of_one_shard_at_once_commit_it_once(bootstrap_servers, topic, tmp_path, same_machine) -> None:
    # Two attempts of shard 0's task over the same records, in two processes at once: on
    # one machine the store's lock puts one after the other; on two (separate state
    # directories) the writers' fences do. Either way the records count once.
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=1)
    rows = list(generate(Workload(events=400, keys=40, seed=5)))
    values = [orjson.dumps(r) for r in rows]
    produce(settings, source, values, ["player_name"], progress=False, per_transaction=400)
    records = [(m.partition(), m.offset(), m.key(), m.value()) for m in read_to_end(settings, source)]
    path = write_pipeline(tmp_path, source, bootstrap_servers)
    pipeline = load_pipeline(path)
    ensure_topics(settings, engine_topics(pipeline, 1))
    run = 1
    claim_shards(pipeline, settings, [0], run, 1)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    dirs = [tmp_path / "state-a", tmp_path / "state-a" if same_machine else tmp_path / "state-b"]
    attempts = [context.Process(target=_task_in_a_process,
                                args=(pipeline.model_dump_json(), settings, records, run, str(d), out)) for d in dirs]
    for attempt in attempts:
        attempt.start()
    summaries = [out.get(timeout=300) for _ in attempts]
    for attempt in attempts:
        attempt.join(60)
        assert attempt.exitcode == 0
    rows_out = [row for summary in summaries for row in summary]
    committed = [row for row in rows_out if row["error_kind"] is None and row["records_in"] > 0]
    assert len(committed) == 1, rows_out  # one attempt committed the records, the other nothing
    assert all(row["error_kind"] in (None, "fenced", "operational") for row in rows_out), rows_out
    checkpoint = load_checkpoints(pipeline, settings)[0]
    assert checkpoint.records_in == len(rows) and checkpoint.batch == 1
    report = verify(pipeline, settings)
    assert report.anomalies == [], "\n".join(report.anomalies)


def test_a_newer_run_takes_the_shards_over(bootstrap_servers, topic, tmp_path) -> None:
    # A task of an older engine run that finds a shard claimed by a newer run stops with
    # FencedError (the older engine then stops), and commits nothing.
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=1)
    produce(settings, source, [orjson.dumps(r) for r in generate(Workload(events=50, keys=5, seed=2))],
            ["player_name"], progress=False, per_transaction=50)
    records = [(m.partition(), m.offset(), m.key(), m.value()) for m in read_to_end(settings, source)]
    pipeline = load_pipeline(write_pipeline(tmp_path, source, bootstrap_servers))
    ensure_topics(settings, engine_topics(pipeline, 1))
    claim_shards(pipeline, settings, [0], 2, 1)  # run 2 started after run 1
    batch = pa.RecordBatch.from_pylist(
        [{"partition": p, "offset": o, "key": k, "value": v, "ts": 0} for p, o, k, v in records])
    older = ShardTask(pipeline, settings, NO_HOOKS, 1, 1, first_of_run=False)
    [summary] = [row for out in older(iter([batch])) for row in out.to_pylist()]
    assert summary["error_kind"] == "fenced" and "newer engine run" in summary["error"]
    assert load_checkpoints(pipeline, settings)[0].batch == 0  # nothing committed


def test_a_file_an_executor_lacks_is_named(tmp_path) -> None:
    # Kafka settings that name files (a truststore, a client key) need them on every
    # executor's machine: a missing one is a clear error naming the setting and host.
    present = tmp_path / "ca.pem"
    present.write_text("-----BEGIN CERTIFICATE-----\n")
    check_files({"ssl.ca.location": str(present), "sasl.password": "x"})
    with pytest.raises(UserError, match=r"kafka\.ssl\.ca\.location: .*missing\.pem does not exist on the Spark "
                                        r"executor on host"):
        check_files({"ssl.ca.location": str(tmp_path / "missing.pem")})


def test_a_shard_task_never_shows_its_settings(tmp_path) -> None:
    # Spark prints a plan's Python function by name and may repr it: the pickled task
    # carries the Kafka settings, passwords included.
    pipeline = load_pipeline(write_pipeline(tmp_path, "src", "127.0.0.1:9"))
    task = ShardTask(pipeline, {"bootstrap.servers": "127.0.0.1:9", "sasl.password": "hunter2-secret"}, NO_HOOKS,
                     7, 1, first_of_run=True)
    shown = f"{task!r} {task} {task.__name__}"
    assert "hunter2-secret" not in shown and pipeline.pipeline in shown


def test_a_claim_fenced_by_an_older_runs_task_is_made_again(bootstrap_servers, topic, tmp_path) -> None:
    # Between the driver's fence and its claim's commit, an older run's task starts the
    # shard again and initialises the same transactional id (fencing the claim's writer):
    # the claim is made again, so the newer run holds the shard.
    settings = {"bootstrap.servers": bootstrap_servers}
    pipeline = load_pipeline(write_pipeline(tmp_path, topic(partitions=1), bootstrap_servers))
    ensure_topics(settings, engine_topics(pipeline, 1))
    claim_writer = TransactionalWriter(settings, pipeline.transactional_id(0), timeout_ms=60_000, label="the claim")
    older_task = TransactionalWriter(settings, pipeline.transactional_id(0), timeout_ms=60_000,
                                    label="an older run's task")
    try:
        claim_writer.initialise()
        older_task.initialise()  # fences the claim's writer
        claimed = _claim(pipeline, settings, claim_writer, 0, 42, 0, None)
    finally:
        claim_writer.close()
        older_task.close()
    assert claimed.run == 42
    assert load_checkpoints(pipeline, settings)[0].run == 42  # committed


def test_cluster_jvms_run_c1_only_local_mode_keeps_the_default_jit() -> None:
    from refold.spark.job import java_options

    local = java_options("local[2]")
    assert local == {"spark.driver.extraJavaOptions": "-Dlog4j2.level=WARN"}  # HotSpot's default JIT
    cluster = java_options("spark://127.0.0.1:7077")
    assert "-XX:TieredStopAtLevel=1" in cluster["spark.executor.extraJavaOptions"]
    assert cluster["spark.driver.extraJavaOptions"].split() == ["-Dlog4j2.level=WARN", "-XX:TieredStopAtLevel=1"]


def test_aborts_count_up_when_a_shard_gets_a_new_processor_or_skips_a_batch() -> None:
    # each summary carries its processor's count so far; a shard without records in a
    # batch reports nothing, a new processor counts from 0 again: the run's total never
    # goes down (a Prometheus counter refuses that, and the engine stopped on it)
    from refold.spark.job import _Batches

    batches = object.__new__(_Batches)
    batches._aborts = {}

    def row(shard: int, worker: int, aborts: int) -> dict[str, int]:
        return {"shard": shard, "worker": worker, "aborts": aborts}

    assert batches._new_aborts([row(0, 1, 2), row(1, 1, 1)], []) == 3
    assert batches._new_aborts([row(0, 1, 2)], [row(0, 1, 1)]) == 1  # shard 1 skipped; stage 2's shard 0
    assert batches._new_aborts([row(0, 2, 0), row(1, 1, 1)], [row(0, 1, 1)]) == 0  # shard 0 moved
    assert batches._new_aborts([row(0, 1, 1)], []) == 1  # a new processor on worker 1 again
