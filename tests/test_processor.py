"""The transactional writer's outcomes through the batch processor, and the collector around a batch."""

from __future__ import annotations

import time
import uuid

import orjson
import pytest

from refold.config import parse_pipeline
from refold.kafka.io import ensure_topics
from refold.kafka.transactions import FencedError, TransactionalWriter, TransactionFailed
from refold.recovery.restore import load_checkpoint
from refold.runtime.batch import InputRecord
from refold.runtime.processor import BatchProcessor
from refold.spark.job import engine_topics

pytestmark = pytest.mark.kafka


def test_a_call_past_its_deadline_fails_the_transaction_and_keeps_the_producer(bootstrap_servers) -> None:
    # librdkafka#5456: send_offsets_to_transaction may block forever after the group
    # coordinator went away (seen in `make chaos` after a broker restart).
    settings = {"bootstrap.servers": bootstrap_servers}
    writer = TransactionalWriter(settings, f"pr{uuid.uuid4().hex[:8]}-0", timeout_ms=60_000)
    writer.initialise()
    try:
        stuck = writer._producer
        started = time.monotonic()
        with pytest.raises(TransactionFailed, match="did not return within 1s"):
            writer._bounded("send_offsets_to_transaction", 1, lambda: time.sleep(4))
        assert time.monotonic() - started < 3
        assert writer._wedged == [stuck]  # never destroyed under the waiting thread

        with pytest.raises(ValueError, match="passed through"):
            writer._bounded("x", 5, lambda: (_ for _ in ()).throw(ValueError("passed through")))
        writer._bounded("x", 5, lambda: None)
    finally:
        writer.close()


def test_a_zombie_fenced_while_it_sends_stops_and_leaves_the_new_instance_alone(bootstrap_servers, topic) -> None:
    # Found by `make chaos`: fenced in the middle of a batch, produce() reports only
    # _FATAL; the zombie took that for a failed transaction, re-initialised, and so
    # fenced the instance that had replaced it.
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=1)
    name = f"pz{uuid.uuid4().hex[:8]}"
    pipeline = parse_pipeline({"pipeline": name, "kafka": settings, "source": {"topic": source, "format": "jsonl"},
                               "view": {"key": ["k"], "columns": {"n": {"count": "*"}}},
                               "outputs": {"view": {"topic": f"{name}.view"}}})
    ensure_topics(settings, engine_topics(pipeline, 1))

    def batch(start: int, size: int) -> list[InputRecord]:
        return [InputRecord(0, o, b'{"k": "a"}', orjson.dumps({"op": "+A", "k": "a", "i": o}), 0)
                for o in range(start, start + size)]

    zombie = BatchProcessor(pipeline, settings)
    successor = None
    try:
        assert zombie.process(batch(0, 10)) is not None
        successor = BatchProcessor(pipeline, settings)  # init_transactions fences the zombie
        with pytest.raises(FencedError, match="another instance"):
            zombie.process(batch(10, 500))
        assert zombie.aborts == 0  # not taken for a failed transaction and retried
        stats = successor.process(batch(10, 20))  # still the owner: it commits
        assert stats is not None and stats.records_in == 20
        checkpoint = load_checkpoint(pipeline, settings)
        assert checkpoint is not None and checkpoint.records_in == 30
    finally:
        zombie.close()
        if successor is not None:
            successor.close()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_collector_freezes_survivors_and_reclaims_their_cycles_at_a_full_collection(monkeypatch) -> None:
    import gc
    import weakref

    from refold.runtime import collector as module

    made_during = None
    with module.collector_paused():
        assert not gc.isenabled()
        made_during = _Cycle()
        died_during = weakref.ref(_Cycle())  # garbage made by the batch itself
    assert gc.isenabled()
    gc.collect()
    assert died_during() is not None, "no collection after a batch: its cycles wait for the full one"
    assert gc.get_freeze_count() > 0  # what survived the batch is out of the collector's sight
    gone = weakref.ref(made_during)
    del made_during
    gc.collect()
    assert gone() is not None, "a frozen cycle is not collected by an ordinary collection"
    monkeypatch.setattr(module, "FULL_COLLECTION_SECONDS", 0.0)
    with module.collector_paused():
        pass
    assert gone() is None, "the periodic full collection reclaims it"
    assert died_during() is None
    gc.unfreeze()
