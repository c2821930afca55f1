"""Exactly once on a local three-broker KRaft cluster (`refold.dev.kafkacluster`):
replicated topics, and a pipeline that rides through kill -9 of the transaction
coordinator of a shard with an open transaction and of the leader of a source
partition.

The cluster runs in a temporary home on free ports beside the session's broker, and
stops at the end of the module. The check after the faults is the one of every
fault test (`engine_runs.assert_exact`: each view key's changelog equals the
reference record by record, every event counted once), and no partition of the
engine's topics is left with an open transaction (its last stable offset below its
high watermark: what `kafka-transactions.sh find-hanging` looks for, asked through
the admin API, since the broker's jars do not bring Kafka's command-line tools).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import engine_runs
import orjson
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic
from engine_runs import assert_exact

from refold.cli.produce import produce
from refold.config import load_pipeline
from refold.dev import kafkacluster, kafkaconfig, kafkahealth, localkafka
from refold.dev.kafkacluster import ClusterInfo
from refold.dev.testing import Workload, generate
from refold.kafka.io import (
    TopicSpec,
    durability_warnings,
    ensure_topics,
    open_transactions,
    partitions_of,
    read_to_end,
)
from refold.plan import plan_of
from refold.recovery.layout import settled
from refold.recovery.restore import load_checkpoints
from refold.spark.job import engine_topics, prepare_topics

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

BROKERS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterInfo, Path]]:
    home = tmp_path_factory.mktemp("cluster-home")
    port = kafkacluster.free_port_range(2 * BROKERS)
    try:
        info = kafkacluster.start(port, BROKERS, timeout=180.0, home=home, quiet=True, die_with_parent=True)
    except Exception as exc:  # no cluster: fail loudly, never skip
        pytest.fail(f"no local Kafka cluster: {exc}", pytrace=False)
    try:
        yield info, home
    finally:
        kafkacluster.stop(home=home)


# The cluster itself -------------------------------------------------------------------------


def test_cluster_nodes_settings_and_status(cluster) -> None:
    info, home = cluster
    assert [node.node_id for node in info.nodes] == [1, 2, 3]
    assert len({node.port for node in info.nodes} | {node.controller_port for node in info.nodes}) == 6
    assert all(node.alive and node.data_dir.is_dir() and node.log_file.exists() for node in info.nodes)
    text = (info.nodes[0].home / "server.properties").read_text()
    for line in ("default.replication.factor=3", "min.insync.replicas=2", "unclean.leader.election.enable=false",
                 "transaction.state.log.replication.factor=3", "transaction.state.log.min.isr=2",
                 "offsets.topic.replication.factor=3", "process.roles=broker,controller"):
        assert line in text.splitlines(), line
    assert kafkacluster.active_controller(info) in {1, 2, 3}
    lines = kafkahealth.report(info)
    assert "under-replicated partitions: 0" in "\n".join(lines)
    assert sum("alive" in line for line in lines) == 3
    # `refold kafka status` in that home: each broker, the controller, the partitions.
    shown = subprocess.run([sys.executable, "-m", "refold.cli.main", "kafka", "status"], capture_output=True,
                           text=True, env={**os.environ, "REFOLD_HOME": str(home)}, timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    assert f"broker 2  port {info.nodes[1].port}  alive" in shown.stdout
    assert "active controller: " in shown.stdout and "under-replicated partitions: 0" in shown.stdout
    # The single broker refuses to start in a home where the cluster runs.
    with pytest.raises(Exception, match="cluster runs in this home"):
        localkafka.start(localkafka.free_port(), home=home, quiet=True)


def test_cluster_settings_scale_with_the_brokers() -> None:
    assert kafkaconfig.cluster_settings(1)["default.replication.factor"] == "1"
    two = kafkaconfig.cluster_settings(2)
    assert (two["default.replication.factor"], two["min.insync.replicas"]) == ("2", "2")
    five = kafkaconfig.cluster_settings(5)
    assert (five["default.replication.factor"], five["transaction.state.log.min.isr"]) == ("3", "2")


def test_transactional_producers_cannot_drop_acks_all_or_idempotence() -> None:
    # Every record Refold writes goes through a transactional producer: librdkafka
    # refuses to make one that is not idempotent with acks=all.
    for weaker, refusal in (({"acks": "1"}, "acks"), ({"enable.idempotence": False}, "enable.idempotence")):
        with pytest.raises(Exception, match=refusal):
            Producer({"bootstrap.servers": "127.0.0.1:1", "transactional.id": "t", **weaker})


def test_topics_take_three_replicas_and_weak_ones_are_named(cluster) -> None:
    info, _home = cluster
    settings = {"bootstrap.servers": info.bootstrap}
    name = f"r-{uuid.uuid4().hex[:8]}"
    ensure_topics(settings, [TopicSpec(name, 2)])
    admin = AdminClient(settings)
    assert replicas_of(admin, name, 2) == [3, 3]
    assert durability_warnings(settings, [name]) == []
    one, loose = f"{name}-one", f"{name}-loose"
    futures = admin.create_topics([NewTopic(one, 1, 1), NewTopic(loose, 1, 3, config={"min.insync.replicas": "1"})])
    for future in futures.values():
        future.result(30)
    assert replicas_of(admin, one, 1) == [1] and replicas_of(admin, loose, 1) == [3]
    warnings = durability_warnings(settings, [name, one, loose])
    assert len(warnings) == 2, warnings
    assert one in warnings[0] and "one replica" in warnings[0] and loose not in warnings[0]
    assert loose in warnings[1] and "min.insync.replicas 1" in warnings[1] and one not in warnings[1]
    # A pipeline's replication_factor overrides the default.
    two = f"{name}-two"
    ensure_topics(settings, [TopicSpec(two, 1)], replication_factor=2)
    assert replicas_of(admin, two, 1) == [2]
    config = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, name)])
    [entries] = [future.result(30) for future in config.values()]
    assert entries["min.insync.replicas"].value == "2"  # the cluster's default


def test_partitions_of_finds_a_topic_just_created_elsewhere_and_names_a_missing_one(cluster) -> None:
    # A broker learns of a topic another just created a moment late: asked of another
    # broker at once, the topic is found (an engine's first start failed on its view
    # topic so); a topic that does not exist is still refused, after that wait.
    from refold.errors import UserError

    info, _home = cluster
    name = f"p-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": info.nodes[0].bootstrap})
    for future in admin.create_topics([NewTopic(name, 2, 3)]).values():
        future.result(30)
    assert partitions_of({"bootstrap.servers": info.nodes[-1].bootstrap}, name) == [0, 1]
    started = time.monotonic()
    with pytest.raises(UserError, match=f"topic '{name}-missing' does not exist"):
        partitions_of({"bootstrap.servers": info.bootstrap}, f"{name}-missing")
    assert 5.0 <= time.monotonic() - started < 40.0


def replicas_of(admin: AdminClient, topic: str, partitions: int) -> list[int]:
    """The replica count of each partition, once the broker asked knows them all."""
    def known() -> list[int]:
        found = admin.list_topics(topic, timeout=10).topics[topic].partitions
        return [len(found[p].replicas) for p in sorted(found)] if len(found) == partitions else []
    return list(wait_until(known, f"the partitions of {topic}", 30))


def write_pipeline(tmp: Path, bootstrap: str, source: str, **extra: Any) -> Path:
    return engine_runs.write_pipeline(tmp, source, bootstrap, spark={"conf": {"spark.ui.enabled": "false"}},
                                      trigger="200ms", max_batch_events=100, **extra)


def test_a_pipeline_replication_factor_of_one_is_used_and_warned_about(cluster, tmp_path, caplog) -> None:
    info, _home = cluster
    settings = {"bootstrap.servers": info.bootstrap}
    source = f"src-{uuid.uuid4().hex[:8]}"
    ensure_topics(settings, [TopicSpec(source, 2)])
    pipeline = load_pipeline(write_pipeline(tmp_path, info.bootstrap, source, replication_factor=1))
    with caplog.at_level(logging.WARNING, logger="refold.spark.job"):
        specs = prepare_topics(plan_of(settled(pipeline, {}, 2), 2), settings)
    admin = AdminClient(settings)
    assert {spec.name: replicas_of(admin, spec.name, spec.partitions)[0] for spec in specs} == {
        spec.name: 1 for spec in specs}
    [warning] = [record.getMessage() for record in caplog.records]
    assert f"pipeline {pipeline.pipeline}: topics with a partition of one replica on a cluster of 3" in warning
    assert pipeline.checkpoints_topic in warning and source not in warning


# A pipeline through broker kills -------------------------------------------------------------


def _java_hash(text: str) -> int:
    """Java's String.hashCode (UTF-16 code units, 32-bit wrap-around)."""
    value = 0
    data = text.encode("utf-16-be")
    for index in range(0, len(data), 2):
        value = (31 * value + int.from_bytes(data[index:index + 2], "big")) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def coordinator_of(settings: dict[str, Any], transactional_id: str) -> tuple[int, int]:
    """(`__transaction_state` partition, its leader: the transaction coordinator) of a
    transactional id, as the broker maps it (`Utils.abs(id.hashCode) % partitions`)."""
    metadata = AdminClient(settings).list_topics("__transaction_state", timeout=10)
    partitions = metadata.topics["__transaction_state"].partitions
    code = _java_hash(transactional_id)
    partition = (0 if code == -(1 << 31) else abs(code)) % len(partitions)
    return partition, partitions[partition].leader


