"""A real local Apache Kafka broker: one KRaft node (broker + controller) on 127.0.0.1.

The embedded default of every `refold` command (`refold kafka start|stop|status`).
Its jars come from Maven Central (`refold.spark.jars`); everything else lives under
`<home>/kafka/` (home: `refold.environment.home()`, i.e. `.refold/`):

    server.properties   written on every start from the settings below
    log4j2.yaml         WARN and above, plus the "started" line
    data/               the log dirs and the KRaft metadata log
    broker.log          the JVM's stdout and stderr
    broker.pid          the pid of the running JVM (its own process group)

The settings, chosen for one node, and the storage format are in
`refold.dev.kafkaconfig`. Secured mode (opt-in: `start(..., security=Security(...))`,
SASL_SSL with SCRAM-SHA-512 and ACLs, a fresh home needed) is in
`refold.dev.kafkasecurity`. A cluster of several nodes (`refold kafka start --brokers
3`) is `refold.dev.kafkacluster`; a home runs one or the other, and `stop` and
`status` here handle both.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refold import environment
from refold.dev import kafkaconfig
from refold.dev.kafkasecurity import Security
from refold.dev.localproc import HOST, ServerStartError, free_port, stop_server
from refold.dev.localproc import bindable as _bindable
from refold.dev.localproc import kill_group as _kill_group
from refold.dev.localproc import listening as _listening
from refold.dev.localproc import locked as _locked
from refold.dev.localproc import rotate as _rotate
from refold.dev.localproc import running_pid as _running_pid_in
from refold.dev.localproc import say as _say
from refold.dev.localproc import signal_group as _signal_group
from refold.dev.localproc import spawn as _spawn
from refold.dev.localproc import tail as _tail
from refold.environment import home as project_home
from refold.errors import PrerequisiteError
from refold.spark.jars import kafka_classpath, require_java

DEFAULT_PORT = 9092
HEAP = ("256m", "1g")  # -Xms, -Xmx
_MAIN_CLASS = "kafka.Kafka"


@dataclass(frozen=True, slots=True)
class BrokerInfo(kafkaconfig.NodeFiles):
    """A running local broker (`bootstrap`, `data_dir`, `log_file`: `NodeFiles`)."""

    pid: int
    port: int
    controller_port: int
    home: Path  # the broker's folder, <project home>/kafka
    secured: bool = False  # SASL_SSL + SCRAM-SHA-512 + ACLs (see Security)


def kafka_home(home: Path | None = None) -> Path:
    """The broker's folder inside a Refold home (default: `project_home()`)."""
    return (home if home is not None else project_home()).resolve() / "kafka"


# Lifecycle ---------------------------------------------------------------------------


def start(
    port: int = DEFAULT_PORT,
    timeout: float = 60.0,
    *,
    home: Path | None = None,
    quiet: bool = False,
    die_with_parent: bool = False,
    security: Security | None = None,
) -> BrokerInfo:
    """Start the broker and wait until it answers a metadata request.

    Formats the storage on first use. Harmless when the broker already runs: it
    returns the running one (whatever its port). `die_with_parent` (Linux) sends the
    broker SIGTERM when the calling thread's process dies, for test sessions that may
    be killed; call it from the main thread, as the signal follows the thread.
    `security` starts it in secured mode (see `Security`; a fresh home is needed).
    Raises PrerequisiteError (no Java, port taken) or ServerStartError (the broker
    exited or did not answer within `timeout` seconds; the process is then killed).
    """
    base = kafka_home(home)
    base.mkdir(parents=True, exist_ok=True)
    with _locked(base):
        from refold.dev import kafkacluster

        cluster = kafkacluster.status(home)
        if cluster is not None:
            raise PrerequisiteError(
                f"a local Kafka cluster runs in this home ({cluster.bootstrap}): "
                "`refold kafka stop` it first, or use another REFOLD_HOME"
            )
        running = status(home)
        if running is not None:
            _say(quiet, f"Kafka already runs at {running.bootstrap} (pid {running.pid})")
            return running
        return _launch(
            base, port, timeout, quiet=quiet, die_with_parent=die_with_parent, security=security
        )


