"""A real local Apache Kafka cluster: N KRaft nodes on 127.0.0.1 (`refold kafka start
--brokers 3`), from the same Maven jars as the single broker (`refold.dev.localkafka`).

Every node is a broker and a controller at once (`process.roles=broker,controller`),
and the controller quorum is all of them. Why not a separate controller quorum: three
more JVMs on a laptop or a two-core CI runner, for a property the tests do not need.
Three combined nodes keep the quorum's arithmetic the same as the brokers' (one
node may die, the other two still elect a leader and acknowledge writes with
`min.insync.replicas` 2), and killing the active controller is then also a broker
kill, which is how small production clusters in combined mode fail. Kafka advises
separate controllers in production for isolation under load; nothing Refold
checks depends on which way the quorum is laid out.

Each node lives in `<home>/kafka-cluster/node-<id>/` (home: `refold.environment.home()`):

    server.properties   written on every start: the node's settings and the quorum
    data/               its log dirs and its copy of the KRaft metadata log
    broker.log          the JVM's stdout and stderr
    broker.pid          the pid of the running JVM (its own process group)

Ports: the brokers listen on `port, port+1, …` (9092… by default), the controllers on
the next ones when free (else another free port below the kernel's ephemeral range,
kept in server.properties for restarts: the quorum is static, so a node comes back
on the controller port it had). The
cluster's settings (`kafkaconfig.cluster_settings`): replication factor min(3, N) for
every topic, the internal ones too, `min.insync.replicas` min(2, N), no unclean
leader election. One heap of 384 MB per node: three nodes fit beside Spark.

A home holds the single broker or a cluster, never both running at once.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from refold.dev import kafkaconfig
from refold.dev.localproc import HOST, ServerStartError
from refold.dev.localproc import bindable as _bindable
from refold.dev.localproc import end_group as _end_group
from refold.dev.localproc import kill_group as _kill_group
from refold.dev.localproc import locked as _locked
from refold.dev.localproc import rotate as _rotate
from refold.dev.localproc import running_pid as _running_pid_in
from refold.dev.localproc import say as _say
from refold.dev.localproc import signal_group as _signal_group
from refold.dev.localproc import spawn as _spawn
from refold.dev.localproc import tail as _tail
from refold.dev.localproc import wait_gone as _wait_gone
from refold.environment import home as project_home
from refold.errors import PrerequisiteError
from refold.spark.jars import kafka_classpath, require_java

DEFAULT_BROKERS = 3
MAX_BROKERS = 9
HEAP = ("128m", "384m")  # -Xms, -Xmx of each node
_MAIN_CLASS = "kafka.Kafka"


@dataclass(frozen=True, slots=True)
class NodeInfo(kafkaconfig.NodeFiles):
    """One node of a local cluster (broker and controller); `pid` None when it is down
    (`bootstrap`, `data_dir`, `log_file`: `NodeFiles`)."""

    node_id: int
    port: int
    controller_port: int
    home: Path  # the node's folder, <project home>/kafka-cluster/node-<id>
    pid: int | None

    @property
    def alive(self) -> bool:
        return self.pid is not None


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """A local cluster as its files and processes say (nothing asked over the network)."""

    home: Path  # <project home>/kafka-cluster
    nodes: tuple[NodeInfo, ...]

    @property
    def bootstrap(self) -> str:
        """Every node's listener, down ones too: a client tries the next."""
        return ",".join(node.bootstrap for node in self.nodes)

    @property
    def running(self) -> tuple[NodeInfo, ...]:
        return tuple(node for node in self.nodes if node.alive)

    def node(self, node_id: int) -> NodeInfo:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(f"no node {node_id} in the cluster in {self.home}")

    def node_at(self, port: int) -> NodeInfo:
        for node in self.nodes:
            if node.port == port:
                return node
        raise KeyError(f"no node listens on port {port} in the cluster in {self.home}")


def cluster_home(home: Path | None = None) -> Path:
    """The cluster's folder inside a Refold home (default: `project_home()`)."""
    return (home if home is not None else project_home()).resolve() / "kafka-cluster"


