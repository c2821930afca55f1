"""Session fixtures: one real Kafka broker for the whole run, a fresh topic per test.

The broker is, in this order: $REFOLD_BOOTSTRAP_SERVERS; a testcontainers Kafka
container when a Docker engine answers; else a local broker started from its
Maven Central jars on a free port with its own data folder. No broker is a
failure, never a skip.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic


def _docker_answers() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=2)
        return bool(client.ping())
    except Exception:
        return False


@pytest.fixture(scope="session")
def bootstrap_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = os.environ.get("REFOLD_BOOTSTRAP_SERVERS")
    if env:
        yield env
        return
    if _docker_answers():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer() as kafka:
            yield kafka.get_bootstrap_server()
        return
    from refold import localkafka

    home = tmp_path_factory.mktemp("refold-home")
    try:
        info = localkafka.start(localkafka.free_port(), home=Path(home), quiet=True)
    except Exception as exc:  # no broker at all: fail loudly, never skip
        pytest.fail(f"no Kafka broker for the integration tests: {exc}")
    os.environ["REFOLD_BOOTSTRAP_SERVERS"] = info.bootstrap  # for subprocesses (CLI, engine)
    try:
        yield info.bootstrap
    finally:
        os.environ.pop("REFOLD_BOOTSTRAP_SERVERS", None)
        localkafka.stop(home=Path(home))


@pytest.fixture(scope="session")
def kafka_config(bootstrap_servers: str) -> dict[str, str]:
    return {"bootstrap.servers": bootstrap_servers}


@pytest.fixture
def topic(kafka_config: dict[str, str], request: pytest.FixtureRequest) -> Iterator[Callable[..., str]]:
    """A factory of fresh, uniquely named topics: `topic(partitions=3)`."""
    admin = AdminClient(kafka_config)
    made: list[str] = []

    def make(partitions: int = 3, **config: str) -> str:
        name = f"t-{request.node.name[:40]}-{uuid.uuid4().hex[:8]}".replace("[", "-").replace("]", "")
        name = "".join(c if c.isalnum() or c in "._-" else "-" for c in name)
        admin.create_topics([NewTopic(name, partitions, config=config)])[name].result(30)
        made.append(name)
        return name

    yield make
    with contextlib.suppress(Exception):
        if made:
            for future in admin.delete_topics(made).values():
                future.result(30)
