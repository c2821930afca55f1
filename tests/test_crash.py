"""kill -9 of the engine process at chosen moments, restarts, zombies: still exactly once.

The crash points are in the shards' Spark tasks (`refold.runtime.hooks`); the engine
runs on `local[1]` here, so the shards' tasks of a batch run one after the other, in
shard order, and "the first shard to reach batch 3" is shard 0.

Three tests here, and the global Top-N test killed at each point (in `make test` it is
killed inside a transaction only), are marked slow (`make test-slow`, which CI runs
after `make test`): each repeats a proof that a faster test in `make test` makes.

- A regrouping grouped view killed at each point: the global Top-N test here kills
  the same stages (stage 1 routing, stage 2 in three shards over the source keyed by
  player) inside a transaction, and adds stage 3 (at each point too, in
  `make test-slow`); kill -9 at each point of a batch is
  `test_kill_9_at_each_point_then_restart`; a regrouping view's driver killed
  mid-run is `test_cluster.test_a_regrouping_view_in_shards_survives_its_driver_killed`,
  and its restart `test_exchange.test_the_engine_runs_a_regrouping_view_in_shards_exactly_once_across_a_restart`.
- Two engines at once: `test_processor.test_a_zombie_fenced_while_it_sends_stops_and_leaves_the_new_instance_alone`
  runs the same fence on the shard processor the engine runs (the newer instance's
  init fences the older, which stops without retrying and leaves the newer committing),
  and `test_localkafka.test_second_producer_with_the_same_id_fences_the_first` the
  broker's side of it.
- A batch outliving its transaction timeout:
  `test_processor.test_a_batch_outliving_its_transaction_timeout_is_replayed_not_taken_for_a_fence`
  stalls the same transaction of the shard processor the engine runs past a 2s
  timeout: the coordinator's abort is told from a fence, the batch replayed once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from engine_runs import assert_exact, load_source

from refold.config import Pipeline, load_pipeline
from refold.kafka.io import ensure_topics, partitions_of, read_to_end
from refold.recovery.restore import load_checkpoints
from refold.runtime.batch import InputRecord
from refold.runtime.exchange import view_pipeline
from refold.runtime.processor import BatchProcessor
from refold.runtime.tops import rank_pipeline
from refold.spark.job import engine_topics, spark_checkpoint_dir

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

COLUMNS = {"total": {"sum": "score"}, "best": {"max": "score"}, "n": {"count": "*"}, "latest": {"last": "score"}}


def write_pipeline(tmp: Path, source: str, bootstrap: str, top_n: dict[str, Any] | None = None,
                   key: str = "player_name") -> Path:
    """The crash tests' pipeline: totals per player (or per `key`); with `top_n`, that
    Top-N. Over the source keyed by player, a Top-N or a view keyed otherwise re-groups,
    in as many shards as partitions."""
    name = f"c{uuid.uuid4().hex[:10]}"
    path = tmp / f"{name}.yaml"
    view = {"top_n": top_n} if top_n else {"key": [key], "columns": COLUMNS}
    outputs = {"view": {"topic": f"{name}.view"}} | ({} if top_n else {"delta": {"topic": f"{name}.delta"}})
    regroups = top_n is not None or key != "player_name"
    path.write_text(
        yaml.safe_dump(
            {
                "pipeline": name,
                "kafka": {"bootstrap.servers": bootstrap},
                "source": {"topic": source} | ({"key": ["player_name"]} if regroups else {}),
                "view": view,
                "outputs": outputs,
                "trigger": "200ms",
                "max_batch_events": 250,
                "spark": {"master": "local[1]", "checkpoint_dir": str(tmp / "spark" / name),
                          "conf": {"spark.ui.enabled": "false"}},
            }
        )
    )
    return path


def start_engine(path: Path, *, crash: str | None = None, idle: float = 1.0, extra_env: dict[str, str] | None = None,
                 stderr: Any = subprocess.PIPE) -> subprocess.Popen[bytes]:
    # a run's input is in the source before it starts: it ends once Spark's query has no
    # data available and has had none for `idle` seconds (the last batch's later stages done)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFOLD_TEST_")}
    if crash:
        env["REFOLD_TEST_CRASH"] = crash
    env.update(extra_env or {})
    return subprocess.Popen(
        [sys.executable, "-m", "refold.cli.main", "run", str(path), "--until-idle", str(idle)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[bytes], timeout: float = 300) -> tuple[int, str]:
    _out, err = proc.communicate(timeout=timeout)
    return proc.returncode, (err or b"").decode(errors="replace")


def wait_for_line(proc: subprocess.Popen[bytes], log: Path, text: bytes, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


@pytest.fixture
def loaded_source(bootstrap_servers: str, topic) -> tuple[str, int]:
    return load_source(bootstrap_servers, topic, partitions=3, events=1500, keys=100, seed=99)


def test_kill_9_at_each_point_then_restart(bootstrap_servers, loaded_source, tmp_path) -> None:
    # One pipeline killed three times, at each point of a batch in turn, each restart
    # going on from what the one before committed:
    # - right after the commit of batch 1 (not yet in the local store or Spark's
    #   checkpoint): batches are atomic per shard, so the shard whose task ran first
    #   committed its part of batch 1 and the two others did not; the restarts run their
    #   parts (and nothing of the first's) again;
    # - inside that shard's transaction of its batch 2 (records sent, not committed), and
    #   Spark's checkpoint folder lost too: the next run starts from what Kafka says;
    # - in its batch 3, decoded, nothing sent.
    # Then the view's records and cause headers are one clean run's, and the trace index
    # answers as the scan (test_provenance and test_trace_index prove them without kills).
    source, events = loaded_source
    path = write_pipeline(tmp_path, source, bootstrap_servers)
    pipeline = load_pipeline(path)
    settings = {"bootstrap.servers": bootstrap_servers}
    first = -1  # the shard whose task ran first, the only one to get to batches 2 and 3 first
    for crash, batch in (("after_commit:1", 1), ("in_txn:2", 1), ("mid_batch:3", 2)):
        code, err = finish(start_engine(path, crash=crash))
        assert code == -9, f"{crash}: {err[-2000:]}"
        shards = {index: c for index, c in load_checkpoints(pipeline, settings).items() if c.batch > 0}
        if first < 0:  # its part of batch 1 committed, nothing of the others'
            [(first, checkpoint)] = shards.items()
            assert checkpoint.batch == 1 and set(checkpoint.offsets) == {first}, shards
        assert shards[first].batch == batch, (crash, shards)  # what it had committed before the kill
        assert all(c.batch <= batch for c in shards.values()), (crash, shards)
        if crash.startswith("in_txn"):
            shutil.rmtree(spark_checkpoint_dir(pipeline))
    code, err = finish(start_engine(path))
    assert code == 0, err[-3000:]
    assert_exact(pipeline, bootstrap_servers, events)
    assert sorted(load_checkpoints(pipeline, settings)) == [0, 1, 2]
    assert_causes_as_one_clean_run(pipeline, source, tmp_path, bootstrap_servers)


def assert_causes_as_one_clean_run(crashed: Pipeline, source: str, tmp: Path, bootstrap: str) -> None:
    """The killed and restarted run's view records, cause headers included, are those of
    the same input reduced in one batch without a crash (the output is a pure function of
    the input); and its trace index: the aborted transactions' index records are not
    read, the replayed batches write theirs once, every trace through it is the scan's."""
    from test_trace_index import assert_index_answers_as_the_scan

    settings = {"bootstrap.servers": bootstrap}
    clean = load_pipeline(write_pipeline(tmp, source, bootstrap))
    partitions = len(partitions_of(settings, source))
    ensure_topics(settings, engine_topics(clean, partitions))
    records = [InputRecord(msg.partition(), msg.offset(), msg.key(), msg.value(), msg.timestamp()[1])
               for msg in read_to_end(settings, source)]
    processor = BatchProcessor(clean, settings)
    try:
        processor.process(records)
    finally:
        processor.close()

    def written(topic_name: str) -> dict[int, list[Any]]:
        by_partition: dict[int, list[Any]] = {}
        for msg in read_to_end(settings, topic_name):
            by_partition.setdefault(msg.partition(), []).append((msg.key(), msg.value(), msg.headers()))
        return by_partition

    assert crashed.outputs.view is not None and clean.outputs.view is not None
    view = written(crashed.outputs.view.topic)
    assert view == written(clean.outputs.view.topic)
    assert sum(len(records) for records in view.values()) > 100
    assert all(headers for records in view.values() for _key, _value, headers in records)
    assert assert_index_answers_as_the_scan(crashed, settings, source, inputs=10) == sum(map(len, view.values()))


