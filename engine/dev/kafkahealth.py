"""A local cluster's health as `refold kafka status` prints it: each broker, the active
controller, under-replicated and leaderless partitions (`refold.dev.kafkacluster`)."""

from __future__ import annotations

from dataclasses import dataclass

from refold.dev.kafkacluster import ClusterInfo, active_controller


@dataclass(frozen=True, slots=True)
class Health:
    """What the cluster's metadata says (`describe`)."""

    registered: tuple[int, ...]  # the broker ids the metadata lists
    under_replicated: tuple[tuple[str, int, int, int], ...]  # topic, partition, in-sync, replicas
    leaderless: tuple[tuple[str, int], ...]  # topic, partition
    error: str | None = None  # why the metadata could not be read


def describe(info: ClusterInfo, timeout: float = 5.0) -> Health:
    """The registered brokers and the partitions (internal topics too) whose in-sync
    replica set is smaller than their replica set, or which have no leader."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": info.bootstrap, "log_level": 0})
    try:
        metadata = admin.list_topics(timeout=timeout)
    except Exception as exc:
        return Health((), (), (), error=str(exc))
    under = []
    leaderless = []
    for name, topic in sorted(metadata.topics.items()):
        for pid, partition in sorted(topic.partitions.items()):
            if partition.leader < 0:
                leaderless.append((name, pid))
            if len(partition.isrs) < len(partition.replicas):
                under.append((name, pid, len(partition.isrs), len(partition.replicas)))
    return Health(tuple(sorted(metadata.brokers)), tuple(under), tuple(leaderless))


def report(info: ClusterInfo) -> list[str]:
    """The lines of `refold kafka status` for a cluster."""
    health = describe(info)
    controller = active_controller(info)
    lines = [f"Kafka cluster of {len(info.nodes)} at {info.bootstrap}"]
    for node in info.nodes:
        state = "alive" if node.alive else "down"
        if node.alive and health.error is None and node.node_id not in health.registered:
            state = "alive, not registered yet"
        pid = f", pid {node.pid}" if node.pid is not None else ""
        role = ", active controller" if node.node_id == controller else ""
        lines.append(f"  broker {node.node_id}  port {node.port}  {state}{pid}{role}")
    lines.append(f"  active controller: {controller if controller is not None else 'none (an election under way?)'}")
    if health.error is not None:
        lines.append(f"  metadata: cannot be read ({health.error})")
        return lines
    if health.under_replicated:
        shown = ", ".join(f"{t}[{p}] {isr}/{reps}" for t, p, isr, reps in health.under_replicated[:10])
        more = f" and {len(health.under_replicated) - 10} more" if len(health.under_replicated) > 10 else ""
        lines.append(f"  under-replicated partitions: {len(health.under_replicated)}: {shown}{more}")
    else:
        lines.append("  under-replicated partitions: 0")
    if health.leaderless:
        shown = ", ".join(f"{t}[{p}]" for t, p in health.leaderless[:10])
        lines.append(f"  partitions without a leader: {len(health.leaderless)}: {shown}")
    lines.append(f"  data {info.home}/node-*/data, logs {info.home}/node-*/broker.log")
    return lines
