"""A real local Apache Kafka broker: one KRaft node (broker + controller) on 127.0.0.1.

The embedded default of every `refold` command. Its jars come from Maven Central
(`refold.jars`); its configuration, data and log live under `<home>/kafka/`.
Transactions work on one node (replication factors and min ISR of 1).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from refold.errors import PrerequisiteError
from refold.jars import kafka_classpath, project_home, require

DEFAULT_PORT = 9092
HEAP = "-Xmx1g"


@dataclass(frozen=True, slots=True)
class BrokerInfo:
    pid: int
    bootstrap: str
    data_dir: Path
    log_file: Path


def kafka_home(home: Path | None = None) -> Path:
    return (home or project_home()) / "kafka"


def _read_pid(base: Path) -> int | None:
    try:
        pid = int((base / "broker.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid


def _info(base: Path, pid: int) -> BrokerInfo:
    port = int((base / "broker.pid").read_text().split()[1])
    return BrokerInfo(pid, f"127.0.0.1:{port}", base / "data", base / "broker.log")


def status(home: Path | None = None) -> BrokerInfo | None:
    """The running local broker, or None."""
    base = kafka_home(home)
    pid = _read_pid(base)
    return _info(base, pid) if pid is not None else None


def _properties(base: Path, port: int, controller_port: int) -> str:
    return "\n".join(
        [
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.bootstrap.servers=127.0.0.1:{controller_port}",
            f"listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{port}",
            "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=PLAINTEXT",
            "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            f"log.dirs={base / 'data'}",
            "num.partitions=3",
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=5",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "transaction.state.log.num.partitions=5",
            "group.initial.rebalance.delay.ms=0",
            # Topics are created on purpose (refold produce / run create what they need).
            "auto.create.topics.enable=false",
            "message.max.bytes=8388608",
            "transaction.abort.timed.out.transaction.cleanup.interval.ms=2000",
            "log.cleaner.backoff.ms=2000",
            "",
        ]
    )


_LOG4J = """Configuration:
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
"""


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(port: int = DEFAULT_PORT, timeout: float = 90.0, home: Path | None = None, quiet: bool = False) -> BrokerInfo:
    """Start the broker (formatting its storage on first use) and wait until it answers."""
    base = kafka_home(home)
    running = status(home)
    if running is not None:
        if not quiet:
            print(f"Kafka already runs at {running.bootstrap} (pid {running.pid})", file=sys.stderr)
        return running
    java = require("java", "apt-get install openjdk-17-jre-headless")
    classpath = kafka_classpath()
    base.mkdir(parents=True, exist_ok=True)
    controller_port = port + 1 if _port_free(port + 1) else free_port()
    if not _port_free(port):
        raise PrerequisiteError(f"port {port} on 127.0.0.1 is taken by another program; use --port")
    (base / "server.properties").write_text(_properties(base, port, controller_port))
    (base / "log4j2.yaml").write_text(_LOG4J)
    jvm = [java, HEAP, f"-Dlog4j2.configurationFile={base / 'log4j2.yaml'}", "-cp", classpath]
    if not (base / "data" / "meta.properties").exists():
        cluster = str(uuid.uuid4())
        formatted = subprocess.run(
            [*jvm, "kafka.tools.StorageTool", "format", "--standalone", "-t", _cluster_id(cluster),
             "-c", str(base / "server.properties")],
            capture_output=True, text=True, check=False,
        )
        if formatted.returncode != 0:
            raise PrerequisiteError(f"formatting Kafka storage failed:\n{formatted.stdout}{formatted.stderr}")
    started = time.monotonic()
    log_file = base / "broker.log"
    with log_file.open("ab") as log:
        proc = subprocess.Popen(
            [*jvm, "kafka.Kafka", str(base / "server.properties")],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    (base / "broker.pid").write_text(f"{proc.pid} {port}\n")
    bootstrap = f"127.0.0.1:{port}"
    if not quiet:
        print(f"starting Kafka on {bootstrap} (data in {base / 'data'}) …", file=sys.stderr, flush=True)
    while not _answers(bootstrap):
        if proc.poll() is not None or time.monotonic() - started > timeout:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-20:])
            raise PrerequisiteError(f"Kafka did not come up on {bootstrap}; the end of {log_file}:\n{tail}")
        time.sleep(0.3)
    if not quiet:
        print(f"Kafka is ready at {bootstrap} ({time.monotonic() - started:.1f}s)", file=sys.stderr)
    return BrokerInfo(proc.pid, bootstrap, base / "data", log_file)


def _cluster_id(seed: str) -> str:
    import base64

    return base64.urlsafe_b64encode(uuid.UUID(seed).bytes).decode().rstrip("=")


def _answers(bootstrap: str) -> bool:
    from confluent_kafka.admin import AdminClient

    host, port = bootstrap.split(",")[0].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    try:
        admin = AdminClient({"bootstrap.servers": bootstrap, "socket.timeout.ms": 2000, "log_level": 0})
        metadata = admin.list_topics(timeout=2)
    except Exception:
        return False
    return bool(metadata.brokers)


def stop(timeout: float = 30.0, home: Path | None = None) -> bool:
    """Stop the broker cleanly (SIGTERM, then SIGKILL after `timeout`). False if none ran."""
    base = kafka_home(home)
    pid = _read_pid(base)
    if pid is None:
        (base / "broker.pid").unlink(missing_ok=True)
        return False
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    (base / "broker.pid").unlink(missing_ok=True)
    return True


def restart_hard(home: Path | None = None, timeout: float = 90.0) -> BrokerInfo:
    """kill -9 the broker and start it again on the same data and port (chaos)."""
    base = kafka_home(home)
    info = status(home)
    if info is None:
        raise PrerequisiteError("no local broker runs")
    os.killpg(info.pid, signal.SIGKILL)
    while _alive(info.pid):
        time.sleep(0.05)
    (base / "broker.pid").unlink(missing_ok=True)
    return start(int(info.bootstrap.rsplit(":", 1)[1]), timeout, home, quiet=True)


def _alive(pid: int) -> bool:
    try:
        waited, _status = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def ensure_broker(bootstrap: str | None) -> str:
    """The bootstrap servers to use: the argument, else $REFOLD_BOOTSTRAP_SERVERS,
    else the local broker (which must be running: `refold kafka start`)."""
    if bootstrap:
        return bootstrap
    env = os.environ.get("REFOLD_BOOTSTRAP_SERVERS")
    if env:
        return env
    info = status()
    return info.bootstrap if info is not None else f"127.0.0.1:{DEFAULT_PORT}"


def cli(args: argparse.Namespace) -> int:
    if args.action == "start":
        info = start(args.port)
        print(f"Kafka runs at {info.bootstrap} (pid {info.pid}); data {info.data_dir}; log {info.log_file}")
    elif args.action == "stop":
        print("Kafka stopped" if stop() else "Kafka was not running")
    else:
        found = status()
        if found is None:
            print("Kafka is not running")
            return 1
        answers = "answers" if _answers(found.bootstrap) else "does not answer"
        print(f"Kafka runs at {found.bootstrap} (pid {found.pid}, {answers}); data {found.data_dir}; log {found.log_file}")
    return 0