@pytest.mark.parametrize("crashes", [
    pytest.param(("in_txn:3",), id="in-txn"),
    # slow: the two other points repeat test_kill_9_at_each_point_then_restart's
    pytest.param(("mid_batch:2", "in_txn:3", "after_commit:4"), marks=pytest.mark.slow, id="each-point"),
])
def test_a_global_top_n_in_shards_killed_at_each_point_then_restarted(bootstrap_servers, loaded_source,
                                                                      tmp_path, crashes) -> None:
    # Three stages: the points fall in stage 2 (its batches count the start's catch-up
    # too, so it reaches each batch number first), whose shards then stand at different
    # batches and whose local-top changes wait in P.tops for stage 3: each restart
    # closes and ranks what the stages before it left. `make test` kills it inside a
    # transaction only; `make test-slow` at each point.
    source, events = loaded_source
    path = write_pipeline(tmp_path, source, bootstrap_servers, top_n={"n": 3, "order_by": {"score": "desc"}})
    pipeline = load_pipeline(path)
    settings = {"bootstrap.servers": bootstrap_servers}
    stage2 = view_pipeline(pipeline.model_copy(update={"shards": 3}))
    for crash in crashes:
        code, err = finish(start_engine(path, crash=crash))
        assert code == -9, f"{crash}: {err[-2000:]}"
        if crash == "mid_batch:2":  # stage 1 committed Spark's first batch, stage 2 only the start's catch-up
            assert {c.batch for c in load_checkpoints(pipeline, settings).values()} == {1}
            assert {c.batch for c in load_checkpoints(stage2, settings).values()} == {1}
    code, err = finish(start_engine(path))
    assert code == 0, err[-3000:]
    assert_exact(pipeline, bootstrap_servers, events)
    assert sorted(load_checkpoints(stage2, settings)) == [0, 1, 2]
    assert load_checkpoints(rank_pipeline(pipeline), settings)[0].batch > 0  # stage 3 ranked it


