"""The transactional writer's outcomes through the batch processor, and the collector around a batch."""

from __future__ import annotations

import time
import uuid

import orjson
import pytest

from refold.config import parse_pipeline
from refold.errors import UserError
from refold.kafka.io import TopicSpec, ensure_topics, read_to_end
from refold.kafka.transactions import FencedError, TransactionalWriter, TransactionFailed
from refold.model.reasons import Reason
from refold.ops.status import print_status
from refold.recovery.records import decode_checkpoint, decode_dead_letter
from refold.recovery.restore import load_checkpoint, load_checkpoints
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


def test_send_all_through_a_full_queue_keeps_every_record_in_order(bootstrap_servers, topic) -> None:
    # a client queue of 50 records: most calls meet a full queue and wait for room
    settings = {"bootstrap.servers": bootstrap_servers, "queue.buffering.max.messages": 50}
    target = topic(partitions=2)
    writer = TransactionalWriter(settings, f"sa{uuid.uuid4().hex[:8]}", timeout_ms=60_000)
    writer.initialise()
    try:
        writer.begin()
        writer.send_all(target, [(b"k%d" % (i % 7), b"%d" % i) for i in range(2_000)], partition=1)
        writer.send_all(target, [(None, b"x")], partition=0)
        writer.commit()
    finally:
        writer.close()
    read = [(msg.partition(), msg.key(), msg.value())
            for msg in read_to_end({"bootstrap.servers": bootstrap_servers}, target)]
    assert [(k, v) for p, k, v in read if p == 1] == [(b"k%d" % (i % 7), b"%d" % i) for i in range(2_000)]
    assert [(k, v) for p, k, v in read if p == 0] == [(None, b"x")]


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


def test_a_batch_outliving_its_transaction_timeout_is_replayed_not_taken_for_a_fence(bootstrap_servers, topic,
                                                                                   monkeypatch, caplog) -> None:
    # The first transaction stays open past transaction.timeout.ms (2s; the test broker
    # looks for timed-out transactions every 2s): the coordinator aborts it and bumps
    # the epoch, which the client reports as a fence. Past its own timeout it is not
    # another instance: the shard re-creates its producer, reads its checkpoint back
    # from Kafka and runs the batch again, once. (`make test-slow`'s
    # test_crash.test_batch_outliving_the_transaction_timeout_is_replayed runs the same
    # through `refold run`.)
    from refold.runtime.hooks import Hooks

    monkeypatch.setenv("REFOLD_TRANSACTION_TIMEOUT_MS", "2000")
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=1)
    pipeline = _sharded(settings, source, 1)
    records = [_record(0, o, "ab"[o % 2]) for o in range(20)]
    processor = BatchProcessor(pipeline, settings, hooks=Hooks(stall_seconds=7))
    try:
        with caplog.at_level("WARNING", logger="refold.runtime.shard"):
            stats = processor.process(records)
        assert stats is not None and stats.records_in == 20
        assert processor.aborts == 1
        assert processor.process(records) is None  # committed once: nothing to replay
    finally:
        processor.close()
    assert "re-initialising from Kafka" in caplog.text and "another instance" not in caplog.text, caplog.text
    checkpoint = load_checkpoint(pipeline, settings)
    assert checkpoint is not None and checkpoint.records_in == 20 and checkpoint.batch == 1
    assert pipeline.outputs.view is not None
    view = [orjson.loads(m.value()) for m in read_to_end(settings, pipeline.outputs.view.topic)]
    for k in "ab":  # once each: the aborted transaction's records are not read
        assert [r["n"] for r in view if r["k"] == k and r["op"] != "-C"] == list(range(1, 11))
    assert len(view) == 38


def _sharded(settings: dict, source: str, partitions: int, view: dict | None = None):
    name = f"ps{uuid.uuid4().hex[:8]}"
    pipeline = parse_pipeline({"pipeline": name, "kafka": settings, "source": {"topic": source, "format": "jsonl"},
                               "view": view or {"key": ["k"], "columns": {"n": {"count": "*"}}},
                               "outputs": {"view": {"topic": f"{name}.view"}}})
    ensure_topics(settings, engine_topics(pipeline, partitions))
    return pipeline


def _record(partition: int, offset: int, k: str, message_key: bytes | None = None) -> InputRecord:
    key = message_key if message_key is not None else orjson.dumps({"k": k})
    return InputRecord(partition, offset, key, orjson.dumps({"op": "+A", "k": k, "i": offset}), 0)