def free_port_range(count: int, attempts: int = 200) -> int:
    """The first of `count` consecutive TCP ports on 127.0.0.1 that are free right now
    (for tests that run a cluster beside other brokers). They are taken below the
    kernel's ephemeral range: a port from that range that is free now may become the
    local end of a node's own connection to another node before that node listens on it."""
    low, high = _ephemeral_range()
    top = (low if low > 11000 else 65536) - count
    start = 10000 if low > 11000 else high + 1
    for _ in range(attempts):
        first = random.randrange(start, top)
        if all(_bindable(first + i) for i in range(count)):
            return first
    raise PrerequisiteError(f"no {count} consecutive free ports on {HOST} after {attempts} tries")


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux; else its default)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


# Lifecycle ---------------------------------------------------------------------------------


def start(
    port: int,
    brokers: int = DEFAULT_BROKERS,
    timeout: float = 120.0,
    *,
    home: Path | None = None,
    quiet: bool = False,
    die_with_parent: bool = False,
) -> ClusterInfo:
    """Start the nodes of the cluster that are down and wait until each answers and the
    cluster has every broker registered.

    A fresh home gets `brokers` nodes on ports `port…port+brokers-1`, formatted with
    one cluster id; a home that has a cluster starts its nodes again on their own ports
    (`port` is then ignored; a different `brokers` is an error). Raises
    PrerequisiteError (no Java, a port taken, the single broker runs in this home)
    or ServerStartError (a node exited or did not answer within `timeout` seconds; the
    nodes started by this call are then killed).
    """
    if not 1 <= brokers <= MAX_BROKERS:
        raise PrerequisiteError(f"--brokers {brokers}: a local cluster has 1 to {MAX_BROKERS} nodes")
    base = cluster_home(home)
    base.mkdir(parents=True, exist_ok=True)
    with _locked(base):
        _refuse_beside_single_broker(home)
        found = configured(home)  # its nodes, running or not
        if found is not None and len(found.nodes) != brokers:
            raise PrerequisiteError(
                f"the cluster in {base} has {len(found.nodes)} nodes, not {brokers}: "
                f"start it with --brokers {len(found.nodes)}, or stop it and remove {base}"
            )
        if found is not None and len(found.running) == len(found.nodes):
            _say(quiet, f"the Kafka cluster already runs at {found.bootstrap}")
            return found
        nodes = found.nodes if found is not None else _new_layout(base, port, brokers)
        return _launch(base, nodes, timeout, quiet=quiet, die_with_parent=die_with_parent)


def start_node(
    node_id: int, timeout: float = 90.0, *, home: Path | None = None, die_with_parent: bool = False,
    cgroup: Path | None = None,
) -> NodeInfo:
    """Start one node of the cluster again (after `kill_node`) on its ports and data,
    and wait until it answers. Harmless when it runs. `cgroup`: a cgroup v2 directory
    to start it in (`refold.dev.netpartition`)."""
    base = cluster_home(home)
    with _locked(base):
        found = status(home)
        if found is None:
            raise PrerequisiteError(f"no local cluster in {base}")
        node = found.node(node_id)
        if node.alive:
            return node
        info = _launch(base, found.nodes, timeout, quiet=True, die_with_parent=die_with_parent, only={node_id},
                       cgroup=cgroup)
        return info.node(node_id)