@pytest.mark.slow  # the Top-N test above kills the same two stages (module docstring)
def test_a_regrouping_grouped_view_killed_at_each_point_then_restarted(bootstrap_servers, loaded_source,
                                                                      tmp_path) -> None:
    # totals per team over the source keyed by player: stage 1 (the native reader and
    # router, for the batches it takes) and stage 2 in 3 shards, killed in each stage's
    # batches, then exact
    source, events = loaded_source
    path = write_pipeline(tmp_path, source, bootstrap_servers, key="team")
    pipeline = load_pipeline(path)
    settings = {"bootstrap.servers": bootstrap_servers}
    for crash in ("mid_batch:2", "in_txn:3", "after_commit:4"):
        code, err = finish(start_engine(path, crash=crash))
        assert code == -9, f"{crash}: {err[-2000:]}"
    code, err = finish(start_engine(path))
    assert code == 0, err[-3000:]
    assert_exact(pipeline, bootstrap_servers, events)
    assert sorted(load_checkpoints(view_pipeline(pipeline.model_copy(update={"shards": 3})), settings)) == [0, 1, 2]


@pytest.mark.slow  # test_processor's zombie test fences the same processor (module docstring)
def test_two_engines_at_once_one_is_fenced(bootstrap_servers, loaded_source, tmp_path) -> None:
    source, events = loaded_source
    path = write_pipeline(tmp_path, source, bootstrap_servers)
    # The first engine stalls inside its first transaction until the second one has started
    # (its init_transactions fences the first). The first must stop with a clear message,
    # never commit. The stall ends on a file, not a clock: a loaded machine may take
    # longer than any fixed stall to start the second engine's Spark.
    log, log2, release = tmp_path / "first.log", tmp_path / "second.log", tmp_path / "release"
    with log.open("wb") as first_err, log2.open("wb") as second_err:
        first = start_engine(path, stderr=first_err, extra_env={
            "REFOLD_TEST_STALL_IN_TXN_SECONDS": "240", "REFOLD_TEST_STALL_UNTIL": str(release)})
        wait_for_line(first, log, b"stalling")
        second = start_engine(path, idle=5.0, stderr=second_err)
        wait_for_line(second, log2, b"recovered")  # logged once every shard is fenced and claimed
        release.touch()
        code2, _ = finish(second)
        code1, _ = finish(first)
    err1, err2 = log.read_text(), log2.read_text()
    assert code2 == 0, err2[-3000:]
    assert code1 != 0 and "fenced" in err1, err1[-3000:]
    assert_exact(load_pipeline(path), bootstrap_servers, events)


@pytest.mark.slow  # test_processor stalls the same shard processor past its timeout (module docstring)
def test_batch_outliving_the_transaction_timeout_is_replayed(bootstrap_servers, loaded_source, tmp_path) -> None:
    source, events = loaded_source
    path = write_pipeline(tmp_path, source, bootstrap_servers)
    # The first transaction stays open three times longer than transaction.timeout.ms: the
    # coordinator aborts it and bumps the epoch. The engine must see that this is its own
    # timeout (not a zombie fence), re-create the producer and replay from Kafka's offsets.
    code, err = finish(
        start_engine(
            path,
            extra_env={"REFOLD_TRANSACTION_TIMEOUT_MS": "4000", "REFOLD_TEST_STALL_IN_TXN_SECONDS": "12"},
        )
    )
    assert code == 0, err[-3000:]
    assert "stalling" in err and "re-initialising from Kafka" in err, err[-3000:]
    assert "fenced: another instance" not in err
    assert_exact(load_pipeline(path), bootstrap_servers, events)