def stop(timeout: float = 30.0, *, home: Path | None = None) -> bool:
    """Stop the broker (and the home's cluster, `kafkacluster`, if one runs) cleanly:
    SIGTERM, then SIGKILL after `timeout` seconds.

    Removes the pid file. Returns False when no broker ran.
    """
    from refold.dev import kafkacluster

    base = kafka_home(home)
    single = stop_server(base, _pid_file(base), lambda: _running_pid(base), timeout)
    cluster = kafkacluster.stop(timeout, home=home)
    return single or cluster


def status(home: Path | None = None) -> BrokerInfo | None:
    """The running local broker, or None. Does not ask the broker anything."""
    base = kafka_home(home)
    pid = _running_pid(base)
    if pid is None:
        return None
    ports = kafkaconfig.configured_ports(base)
    if ports is None:
        return None
    return BrokerInfo(pid, ports[0], ports[1], base, secured=ports[2])


def kill_hard(home: Path | None = None) -> bool:
    """kill -9 the broker's process group, like a crash. False when none ran."""
    base = kafka_home(home)
    with _locked(base):
        pid = _running_pid(base)
        if pid is None:
            return False
        _kill_group(pid)
        _pid_file(base).unlink(missing_ok=True)
        return True


def restart_hard(
    home: Path | None = None,
    timeout: float = 60.0,
    *,
    die_with_parent: bool = False,
    security: Security | None = None,
) -> BrokerInfo:
    """kill -9 the broker and start it again on the same data and port (chaos tests).
    A secured broker needs its `security` again."""
    info = status(home)
    if info is None:
        raise PrerequisiteError(f"no local broker runs in {kafka_home(home)}")
    kill_hard(home)
    _bindable(info.port, wait=10.0)  # the kernel may take a moment to release the port
    return start(
        info.port, timeout, home=home, quiet=True, die_with_parent=die_with_parent, security=security
    )


def answers(bootstrap: str, timeout: float = 2.0, client: Mapping[str, Any] | None = None) -> bool:
    """Whether a broker at `bootstrap` answers a metadata request within `timeout`.
    `client`: further librdkafka settings (security) for the request."""
    from confluent_kafka.admin import AdminClient

    host, _, port = bootstrap.split(",")[0].strip().rpartition(":")
    try:
        address = (host.strip("[]") or HOST, int(port))
        socket.create_connection(address, timeout=min(timeout, 1.0)).close()
    except (OSError, ValueError):
        return False
    try:
        admin = AdminClient(
            {
                **(client or {}),
                "bootstrap.servers": bootstrap,
                "socket.timeout.ms": int(timeout * 1000),
                "log_level": 0,
            }
        )
        metadata = admin.list_topics(timeout=timeout)
    except Exception:
        return False
    return bool(metadata.brokers)


def ensure_broker(bootstrap: str | None, *, start_local: bool = False) -> str:
    """The bootstrap servers a command should use.

    The explicit argument, else `$REFOLD_BOOTSTRAP_SERVERS` (both returned as they
    are, unchecked), else the local broker: the one running in this home (whatever
    its port), else 127.0.0.1:9092 when something listens there. When nothing does,
    `start_local=True` starts the local broker; otherwise a PrerequisiteError says
    how to get one.
    """
    if bootstrap:
        return bootstrap
    env = environment.bootstrap_servers()
    if env:
        return env
    info = status()
    if info is not None:
        return info.bootstrap
    from refold.dev import kafkacluster

    cluster = kafkacluster.status()
    if cluster is not None:
        return cluster.bootstrap
    default = f"{HOST}:{DEFAULT_PORT}"
    if _listening(HOST, DEFAULT_PORT):
        return default
    if start_local:
        return start().bootstrap
    raise PrerequisiteError(
        f"no Kafka broker at {default}: start the local one with `refold kafka start`, "
        "or name a cluster with --bootstrap-servers or REFOLD_BOOTSTRAP_SERVERS"
    )


# Command line --------------------------------------------------------------------------


