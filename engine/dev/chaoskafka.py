"""The chaos harness's faults of a three-broker Kafka cluster (`python -m refold.dev.chaos
--kafka-brokers 3`; `refold.dev.kafkacluster`).

Each fault hits the cluster while the target engine runs (a batch in flight: the
harness injects right after the engine committed new work and the next chunk of
input was written, after a random pause of up to 1.5 s), and waits until the
cluster has every partition fully in sync again before the next fault, so no two
faults together take two of the three replicas:

- `leader_kill_source`, `leader_kill_view`, `leader_kill_state`, `leader_kill_checkpoints`
                     kill -9 of the broker that leads a random partition of the
                     source topic, the view topic (the delta topic when the
                     pipeline has no view topic), `P.state` or `P.checkpoints`;
                     started again 2-6 s later on its data; the second half of the
                     fault's chunk of input is written right after the kill, and the
                     seconds from the kill to the target engine's next committed batch
                     go into the run's line (`leader_kill_to_commit`: median, max);
- `coordinator_kill` kill -9 of the transaction coordinator of a random shard's
                     transactional id (the leader of its `__transaction_state`
                     partition); started again 2-6 s later;
- `controller_kill`  kill -9 of the active KRaft controller; started again 2-6 s later;
- `broker_data_lost` kill -9 of a random broker, its partition data deleted (every log
                     directory but its copy of the KRaft metadata log and its
                     meta.properties: the controllers are a static quorum, and a voter
                     that forgets what it voted can break Raft's safety), started
                     again empty: its replicas are fetched again from the others;
- `rolling_restart`  each of the three brokers stopped (SIGTERM, kill -9 after 30 s)
                     and started again in turn, the next one once every partition
                     is in sync;
- `partition`        a random broker cut off from the other brokers and from every
                     client for 15-25 s (past the brokers' 6 s session timeout: the
                     controllers fence it and its partitions get new leaders), then
                     healed (`refold.dev.netpartition`: iptables rules on the loopback,
                     the node in a cgroup of its own; a node running outside one is
                     first restarted cleanly into it). The second half of the fault's
                     chunk of input is written while it is cut off. Only where the
                     machine allows it (root, cgroup v2, iptables): elsewhere the
                     harness leaves the kind out and says why.

At the end, `final_markers` checks that every output partition still takes a
transaction and shows its end to read_committed.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from refold.dev import kafkacluster, kafkahealth, netpartition
from refold.dev.chaosengine import Engine
from refold.kafka.io import consumer_config, partitions_of, producer_config
from refold.kafka.transactions import transaction_state_partition

KAFKA_FAULTS = ("leader_kill_source", "leader_kill_view", "leader_kill_state", "leader_kill_checkpoints",
                "coordinator_kill", "controller_kill", "broker_data_lost", "rolling_restart", "partition")

# What a broker keeps when its data directory is lost (see the module's docstring).
_KEPT = frozenset({"__cluster_metadata-0", "meta.properties", "bootstrap.checkpoint"})


def leader_of(settings: dict[str, Any], topic: str, partition: int) -> int:
    """The broker id leading `topic[partition]`, -1 when none does."""
    metadata = AdminClient(settings).list_topics(topic, timeout=10)
    return int(metadata.topics[topic].partitions[partition].leader)


def coordinator_of(settings: dict[str, Any], transactional_id: str) -> int:
    """The transaction coordinator of a transactional id: the leader of its
    `__transaction_state` partition; -1 when unknown."""
    admin = AdminClient(settings)
    partition = transaction_state_partition(transactional_id, admin)
    if partition is None:
        return -1
    return leader_of(settings, "__transaction_state", partition)


def wait_in_sync(home: Path, timeout: float = 180.0) -> bool:
    """Until every node runs and no partition is under-replicated or leaderless."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = kafkacluster.status(home)
        if info is not None and len(info.running) == len(info.nodes):
            health = kafkahealth.describe(info)
            if health.error is None and not health.under_replicated and not health.leaderless:
                return True
        time.sleep(1.0)
    return False