def leader_of(settings: dict[str, Any], topic: str, partition: int) -> int:
    return AdminClient(settings).list_topics(topic, timeout=10).topics[topic].partitions[partition].leader


def open_partitions(settings: dict[str, Any], topic: str) -> list[int]:
    """The partitions of `topic` with an open transaction right now."""
    return [int(line.split("[")[1].split("]")[0]) for line in open_transactions(settings, [topic], timeout=0.5)]


def wait_until(condition: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        assert time.monotonic() < deadline, f"not within {timeout:.0f}s: {what}"
        time.sleep(0.3)


def load(settings: dict[str, Any], topic: str, events: int, seed: int) -> int:
    rows = [orjson.dumps(r) for r in generate(Workload(events=events, keys=80, seed=seed))]
    produce(settings, topic, rows, ["player_name"], progress=False, per_transaction=200)
    return len(rows)


def test_pipeline_exact_through_coordinator_and_leader_kills(cluster, tmp_path) -> None:
    info, home = cluster
    settings = {"bootstrap.servers": info.bootstrap}
    source = f"src-{uuid.uuid4().hex[:8]}"
    ensure_topics(settings, [TopicSpec(source, 3)])
    events = load(settings, source, 800, seed=7)
    path = write_pipeline(tmp_path, info.bootstrap, source)
    pipeline = load_pipeline(path)
    release, log = tmp_path / "release", tmp_path / "engine.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFOLD_TEST_")}
    env |= {"REFOLD_BOOTSTRAP_SERVERS": info.bootstrap,
            "REFOLD_TEST_STALL_IN_TXN_SECONDS": "200", "REFOLD_TEST_STALL_UNTIL": str(release),
            "REFOLD_TRANSACTION_TIMEOUT_MS": "300000"}  # the stall outlives no transaction
    with log.open("wb") as err:
        engine = subprocess.Popen(
            [sys.executable, "-m", "refold.cli.main", "run", str(path), "--until-idle", "8"],
            env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
        )
    try:
        # A shard stalls inside its first transaction, its records and checkpoint sent,
        # not committed, while the faults happen:
        wait_until(lambda: b"stalling" in log.read_bytes() or engine.poll() is not None, "the stall", 180)
        assert engine.poll() is None, log.read_text()[-3000:]
        [shard, *_] = wait_until(lambda: open_partitions(settings, pipeline.checkpoints_topic),
                                 "an open transaction on the checkpoints topic", 30)
        # 1. kill -9 of the coordinator of its transactional id; the transaction's state
        #    moves with the leadership of its __transaction_state partition.
        partition, coordinator = coordinator_of(settings, pipeline.transactional_id(shard))
        assert coordinator in {1, 2, 3}
        assert kafkacluster.kill_node(coordinator, home=home)
        wait_until(lambda: coordinator_of(settings, pipeline.transactional_id(shard))[1] not in {-1, coordinator},
                   f"a new leader of __transaction_state[{partition}]")
        kafkacluster.start_node(coordinator, home=home, die_with_parent=True)
        wait_until(lambda: not kafkahealth.describe(info).under_replicated, "no under-replicated partitions", 90)
        # 2. kill -9 of the leader of source partition 0, and more events into the
        #    source while it is down (`refold produce` rides through too).
        leader = leader_of(settings, source, 0)
        assert kafkacluster.kill_node(leader, home=home)
        events += load(settings, source, 400, seed=8)
        assert leader_of(settings, source, 0) not in {-1, leader}
        # The transaction still open through both kills, the engine commits it and
        # reads on, the source's partition 0 from its new leader.
        assert open_partitions(settings, pipeline.checkpoints_topic), "the stalled transaction ended early"
        assert engine.poll() is None, log.read_text()[-3000:]
        release.touch()
        wait_until(lambda: load_checkpoints(pipeline, settings).get(shard, None) is not None
                   and load_checkpoints(pipeline, settings)[shard].batch >= 1,
                   f"shard {shard}'s stalled batch committed", 90)
        kafkacluster.start_node(leader, home=home, die_with_parent=True)
        code = engine.wait(240)
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, 9)
            engine.wait(30)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert_exact(pipeline, info.bootstrap, events)
    topics = [spec.name for spec in engine_topics(pipeline, 3)]
    assert open_transactions(settings, topics, timeout=30) == []
    assert "Traceback" not in text, text[-3000:]
    assert "one replica" not in text and "min.insync.replicas 1" not in text  # no durability warning