def cli(args: argparse.Namespace) -> int:
    """`refold kafka start|stop|status [--port N] [--brokers N]`. Exit 1 from `status`
    when none runs."""
    from refold.dev import kafkacluster, kafkahealth

    action = args.action
    if action == "start":
        port = getattr(args, "port", None) or DEFAULT_PORT
        brokers = getattr(args, "brokers", None) or 1
        if brokers > 1:
            cluster = kafkacluster.start(port, brokers)
            print("\n".join(kafkahealth.report(cluster)))
            return 0
        info = start(port)
        print(f"Kafka runs at {info.bootstrap} (pid {info.pid})")
        print(f"  data {info.data_dir}")
        print(f"  log  {info.log_file}")
        return 0
    if action == "stop":
        print("Kafka stopped" if stop() else "Kafka was not running")
        return 0
    if action == "status":
        cluster = kafkacluster.status()
        if cluster is not None:
            print("\n".join(kafkahealth.report(cluster)))
            return 0
        found = status()
        if found is None:
            print(f"Kafka is not running (data in {kafka_home() / 'data'})")
            return 1
        if found.secured:
            state = "SASL_SSL + SCRAM-SHA-512, ACLs on"
        else:
            state = "answers" if answers(found.bootstrap) else "does not answer yet"
        print(f"Kafka runs at {found.bootstrap} (pid {found.pid}, {state})")
        print(f"  data {found.data_dir}")
        print(f"  log  {found.log_file}")
        return 0
    raise ValueError(f"unknown action {action!r}: start, stop or status")


# Inside ----------------------------------------------------------------------------------


def _launch(
    base: Path,
    port: int,
    timeout: float,
    *,
    quiet: bool,
    die_with_parent: bool,
    security: Security | None,
) -> BrokerInfo:
    java = require_java()
    classpath = kafka_classpath()
    if not _bindable(port):
        raise PrerequisiteError(
            f"port {port} on {HOST} is taken by another program; choose another"
        )
    controller_port = port + 1 if _bindable(port + 1) else free_port()
    properties = base / "server.properties"
    properties.touch(mode=0o600)
    properties.chmod(0o600)  # secured mode: it holds the keystore and admin passwords
    properties.write_text(kafkaconfig.server_properties(base, port, controller_port, security))
    jvm = kafkaconfig.java_command(java, classpath, base, heap=HEAP)
    log_file = base / "broker.log"
    _rotate(log_file)
    started = time.monotonic()
    if not (base / "data" / "meta.properties").exists():
        kafkaconfig.format_storage(jvm, properties, log_file, security)
    proc = _spawn(
        [*jvm, _MAIN_CLASS, str(properties)],
        what=f"Kafka on {HOST}:{port}",
        log_file=log_file,
        pid_file=_pid_file(base),
        cwd=base,
        die_with_parent=die_with_parent,
    )
    info = BrokerInfo(proc.pid, port, controller_port, base, secured=security is not None)
    _say(quiet, f"starting Kafka on {info.bootstrap} (data in {info.data_dir}) …")
    _await_answer(info, proc, started + timeout, timeout, security)
    _say(quiet, f"Kafka is ready at {info.bootstrap} ({time.monotonic() - started:.1f}s)")
    return info


def _await_answer(
    info: BrokerInfo,
    proc: subprocess.Popen[bytes],
    deadline: float,
    timeout: float,
    security: Security | None,
) -> None:
    """Until the new broker answers; when it exits or `deadline` passes first, kill it,
    remove its pid file and raise ServerStartError."""
    client = security.client_settings() if security is not None else None
    while not answers(info.bootstrap, timeout=2.0, client=client):
        exited = proc.poll()
        if exited is not None or time.monotonic() > deadline:
            if exited is None:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(10)
            _pid_file(info.home).unlink(missing_ok=True)
            why = (
                f"exited with {exited}"
                if exited is not None
                else f"did not answer in {timeout:.0f}s"
            )
            log_file = info.log_file
            raise ServerStartError(
                f"Kafka on {info.bootstrap} {why}", log_file=log_file, log_tail=_tail(log_file)
            )
        time.sleep(0.2)


def _pid_file(base: Path) -> Path:
    return base / "broker.pid"


def _running_pid(base: Path) -> int | None:
    """The pid in the pid file, if that process lives and is this home's broker."""
    return _running_pid_in(_pid_file(base), (_MAIN_CLASS, str(base / "server.properties")))
