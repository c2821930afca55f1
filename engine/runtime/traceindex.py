"""The trace index `P.trace`: where each view key's records are, written with them.

Kafka has no lookup by key, so every shard batch that writes view records also writes,
in the same transaction, one record (one per `ENTRY_RECORDS` view records) to `P.trace` (partition = the shard's view
partition, key `<writer>/<shard>`): the view partition's offsets the batch wrote, the
64-bit hashes of the view keys it touched (sorted) with each key's records' positions
in the batch, and the source offsets the batch consumed (a later stage of a re-grouping
view, whose input is an engine topic: the source offsets its view records' causes span;
a join: both sources', the right one's partitions numbered `RIGHT_PARTITIONS + p`).
`refold trace --key` reads the small index topic and then fetches only the named view
records; `--input` reads only the batches whose source range holds the event
(refold.cli.traceread).

Why the offsets are exact: the index is written only where the shard alone writes its
view partition (`outputs.view.partitioning: shard`, the default). Its transactional
producer's records of one transaction are then contiguous in the partition (a zombie
is fenced, and its open transaction settled, before this producer's first transaction;
commit and abort markers come after a transaction's records, never among them; the
idempotent producer's retries never write a record twice). So after the batch's view
records are flushed (acknowledged by every in-sync replica), the partition's high
watermark is one past the batch's last view record, and the first is that minus their
count. The index record commits or aborts with them: it never names a record that was
not committed, and every committed batch with view records has one.

The value (little-endian):

    u8 version (1), 3 pad, i32 view partition, i64 first offset, u32 records (n),
    u32 keys (k), u32 sources (s), i64 batch, 4 pad            -- 40 bytes
    s x (i32 source partition, 4 pad, i64 from, i64 to)         -- consumed [from, to)
    k x u64 key hash (sorted, each once; blake2b-64 of the view record's message key:
                      keys whose hashes collide share one)
    (k + 1) x u32 start of each key's positions, n x u32 positions in the batch
"""

from __future__ import annotations

import bisect
import hashlib
import struct
import sys
from array import array
from itertools import accumulate
from typing import Any, NamedTuple

from confluent_kafka import Consumer, TopicPartition

from refold.config import Pipeline
from refold.errors import OperationalError
from refold.kafka.io import consumer_config
from refold.kafka.transactions import TransactionalWriter
from refold.plan import checkpoint_key, tops_topic, trace_topic, view_partitioning
from refold.recovery.records import Checkpoint
from refold.runtime.render import CAUSE

VERSION = 1
ENTRY_RECORDS = 40_000  # view records per index record at most: 16 bytes each at worst, 640 kB
_HEAD = struct.Struct("<B3xiqIIIq4x")
_SOURCE = struct.Struct("<i4xqq")

try:
    from refold_native import trace_entry as _native_entry
except ImportError:  # not built (or built before the index): Python makes the entries
    _native_entry = None

if sys.byteorder != "little":  # pragma: no cover - every platform Refold runs on is little-endian
    raise ImportError("refold.runtime.traceindex writes little-endian arrays")


def key_hash(key: bytes) -> int:
    """A view message key's 64-bit hash in the index (stable across processes and versions)."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def build_entry(view: list[tuple[Any, ...]], partition: int, first: int, batch: int,
                sources: list[tuple[int, int, int]]) -> bytes:
    """The index record of a batch's view records `view` (key first in each tuple) written
    to `partition` from offset `first` on; `sources`: (source partition, from, to) consumed.
    The native core's `trace_entry` makes the same bytes when it is built."""
    if _native_entry is not None:
        return _native_entry(view, partition, first, batch, sources)
    return python_entry(view, partition, first, batch, sources)


def python_entry(view: list[tuple[Any, ...]], partition: int, first: int, batch: int,
                 sources: list[tuple[int, int, int]]) -> bytes:
    """`build_entry` in Python."""
    hashes_of: dict[bytes, int] = {}
    positions: dict[int, list[int]] = {}
    for index, record in enumerate(view):
        key = record[0]
        hashed_key = hashes_of.get(key)
        if hashed_key is None:
            hashed_key = hashes_of[key] = key_hash(key)
        found = positions.get(hashed_key)
        if found is None:
            positions[hashed_key] = [index]
        else:
            found.append(index)
    hashed = sorted(positions.items())
    hashes = array("Q", [h for h, _ in hashed])
    starts = array("I", [0])
    starts.extend(accumulate(len(found) for _, found in hashed))
    flat = array("I")
    for _, found in hashed:
        flat.extend(found)
    parts = [_HEAD.pack(VERSION, partition, first, len(view), len(hashed), len(sources), batch)]
    parts += [_SOURCE.pack(p, lo, hi) for p, lo, hi in sources]
    parts += [hashes.tobytes(), starts.tobytes(), flat.tobytes()]
    return b"".join(parts)


