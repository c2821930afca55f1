"""A real local Apache Kafka broker: one KRaft node (broker + controller) on 127.0.0.1.

The embedded default of every `refold` command (`refold kafka start|stop|status`).
Its jars come from Maven Central (`refold.spark.jars`); everything else lives under
`<home>/kafka/` (home: `refold.environment.home()`, i.e. `.refold/`):

    server.properties   written on every start from the settings below
    log4j2.yaml         WARN and above, plus the "started" line
    data/               the log dirs and the KRaft metadata log
    broker.log          the JVM's stdout and stderr
    broker.pid          the pid of the running JVM (its own process group)

Settings, chosen for one node: replication factor and min ISR 1 for the offsets and
transaction state topics (so transactions work), no initial rebalance delay, and
automatic topic creation OFF: Refold creates every topic it uses on purpose, with
its partition count and cleanup policy, and a typo in a topic name should fail
rather than make a topic. The controller quorum is static (`controller.quorum.voters`),
so the controller port may change between starts.

Secured mode (opt-in: `start(..., security=Security(...))`): the client listener is
SASL_SSL with SCRAM-SHA-512, TLS from a PKCS12 keystore (`refold.dev.tlsgen` makes one);
the broker uses the same listener between brokers (as the admin user) and a
mutual-TLS controller listener on 127.0.0.1 (its certificate is its principal). The
`StandardAuthorizer` checks ACLs with `allow.everyone.if.no.acl.found=false`; the
admin user and the broker's certificate are super users. SCRAM users are written at
format time, so a secured broker needs a fresh home. server.properties then holds
the keystore and admin passwords and is readable by its owner only.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refold import environment
from refold.dev.localproc import HOST, ServerStartError, free_port
from refold.dev.localproc import alive as _alive
from refold.dev.localproc import bindable as _bindable
from refold.dev.localproc import listening as _listening
from refold.dev.localproc import locked as _locked
from refold.dev.localproc import parent_death_signal as _parent_death_signal
from refold.dev.localproc import say as _say
from refold.dev.localproc import signal_group as _signal_group
from refold.dev.localproc import tail as _tail
from refold.dev.localproc import wait_gone as _wait_gone
from refold.dev.tlsgen import TlsFiles
from refold.environment import home as project_home
from refold.errors import PrerequisiteError
from refold.spark.jars import kafka_classpath, require_java

DEFAULT_PORT = 9092
JVM_OPTIONS = (
    "-Xms256m",
    "-Xmx1g",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
_LOG_ROTATE_BYTES = 20 * 1024 * 1024
_MAIN_CLASS = "kafka.Kafka"


@dataclass(frozen=True, slots=True)
class BrokerInfo:
    """A running local broker."""

    pid: int
    port: int
    controller_port: int
    home: Path  # the broker's folder, <project home>/kafka
    secured: bool = False  # SASL_SSL + SCRAM-SHA-512 + ACLs (see Security)

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def data_dir(self) -> Path:
        return self.home / "data"

    @property
    def log_file(self) -> Path:
        return self.home / "broker.log"


SCRAM_MECHANISM = "SCRAM-SHA-512"
_SCRAM_ITERATIONS = 4096


@dataclass(frozen=True, slots=True)
class Security:
    """The secured mode of the local broker: SASL_SSL + SCRAM-SHA-512 + ACLs.

    `admin` is a super user (the broker talks to itself as this user too); `users`
    are further SCRAM users, written with the admin at format time. Passwords stay
    out of reprs and logs; they are hashed (salted, as SCRAM stores them) before they
    reach the format command's arguments.
    """

    tls: TlsFiles
    admin_password: str = field(repr=False)
    admin: str = "admin"
    users: Mapping[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name, password in {self.admin: self.admin_password, **self.users}.items():
            for text in (name, password):
                if not text or any(c in text for c in '"\\\n,=[]'):
                    raise ValueError(f"SCRAM user {name!r}: names and passwords must not be empty "
                                     "nor contain quotes, backslashes, newlines, ',', '=' or brackets")

    @property
    def super_users(self) -> list[str]:
        return [f"User:{self.admin}", self.tls.broker_principal]

    def client_settings(self, user: str | None = None, password: str | None = None) -> dict[str, Any]:
        """librdkafka settings for `user` (default: the admin) on the SASL_SSL listener."""
        name = user or self.admin
        if password is None:
            password = self.admin_password if name == self.admin else self.users[name]
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": SCRAM_MECHANISM,
            "sasl.username": name,
            "sasl.password": password,
            "ssl.ca.location": str(self.tls.ca),
        }


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
        running = status(home)
        if running is not None:
            _say(quiet, f"Kafka already runs at {running.bootstrap} (pid {running.pid})")
            return running
        return _launch(
            base, port, timeout, quiet=quiet, die_with_parent=die_with_parent, security=security
        )


def stop(timeout: float = 30.0, *, home: Path | None = None) -> bool:
    """Stop the broker cleanly: SIGTERM, then SIGKILL after `timeout` seconds.

    Removes the pid file. Returns False when no broker ran.
    """
    base = kafka_home(home)
    with _locked(base):
        pid = _running_pid(base)
        if pid is None:
            _pid_file(base).unlink(missing_ok=True)
            return False
        _signal_group(pid, signal.SIGTERM)
        if not _wait_gone(pid, timeout):
            _signal_group(pid, signal.SIGKILL)
            _wait_gone(pid, 10.0)
        _pid_file(base).unlink(missing_ok=True)
        return True


def status(home: Path | None = None) -> BrokerInfo | None:
    """The running local broker, or None. Does not ask the broker anything."""
    base = kafka_home(home)
    pid = _running_pid(base)
    if pid is None:
        return None
    ports = _configured_ports(base)
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
        _signal_group(pid, signal.SIGKILL)
        _wait_gone(pid, 10.0)
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
    """`refold kafka start|stop|status [--port N]`. Exit 1 from `status` when none runs."""
    action = args.action
    if action == "start":
        port = getattr(args, "port", None) or DEFAULT_PORT
        info = start(port)
        print(f"Kafka runs at {info.bootstrap} (pid {info.pid})")
        print(f"  data {info.data_dir}")
        print(f"  log  {info.log_file}")
        return 0
    if action == "stop":
        print("Kafka stopped" if stop() else "Kafka was not running")
        return 0
    if action == "status":
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
    properties.write_text(_properties(base, port, controller_port, security))
    (base / "log4j2.yaml").write_text(_LOG4J)
    jvm = [
        java,
        *JVM_OPTIONS,
        f"-Dlog4j2.configurationFile={base / 'log4j2.yaml'}",
        "-cp",
        classpath,
    ]
    log_file = base / "broker.log"
    _rotate(log_file)
    started = time.monotonic()
    if not (base / "data" / "meta.properties").exists():
        _format(jvm, properties, log_file, security)
    with log_file.open("ab") as log:
        log.write(f"--- refold: starting Kafka on {HOST}:{port} at {time.ctime()}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            [*jvm, _MAIN_CLASS, str(properties)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=base,  # where a crashing JVM writes its hs_err file
            start_new_session=True,  # its own process group: stop/kill reach the whole JVM
            preexec_fn=_parent_death_signal(os.getpid()) if die_with_parent else None,
        )
    _pid_file(base).write_text(f"{proc.pid}\n")
    info = BrokerInfo(proc.pid, port, controller_port, base, secured=security is not None)
    client = security.client_settings() if security is not None else None
    _say(quiet, f"starting Kafka on {info.bootstrap} (data in {info.data_dir}) …")
    deadline = started + timeout
    while not answers(info.bootstrap, timeout=2.0, client=client):
        exited = proc.poll()
        if exited is not None or time.monotonic() > deadline:
            if exited is None:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(10)
            _pid_file(base).unlink(missing_ok=True)
            why = (
                f"exited with {exited}"
                if exited is not None
                else f"did not answer in {timeout:.0f}s"
            )
            raise ServerStartError(
                f"Kafka on {info.bootstrap} {why}", log_file=log_file, log_tail=_tail(log_file)
            )
        time.sleep(0.2)
    _say(quiet, f"Kafka is ready at {info.bootstrap} ({time.monotonic() - started:.1f}s)")
    return info


def _format(jvm: list[str], properties: Path, log_file: Path, security: Security | None) -> None:
    """Format the storage of a fresh node (static quorum: a cluster id is enough).
    Secured mode adds its SCRAM users, salted and hashed here."""
    scram = []
    if security is not None:
        for name, password in {security.admin: security.admin_password, **security.users}.items():
            scram += ["--add-scram", _scram_credential(name, password)]
    formatted = subprocess.run(
        [*jvm, "kafka.tools.StorageTool", "format", "--ignore-formatted",
         f"--cluster-id={_new_cluster_id()}", "--config", str(properties), *scram],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if formatted.returncode != 0:
        with log_file.open("a") as log:
            log.write(formatted.stdout + formatted.stderr)
        raise ServerStartError(
            "formatting the Kafka storage failed", log_file=log_file, log_tail=_tail(log_file)
        )


def _scram_credential(name: str, password: str) -> str:
    """A `--add-scram` argument with the salted password (RFC 5802 Hi()), not the password."""
    salt = os.urandom(24)
    salted = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, _SCRAM_ITERATIONS)
    return (
        f"{SCRAM_MECHANISM}=[name={name},iterations={_SCRAM_ITERATIONS},"
        f'salt="{base64.b64encode(salt).decode()}",'
        f'saltedpassword="{base64.b64encode(salted).decode()}"]'
    )


def _new_cluster_id() -> str:
    """A random cluster id as Kafka writes them (URL-safe base64 of 16 bytes)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if text[0].isalnum():
            return text


