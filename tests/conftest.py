"""Session fixtures: one real Kafka broker for the whole run, a fresh topic per test.

The broker is, in this order:

1. `$REFOLD_BOOTSTRAP_SERVERS` (any cluster; it must answer);
2. a testcontainers Kafka container, when a Docker engine answers;
3. a local broker (`refold.dev.localkafka`, jars from Maven Central) on a free port —
   never 9092, so a user's own broker is left alone — with its data in the
   session's Refold home, stopped at the end of the session.

No broker is a failure, never a skip. The whole session runs with `REFOLD_HOME`
set to a temporary folder (the jar cache stays shared through `REFOLD_JARS`), so
tests never write into the checkout's `.refold/`. Tests marked `kafka`, `spark`
or `postgres` (PostgreSQL: `pg_fixtures.py`) are integration tests: `-m
integration` selects them, `-m "not integration"` the unit tests.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

# PostgreSQL: `pg_server` (session) and `postgres_dsn` (a fresh database per test).
# pytest puts this folder on sys.path (rootdir conftest, prepend import mode).
pytest_plugins = ["pg_fixtures"]

INTEGRATION_MARKERS = ("kafka", "spark", "postgres")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "integration: needs a real broker, Spark or PostgreSQL (added to every kafka/spark/postgres test)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(name) for name in INTEGRATION_MARKERS):
            item.add_marker(pytest.mark.integration)


# The session's Refold home -------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def refold_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh REFOLD_HOME for the session; the resolved jars stay shared."""
    from refold.environment import jars_home

    saved = {name: os.environ.get(name) for name in ("REFOLD_HOME", "REFOLD_JARS")}
    os.environ["REFOLD_JARS"] = str(jars_home())  # before REFOLD_HOME moves
    home = tmp_path_factory.mktemp("refold-home")
    os.environ["REFOLD_HOME"] = str(home)
    try:
        yield home
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# Spark's driver JVM --------------------------------------------------------------------------

# The tests' engine runs are short and start a Spark driver JVM each (`refold run` in a
# subprocess, the tutorial's and the demo's runs, the session's `spark` fixture): there
# HotSpot's C2 compiler threads and the parallel collector's compete with the run itself
# for the machine's cores. C1 alone and the serial collector cut a one-batch `refold run`
# by a third on two cores (two A/B pairs on a loaded machine: 54 -> 40 s and 66 -> 33 s).
# Spark's launcher adds SPARK_SUBMIT_OPTS to the driver's command line only (the
# executors keep theirs, refold.spark.launch.java_options, which the tests check); the
# engine itself starts local mode with HotSpot's defaults. A value set outside is kept.
DRIVER_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


@pytest.fixture(scope="session", autouse=True)
def spark_driver_options() -> Iterator[None]:
    saved = os.environ.get("SPARK_SUBMIT_OPTS")
    if saved is None:
        os.environ["SPARK_SUBMIT_OPTS"] = DRIVER_JAVA_OPTIONS
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("SPARK_SUBMIT_OPTS", None)


# The broker ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TestBroker:
    """The session's broker: where it is and where it came from."""

    __test__ = False  # not a test class

    bootstrap: str
    origin: Literal["env", "docker", "local"]
    home: Path | None = None  # the Refold home of a local broker (for localkafka calls)


def _docker_answers(timeout: float = 2.0) -> bool:
    try:
        import docker

        client = docker.from_env(timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def _fail_unless_answers(bootstrap: str, origin: str) -> None:
    from refold.dev.localkafka import answers

    deadline = time.monotonic() + 30
    while not answers(bootstrap, timeout=5.0):
        if time.monotonic() > deadline:
            pytest.fail(f"the Kafka broker from {origin} ({bootstrap}) does not answer", pytrace=False)
        time.sleep(1)


@pytest.fixture(scope="session")
def kafka_broker(refold_home: Path, request: pytest.FixtureRequest) -> Iterator[TestBroker]:
    env = os.environ.get("REFOLD_BOOTSTRAP_SERVERS")
    if env:
        _fail_unless_answers(env, "REFOLD_BOOTSTRAP_SERVERS")
        yield TestBroker(env, "env")
    elif _docker_answers():
        yield from _no_client_outlives(_container_broker(), request)
    else:
        yield from _no_client_outlives(_local_broker(refold_home), request)


def _no_client_outlives(broker: Iterator[TestBroker], request: pytest.FixtureRequest) -> Iterator[TestBroker]:
    """The broker, and before it stops, the check that no Kafka client of the tests is
    still alive: one would retry its connections after the broker is gone (librdkafka's
    "Connect to ipv4#… failed" at the end of the run). Garbage is collected first (a
    client in a reference cycle is destroyed then); a client still referenced is a
    test's or a fixture's that did not let it go, and fails the run (unless a test
    failed already: its traceback keeps its clients)."""
    alive: list[str] = []
    for found in broker:  # one broker; the loop's end stops it
        yield found
        alive = sorted(type(client).__name__ for client in _live_clients())
    if alive and not request.session.testsfailed:
        pytest.fail(f"{len(alive)} Kafka client(s) outlived the tests, alive when the broker stopped: {alive} "
                    "(close consumers, flush or close producers, drop admin clients when a test or fixture "
                    "ends)", pytrace=False)


def _live_clients() -> list[Any]:
    """The confluent-kafka clients still alive in this process (a closed consumer is not),
    after a garbage collection."""
    from confluent_kafka import Consumer, Producer

    def open_(client: Any) -> bool:
        if isinstance(client, Consumer):
            try:
                client.memberid()
            except RuntimeError:  # "Consumer closed"
                return False
        return True

    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, (Producer, Consumer, AdminClient)) and open_(o)]


