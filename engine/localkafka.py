"""A real local Apache Kafka broker: one KRaft node (broker + controller) on 127.0.0.1.

The embedded default of every `refold` command (`refold kafka start|stop|status`).
Its jars come from Maven Central (`refold.jars`); everything else lives under
`<home>/kafka/` (home: `refold.jars.project_home()`, i.e. `.refold/`):

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
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from refold.errors import PrerequisiteError
from refold.jars import kafka_classpath, project_home, require_java

DEFAULT_PORT = 9092
HOST = "127.0.0.1"
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


class BrokerStartError(PrerequisiteError):
    """The local broker did not come up. Keeps its log file and the log's last lines."""

    def __init__(self, message: str, *, log_file: Path, log_tail: str) -> None:
        self.log_file = log_file
        self.log_tail = log_tail
        super().__init__(f"{message}; the end of {log_file}:\n{log_tail}")


@dataclass(frozen=True, slots=True)
class BrokerInfo:
    """A running local broker."""

    pid: int
    port: int
    controller_port: int
    home: Path  # the broker's folder, <project home>/kafka

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def data_dir(self) -> Path:
        return self.home / "data"

    @property
    def log_file(self) -> Path:
        return self.home / "broker.log"


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
) -> BrokerInfo:
    """Start the broker and wait until it answers a metadata request.

    Formats the storage on first use. Harmless when the broker already runs: it
    returns the running one (whatever its port). `die_with_parent` (Linux) sends the
    broker SIGTERM when the calling thread's process dies, for test sessions that may
    be killed; call it from the main thread, as the signal follows the thread.
    Raises PrerequisiteError (no Java, port taken) or BrokerStartError (the broker
    exited or did not answer within `timeout` seconds; the process is then killed).
    """
    base = kafka_home(home)
    base.mkdir(parents=True, exist_ok=True)
    with _locked(base):
        running = status(home)
        if running is not None:
            _say(quiet, f"Kafka already runs at {running.bootstrap} (pid {running.pid})")
            return running
        return _launch(base, port, timeout, quiet=quiet, die_with_parent=die_with_parent)


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
    return BrokerInfo(pid, ports[0], ports[1], base)


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
    home: Path | None = None, timeout: float = 60.0, *, die_with_parent: bool = False
) -> BrokerInfo:
    """kill -9 the broker and start it again on the same data and port (chaos tests)."""
    info = status(home)
    if info is None:
        raise PrerequisiteError(f"no local broker runs in {kafka_home(home)}")
    kill_hard(home)
    _bindable(info.port, wait=10.0)  # the kernel may take a moment to release the port
    return start(info.port, timeout, home=home, quiet=True, die_with_parent=die_with_parent)


def answers(bootstrap: str, timeout: float = 2.0) -> bool:
    """Whether a broker at `bootstrap` answers a metadata request within `timeout`."""
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
    env = os.environ.get("REFOLD_BOOTSTRAP_SERVERS")
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


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
        state = "answers" if answers(found.bootstrap) else "does not answer yet"
        print(f"Kafka runs at {found.bootstrap} (pid {found.pid}, {state})")
        print(f"  data {found.data_dir}")
        print(f"  log  {found.log_file}")
        return 0
    raise ValueError(f"unknown action {action!r}: start, stop or status")


# Inside ----------------------------------------------------------------------------------


def _launch(
    base: Path, port: int, timeout: float, *, quiet: bool, die_with_parent: bool
) -> BrokerInfo:
    java = require_java()
    classpath = kafka_classpath()
    if not _bindable(port):
        raise PrerequisiteError(
            f"port {port} on {HOST} is taken by another program; choose another"
        )
    controller_port = port + 1 if _bindable(port + 1) else free_port()
    properties = base / "server.properties"
    properties.write_text(_properties(base, port, controller_port))
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
        _format(jvm, properties, log_file)
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
    info = BrokerInfo(proc.pid, port, controller_port, base)
    _say(quiet, f"starting Kafka on {info.bootstrap} (data in {info.data_dir}) …")
    deadline = started + timeout
    while not answers(info.bootstrap, timeout=2.0):
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
            raise BrokerStartError(
                f"Kafka on {info.bootstrap} {why}", log_file=log_file, log_tail=_tail(log_file)
            )
        time.sleep(0.2)
    _say(quiet, f"Kafka is ready at {info.bootstrap} ({time.monotonic() - started:.1f}s)")
    return info


def _format(jvm: list[str], properties: Path, log_file: Path) -> None:
    """Format the storage of a fresh node (static quorum: a cluster id is enough)."""
    formatted = subprocess.run(
        [*jvm, "kafka.tools.StorageTool", "format", "--ignore-formatted",
         f"--cluster-id={_new_cluster_id()}", "--config", str(properties)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if formatted.returncode != 0:
        with log_file.open("a") as log:
            log.write(formatted.stdout + formatted.stderr)
        raise BrokerStartError(
            "formatting the Kafka storage failed", log_file=log_file, log_tail=_tail(log_file)
        )


def _new_cluster_id() -> str:
    """A random cluster id as Kafka writes them (URL-safe base64 of 16 bytes)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if text[0].isalnum():
            return text


def _properties(base: Path, port: int, controller_port: int) -> str:
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
    return "".join(f"{key}={value}\n" for key, value in settings.items())


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


def _configured_ports(base: Path) -> tuple[int, int] | None:
    """The (broker, controller) ports of the last start, from its server.properties."""
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
            if "PLAINTEXT" in ports and "CONTROLLER" in ports:
                return ports["PLAINTEXT"], ports["CONTROLLER"]
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


def _alive(pid: int) -> bool:
    """Whether `pid` runs (reaping it first if it is our own exited child)."""
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: ask the system below
    else:
        # Our child: waitpid reports it only once every thread is gone (a JVM's main
        # thread may look like a zombie while the others still hold its sockets).
        return waited != pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError, IndexError):
        if stat.read_text().rpartition(")")[2].split()[0] == "Z":
            return False  # a zombie: exited, not yet reaped by its parent
    return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@contextlib.contextmanager
def _locked(base: Path) -> Iterator[None]:
    """Serialize start/stop/kill of one home's broker across processes."""
    base.mkdir(parents=True, exist_ok=True)
    with (base / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _bindable(port: int, wait: float = 0.0) -> bool:
    """Whether a server could listen on `port` now (or within `wait` seconds)."""
    deadline = time.monotonic() + wait
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((HOST, port))
            except OSError:
                if time.monotonic() >= deadline:
                    return False
            else:
                return True
        time.sleep(0.1)


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return False
    return True


def _parent_death_signal(parent: int) -> Callable[[], None]:
    """A preexec_fn that makes the child get SIGTERM when `parent` dies (Linux only)."""

    import ctypes
    import ctypes.util

    try:  # loaded here, before the fork: the child only calls it
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").prctl
    except (OSError, AttributeError):
        return lambda: None

    def arm() -> None:
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def _rotate(log_file: Path) -> None:
    with contextlib.suppress(OSError):
        if log_file.stat().st_size > _LOG_ROTATE_BYTES:
            log_file.replace(log_file.with_name(log_file.name + ".1"))


def _tail(log_file: Path, lines: int = 25) -> str:
    try:
        text = log_file.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)