def _properties(base: Path, port: int, controller_port: int, security: Security | None = None) -> str:
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@{HOST}:{controller_port}",
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
    }
    if security is not None:
        settings.update(_secured_properties(port, controller_port, security))
    return "".join(f"{key}={value}\n" for key, value in settings.items())


def _secured_properties(port: int, controller_port: int, security: Security) -> dict[str, str]:
    tls = security.tls
    login = (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{security.admin}" password="{security.admin_password}";'
    )
    return {
        "listeners": f"SASL_SSL://{HOST}:{port},CONTROLLER://{HOST}:{controller_port}",
        "advertised.listeners": f"SASL_SSL://{HOST}:{port}",
        "inter.broker.listener.name": "SASL_SSL",
        "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:SSL",
        "sasl.enabled.mechanisms": SCRAM_MECHANISM,
        "sasl.mechanism.inter.broker.protocol": SCRAM_MECHANISM,
        f"listener.name.sasl_ssl.{SCRAM_MECHANISM.lower()}.sasl.jaas.config": login,
        "ssl.keystore.type": "PKCS12",
        "ssl.keystore.location": str(tls.keystore),
        "ssl.keystore.password": tls.keystore_password,
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(tls.ca),
        "ssl.endpoint.identification.algorithm": "https",
        # The controller link: mutual TLS, the broker's certificate is its principal.
        "listener.name.controller.ssl.client.auth": "required",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": ";".join(security.super_users),
    }


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
      - name: kafka.server.BrokerLifecycleManager
        level: INFO
"""


def _configured_ports(base: Path) -> tuple[int, int, bool] | None:
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


def _pid_file(base: Path) -> Path:
    return base / "broker.pid"


def _running_pid(base: Path) -> int | None:
    """The pid in the pid file, if that process lives and is this home's broker."""
    try:
        pid = int(_pid_file(base).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if not _alive(pid):
        return None
    cmdline = Path(f"/proc/{pid}/cmdline")
    if cmdline.exists():  # Linux: make sure the pid was not reused by another program
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            return None
        if _MAIN_CLASS.encode() not in args or str(base / "server.properties").encode() not in args:
            return None
    return pid


def _rotate(log_file: Path) -> None:
    with contextlib.suppress(OSError):
        if log_file.stat().st_size > _LOG_ROTATE_BYTES:
            log_file.replace(log_file.with_name(log_file.name + ".1"))

