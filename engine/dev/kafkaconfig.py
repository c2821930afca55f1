"""The local broker's files (`refold.dev.localkafka`): server.properties, log4j2.yaml and
the storage format.

Settings, chosen for one node (a cluster's nodes, `refold.dev.kafkacluster`, add
`cluster_settings` over them): replication factor and min ISR 1 for the offsets and
transaction state topics (so transactions work), no initial rebalance delay, and
automatic topic creation OFF: Refold creates every topic it uses on purpose, with
its partition count and cleanup policy, and a typo in a topic name should fail
rather than make a topic. The controller quorum is static (`controller.quorum.voters`),
so the controller port may change between starts. server.properties is written on
every start and read back by `status` for the ports; the storage is formatted once.
"""

from __future__ import annotations

import base64
import subprocess
import uuid
from pathlib import Path

from refold.dev.kafkasecurity import Security
from refold.dev.localproc import HOST, ServerStartError, tail

LOG4J = """Configuration:
  Appenders:
    Console:
      name: STDOUT
      PatternLayout:
        pattern: "[%d] %p %m (%c)%n"
  Loggers:
    Root:
      level: WARN
      AppenderRef:
        - ref: STDOUT
    Logger:
      - name: kafka.server.KafkaRaftServer
        level: INFO
      - name: kafka.server.BrokerLifecycleManager
        level: INFO
"""


class NodeFiles:
    """Where a local Kafka node (the single broker, or one node of a cluster) is reached
    and keeps its files; a mixin of the frozen dataclasses that describe one, which
    have `port` and `home` (the node's folder)."""

    __slots__ = ()
    port: int
    home: Path

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def data_dir(self) -> Path:
        return self.home / "data"

    @property
    def log_file(self) -> Path:
        return self.home / "broker.log"


def java_command(java: str, classpath: str, base: Path, *, heap: tuple[str, str], c1_only: bool = False) -> list[str]:
    """The JVM and its options for a node whose folder is `base` (the main class and its
    arguments follow); writes the node's log4j2.yaml there. `heap`: its first and largest
    size (-Xms, -Xmx). `c1_only`: the C1 compiler only, a faster start and less CPU on a
    shared machine (the cluster's nodes)."""
    (base / "log4j2.yaml").write_text(LOG4J)
    return [
        java,
        f"-Xms{heap[0]}",
        f"-Xmx{heap[1]}",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-XX:+ExitOnOutOfMemoryError",
        *(["-XX:TieredStopAtLevel=1"] if c1_only else []),
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={base / 'log4j2.yaml'}",
        "-cp",
        classpath,
    ]


def server_properties(
    base: Path,
    port: int,
    controller_port: int,
    security: Security | None = None,
    *,
    node_id: int = 1,
    voters: dict[int, int] | None = None,
) -> str:
    """The text of server.properties for a node in `base` on these ports. `voters`
    (node id -> controller port) makes it a node of a cluster (`cluster_settings`)."""
    quorum = voters if voters is not None else {node_id: controller_port}
    settings = {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.voters": ",".join(f"{node}@{HOST}:{cport}" for node, cport in sorted(quorum.items())),
        "listeners": f"PLAINTEXT://{HOST}:{port},CONTROLLER://{HOST}:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://{HOST}:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(base / "data"),
        "num.partitions": "3",
        "auto.create.topics.enable": "false",
        # One node: internal topics with one replica, so that groups and transactions work.
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "5",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "5",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        # After a kill -9 the controller keeps the dead broker's registration until its
        # session times out (9 s by default), and the restarted broker waits for that.
        "broker.session.timeout.ms": "6000",
        "broker.heartbeat.interval.ms": "1000",
        # Abort transactions of crashed producers soon after their timeout (chaos tests).
        "transaction.abort.timed.out.transaction.cleanup.interval.ms": "2000",
        "message.max.bytes": "8388608",
        "log.cleaner.backoff.ms": "2000",
        # A deleted topic's files go a second after the deletion, not a minute (the
        # broker's name of the topics' `file.delete.delay.ms`), and a new broker's log
        # tasks start after a second, not half a minute: the benches' topics are a few
        # GB a run (`bench.cleanup`).
        "log.segment.delete.delay.ms": "1000",
        "log.initial.task.delay.ms": "1000",
    }
    if voters is not None:
        settings.update(cluster_settings(len(voters)))
    if security is not None:
        settings.update(security.broker_properties(port, controller_port))
    return "".join(f"{key}={value}\n" for key, value in settings.items())


def cluster_settings(brokers: int) -> dict[str, str]:
    """The durability settings of a cluster of `brokers` nodes: every topic (the
    internal ones too) on min(3, brokers) replicas, a write acknowledged by acks=all
    once min(2, brokers) of them have it, and no out-of-sync replica ever elected
    leader (it would drop committed records, transaction markers among them)."""
    replicas = str(min(3, brokers))
    isr = str(min(2, brokers))
    return {
        "default.replication.factor": replicas,
        "min.insync.replicas": isr,
        "unclean.leader.election.enable": "false",
        "offsets.topic.replication.factor": replicas,
        "transaction.state.log.replication.factor": replicas,
        "transaction.state.log.min.isr": isr,
        "share.coordinator.state.topic.replication.factor": replicas,
        "share.coordinator.state.topic.min.isr": isr,
    }


def configured_ports(base: Path) -> tuple[int, int, bool] | None:
    """The (broker, controller) ports of the last start and whether it was secured,
    from its server.properties."""
    try:
        lines = (base / "server.properties").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition("=")
        if key.strip() == "listeners":
            ports = {
                name: int(address.rpartition(":")[2])
                for name, _, address in (part.partition("://") for part in value.split(","))
            }
            for client in ("PLAINTEXT", "SASL_SSL"):
                if client in ports and "CONTROLLER" in ports:
                    return ports[client], ports["CONTROLLER"], client == "SASL_SSL"
    return None


def format_storage(
    jvm: list[str], properties: Path, log_file: Path, security: Security | None, cluster_id: str | None = None
) -> None:
    """Format the storage of a fresh node (static quorum: a cluster id is enough; the
    nodes of one cluster share theirs). Secured mode adds its SCRAM users, salted and
    hashed."""
    scram = security.scram_arguments() if security is not None else []
    formatted = subprocess.run(
        [*jvm, "kafka.tools.StorageTool", "format", "--ignore-formatted",
         f"--cluster-id={cluster_id or new_cluster_id()}", "--config", str(properties), *scram],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if formatted.returncode != 0:
        with log_file.open("a") as log:
            log.write(formatted.stdout + formatted.stderr)
        raise ServerStartError(
            "formatting the Kafka storage failed", log_file=log_file, log_tail=tail(log_file)
        )


def new_cluster_id() -> str:
    """A random cluster id as Kafka writes them (URL-safe base64 of 16 bytes)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if text[0].isalnum():
            return text
