"""The trace index read back (`refold trace`): which view records to fetch.

`P.trace` (refold.runtime.traceindex) holds one record per shard batch that wrote view
records. `key_offsets` reads it whole (a few bytes per view record) and names the view
offsets of a key; `input_ranges` the view offset ranges of the batches that consumed an
input event. What the index does not cover — a view partition's records before its
first indexed batch (a pipeline that ran before the index existed), after its last and
between two (written while provenance was off) — is left to the caller's scan
(`Coverage.unindexed`). `fetch_offsets` reads single records by offset.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, Message, TopicPartition

from refold.config import Pipeline
from refold.errors import UserError
from refold.kafka.io import consumer_config, partitions_of, read_to_end
from refold.plan import trace_topic
from refold.runtime.traceindex import Entry, key_hash, parse

log = logging.getLogger(__name__)

GAP = 200  # offsets a fetch reads on rather than seeking again
# how long a read of a whole topic may take (read_to_end's default, 120 s, is for the
# engine's small topics; a gigabyte view topic on a busy machine takes longer)
SCAN_SECONDS = 3600.0
# a consumer that reads single records: no prefetching past what it asked for, and no
# wait for its queue to drain before the next fetch (fetch.queue.backoff.ms is 1 s by default)
SMALL_FETCHES = {"enable.partition.eof": True, "fetch.wait.max.ms": 10, "queued.min.messages": 1,
                 "max.partition.fetch.bytes": 65536, "fetch.queue.backoff.ms": 0, "fetch.error.backoff.ms": 10}


@dataclass
class Coverage:
    """What an index read found: the view offsets wanted per partition, and the view
    offset ranges [first, end) the index records name, per partition in offset order."""

    wanted: dict[int, set[int]] = field(default_factory=dict)
    spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    entries: int = 0

    def unindexed(self, view_partitions: list[int]) -> dict[int, list[tuple[int, int | None]]]:
        """Per view partition, the offset ranges [start, end) the index does not name (end
        None: to the partition's end), for a scan: before its first index record, after its
        last, and between two index records more than a commit marker apart (records
        written while provenance was off; an aborted transaction's records, which a
        read_committed scan skips, look the same)."""
        found: dict[int, list[tuple[int, int | None]]] = {}
        for partition in view_partitions:
            spans = self.spans.get(partition)
            if not spans:
                found[partition] = [(0, None)]
                continue
            ranges: list[tuple[int, int | None]] = [(0, spans[0][0])] if spans[0][0] > 0 else []
            end = spans[0][1]
            for first, last in spans[1:]:
                if first > end + 1:  # (one offset: the batch's commit marker)
                    ranges.append((end, first))
                end = max(end, last)
            ranges.append((end, None))
            found[partition] = ranges
        return found

    def _saw(self, entry: Entry) -> None:
        self.entries += 1
        spans = self.spans.setdefault(entry.partition, [])
        span = (entry.first, entry.first + entry.records)
        if spans and span < spans[-1]:
            bisect.insort(spans, span)
        else:
            spans.append(span)


def _entries(settings: dict[str, Any], pipeline: Pipeline) -> Iterator[Entry] | None:
    topic = trace_topic(pipeline)
    try:
        partitions_of(settings, topic)
    except UserError:
        return None  # a pipeline that ran before the index existed, or without provenance
    return _parsed(settings, topic)


def _parsed(settings: dict[str, Any], topic: str) -> Iterator[Entry]:
    for msg in read_to_end(settings, topic, timeout=SCAN_SECONDS):
        value = msg.value()
        try:
            yield parse(value or b"")
        except ValueError as exc:
            log.warning("%s[%d]@%d skipped: %s", topic, msg.partition(), msg.offset(), exc)


def key_offsets(settings: dict[str, Any], pipeline: Pipeline, message_key: bytes) -> Coverage | None:
    """The view offsets the index names for `message_key` (None: no index)."""
    entries = _entries(settings, pipeline)
    if entries is None:
        return None
    wanted = key_hash(message_key)
    found = Coverage()
    for entry in entries:
        found._saw(entry)
        offsets = entry.offsets_of(wanted)
        if offsets:
            found.wanted.setdefault(entry.partition, set()).update(offsets)
    return found


def input_ranges(settings: dict[str, Any], pipeline: Pipeline, partitions: list[int],
                 offset: int) -> tuple[Coverage, list[tuple[int, int, int]]] | None:
    """The view ranges (partition, first, end) of the batches that consumed `offset` of
    one of the source `partitions` (as the index numbers them; None: no index)."""
    entries = _entries(settings, pipeline)
    if entries is None:
        return None
    found = Coverage()
    ranges = []
    for entry in entries:
        found._saw(entry)
        # (no source ranges: a later stage's batch whose causes do not say; read it whole)
        if not entry.sources or any(entry.consumed(partition, offset) for partition in partitions):
            ranges.append((entry.partition, entry.first, entry.first + entry.records))
    return found, ranges


def fetch_offsets(settings: dict[str, Any], topic: str, partition: int, offsets: list[int],
                  timeout: float = 30.0, consumer: Consumer | None = None) -> list[Message]:
    """The committed records of `topic[partition]` at `offsets` (sorted), read_committed:
    a seek to each run of nearby offsets, small fetches (with `consumer`, one made with
    `SMALL_FETCHES`, left open)."""
    own = consumer is None
    if consumer is None:
        consumer = Consumer(consumer_config(settings, **SMALL_FETCHES))
    found: list[Message] = []
    try:
        i = 0
        while i < len(offsets):
            consumer.assign([TopicPartition(topic, partition, offsets[i])])
            while i < len(offsets):
                msg = consumer.poll(timeout)
                if msg is None or msg.error():
                    i += 1  # (the end: not there)
                    break
                at = msg.offset()
                assert at is not None
                while i < len(offsets) and offsets[i] < at:
                    i += 1  # not returned (not committed): not a record of the view
                if i < len(offsets) and offsets[i] == at:
                    found.append(msg)
                    i += 1
                if i < len(offsets) and offsets[i] - at > GAP:
                    break
    finally:
        if own:
            consumer.close()
    return found


def fetch_range(settings: dict[str, Any], topic: str, partition: int, first: int, end: int) -> list[Message]:
    """The committed records of `topic[partition]` in [first, end)."""
    found: list[Message] = []
    if end <= first:
        return found
    for msg in read_to_end(settings, topic, start={partition: first}, only=[partition], timeout=SCAN_SECONDS):
        at = msg.offset()
        if at is not None and at >= end:
            break
        found.append(msg)
    return found


def written_since(settings: dict[str, Any], topic: str, timestamp: int) -> dict[int, int]:
    """Per partition of `topic`, the first offset whose record timestamp is `timestamp` (ms)
    or later, every record before it older (Kafka's time index keeps the largest timestamp
    so far); a partition with none is left out."""
    consumer = Consumer(consumer_config(settings, **SMALL_FETCHES))
    try:
        asked = [TopicPartition(topic, p, timestamp) for p in partitions_of(settings, topic)]
        return {tp.partition: tp.offset for tp in consumer.offsets_for_times(asked, timeout=30) if tp.offset >= 0}
    finally:
        consumer.close()


def view_partitions(settings: dict[str, Any], topic: str) -> list[int]:
    return partitions_of(settings, topic)
