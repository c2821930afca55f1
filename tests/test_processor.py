"""The batch processor's guard against transactional calls that ignore their timeout."""

from __future__ import annotations

import time
import uuid

import pytest

from refold.config import parse_pipeline
from refold.job import engine_topics
from refold.kafkaio import ensure_topics
from refold.processor import BatchProcessor, TransactionFailed

pytestmark = pytest.mark.kafka


def test_a_call_past_its_deadline_fails_the_transaction_and_keeps_the_producer(bootstrap_servers, topic) -> None:
    # librdkafka#5456: send_offsets_to_transaction may block forever after the group
    # coordinator went away (seen in `make chaos` after a broker restart).
    settings = {"bootstrap.servers": bootstrap_servers}
    name = f"pr{uuid.uuid4().hex[:8]}"
    pipeline = parse_pipeline({"pipeline": name, "kafka": settings, "source": {"topic": topic(partitions=1)},
                               "view": {"key": ["k"], "columns": {"n": {"count": "*"}}},
                               "outputs": {"view": {"topic": f"{name}.view"}}})
    ensure_topics(settings, engine_topics(pipeline, 1))
    processor = BatchProcessor(pipeline, settings)
    try:
        stuck = processor.producer
        started = time.monotonic()
        with pytest.raises(TransactionFailed, match="did not return within 1s"):
            processor._bounded("send_offsets_to_transaction", 1, lambda: time.sleep(4))
        assert time.monotonic() - started < 3
        assert processor._wedged == [stuck]  # never destroyed under the waiting thread

        with pytest.raises(ValueError, match="passed through"):
            processor._bounded("x", 5, lambda: (_ for _ in ()).throw(ValueError("passed through")))
        processor._bounded("x", 5, lambda: None)
    finally:
        processor.close()