_GROUP_KILL = """
import json, os, sys, time, uuid
from pathlib import Path
from confluent_kafka.admin import AdminClient
from refold.dev import kafkacluster
from refold.dev.leaderkill import group_coordinator
from refold.kafka.io import TopicSpec, ensure_topics
from refold.kafka.transactions import TransactionalWriter, TransactionTimedOut

bootstrap, home = sys.argv[1], sys.argv[2]
settings = {"bootstrap.servers": bootstrap}
topic, group = f"gc-{uuid.uuid4().hex[:8]}", f"refold.gc-{uuid.uuid4().hex[:8]}"
ensure_topics(settings, [TopicSpec(topic, 1)])
writer = TransactionalWriter(settings, f"{group}-0", timeout_ms=180_000, consumer_group=group)
writer.initialise()
writer.begin()
writer.send(topic, b"k", b"1")
writer.commit({topic: {0: 1}})  # the producer now holds the group's coordinator
node = group_coordinator(settings, group)
print(json.dumps({"topic": topic, "node": node}), flush=True)
kafkacluster.kill_node(node, home=Path(home))
deadline = time.monotonic() + 60
while node in AdminClient(settings).list_topics(timeout=10).brokers and time.monotonic() < deadline:
    time.sleep(0.3)
writer.begin()
writer.send(topic, b"k", b"2")
started, error = time.monotonic(), None
try:
    writer.commit({topic: {0: 2}})
except TransactionTimedOut as exc:  # (as every run here: the call waited on the lost coordinator)
    error = str(exc)
first = time.monotonic() - started
if error is not None:
    writer.initialise()  # a new producer: it finds the new coordinator
    writer.begin()
    writer.send(topic, b"k", b"2")
    writer.commit({topic: {0: 2}})
print(json.dumps({"first": first, "error": error}), flush=True)
os._exit(0)  # not waiting at exit for the stuck producer's thread
"""


