"""The local state store (refold.state): the store on a temporary folder, then
`open_shard` against `P.state` partitions on the real broker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from refold.config import ViewSpec
from refold.errors import InternalError
from refold.kafka.io import open_transactions, producer_config
from refold.model.changelog import Op
from refold.reduce import SourceEvent, make_reducer
from refold.reduce.statecodec import row_key, summary_key
from refold.reduce.values import key_bytes
from refold.state import ShardId, ShardStore, Stamp, StoreLocked, open_shard

SHARD = ShardId("scores", "0", 0)
Record = tuple[bytes, bytes | None]


def kj(*key: Any) -> bytes:
    return key_bytes(tuple(key))


def records(*key: Any, rows: int = 2, tag: bytes = b"") -> list[tuple[bytes, bytes]]:
    """A view key's summary and `rows` live rows, with made-up values."""
    out = [(summary_key(kj(*key)), b"summary" + tag)]
    out += [(row_key(kj(*key), bytes([n]) * 16), b"row%d" % n + tag) for n in range(rows)]
    return out


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ShardStore]:
    with ShardStore.open(SHARD, tmp_path) as opened:
        yield opened


def run_python(code: str, *args: str) -> subprocess.Popen[str]:
    """Another process running `code` (the store's lock is per process)."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


HOLDER = """
    import sys, time
    from pathlib import Path
    from refold.state import ShardId, ShardStore, Stamp
    store = ShardStore.open(ShardId("scores", "0", 0), Path(sys.argv[1]))
    store.apply([(b'["held"]', b"v")], Stamp(7, 70))
    print("holding", flush=True)
    time.sleep(float(sys.argv[2]))
    store.close()