def test_each_shard_commits_its_own_transaction_state_and_checkpoint(bootstrap_servers, topic, capsys) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    pipeline = _sharded(settings, source, 3)
    processor = BatchProcessor(pipeline, settings)
    try:
        assert sorted(processor.shards) == [0, 1, 2]
        assert [s.writer.transactional_id for s in processor.shards.values()] == [
            f"{pipeline.pipeline}-0-{n}" for n in range(3)]
        batch = [_record(p, o, f"k{p}-{o % 2}") for p in (0, 2) for o in range(4)]
        stats = processor.process(batch)
        assert stats is not None and stats.records_in == 8 and stats.shards == 2
        assert processor.process(batch) is None  # replayed: nothing again, no transaction
    finally:
        processor.close()
    shards = load_checkpoints(pipeline, settings)
    assert sorted(shards) == [0, 2]  # shard 1 had no records: it committed nothing
    assert shards[0].offsets == {0: 4} and shards[2].offsets == {2: 4} and shards[2].shard == 2
    # checkpoint records keyed <writer>/<shard>, state records in partition = shard
    keys = {(m.key(), m.partition()) for m in read_to_end(settings, pipeline.checkpoints_topic)}
    assert keys == {(b"0/0", 0), (b"0/2", 2)}
    assert {m.partition() for m in read_to_end(settings, pipeline.state_topic)} == {0, 2}
    assert all(decode_checkpoint(m.value()).shard == int(m.key().split(b"/")[1])
               for m in read_to_end(settings, pipeline.checkpoints_topic))
    restarted = BatchProcessor(pipeline, settings)  # each shard restores its own offsets
    try:
        assert restarted.offsets == {0: 4, 2: 4}
        stats = restarted.process([_record(1, 0, "x"), _record(2, 4, "k2-0")])
        assert stats is not None and stats.records_in == 2
    finally:
        restarted.close()
    assert load_checkpoint(pipeline, settings).records_in == 10
    print_status(pipeline)  # `refold status`: one line per shard
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["shard", "partitions"])
    shard_lines = [line.split() for line in lines[header + 1 : header + 4]]
    assert [(row[0], row[1], row[2], row[3]) for row in shard_lines] == [
        ("0", "0", "1", "0:4"), ("1", "1", "1", "1:1"), ("2", "2", "2", "2:5")]
    assert "total lag 0" in lines[-1]


def test_a_regrouping_view_runs_as_one_shard(bootstrap_servers, topic) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    pipeline = _sharded(settings, source, 3, {"top_n": {"n": 2, "order_by": {"i": "desc"}}})
    processor = BatchProcessor(pipeline, settings)
    try:
        assert list(processor.shards) == [0] and processor.shards[0].writer.transactional_id.endswith("-0-0")
        assert processor.process([_record(p, 0, "a", b"whatever") for p in range(3)]) is not None
    finally:
        processor.close()
    shards = load_checkpoints(pipeline, settings)
    assert list(shards) == [0] and shards[0].offsets == {0: 1, 1: 1, 2: 1}


def test_messages_keyed_otherwise_stop_the_run_before_any_commit(bootstrap_servers, topic) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=2)
    pipeline = _sharded(settings, source, 2)
    processor = BatchProcessor(pipeline, settings)
    try:
        with pytest.raises(UserError, match=r"keyed by a JSON object of the fields \['id'\].*source\.key"):
            processor.process([_record(0, 0, "a", b'{"id": 1}'), _record(1, 0, "b")])
    finally:
        processor.close()
    assert load_checkpoints(pipeline, settings) == {}
    assert list(read_to_end(settings, f"{pipeline.pipeline}.view")) == []
    # a later record keyed otherwise is a dead letter
    processor = BatchProcessor(pipeline, settings)
    try:
        assert processor.process([_record(0, 0, "a")]) is not None
        stats = processor.process([_record(0, 1, "a", b'{"k": "b"}'), _record(1, 0, "b", b"b")])
        assert stats is not None and stats.dead_letters == 2
    finally:
        processor.close()
    letters = [decode_dead_letter(m.value()) for m in read_to_end(settings, pipeline.dlq_topic)]
    assert sorted((d.partition, d.offset, d.reason) for d in letters) == [
        (0, 1, Reason.KEY_MISMATCH), (1, 0, Reason.KEY_MISMATCH)]


def test_a_state_topic_with_fewer_partitions_than_shards_is_refused(bootstrap_servers, topic) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    name = f"pf{uuid.uuid4().hex[:8]}"
    ensure_topics(settings, [TopicSpec(f"{name}.state", 1, compacted=True)])
    pipeline = parse_pipeline(
        {"pipeline": name, "kafka": settings, "source": {"topic": source},
         "view": {"key": ["k"], "columns": {"n": {"count": "*"}}}, "outputs": {"view": {"topic": f"{name}.view"}}})
    ensure_topics(settings, engine_topics(pipeline, 3))
    with pytest.raises(UserError, match=rf"{name}\.state has 1 partitions.*shard 1.*add partitions"):
        BatchProcessor(pipeline, settings)


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


@pytest.mark.parametrize("core", ["python", "auto"])
def test_a_row_the_filter_cannot_compare_is_a_dead_letter_and_the_batch_commits(bootstrap_servers, topic,
                                                                                core) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=1)
    name = f"pf{uuid.uuid4().hex[:8]}"
    pipeline = parse_pipeline({"pipeline": name, "kafka": settings, "source": {"topic": source, "format": "jsonl"},
                               "view": {"key": ["k"], "columns": {"n": {"count": "*"}}, "where": "v > 1"},
                               "outputs": {"view": {"topic": f"{name}.view"}}, "spark": {"core": core}})
    ensure_topics(settings, engine_topics(pipeline, 1))
    rows = [{"op": "+A", "k": "a", "v": 2}, {"op": "+A", "k": "a", "v": "text"}, {"op": "+A", "k": "a", "v": 3}]
    processor = BatchProcessor(pipeline, settings)
    try:
        stats = processor.process([InputRecord(0, i, orjson.dumps({"k": "a"}), orjson.dumps(r), 0)
                                   for i, r in enumerate(rows)])
    finally:
        processor.close()
    assert stats is not None and stats.dead_letters == 1
    letters = [decode_dead_letter(m.value()) for m in read_to_end(settings, pipeline.dlq_topic)]
    assert [(letter.offset, letter.reason) for letter in letters] == [(1, Reason.SCHEMA_MISMATCH)]
    views = [orjson.loads(m.value())["n"] for m in read_to_end(settings, f"{name}.view")]
    assert views[-1] == 2
