"""The local broker: transactions commit, abort and fence on one node."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from refold import localkafka
from refold.kafkaio import read_to_end

pytestmark = pytest.mark.kafka


def _values(kafka_config: dict[str, str], topic: str) -> list[bytes]:
    return [m.value() for m in read_to_end(kafka_config, topic)]


def test_committed_visible_aborted_invisible(kafka_config, topic) -> None:
    name = topic(partitions=1)
    producer = Producer({**kafka_config, "transactional.id": f"{name}-tx"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(name, b"kept")
    producer.commit_transaction(30)
    producer.begin_transaction()
    producer.produce(name, b"dropped")
    producer.flush(30)
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(name, b"kept too")
    producer.commit_transaction(30)
    assert _values(kafka_config, name) == [b"kept", b"kept too"]


def test_second_producer_with_same_id_fences_the_first(kafka_config, topic) -> None:
    name = topic(partitions=1)
    first = Producer({**kafka_config, "transactional.id": f"{name}-tx"})
    first.init_transactions(30)
    first.begin_transaction()
    first.produce(name, b"zombie")
    first.flush(30)
    second = Producer({**kafka_config, "transactional.id": f"{name}-tx"})
    second.init_transactions(30)  # aborts the first's open transaction, bumps the epoch
    with pytest.raises(KafkaException) as failure:
        first.produce(name, b"zombie 2")
        first.commit_transaction(30)
    assert failure.value.args[0].code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED)
    second.begin_transaction()
    second.produce(name, b"live")
    second.commit_transaction(30)
    assert _values(kafka_config, name) == [b"live"]


def test_start_status_stop_of_a_second_broker(tmp_path) -> None:
    assert localkafka.status(home=tmp_path) is None
    info = localkafka.start(localkafka.free_port(), home=tmp_path, quiet=True)
    try:
        again = localkafka.start(home=tmp_path, quiet=True)  # already running: harmless
        assert again.pid == info.pid
        status = localkafka.status(home=tmp_path)
        assert status is not None and status.bootstrap == info.bootstrap
        assert (status.data_dir / "meta.properties").exists()
    finally:
        assert localkafka.stop(home=tmp_path)
    assert localkafka.status(home=tmp_path) is None
    assert not localkafka.stop(home=tmp_path)