class Entry(NamedTuple):
    """One batch's index record, read back (`parse`); the arrays are views of its bytes."""

    partition: int
    first: int
    records: int
    batch: int
    sources: list[tuple[int, int, int]]
    hashes: memoryview  # u64, sorted
    starts: memoryview  # u32
    positions: memoryview  # u32

    def offsets_of(self, wanted: int) -> list[int]:
        """The view offsets of the key whose hash is `wanted` (a colliding key's too: the
        reader checks each record's key)."""
        hashes = self.hashes
        at = bisect.bisect_left(hashes, wanted)
        found: list[int] = []
        while at < len(hashes) and hashes[at] == wanted:
            first = self.first
            found += [first + self.positions[i] for i in range(self.starts[at], self.starts[at + 1])]
            at += 1
        return found

    def consumed(self, partition: int, offset: int) -> bool:
        """Whether the batch consumed source `partition`'s `offset` (a `-C` it held over
        from the batch before counts: its records come out in this batch)."""
        return any(p == partition and lo <= offset < hi for p, lo, hi in self.sources)


def parse(value: bytes) -> Entry:
    """An index record's value as an `Entry`; ValueError when it is not one this version reads."""
    if len(value) < _HEAD.size or value[0] != VERSION:
        raise ValueError(f"not a version-{VERSION} trace index record")
    _, partition, first, n, k, s, batch = _HEAD.unpack_from(value)
    at = _HEAD.size
    sources = [_SOURCE.unpack_from(value, at + i * _SOURCE.size) for i in range(s)]
    at += s * _SOURCE.size
    view = memoryview(value)
    hashes = view[at:at + 8 * k].cast("Q")
    at += 8 * k
    starts = view[at:at + 4 * (k + 1)].cast("I")
    at += 4 * (k + 1)
    positions = view[at:at + 4 * n].cast("I")
    if len(positions) != n:
        raise ValueError("a truncated trace index record")
    return Entry(partition, first, n, batch, sources, hashes, starts, positions)


def indexed(pipeline: Pipeline) -> bool:
    """Whether the pipeline's shards write the trace index: a view output partitioned by
    shard, with provenance on (a join's too: its sources' partitions are numbered as its
    shards number them, the right one's `RIGHT_PARTITIONS + p`)."""
    return pipeline.outputs.view is not None and pipeline.outputs.provenance and view_partitioning(pipeline) == "shard"


def cause_ranges(view: list[Any]) -> list[tuple[int, int, int]]:
    """A later stage's batch: per source partition, the offsets [from, to) its view
    records' causes span (`refold.cause` is the original input event through every
    stage). Nothing when a cause is not `<partition>:<offset>` (the reader then reads the
    batch's view records whole)."""
    spans: dict[int, tuple[int, int]] = {}
    seen: set[bytes] = set()
    for record in view:
        headers = record[3]
        if not headers or headers[0][0] != CAUSE or (value := headers[0][1]) in seen:
            continue
        seen.add(value)
        partition, _, offset = value.partition(b":")
        try:
            p, o = int(partition), int(offset)
        except ValueError:
            return []
        lo, hi = spans.get(p, (o, o + 1))
        spans[p] = (min(lo, o), max(hi, o + 1))
    return [(p, lo, hi) for p, (lo, hi) in sorted(spans.items())]


class IndexWriter:
    """A shard's index records, one per batch with view records, in the batch's
    transaction (`write`, after everything else of the batch is sent)."""

    def __init__(self, pipeline: Pipeline, settings: dict[str, Any], shard: int) -> None:
        self.settings = settings
        self.shard = shard
        self.topic = trace_topic(pipeline) if indexed(pipeline) else None
        self.view_topic = pipeline.outputs.view.topic if pipeline.outputs.view is not None else ""
        self.key = checkpoint_key(pipeline.writer, shard)
        # a later stage's input is an engine topic: its source ranges come from its records' causes
        self.sourced = pipeline.source.topic not in (pipeline.repartition_topic, tops_topic(pipeline))
        self._consumer: Consumer | None = None
        self._end: int | None = None  # one past the last batch's view records

    def write(self, writer: TransactionalWriter, view: list[Any], before: Checkpoint,
              after: Checkpoint) -> None:
        """The batch's index record: its view records flushed first, their offsets from
        the view partition's high watermark (see the module's docstring for why exact)."""
        if self.topic is None or not view:
            return
        writer.flush()
        if self._consumer is None:
            self._consumer = Consumer(consumer_config(self.settings, **{"isolation.level": "read_uncommitted"}))
            self._consumer.list_topics(self.view_topic, timeout=60)
        _low, high = self._consumer.get_watermark_offsets(TopicPartition(self.view_topic, self.shard), timeout=60)
        first = int(high) - len(view)
        if self._end is not None and first < self._end:
            raise OperationalError(
                f"{self.view_topic}[{self.shard}] has records this shard did not write (at {first}, before "
                f"{self._end}): another producer writes the view partition; the trace index cannot name them")
        sources = []
        if self.sourced:
            for partition, to in sorted(after.offsets.items()):
                start = before.offsets.get(partition, 0)
                held = before.pending.get(partition)
                if held is not None:  # a -C held over: its records come out in this batch
                    start = min(start, held.offset)
                if to > start:
                    sources.append((partition, start, to))
        else:
            sources = cause_ranges(view)
        for at in range(0, len(view), ENTRY_RECORDS):  # (a record stays far below the broker's 1 MB default)
            value = build_entry(view[at:at + ENTRY_RECORDS], self.shard, first + at, after.batch, sources)
            writer.send(self.topic, self.key, value, partition=self.shard)
        self._end = int(high)

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
