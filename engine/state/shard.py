"""A shard's store brought to the committed checkpoint: `open_shard`.

DESIGN.md §3: a shard's state comes from its local store when that store's stamp
matches the committed checkpoint, catching up from `P.state` when it is behind, and
from `P.state` alone when it is gone. `P.state` partition p holds shard p's records
only, so a shard reads partition p and nothing else.

Call it after the shard's writer's `init_transactions` and after reading the
committed checkpoint: then no transaction of this shard is open, and none can
commit while the store's lock is held (a newer attempt needs the store to compute
its batch), so what partition p holds to its end is the state as of that checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import ConfigResource, ResourceType

from refold.errors import InternalError
from refold.kafka.io import admin_client, consumer_config, read_to_end
from refold.state.store import CACHE_BYTES, RECORD_FIRST, ShardId, ShardStore, Stamp

log = logging.getLogger(__name__)

RESTORING = -1  # the stamp's batch while a restore is under way (behind every checkpoint)
CHUNK_RECORDS = 50_000  # records per write batch while catching up; each carries a progress stamp
KAFKA_DELETE_RETENTION_MS = 86_400_000  # Kafka's default `delete.retention.ms`, when the topic's cannot be read


@dataclass(frozen=True, slots=True)
class Recovery:
    """How `open_shard` brought the store to the committed checkpoint, and what it read."""

    how: Literal["as_is", "caught_up", "restored"]
    reason: str  # why this way, for logs
    records_read: int  # `P.state` records read from Kafka (0 when as is)
    start: int | None  # the partition offset reading started at (None when nothing was read)
    seconds: float


def open_shard(
    settings: Mapping[str, Any],
    state_topic: str,
    shard: ShardId,
    committed_batch: int,
    root: Path | None = None,
    *,
    checkpoint_at: int = 0,
    lock_timeout: float = 60.0,
    read_timeout: float = 120.0,
    tombstone_retention_ms: int | None = None,
    cache_bytes: int = CACHE_BYTES,
) -> tuple[ShardStore, Recovery]:
    """The shard's store (`ShardStore.open`, which takes its lock), brought to the
    committed checkpoint by `bring_to`. The caller closes the store. Raises StoreLocked
    when another process keeps the store past `lock_timeout` seconds."""
    store = ShardStore.open(shard, root, lock_timeout=lock_timeout, cache_bytes=cache_bytes)
    try:
        recovery = bring_to(
            settings, state_topic, store, committed_batch, checkpoint_at=checkpoint_at,
            read_timeout=read_timeout, tombstone_retention_ms=tombstone_retention_ms,
        )
    except BaseException:
        store.close()
        raise
    return store, recovery


def bring_to(
    settings: Mapping[str, Any],
    state_topic: str,
    store: ShardStore,
    committed_batch: int,
    *,
    checkpoint_at: int = 0,
    read_timeout: float = 120.0,
    tombstone_retention_ms: int | None = None,
) -> Recovery:
    """Bring an open store exactly to the committed checkpoint (`committed_batch`: its
    `batch`, 0 when nothing is committed; `checkpoint_at`: its `committed_at`), and say
    how:

    - stamp == committed (batch and `checkpoint_at`): as is; nothing read from Kafka;
    - stamp behind: catch up, reading partition `shard.shard` of `state_topic`
      (read_committed) from the stamp's `state_end` to the end;
    - missing, unreadable, ahead of the checkpoint or at its batch from another run, past
      the partition's end (a recreated topic), behind its log start, or stamped longer
      ago than half the topic's `delete.retention.ms` (tombstones it missed may be
      gone): wiped and restored from the partition's first offset.

    Nothing committed: the store is empty, stamped at the partition's end."""
    began = time.monotonic()
    stamp = store.stamp
    if stamp is not None and stamp.batch == committed_batch and stamp.checkpoint_at == checkpoint_at:
        return Recovery("as_is", f"stamped at batch {stamp.batch}", 0, None, time.monotonic() - began)
    shard = store.shard
    low, high = _offsets(settings, state_topic, shard.shard, read_timeout)
    reason = _why_restore(store, committed_batch, low, high)
    if reason is None:
        assert stamp is not None
        retention = tombstone_retention_ms or _delete_retention_ms(settings, state_topic)
        age = time.time() * 1000 - (store.stamped_at or 0)
        if age > retention / 2:
            reason = (f"stamped {age / 3_600_000:.1f} h ago, over half the topic's delete.retention.ms "
                      f"({retention / 3_600_000:.1f} h): tombstones it missed may be gone")
    if reason is None:
        assert stamp is not None
        read = _catch_up(settings, state_topic, store, stamp, committed_batch, checkpoint_at, read_timeout)
        why = f"stamped at batch {stamp.batch}, committed {committed_batch}"
        return Recovery("caught_up", why, read, stamp.state_end, time.monotonic() - began)
    log.info("restoring the state store of %s from %s: %s", shard, state_topic, reason)
    store.clear()
    if committed_batch == 0:
        store.apply((), Stamp(0, high, checkpoint_at))
        return Recovery("restored", reason, 0, None, time.monotonic() - began)
    read = _catch_up(settings, state_topic, store, Stamp(RESTORING, low), committed_batch, checkpoint_at, read_timeout)
    return Recovery("restored", reason, read, low, time.monotonic() - began)


