"""The benches' own contenders still run. `make bench` is not part of `make test`, so a
contender that an engine change broke would show only there: the spark-sink contender
(Refold's reducer behind Spark's Kafka sink, `bench.baseline`) overrides
`ShardProcessor._load`, and an engine change out of step with that override fails it."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.baseline import run_baseline
from bench.cleanup import _left, bench_topics, clean
from bench.run import pipeline
from bench.spark_sql import expected_sums
from refold.cli.produce import produce
from refold.dev.localkafka import kafka_home
from refold.dev.testing import Workload, generate
from refold.kafka.io import TopicSpec, admin_client, ensure_topics, list_topics, read_to_end

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


def test_the_spark_sink_contender_reduces_every_event(spark: Any, bootstrap_servers: str, topic,
                                                      tmp_path: Path) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=2)
    rows = list(generate(Workload(events=600, keys=40, seed=3)))
    produce(settings, source, [orjson.dumps(r) for r in rows], ["player_name"], progress=False, per_transaction=600)
    p = pipeline(f"bench-sink-{uuid.uuid4().hex[:8]}", source, bootstrap_servers, 200, state_dir=tmp_path / "state")
    progress = run_baseline(p, bootstrap_servers, spark, until_idle=1.0)
    assert progress.failure is None and progress.events == len(rows)
    assert p.outputs.view is not None
    # Spark's sink keeps no order within a batch, so each key's expected row is looked for
    # among its view records (`+A`/`+C`), not as the last one
    shown: dict[str, set[tuple[int, int]]] = {}
    for message in read_to_end(settings, p.outputs.view.topic):
        value = orjson.loads(message.value())
        if value["op"] in ("+A", "+C"):
            shown.setdefault(value["player_name"], set()).add((value["total"], value["games"]))
    expected = {key: sums for key, sums in expected_sums(rows).items() if sums[1] > 0}
    assert expected and all(sums in shown.get(key, set()) for key, sums in expected.items()), (expected, shown)


def test_bench_clean_deletes_the_benches_topics_and_their_files(kafka_broker: Any) -> None:
    """`make bench-clean`: every topic a bench named (`bench-…`, `hotpath-…`) goes, with its
    log folders; any other topic stays."""
    settings = {"bootstrap.servers": kafka_broker.bootstrap}
    run = uuid.uuid4().hex[:8]
    made, kept = [f"bench-{run}.view", f"hotpath-{run}"], f"kept-bench-{run}"
    ensure_topics(settings, [TopicSpec(made[0], 2), TopicSpec(made[1], 1), TopicSpec(kept, 1)])
    data = kafka_home(kafka_broker.home) / "data" if kafka_broker.home is not None else None
    if data is not None:  # a folder per partition, made once the broker leads it
        deadline = time.monotonic() + 30
        while len(_left(data, set(made))) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_left(data, set(made))) == 3

    deleted = clean(settings, data, wait=60.0)

    assert set(made) <= set(deleted) and kept not in deleted
    assert bench_topics(deleted) == deleted
    names = list_topics(admin_client(settings)).topics
    assert not set(made) & set(names) and kept in names
    if data is not None:
        assert _left(data, set(made)) == []
        assert _left(data, {kept})



def test_the_hot_path_bench_sends_the_same_records_from_memory_as_from_the_store(kafka_broker: Any, capsys) -> None:
    """`python -m bench.hotpath --store memory` overrides the shard's store and loading
    (`MemoryDryShard`): its reducer and its native core hold every key across batches,
    and send what the shards over their stores send."""
    from bench.hotpath import main

    sent = {}
    for store, cores in (("memory", "python,native"), ("rocksdb", "native")):
        assert main(["--store", store, "--events", "2000", "--keys", "300", "--batch", "500", "--repeat", "1",
                     "--core", cores]) == 0
        sent[store] = [line.split(", ")[1] for line in capsys.readouterr().err.splitlines() if " run 1: " in line]
    assert len(sent["memory"]) == 2 and len(set(sent["memory"])) == 1, sent
    assert sent["rocksdb"] == sent["memory"][:1], sent


def test_the_join_hot_path_runs_its_view_in_one_call_as_in_two() -> None:
    """`python -m bench.hotpath --view join --core view,view-read` times the same work:
    the join and the view over it write as many records either way."""
    from bench.hotpath_join import batches, run_view, workload

    cut = batches(workload(2_000, 200), 500)
    assert run_view(cut, fused=True) == run_view(cut, fused=False) > 2_000


def test_the_join_shard_hot_path_writes_the_same_view_on_each_core(kafka_broker: Any) -> None:
    """`python -m bench.hotpath --view join-shard` times the same work on each core: the
    native reading, the Python readers and the Python reducers write the same view
    records, and the native reading read every batch itself."""
    from bench.hotpath_joinshard import input_records, run
    from refold.dev.joinload import JoinWorkload
    from refold.kafka.io import read_to_end
    from refold.runtime.joins import JoinShardProcessor

    records = input_records(JoinWorkload(orders=3_000, customers=150))
    read_natively = JoinShardProcessor._read_natively
    native = []

    def counted(shard: Any, fresh: Any, out: Any) -> Any:
        pending = read_natively(shard, fresh, out)
        native.append(pending is not None)
        return pending

    views = {}
    run_id = uuid.uuid4().hex[:8]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(JoinShardProcessor, "_read_natively", counted)
        for core in ("read", "decode", "python"):
            native.clear()
            name = f"hotpath-join-{core}-{run_id}"
            assert run(records, kafka_broker.bootstrap, core, 1_000, name) > 0
            views[core] = [(m.key(), m.value()) for m in read_to_end({"bootstrap.servers": kafka_broker.bootstrap},
                                                                     f"{name}.view")]
            if core == "read":
                assert native and all(native), native
    assert views["read"] == views["decode"] == views["python"] and len(views["read"]) > 3_000