def _container_broker() -> Iterator[TestBroker]:
    try:
        from testcontainers.community.kafka import KafkaContainer
    except ImportError:  # older testcontainers
        from testcontainers.kafka import KafkaContainer

    container = (
        KafkaContainer("confluentinc/cp-kafka:7.9.0")
        .with_kraft()
        .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
        .with_env("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false")
    )
    try:
        container.start(timeout=180)
    except Exception as exc:
        pytest.fail(f"no Kafka broker for the integration tests: the container failed: {exc!r}")
    try:
        bootstrap = container.get_bootstrap_server()
        _fail_unless_answers(bootstrap, "testcontainers")
        with _bootstrap_env(bootstrap):
            yield TestBroker(bootstrap, "docker")
    finally:
        container.stop()


def _local_broker(home: Path) -> Iterator[TestBroker]:
    from refold.dev import localkafka

    try:
        info = localkafka.start(
            localkafka.free_port(), timeout=180.0, home=home, quiet=True, die_with_parent=True
        )
    except Exception as exc:  # no broker at all: fail loudly, never skip
        pytest.fail(f"no Kafka broker for the integration tests: {exc}", pytrace=False)
    try:
        with _bootstrap_env(info.bootstrap):
            yield TestBroker(info.bootstrap, "local", home)
    finally:
        localkafka.stop(home=home)


@contextlib.contextmanager
def _bootstrap_env(bootstrap: str) -> Iterator[None]:
    """Let subprocesses (the CLI, the engine) find the session's broker."""
    saved = os.environ.get("REFOLD_BOOTSTRAP_SERVERS")
    os.environ["REFOLD_BOOTSTRAP_SERVERS"] = bootstrap
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("REFOLD_BOOTSTRAP_SERVERS", None)
        else:
            os.environ["REFOLD_BOOTSTRAP_SERVERS"] = saved


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory, kafka_broker: TestBroker) -> Iterator[Any]:
    """One Spark session (`local[2]`) for every test that runs the engine in this process
    (starting one costs seconds); such tests never stop it. It stops before the broker
    (it needs it): its Python workers keep the shards' Kafka clients between batches."""
    from refold.spark.job import spark_session

    session = spark_session("local[2]", {"spark.sql.streaming.checkpointLocation": str(tmp_path_factory.mktemp("spark"))})
    yield session
    session.stop()


@pytest.fixture(scope="session")
def bootstrap_servers(kafka_broker: TestBroker) -> str:
    return kafka_broker.bootstrap


@pytest.fixture(scope="session")
def kafka_config(bootstrap_servers: str) -> dict[str, Any]:
    """librdkafka base settings. Shared by the session: copy before changing it."""
    return {"bootstrap.servers": bootstrap_servers}


# Topics ------------------------------------------------------------------------------------


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@pytest.fixture
def topic(kafka_config: dict[str, Any], request: pytest.FixtureRequest) -> Iterator[Callable[..., str]]:
    """A factory of fresh, uniquely named topics: `topic()`, `topic(partitions=1,
    **{"cleanup.policy": "compact"})`. Returns once every partition has a leader;
    deletes the topics after the test."""
    from refold.kafka.io import admin_client

    admin: AdminClient | None = admin_client(kafka_config)  # its librdkafka lines at DEBUG (refold.kafka.io)
    made: list[str] = []

    def make(partitions: int = 3, **config: str) -> str:
        stem = _UNSAFE.sub("-", request.node.name).strip("-.")[:60]
        name = f"t-{stem}-{uuid.uuid4().hex[:8]}"
        assert admin is not None, "the topic factory is used after its test"
        admin.create_topics([NewTopic(name, partitions, 1, config=config)])[name].result(30)
        made.append(name)
        _wait_for_leaders(admin, name, partitions)
        return name

    yield make
    if made and admin is not None:
        with contextlib.suppress(Exception):
            for future in admin.delete_topics(made, operation_timeout=30).values():
                future.result(30)
    # `make` (its closure holds `admin`) stays referenced by pytest until the test's whole
    # teardown ends, after the session's broker stops in the last test's: let go of it here
    admin = None


def _wait_for_leaders(admin: AdminClient, name: str, partitions: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        found = admin.list_topics(name, timeout=10).topics.get(name)
        if (
            found is not None
            and found.error is None
            and len(found.partitions) == partitions
            and all(p.leader >= 0 for p in found.partitions.values())
        ):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"topic {name} has no leader for every partition after {timeout:.0f}s")
        time.sleep(0.1)