def _why_restore(store: ShardStore, committed_batch: int, low: int, high: int) -> str | None:
    """Why the store cannot catch up from its stamp (None: it can)."""
    stamp = store.stamp
    if committed_batch == 0:
        return "nothing is committed yet"
    if stamp is None:
        return f"no usable local store ({store.reset_reason})" if store.reset_reason else "no local store"
    if stamp.batch > committed_batch:
        return f"its stamp (batch {stamp.batch}) is ahead of the committed checkpoint (batch {committed_batch})"
    if stamp.batch == committed_batch:
        return f"its stamp is at batch {stamp.batch} of another run (not the committed checkpoint's)"
    if stamp.state_end > high:
        return f"its state_end {stamp.state_end} is past the partition's end {high} (was the topic recreated?)"
    if stamp.state_end < low:
        return f"its state_end {stamp.state_end} is below the partition's log start {low} (records were deleted)"
    return None


def _catch_up(
    settings: Mapping[str, Any],
    topic: str,
    store: ShardStore,
    stamp: Stamp,
    committed_batch: int,
    checkpoint_at: int,
    timeout: float,
) -> int:
    """Apply partition p's committed records from `stamp.state_end` to its end, in write
    batches that each carry a progress stamp (still behind: a catch-up cut short resumes
    where it stopped), then stamp the store `committed_batch`. Returns how many records
    it read."""
    partition = store.shard.shard
    start = position = stamp.state_end
    read = 0
    chunk: list[tuple[bytes, bytes | None]] = []
    for msg in read_to_end(settings, topic, timeout=timeout, start={partition: start}, only=(partition,)):
        key, offset = msg.key(), int(msg.offset() or 0)
        if key is None or key[:1] != RECORD_FIRST:
            raise InternalError(f"{topic}[{partition}]@{offset}: not a P.state record (key {key!r:.60})")
        chunk.append((key, msg.value()))
        position = offset + 1
        if len(chunk) >= CHUNK_RECORDS:
            store.apply(chunk, Stamp(stamp.batch, position))
            read += len(chunk)
            chunk = []
    # `position` is past the last record read: only markers and aborted records can lie
    # between it and the end, so a later catch-up from it reads nothing twice.
    store.apply(chunk, Stamp(committed_batch, position, checkpoint_at))
    log.info("state store of %s: %d records of %s[%d] from offset %d", store.shard, read + len(chunk),
             topic, partition, start)
    return read + len(chunk)


_NOT_READY = (KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART)


def _offsets(settings: Mapping[str, Any], topic: str, partition: int, timeout: float) -> tuple[int, int]:
    """Partition p's log start offset and high watermark (read_uncommitted: a
    read_committed consumer is told the last stable offset instead)."""
    consumer = Consumer(consumer_config(settings, **{"isolation.level": "read_uncommitted"}))
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout)
                return int(low), int(high)
            except KafkaException as exc:  # a topic just made: its leader may not serve it yet
                error = exc.args[0]
                if not (error.retriable() or error.code() in _NOT_READY) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        consumer.close()


def _delete_retention_ms(settings: Mapping[str, Any], topic: str) -> int:
    """The topic's `delete.retention.ms` (how long Kafka keeps a tombstone after compacting
    it); Kafka's default when it cannot be read (no DESCRIBE_CONFIGS right)."""
    resource = ConfigResource(ResourceType.TOPIC, topic)
    admin = admin_client(settings)  # referenced until the answer is in: a dropped client cancels it
    try:
        entries = admin.describe_configs([resource], request_timeout=30)[resource].result(30)
        return int(entries["delete.retention.ms"].value)
    except (KafkaException, KeyError, ValueError) as exc:
        log.warning("cannot read delete.retention.ms of %s (%s); assuming Kafka's default of 24 h", topic, exc)
        return KAFKA_DELETE_RETENTION_MS