def test_send_offsets_gives_up_once_the_group_coordinator_left(cluster, tmp_path) -> None:
    # librdkafka#5511: a producer that cached the group's coordinator waits in
    # send_offsets_to_transaction, past its own timeout, once that broker has dropped out
    # of the metadata (killed, then fenced). The writer gives the call up as soon as the
    # metadata lacks a broker it knew, not at the deadline (set far off here), and a new
    # producer commits through the new coordinator. In a process of its own: the stuck
    # producer stays alive as long as the call waits.
    info, home = cluster
    settings = {"bootstrap.servers": info.bootstrap}
    script = tmp_path / "group_kill.py"
    script.write_text(_GROUP_KILL)
    env = {**os.environ, "REFOLD_SEND_OFFSETS_SECONDS": "120"}
    done = subprocess.run([sys.executable, str(script), info.bootstrap, str(home)], env=env,
                          capture_output=True, timeout=300)
    lines = [orjson.loads(line) for line in done.stdout.splitlines() if line.startswith(b"{")]
    node = lines[0]["node"] if lines else -1
    if node in {1, 2, 3}:
        kafkacluster.start_node(node, home=home, die_with_parent=True)
    assert done.returncode == 0 and len(lines) == 2, done.stderr.decode(errors="replace")[-3000:]
    outcome = lines[1]
    assert outcome["first"] < 30, outcome  # not the deadline's 120 s
    assert outcome["error"] is None or f"broker {node} left the cluster's metadata" in outcome["error"], outcome
    assert [m.value() for m in read_to_end(settings, lines[0]["topic"], timeout=60)] == [b"1", b"2"]
    wait_until(lambda: not kafkahealth.describe(info).under_replicated, "no under-replicated partitions", 120)


