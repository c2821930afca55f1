"""The broker under every integration test: transactions commit, abort and fence;
the local broker starts, answers, survives kill -9 and stops; the jar sets are sane."""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from refold import environment
from refold.dev import localkafka, localproc
from refold.errors import PrerequisiteError
from refold.spark import jars


def _read(
    kafka_config: dict[str, Any], topic: str, isolation: str = "read_committed", timeout: float = 30
) -> list[bytes]:
    """Every record value of partition 0 a consumer with `isolation` sees, up to its end."""
    consumer = Consumer(
        {
            **kafka_config,
            "group.id": f"reader-{topic}",
            "isolation.level": isolation,
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    values: list[bytes] = []
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is None:
                continue
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    return values
                raise KafkaException(error)
            values.append(message.value() or b"")
        raise AssertionError(f"no end of {topic}[0] within {timeout}s; read {values}")
    finally:
        consumer.close()


def _transactional(kafka_config: dict[str, Any], transactional_id: str) -> Producer:
    producer = Producer({**kafka_config, "transactional.id": transactional_id})
    producer.init_transactions(30)
    return producer


# Transactions on the session's broker ---------------------------------------------------


@pytest.mark.kafka
def test_committed_transaction_is_seen_by_read_committed_only_after_commit(
    kafka_config, topic
) -> None:
    name = topic(partitions=1)
    producer = _transactional(kafka_config, f"{name}-tx")
    producer.begin_transaction()
    producer.produce(name, b"a")
    producer.produce(name, b"b")
    producer.flush(30)
    assert _read(kafka_config, name) == []  # open transaction: beyond the last stable offset
    assert _read(kafka_config, name, "read_uncommitted") == [b"a", b"b"]
    producer.commit_transaction(30)
    assert _read(kafka_config, name) == [b"a", b"b"]


@pytest.mark.kafka
def test_aborted_transaction_is_invisible_to_read_committed(kafka_config, topic) -> None:
    name = topic(partitions=1)
    producer = _transactional(kafka_config, f"{name}-tx")
    for value, commit in ((b"kept", True), (b"dropped", False), (b"kept too", True)):
        producer.begin_transaction()
        producer.produce(name, value)
        producer.flush(30)
        if commit:
            producer.commit_transaction(30)
        else:
            producer.abort_transaction(30)
    assert _read(kafka_config, name) == [b"kept", b"kept too"]
    assert _read(kafka_config, name, "read_uncommitted") == [b"kept", b"dropped", b"kept too"]


@pytest.mark.kafka
def test_second_producer_with_the_same_id_fences_the_first(kafka_config, topic) -> None:
    name = topic(partitions=1)
    first = _transactional(kafka_config, f"{name}-tx")
    first.begin_transaction()
    first.produce(name, b"zombie")
    first.flush(30)
    second = _transactional(kafka_config, f"{name}-tx")  # aborts the first's transaction
    with pytest.raises(KafkaException) as failure:
        first.produce(name, b"zombie again")
        first.commit_transaction(30)
    error = failure.value.args[0]
    assert error.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED), error
    assert error.fatal(), error
    second.begin_transaction()
    second.produce(name, b"live")
    second.commit_transaction(30)
    assert _read(kafka_config, name) == [b"live"]


# The local broker's lifecycle (a second broker, in its own home) ---------------------------


@pytest.mark.kafka
def test_local_broker_starts_survives_kill_9_and_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    assert localkafka.status(home=home) is None
    assert not localkafka.stop(home=home)

    info = localkafka.start(localkafka.free_port(), timeout=180.0, home=home, quiet=True, die_with_parent=True)
    try:
        assert localkafka.start(home=home, quiet=True) == info  # already runs: harmless
        assert localkafka.status(home=home) == info
        assert (info.data_dir / "meta.properties").is_file()
        assert "Kafka Server started" in info.log_file.read_text()
        config = {"bootstrap.servers": info.bootstrap}
        _make_topic(config, "survivor")
        producer = _transactional(config, "survivor-tx")
        producer.begin_transaction()
        producer.produce("survivor", b"before")
        producer.commit_transaction(30)
        producer.begin_transaction()
        producer.produce("survivor", b"in flight")
        producer.flush(30)

        again = localkafka.restart_hard(home=home, timeout=180.0, die_with_parent=True)
        assert again.pid != info.pid and again.bootstrap == info.bootstrap
        later = _transactional(config, "survivor-tx")  # aborts what the crash left open
        later.begin_transaction()
        later.produce("survivor", b"after")
        later.commit_transaction(30)
        assert _read(config, "survivor") == [b"before", b"after"]

        monkeypatch.setenv("REFOLD_HOME", str(home))
        monkeypatch.delenv("REFOLD_BOOTSTRAP_SERVERS", raising=False)
        assert localkafka.ensure_broker(None) == info.bootstrap
        assert localkafka.cli(argparse.Namespace(action="status", port=None)) == 0
        assert f"Kafka runs at {info.bootstrap} (pid {again.pid}, answers)" in capsys.readouterr().out
        assert localkafka.cli(argparse.Namespace(action="stop", port=None)) == 0
        assert "Kafka stopped" in capsys.readouterr().out
        assert localkafka.cli(argparse.Namespace(action="status", port=None)) == 1
        assert "Kafka is not running" in capsys.readouterr().out
    finally:
        localkafka.stop(home=home)
    assert localkafka.status(home=home) is None
    assert not (home / "kafka" / "broker.pid").exists()
    assert not _runs(again.pid)


@pytest.mark.kafka
def test_start_fails_with_the_log_when_the_broker_does_not_answer(tmp_path: Path) -> None:
    with pytest.raises(localproc.ServerStartError) as failure:
        localkafka.start(localkafka.free_port(), timeout=0.1, home=tmp_path, quiet=True)
    assert "did not answer" in str(failure.value)
    assert failure.value.log_file == tmp_path / "kafka" / "broker.log"
    assert "refold: starting Kafka" in failure.value.log_tail
    assert localkafka.status(home=tmp_path) is None
    assert not (tmp_path / "kafka" / "broker.pid").exists()


def test_start_refuses_a_port_that_is_taken(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(PrerequisiteError, match="is taken"):
            localkafka.start(sock.getsockname()[1], home=tmp_path, quiet=True)
    assert localkafka.status(home=tmp_path) is None


def test_ensure_broker_prefers_the_argument_then_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("REFOLD_BOOTSTRAP_SERVERS", "env:9092")
    assert localkafka.ensure_broker("arg:9092") == "arg:9092"
    assert localkafka.ensure_broker(None) == "env:9092"
    monkeypatch.delenv("REFOLD_BOOTSTRAP_SERVERS")
    monkeypatch.setenv("REFOLD_HOME", str(tmp_path))  # no local broker runs there
    monkeypatch.setattr(localkafka, "DEFAULT_PORT", localkafka.free_port())  # nothing listens
    with pytest.raises(PrerequisiteError, match="refold kafka start"):
        localkafka.ensure_broker(None)


def _make_topic(config: dict[str, Any], name: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(config)  # keep it alive until the future resolves
    admin.create_topics([NewTopic(name, 1, 1)])[name].result(30)


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# Jar sets ----------------------------------------------------------------------------------


@pytest.mark.spark
def test_spark_jars_are_the_kafka_connector_without_what_pyspark_ships() -> None:
    names = {jars.artifact_of(jar.name) for jar in jars.spark_jars()}
    assert names == {
        "spark-sql-kafka",
        "spark-token-provider-kafka",
        "kafka-clients",
        "commons-pool2",
    }
    shipped = jars._pyspark_artifacts()
    assert shipped and not names & shipped
    assert all(
        jar.name.endswith("_2.13-4.1.1.jar")
        for jar in jars.spark_jars()
        if jar.name.startswith("spark-")
    )


@pytest.mark.kafka
def test_kafka_classpath_has_the_broker_and_one_logging_binding() -> None:
    names = [Path(p).name for p in jars.kafka_classpath().split(os.pathsep)]
    assert "kafka_2.13-4.1.1.jar" in names
    assert [n for n in names if n.startswith("log4j-slf4j")] == ["log4j-slf4j-impl-2.24.3.jar"]
    assert len({jars.artifact_of(n) for n in names}) == len(names)  # no artifact twice


def test_artifact_names_and_project_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert jars.artifact_of("kafka-clients-3.9.1.jar") == "kafka-clients"
    assert jars.artifact_of("zstd-jni-1.5.7-6.jar") == "zstd-jni"
    assert jars.artifact_of("jackson-module-scala_2.13-2.20.0.jar") == "jackson-module-scala_2.13"
    monkeypatch.setenv("REFOLD_HOME", str(tmp_path))
    monkeypatch.delenv("REFOLD_JARS", raising=False)
    assert environment.home() == tmp_path.resolve()
    assert environment.jars_home() == tmp_path.resolve() / "jars"
    assert jars.describe("kafka-broker") == "Kafka 4.1.1"
    with pytest.raises(ValueError, match="unknown jar set"):
        jars.resolve("nope")