def inject_kafka(kind: str, target: Engine, rng: random.Random, home: Path, settings: dict[str, Any],
                 say: Any, after_kill: Callable[[], None] | None = None) -> float | None:
    """One cluster fault while `target` runs; returns once the cluster is in sync again.
    For a leader's kill -9: the seconds from the kill to `target`'s next committed batch
    (None when none came within 180 s; `after_kill()` runs right after the kill: the
    harness writes more input there); for the other faults None."""
    time.sleep(rng.uniform(0.0, 1.5))  # into the batch the engine is working on
    pipeline = target.pipeline
    recovery: float | None = None
    if kind.startswith("leader_kill_"):
        view = pipeline.outputs.view or pipeline.outputs.delta
        topic = {
            "leader_kill_source": pipeline.source.topic,
            "leader_kill_view": view.topic if view is not None else pipeline.state_topic,
            "leader_kill_state": pipeline.state_topic,
            "leader_kill_checkpoints": pipeline.checkpoints_topic,
        }[kind]
        partition = rng.choice(sorted(partitions_of(settings, topic)))
        watch = NextCommit(target)

        def killed() -> None:
            watch.start()
            if after_kill is not None:
                after_kill()

        if _bounce(leader_of(settings, topic, partition), home, rng, say, f"the leader of {topic}[{partition}]",
                   on_kill=killed):
            recovery = watch.seconds()
            say(f"  {kind}: " + ("next committed batch within 180s: none" if recovery is None
                                 else f"next committed batch {recovery:.1f}s after the kill")
                + (f" (a read of its checkpoint took {watch.slowest:.0f}s)" if watch.slowest > 5 else "")
                + (f" (the engine stopped meanwhile; started again {watch.restarts}x)" if watch.restarts else ""))
        elif after_kill is not None:
            after_kill()
    elif kind == "coordinator_kill":
        shard = rng.choice(sorted(partitions_of(settings, pipeline.checkpoints_topic)))
        tid = pipeline.transactional_id(shard)
        _bounce(coordinator_of(settings, tid), home, rng, say, f"the coordinator of {tid!r}")
    elif kind == "controller_kill":
        info = kafkacluster.status(home)
        node = kafkacluster.active_controller(info) if info is not None else None
        _bounce(-1 if node is None else node, home, rng, say, "the active controller")
    elif kind == "broker_data_lost":
        info = kafkacluster.configured(home)
        assert info is not None
        node = rng.choice(info.nodes)
        kafkacluster.kill_node(node.node_id, home=home)
        for entry in node.data_dir.iterdir():
            if entry.name not in _KEPT:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        kafkacluster.start_node(node.node_id, home=home, die_with_parent=True)
    elif kind == "rolling_restart":
        info = kafkacluster.configured(home)
        assert info is not None
        for node in info.nodes:
            kafkacluster.stop_node(node.node_id, home=home)
            kafkacluster.start_node(node.node_id, home=home, die_with_parent=True)
            if not wait_in_sync(home):
                say(f"  rolling_restart: partitions not in sync 180s after node {node.node_id} came back")
    elif kind == "partition":
        _partition(home, rng, say, after_kill)
    else:
        raise ValueError(kind)
    if not wait_in_sync(home):
        say(f"  {kind}: the cluster is not in sync 180s after the fault")
    return recovery


class NextCommit:
    """Times an engine's next committed batch from a moment on, in a thread of its own
    (the broker's restart goes on meanwhile): the checkpoint's batch number polled every
    0.2 s until it passes the one committed before the moment. An engine that stops
    meanwhile is started again (`restarts`): one run with `--until-idle` stops when no
    input came for that long, which a broker's loss can make it see while the input
    written after the kill waits for a new leader; nothing would start it again before
    the next fault."""

    def __init__(self, target: Engine, timeout: float = 180.0) -> None:
        self._target = target
        self._timeout = timeout
        self._before = max(0, target.committed_batch())
        self._started = 0.0
        self._seconds: float | None = None
        self.slowest = 0.0  # the longest read of the checkpoint: a read that waits on a lost leader delays the finding
        self.restarts = 0
        self._thread = threading.Thread(target=self._watch, name="chaos-next-commit", daemon=True)

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def _watch(self) -> None:
        while time.monotonic() - self._started < self._timeout:
            proc = self._target.proc
            if proc is None or proc.poll() is not None:
                self.restarts += 1
                self._target.ensure_running()
            probe = time.monotonic()
            batch = self._target.committed_batch()
            self.slowest = max(self.slowest, time.monotonic() - probe)
            if batch > self._before:
                self._seconds = time.monotonic() - self._started
                return
            time.sleep(0.2)

    def seconds(self) -> float | None:
        self._thread.join(self._timeout + 5.0)
        return self._seconds