"""


def held(root: Path, seconds: float) -> subprocess.Popen[str]:
    proc = run_python(HOLDER, str(root), str(seconds))
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "holding", proc.stderr.read() if proc.stderr else ""
    return proc


# The store --------------------------------------------------------------------------------


def test_records_and_stamp_are_written_together_and_survive_a_reopen(tmp_path: Path) -> None:
    with ShardStore.open(SHARD, tmp_path) as store:
        assert store.stamp is None and store.count() == 0
        store.apply(records("a"), Stamp(1, 3))
        assert store.stamp == Stamp(1, 3)
    with ShardStore.open(SHARD, tmp_path) as store:
        assert store.stamp == Stamp(1, 3)
        assert store.stamped_at is not None and abs(store.stamped_at - time.time() * 1000) < 60_000
        assert list(store.items()) == sorted(records("a"))  # the stamp is not a record
    assert SHARD.directory(tmp_path) == tmp_path / "scores" / "0" / "0"


def test_a_key_s_records_are_only_its_own(store: ShardStore) -> None:
    keys = [("a",), ("a", "b"), ("ab",), ("a]",), ('a"',), (1,), ("1",), (1, 2), ("a", 1)]
    for key in keys:
        store.apply(records(*key, tag=kj(*key)), Stamp(1, 0))
    for key in keys:
        assert store.records_of(kj(*key)) == sorted(records(*key, tag=kj(*key))), key
    assert store.records_of(kj("b")) == []
    wanted = [kj("a"), kj(1), kj("a"), kj("zz")]
    assert store.load_keys(wanted) == sorted(records("a", tag=kj("a")) + records(1, tag=kj(1)))
    assert store.count() == 3 * len(keys)


def test_a_tombstone_deletes_its_record(store: ShardStore) -> None:
    store.apply(records("a", rows=3), Stamp(1, 4))
    gone = row_key(kj("a"), bytes([1]) * 16)
    store.apply([(gone, None), (summary_key(kj("a")), b"summary2")], Stamp(2, 6))
    assert dict(store.records_of(kj("a"))) == {
        summary_key(kj("a")): b"summary2",
        row_key(kj("a"), bytes(16)): b"row0",
        row_key(kj("a"), bytes([2]) * 16): b"row2",
    }
    store.apply([(k, None) for k, _ in store.records_of(kj("a"))], Stamp(3, 9))
    assert store.count() == 0 and store.stamp == Stamp(3, 9)


def test_the_stamp_never_goes_back_and_only_state_keys_are_taken(store: ShardStore) -> None:
    store.apply(records("a"), Stamp(5, 50))
    with pytest.raises(InternalError, match="behind"):
        store.apply([], Stamp(4, 60))
    with pytest.raises(InternalError, match="behind"):
        store.apply([], Stamp(5, 49))
    with pytest.raises(InternalError, match=r"not a P\.state record key"):
        store.apply([(b"\x00refold.stamp", b"x")], Stamp(6, 60))
    assert store.stamp == Stamp(5, 50) and store.count() == 3  # nothing of the refused batches
    store.clear()
    assert store.stamp is None and store.count() == 0
    store.apply([], Stamp(1, 0))  # after clear() it starts over


def test_an_unreadable_directory_is_wiped(tmp_path: Path) -> None:
    with ShardStore.open(SHARD, tmp_path) as store:
        store.apply(records("a"), Stamp(1, 3))
    (SHARD.directory(tmp_path) / "CURRENT").write_text("garbage\n")
    with ShardStore.open(SHARD, tmp_path) as store:
        assert store.reset_reason is not None and "Corruption" in store.reset_reason
        assert store.stamp is None and store.count() == 0


def test_a_scan_left_open_does_not_keep_the_store_open(tmp_path: Path) -> None:
    store = ShardStore.open(SHARD, tmp_path)
    store.apply(records("a"), Stamp(1, 3))
    scan = store.items()
    next(scan)
    store.close()
    with ShardStore.open(SHARD, tmp_path, lock_timeout=2) as again:
        assert again.count() == 3


def test_a_second_open_in_the_same_process_waits_then_fails(store: ShardStore, tmp_path: Path) -> None:
    with pytest.raises(StoreLocked):
        ShardStore.open(SHARD, tmp_path, lock_timeout=0.3)
    with ShardStore.open(ShardId("scores", "0", 1), tmp_path, lock_timeout=0.3):
        pass  # another shard is another store


def test_a_store_held_by_another_process_waits_then_names_it(tmp_path: Path) -> None:
    proc = held(tmp_path, 30)
    try:
        began = time.monotonic()
        with pytest.raises(StoreLocked) as caught:
            ShardStore.open(SHARD, tmp_path, lock_timeout=1.0)
        assert time.monotonic() - began >= 1.0
        message = str(caught.value)
        assert str(SHARD.directory(tmp_path)) in message
        assert "another attempt of this shard's task" in message and f"pid {proc.pid}" in message
    finally:
        proc.kill()
        proc.wait()


def test_a_store_is_taken_as_soon_as_its_holder_lets_go(tmp_path: Path) -> None:
    proc = held(tmp_path, 1.5)
    began = time.monotonic()
    with ShardStore.open(SHARD, tmp_path, lock_timeout=60) as store:
        assert time.monotonic() - began > 0.5
        assert store.stamp == Stamp(7, 70)
    assert proc.wait(30) == 0


KEEPER = """
    import sys, time
    from pathlib import Path
    from refold.state import ShardId, ShardStore, Stamp
    store = ShardStore.open(ShardId("scores", "0", 0), Path(sys.argv[1]))
    store.apply([(b'["held"]', b"v")], Stamp(7, 70))
    print("holding", flush=True)
    while not store.wanted:
        time.sleep(0.05)
    store.close()
    print("let go", flush=True)
    time.sleep(60)