# Quorum lost --------------------------------------------------------------------------------


def read_committed_count(settings: dict[str, Any], topic: str) -> int:
    """The records of `topic` a read_committed reader sees (to its end)."""
    return sum(1 for _ in read_to_end(settings, topic, timeout=60))


def test_produce_without_quorum_stops_named_and_writes_nothing(cluster, monkeypatch) -> None:
    from refold.errors import UserError
    from refold.kafka import transactions

    info, home = cluster
    settings = {"bootstrap.servers": info.bootstrap}
    topic = f"q-{uuid.uuid4().hex[:8]}"
    ensure_topics(settings, [TopicSpec(topic, 2)])
    replicas_of(AdminClient(settings), topic, 2)
    rows = [orjson.dumps(r) for r in generate(Workload(events=300, keys=20, seed=11))]
    survivor = leader_of(settings, topic, 0)
    down = [node for node in (1, 2, 3) if node != survivor]
    for node in down:
        assert kafkacluster.kill_node(node, home=home)
    # A short retry budget: the records time out after 10 s, init_transactions after 15 s
    # (60 s in the engine: the outcome is the same, only later).
    budget = {**settings, "message.timeout.ms": 10_000}
    monkeypatch.setattr(transactions, "_INIT_SECONDS", 15)
    started = time.monotonic()
    try:
        with pytest.raises(UserError) as raised:
            produce(budget, topic, rows, ["player_name"], progress=False)
        waited = time.monotonic() - started
    finally:
        for node in down:
            kafkacluster.start_node(node, home=home, die_with_parent=True)
    monkeypatch.undo()
    message = str(raised.value)
    assert waited < 45, message  # init_transactions gives up after 15 s, the records after 10 s
    assert "the Kafka cluster cannot take writes to " in message, message
    # the partitions the records were refused on, or (when the coordinator could not even
    # start a transaction: two thirds of the time) the transaction log's partition
    assert f"{topic}[" in message or "__transaction_state" in message, message
    assert "fewer of their replicas are in sync than min.insync.replicas" in message.lower(), message
    assert "nothing of it is visible" in message, message
    wait_until(lambda: not kafkahealth.describe(info).under_replicated, "no under-replicated partitions", 90)
    assert read_committed_count(settings, topic) == 0
    assert open_transactions(settings, [topic], timeout=30) == []
    # With the brokers back, the same produce succeeds, each event once.
    assert produce(settings, topic, rows, ["player_name"], progress=False).events == len(rows)
    # (the commit returns once the coordinator logged it; the markers reach the
    # partitions a moment later, and the last stable offset moves with them)
    wait_until(lambda: read_committed_count(settings, topic) == len(rows), "the events committed and visible", 60)
    assert open_transactions(settings, [topic], timeout=30) == []


def test_chaos_on_the_cluster_plans_five_of_each_cluster_fault_at_its_defaults() -> None:
    import random
    from collections import Counter

    from refold.dev.chaos import ChaosConfig, fault_plan
    from refold.dev.chaoskafka import KAFKA_FAULTS

    plan = Counter(fault_plan(ChaosConfig(kafka_brokers=3, other_kinds=KAFKA_FAULTS, kills=20), random.Random(1)))
    assert {kind: plan[kind] for kind in KAFKA_FAULTS} == dict.fromkeys(KAFKA_FAULTS, 5)
    assert plan["broker_restart"] == 0 and plan["kill9"] + plan["kill9_in_commit"] == 20