def _bounce(node: int, home: Path, rng: random.Random, say: Any, what: str,
            on_kill: Callable[[], None] | None = None) -> bool:
    """kill -9 of `node` (then `on_kill()`), started again on its data 2-6 s later; False
    when no broker is `what`."""
    if node < 0:
        say(f"  no broker is {what} right now; nothing killed")
        return False
    kafkacluster.kill_node(node, home=home)
    if on_kill is not None:
        on_kill()
    time.sleep(rng.uniform(2.0, 6.0))
    kafkacluster.start_node(node, home=home, die_with_parent=True)
    return True


def _partition(home: Path, rng: random.Random, say: Any, during: Callable[[], None] | None) -> None:
    """A random node cut off for 15-25 s, then healed (see the module's docstring)."""
    info = kafkacluster.configured(home)
    assert info is not None
    node = rng.choice(info.nodes)
    cgroup = netpartition.node_cgroup(f"{home.parent.name}-node-{node.node_id}")
    if not _runs_in(node.node_id, home, cgroup):
        kafkacluster.stop_node(node.node_id, home=home)
        kafkacluster.start_node(node.node_id, home=home, die_with_parent=True, cgroup=cgroup)
        if not wait_in_sync(home):
            say(f"  partition: partitions not in sync 180s after node {node.node_id} came back in its cgroup")
        time.sleep(rng.uniform(0.0, 1.5))
    held = rng.uniform(15.0, 25.0)
    with netpartition.Cut(cgroup, [node.port, node.controller_port]):
        say(f"  node {node.node_id} cut off for {held:.0f}s")
        if during is not None:
            during()
        time.sleep(held)


def _runs_in(node_id: int, home: Path, cgroup: Path) -> bool:
    """Whether the node's JVM runs in `cgroup`."""
    info = kafkacluster.status(home)
    pid = info.node(node_id).pid if info is not None else None
    if not pid:
        return False
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return False
    root = netpartition.cgroup2_root()
    want = "0::/" + str(cgroup.relative_to(root)) if root is not None else None
    return want in lines


def final_markers(settings: dict[str, Any], topics: Sequence[str]) -> list[str]:
    """Write one transactional marker record into every output partition and read it back
    with read_committed: every partition accepts a transaction and shows its end."""
    problems: list[str] = []
    marker = f"chaos-marker-{uuid.uuid4()}".encode()
    producer = Producer(producer_config(settings, **{"transactional.id": f"chaos-marker-{uuid.uuid4()}"}))
    producer.init_transactions(60)
    producer.begin_transaction()
    targets = [(t, p) for t in topics for p in partitions_of(settings, t)]
    for topic, partition in targets:
        producer.produce(topic, marker, b"chaos-marker", partition=partition)
    producer.commit_transaction(60)
    consumer = Consumer(consumer_config(settings, **{"group.id": f"chaos-marker-{uuid.uuid4()}",
                                                    "enable.auto.commit": False}))
    try:
        for topic, partition in targets:
            _low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10, cached=False)
            consumer.assign([TopicPartition(topic, partition, max(0, high - 3))])
            seen = False
            deadline = time.monotonic() + 30
            while not seen and time.monotonic() < deadline:
                msg = consumer.poll(0.5)
                seen = msg is not None and msg.error() is None and msg.value() == marker
            if not seen:
                problems.append(f"{topic}[{partition}]: the final marker is not visible to read_committed")
    finally:
        consumer.close()
    return problems