"""


def test_a_holder_that_keeps_its_store_lets_go_when_another_process_waits(tmp_path: Path) -> None:
    # a shard host keeps its stores open between batches and closes one another process
    # waits for (`<shard>.want`, `ShardStore.wanted`): the waiter gets it then, not at
    # its deadline, and the want is gone once it holds the store
    want = SHARD.directory(tmp_path).with_name("0.want")
    proc = run_python(KEEPER, str(tmp_path))
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "holding", proc.stderr.read() if proc.stderr else ""
        assert not want.exists()
        began = time.monotonic()
        with ShardStore.open(SHARD, tmp_path, lock_timeout=30) as store:
            assert time.monotonic() - began < 10
            assert store.stamp == Stamp(7, 70)
            assert not want.exists() and not store.wanted
        assert proc.stdout.readline().strip() == "let go"
    finally:
        proc.kill()
        proc.wait()


def test_a_store_whose_holder_was_killed_opens_intact(tmp_path: Path) -> None:
    proc = held(tmp_path, 300)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with ShardStore.open(SHARD, tmp_path, lock_timeout=5) as store:
        assert store.reset_reason is None
        assert store.stamp == Stamp(7, 70) and list(store.items()) == [(b'["held"]', b"v")]


SPEC = ViewSpec.model_validate({"key": ["k"], "columns": {
    "total": {"sum": "v"}, "n": {"count": "*"}, "low": {"min": "v"}, "last_v": {"last": "v"}}})
TOP = ViewSpec.model_validate({"top_n": {"n": 2, "order_by": {"v": "desc"}, "partition_by": ["k"]}})


@pytest.mark.parametrize("spec", [SPEC, TOP], ids=["grouped", "top_n"])
def test_a_reducer_restored_from_some_keys_equals_the_full_one_on_them(spec: ViewSpec, store: ShardStore) -> None:
    full = make_reducer(spec)
    keys = ["a", "ab", "b", "c", "a]", ""]
    tag = 0
    for batch in range(3):
        rows = [{"k": k, "v": (n * 7 + batch) % 5, "i": n} for n, k in enumerate(keys * 3)]
        for row in rows:
            tag += 1
            full.apply([SourceEvent(Op.APPEND, row, (tag, 0, tag))])
        for gone in (rows[0], rows[3], rows[9]):  # of "a", of "c" and of "c" again
            full.apply([SourceEvent(Op.RETRACT, gone, (tag, 0, tag))])
        store.apply(full.take_state_changes(), Stamp(batch + 1, 0))
    from_all = make_reducer(spec)
    from_all.restore(store.items())
    assert from_all.view() == full.view()
    some = ["a", "a]", "c"]
    partial = make_reducer(spec)
    partial.restore(store.load_keys(kj(k) for k in some))
    assert partial.view() == {key: row for key, row in from_all.view().items() if key[0] in some}
    assert partial.view() and set(partial.view()) < set(from_all.view())


# open_shard on the real broker ----------------------------------------------------------


Txn = list[tuple[int, bytes, bytes | None]]  # (partition, record key, value or None)


def write(settings: dict[str, Any], topic: str, txns: list[Txn], *, aborted: frozenset[int] = frozenset()) -> None:
    """One transaction per entry (those at the indexes in `aborted` aborted), then wait
    until their markers are written."""
    producer = Producer(producer_config(settings, **{"transactional.id": f"{topic}-writer"}))
    producer.init_transactions(30)
    for i, txn in enumerate(txns):
        producer.begin_transaction()
        for partition, key, value in txn:
            producer.produce(topic, value, key, partition=partition)
        if i in aborted:
            producer.flush(30)  # on the broker first: abort_transaction drops unsent records
            producer.abort_transaction(30)
        else:
            producer.commit_transaction(30)
    assert open_transactions(settings, [topic]) == []


def latest(txns: list[Txn], partition: int) -> dict[bytes, bytes]:
    """What partition `partition` holds as a compacted topic: the latest value per key."""
    out: dict[bytes, bytes | None] = {}
    for txn in txns:
        for p, key, value in txn:
            if p == partition:
                out[key] = value
    return {k: v for k, v in out.items() if v is not None}


def batch_of(n: int, keys: range, *, drop: range = range(0)) -> Txn:
    """Batch `n`: records of `keys` (key i on partition i % 2) and tombstones for `drop`."""
    txn: Txn = []
    for i in keys:
        txn += [(i % 2, key, value + b"@%d" % n) for key, value in records(f"k{i}")]
    for i in drop:
        txn += [(i % 2, key, None) for key, _ in records(f"k{i}")]
    return txn


def count_in(txns: list[Txn], partition: int) -> int:
    return sum(1 for txn in txns for p, _k, _v in txn if p == partition)


@pytest.fixture
def state_topic(topic: Callable[..., str]) -> str:
    return topic(partitions=2, **{"cleanup.policy": "compact"})


@pytest.mark.kafka
@pytest.mark.parametrize("partition", [0, 1])
def test_a_fresh_store_restores_its_partition_only(kafka_config, state_topic, tmp_path: Path, partition: int) -> None:
    committed = [batch_of(1, range(10)), batch_of(2, range(4, 14), drop=range(2)), batch_of(3, range(3))]
    stray = [(partition, row_key(kj("only-aborted"), bytes(16)), b"never")]
    write(kafka_config, state_topic, [committed[0], committed[1], stray + batch_of(9, range(20)), committed[2]],
          aborted=frozenset({2}))  # fmt: skip
    shard = ShardId("scores", "0", partition)
    store, recovery = open_shard(kafka_config, state_topic, shard, 3, tmp_path)
    with store:
        assert (recovery.how, recovery.start) == ("restored", 0)
        assert recovery.records_read == count_in(committed, partition)  # neither the other partition nor aborted
        assert dict(store.items()) == latest(committed, partition)
        assert store.stamp is not None and store.stamp.batch == 3


@pytest.mark.kafka
def test_a_store_behind_catches_up_from_its_state_end_only(kafka_config, state_topic, tmp_path: Path) -> None:
    first = [batch_of(1, range(10)), batch_of(2, range(5))]
    write(kafka_config, state_topic, first)
    store, recovery = open_shard(kafka_config, state_topic, SHARD, 2, tmp_path)
    with store:
        assert recovery.how == "restored"
        stamp = store.stamp
    assert stamp is not None and stamp.batch == 2

    later = [batch_of(3, range(6, 12), drop=range(3)), batch_of(4, range(2))]
    write(kafka_config, state_topic, [batch_of(8, range(30)), *later], aborted=frozenset({0}))
    store, recovery = open_shard(kafka_config, state_topic, SHARD, 4, tmp_path)
    with store:
        assert (recovery.how, recovery.start) == ("caught_up", stamp.state_end)
        assert recovery.records_read == count_in(later, 0)
        assert dict(store.items()) == latest(first + later, 0)
        assert store.stamp is not None and store.stamp.batch == 4

    store, recovery = open_shard(kafka_config, state_topic, SHARD, 4, tmp_path)
    with store:
        assert (recovery.how, recovery.records_read) == ("as_is", 0)

    store, recovery = open_shard(kafka_config, state_topic, SHARD, 3, tmp_path)  # the store is ahead
    with store:
        assert recovery.how == "restored" and "ahead" in recovery.reason
        assert recovery.records_read == count_in(first + later, 0)
        assert dict(store.items()) == latest(first + later, 0) and store.stamp is not None
        assert store.stamp.batch == 3


@pytest.mark.kafka
def test_nothing_committed_means_an_empty_store_at_the_partition_s_end(kafka_config, state_topic, tmp_path) -> None:
    write(kafka_config, state_topic, [batch_of(1, range(4))])  # records without a checkpoint: not state
    store, recovery = open_shard(kafka_config, state_topic, SHARD, 0, tmp_path)
    with store:
        assert (recovery.how, recovery.records_read) == ("restored", 0)
        assert store.count() == 0 and store.stamp is not None and store.stamp.state_end >= 4


@pytest.mark.kafka
def test_a_store_that_missed_deleted_records_restores(kafka_config, topic, tmp_path: Path) -> None:
    state = topic(partitions=1)  # DeleteRecords needs cleanup.policy=delete
    batches = [batch_of(1, range(0, 8, 2)), batch_of(2, range(8, 16, 2)), batch_of(3, range(16, 24, 2))]
    write(kafka_config, state, batches[:1])
    store, _ = open_shard(kafka_config, state, SHARD, 1, tmp_path)
    store.close()
    write(kafka_config, state, batches[1:])
    admin = AdminClient(kafka_config)
    cut = TopicPartition(state, 0, 15)  # inside batch 2
    admin.delete_records([cut])[cut].result(30)
    store, recovery = open_shard(kafka_config, state, SHARD, 3, tmp_path)
    with store:
        assert recovery.how == "restored" and "log start" in recovery.reason
        assert recovery.start == 15
    store, recovery = open_shard(kafka_config, state, SHARD, 3, tmp_path, tombstone_retention_ms=1)
    with store:
        assert recovery.how == "as_is"  # the stamp matches: nothing to miss


@pytest.mark.kafka
def test_a_store_stamped_too_long_ago_restores(kafka_config, state_topic, tmp_path: Path) -> None:
    write(kafka_config, state_topic, [batch_of(1, range(4))])
    open_shard(kafka_config, state_topic, SHARD, 1, tmp_path)[0].close()
    write(kafka_config, state_topic, [batch_of(2, range(4))])
    time.sleep(0.01)
    store, recovery = open_shard(kafka_config, state_topic, SHARD, 2, tmp_path, tombstone_retention_ms=2)
    with store:
        assert recovery.how == "restored" and "delete.retention.ms" in recovery.reason


@pytest.mark.kafka
def test_the_tombstone_retention_is_the_topic_s(kafka_config, topic) -> None:
    from refold.state.shard import _delete_retention_ms

    assert _delete_retention_ms(kafka_config, topic(partitions=1, **{"delete.retention.ms": "3600000"})) == 3_600_000


ENGINE = """
    import sys, time
    from pathlib import Path
    from confluent_kafka import Producer, TopicPartition, Consumer
    from refold.kafka.io import consumer_config, producer_config
    from refold.state import ShardId, ShardStore, Stamp, open_shard

    bootstrap, topic, root, batches, applied = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    settings = {"bootstrap.servers": bootstrap}
    producer = Producer(producer_config(settings, **{"transactional.id": f"{topic}-0"}))
    producer.init_transactions(30)
    # the end after a commit: the high watermark, read_uncommitted (read_committed is told
    # the last stable offset, which stays before the batch until its markers are written)
    ends = Consumer(consumer_config(settings, **{"isolation.level": "read_uncommitted"}))
    store, _ = open_shard(settings, topic, ShardId("scores", "0", 0), 0, root)
    for batch in range(1, batches + 1):
        changes = [(b'["k%d",%d]' % (i, batch % 3), b"v%d" % batch) for i in range(25)]
        changes.append((b'["k%d",%d]' % (batch, (batch - 1) % 3), None))
        producer.begin_transaction()
        for key, value in changes:
            producer.produce(topic, value, key, partition=0)
        producer.commit_transaction(30)
        if batch <= applied:  # after the commit: the committed stamp with the records
            _low, high = ends.get_watermark_offsets(TopicPartition(topic, 0), timeout=30, cached=False)
            store.apply(changes, Stamp(batch, high))
    print("committed", flush=True)
    time.sleep(300)
"""


@pytest.mark.kafka
@pytest.mark.parametrize("missed", [0, 2])
def test_after_kill_9_a_restart_reads_only_the_batches_it_missed(
    kafka_config, state_topic, tmp_path: Path, missed: int
) -> None:
    batches = 6
    proc = run_python(ENGINE, kafka_config["bootstrap.servers"], state_topic, str(tmp_path), str(batches),
                      str(batches - missed))  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "committed", proc.stderr.read() if proc.stderr else ""
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # with the store open, its lock held
        proc.wait()
    assert open_transactions(kafka_config, [state_topic]) == []
    store, recovery = open_shard(kafka_config, state_topic, SHARD, batches, tmp_path, lock_timeout=5)
    with store:
        assert recovery.how == ("as_is" if missed == 0 else "caught_up")
        assert recovery.records_read == 26 * missed  # no more than the batches it missed
        expected: dict[bytes, bytes | None] = {}
        for batch in range(1, batches + 1):
            expected.update({b'["k%d",%d]' % (i, batch % 3): b"v%d" % batch for i in range(25)})
            expected[b'["k%d",%d]' % (batch, (batch - 1) % 3)] = None
        assert dict(store.items()) == {k: v for k, v in expected.items() if v is not None}