def stop(timeout: float = 30.0, *, home: Path | None = None) -> bool:
    """Stop every node cleanly (SIGTERM to all at once, SIGKILL after `timeout`
    seconds). Returns False when none ran."""
    base = cluster_home(home)
    with _locked(base):
        found = status(home)
        if found is None:
            return False
        running = found.running
        for node in running:
            _signal_group(_pid(node), signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for node in running:
            pid = _pid(node)
            if not _wait_gone(pid, max(deadline - time.monotonic(), 0.1)):
                _end_group(pid, 1.0)
        for node in found.nodes:
            _pid_file(node.home).unlink(missing_ok=True)
        return bool(running)


def stop_node(node_id: int, timeout: float = 30.0, *, home: Path | None = None) -> bool:
    """Stop one node cleanly (SIGTERM: it hands its leaderships over and closes its
    logs; SIGKILL after `timeout` seconds), as a rolling restart does. False when it was
    not running."""

    def stop(pid: int) -> None:
        _signal_group(pid, signal.SIGTERM)
        if not _wait_gone(pid, timeout):
            _end_group(pid, 1.0)

    return _end_node(node_id, stop, home)


def kill_node(node_id: int, *, home: Path | None = None) -> bool:
    """kill -9 one node's process group, like a crash. False when it was not running."""
    return _end_node(node_id, _kill_group, home)


def _end_node(node_id: int, end: Callable[[int], object], home: Path | None) -> bool:
    """End the running node `node_id` with `end(pid)` (its process group's way to go)
    and forget its pid. False when it was not running."""
    with _locked(cluster_home(home)):
        found = status(home)
        node = found.node(node_id) if found is not None else None
        if node is None or node.pid is None:
            return False
        end(node.pid)
        _pid_file(node.home).unlink(missing_ok=True)
        return True


def status(home: Path | None = None) -> ClusterInfo | None:
    """The local cluster of this home when any node of it runs, else None. Reads
    files and processes only."""
    found = configured(home)
    if found is None or not found.running:
        return None
    return found


def configured(home: Path | None = None) -> ClusterInfo | None:
    """The cluster whose nodes this home has (running or not), or None."""
    base = cluster_home(home)
    nodes = []
    for folder in sorted(base.glob("node-*"), key=lambda path: path.name):
        try:
            node_id = int(folder.name.removeprefix("node-"))
        except ValueError:
            continue
        ports = kafkaconfig.configured_ports(folder)
        if ports is None:
            continue
        nodes.append(NodeInfo(node_id, ports[0], ports[1], folder, _running_pid(folder)))
    if not nodes:
        return None
    return ClusterInfo(base, tuple(sorted(nodes, key=lambda node: node.node_id)))


def active_controller(info: ClusterInfo) -> int | None:
    """The node id of the active KRaft controller, as the running nodes' quorum-state
    files say (the one of the highest leader epoch), or None when no running node
    knows a live leader (an election under way)."""
    best: tuple[int, int] | None = None
    for node in info.running:
        try:
            state = json.loads((node.data_dir / "__cluster_metadata-0" / "quorum-state").read_text())
        except (OSError, ValueError):
            continue
        leader, epoch = int(state.get("leaderId", -1)), int(state.get("leaderEpoch", -1))
        if leader >= 0 and (best is None or epoch > best[1]):
            best = (leader, epoch)
    if best is None:
        return None
    alive = {node.node_id for node in info.running}
    return best[0] if best[0] in alive else None


# Inside ----------------------------------------------------------------------------------


def _refuse_beside_single_broker(home: Path | None) -> None:
    from refold.dev import localkafka

    single = localkafka.status(home)
    if single is not None:
        raise PrerequisiteError(
            f"the single local broker runs in this home ({single.bootstrap}): "
            "`refold kafka stop` it first, or use another REFOLD_HOME"
        )


def _new_layout(base: Path, port: int, brokers: int) -> tuple[NodeInfo, ...]:
    taken = [p for p in range(port, port + brokers) if not _bindable(p)]
    if taken:
        raise PrerequisiteError(
            f"port {taken[0]} on {HOST} is taken by another program; a cluster of {brokers} "
            f"needs ports {port}-{port + brokers - 1}: choose another --port"
        )
    controllers: list[int] = []
    for index in range(brokers):
        wanted = port + brokers + index
        controllers.append(wanted if _bindable(wanted) else free_port_range(1))
    return tuple(
        NodeInfo(index + 1, port + index, controllers[index], base / f"node-{index + 1}", None)
        for index in range(brokers)
    )


def _launch(
    base: Path,
    nodes: tuple[NodeInfo, ...],
    timeout: float,
    *,
    quiet: bool,
    die_with_parent: bool,
    only: Iterable[int] | None = None,
    cgroup: Path | None = None,
) -> ClusterInfo:
    java = require_java()
    classpath = kafka_classpath()
    wanted = set(only) if only is not None else {node.node_id for node in nodes if not node.alive}
    for node in nodes:  # a node stopped a moment ago may hold its ports a little longer
        for used in (node.port, node.controller_port) if node.node_id in wanted else ():
            if not _bindable(used, wait=10.0):
                raise PrerequisiteError(f"port {used} on {HOST} (node {node.node_id}) is taken by another program")
    voters = {node.node_id: node.controller_port for node in nodes}
    cluster_id = _cluster_id(nodes) or kafkaconfig.new_cluster_id()
    started = time.monotonic()
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for node in nodes:
            if node.node_id not in wanted:
                continue
            node.home.mkdir(parents=True, exist_ok=True)
            properties = node.home / "server.properties"
            properties.write_text(
                kafkaconfig.server_properties(
                    node.home, node.port, node.controller_port, node_id=node.node_id, voters=voters
                )
            )
            jvm = kafkaconfig.java_command(java, classpath, node.home, heap=HEAP, c1_only=True)
            log_file = node.log_file
            _rotate(log_file)
            if not (node.data_dir / "meta.properties").exists():
                kafkaconfig.format_storage(jvm, properties, log_file, None, cluster_id)
            procs[node.node_id] = _spawn(
                [*jvm, _MAIN_CLASS, str(properties)],
                what=f"Kafka node {node.node_id} on {node.bootstrap}",
                log_file=log_file,
                pid_file=_pid_file(node.home),
                cwd=node.home,
                die_with_parent=die_with_parent,
                cgroup=cgroup,
            )
        _say(quiet, f"starting a Kafka cluster of {len(nodes)} on {','.join(n.bootstrap for n in nodes)} …")
        _await_cluster(nodes, procs, started + timeout, timeout)
    except BaseException:
        for pid in (proc.pid for proc in procs.values()):
            _signal_group(pid, signal.SIGKILL)
        for node in nodes:
            if node.node_id in procs:
                _pid_file(node.home).unlink(missing_ok=True)
        raise
    info = configured(base.parent)
    assert info is not None
    _say(quiet, f"the Kafka cluster is ready at {info.bootstrap} ({time.monotonic() - started:.1f}s)")
    return info


def _await_cluster(
    nodes: tuple[NodeInfo, ...], procs: dict[int, subprocess.Popen[bytes]], deadline: float, timeout: float
) -> None:
    """Until every started node answers and the metadata lists every running broker;
    ServerStartError when a node exits or `deadline` passes first."""
    from refold.dev.localkafka import answers

    pending = dict(procs)
    while True:
        for node in nodes:
            proc = pending.get(node.node_id)
            if proc is None:
                continue
            exited = proc.poll()
            if exited is not None or time.monotonic() > deadline:
                why = f"exited with {exited}" if exited is not None else f"did not answer in {timeout:.0f}s"
                raise ServerStartError(
                    f"Kafka node {node.node_id} on {node.bootstrap} {why}",
                    log_file=node.log_file,
                    log_tail=_tail(node.log_file),
                )
            if answers(node.bootstrap, timeout=2.0):
                del pending[node.node_id]
        if not pending and _registered(nodes) >= len(procs):
            return
        if time.monotonic() > deadline:
            raise ServerStartError(
                f"the Kafka cluster on {nodes[0].bootstrap}… has not every broker registered after {timeout:.0f}s",
                log_file=nodes[0].log_file,
                log_tail=_tail(nodes[0].log_file),
            )
        time.sleep(0.3)


def _registered(nodes: tuple[NodeInfo, ...]) -> int:
    """How many brokers the cluster's metadata lists."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": ",".join(n.bootstrap for n in nodes), "log_level": 0})
    try:
        return len(admin.list_topics(timeout=5).brokers)
    except Exception:
        return 0


def _cluster_id(nodes: Iterable[NodeInfo]) -> str | None:
    """The cluster id a formatted node has (so a wiped node rejoins its cluster)."""
    for node in nodes:
        try:
            lines = (node.data_dir / "meta.properties").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition("=")
            if key.strip() == "cluster.id":
                return value.strip()
    return None


def _pid(node: NodeInfo) -> int:
    assert node.pid is not None
    return node.pid


def _pid_file(folder: Path) -> Path:
    return folder / "broker.pid"


def _running_pid(folder: Path) -> int | None:
    return _running_pid_in(_pid_file(folder), (_MAIN_CLASS, str(folder / "server.properties")))
