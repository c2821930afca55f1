"""The engine's own records: checkpoints (`P.checkpoints`) and dead letters.

Values (frozen dataclasses), each with an Avro schema in `schemas/avro/` and a
schemaless Avro round trip. Encoding is deterministic: partition maps are
written sorted by partition and driver checkpoints sorted by name, so the same
checkpoint always gives the same bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from io import BytesIO
from typing import TYPE_CHECKING, Any

import orjson
from fastavro import parse_schema, schemaless_reader, schemaless_writer

from refold.codecs import load_schema
from refold.codecs.schemas import schema_path
from refold.errors import InternalError
from refold.plan import view_partitioning

if TYPE_CHECKING:
    from refold.config import Pipeline


@dataclass(frozen=True, slots=True)
class PendingRecord:
    """An unpaired `-C` at the end of a batch, held over to the next batch: the raw
    input record, replayed in front of its partition's next records."""

    offset: int
    key: bytes | None
    value: bytes
    timestamp: int  # the Kafka record timestamp, epoch ms


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One committed batch of one shard of a pipeline's writer (the value keyed
    `<writer>/<shard>` in the compacted topic `P.checkpoints`): the offsets and held
    `-C`s of the partitions the shard covers, its counters and its drivers' checkpoints."""

    pipeline: str
    writer: str
    batch: int  # how many batches this writer has committed
    source_topic: str
    offsets: dict[int, int]  # partition -> next offset to read
    pending: dict[int, PendingRecord]  # partition -> its held-over -C
    records_in: int
    records_out: int
    dlq: int
    committed_at: int  # epoch ms
    driver_checkpoints: dict[str, bytes]  # opaque, by materialization driver
    shard: int = 0  # the shard of the writer that committed it (P-<writer>-<shard>)
    run: int = 0  # the engine run that committed it (its driver's start, epoch ms)
    view_partitioning: str = "key"  # how the shard partitions its view records: "shard" or "key"


def first_checkpoint(pipeline: Pipeline, shard: int) -> Checkpoint:
    """A shard's checkpoint before its first batch: batch 0, no offsets."""
    return Checkpoint(
        pipeline=pipeline.pipeline,
        writer=pipeline.writer,
        batch=0,
        source_topic=pipeline.source.topic,
        offsets={},
        pending={},
        records_in=0,
        records_out=0,
        dlq=0,
        committed_at=0,
        driver_checkpoints={},
        shard=shard,
        view_partitioning=view_partitioning(pipeline),
    )


def combined(checkpoints: Sequence[Checkpoint]) -> Checkpoint | None:
    """One writer's shards' checkpoints as one (None for none): the offsets and held
    `-C`s of every partition (each from the shard that covers it), the counters summed,
    `batch` the most any shard committed, the latest commit time, every driver's name
    (the first shard's checkpoint for it). `shard` is -1: it is no shard's record."""
    if not checkpoints:
        return None
    ordered = sorted(checkpoints, key=lambda c: c.shard)
    offsets: dict[int, int] = {}
    pending: dict[int, PendingRecord] = {}
    drivers: dict[str, bytes] = {}
    for checkpoint in ordered:
        offsets.update(checkpoint.offsets)
        pending.update(checkpoint.pending)
        for name, data in checkpoint.driver_checkpoints.items():
            drivers.setdefault(name, data)
    return replace(
        ordered[0],
        batch=max(c.batch for c in ordered),
        offsets=offsets,
        pending=pending,
        records_in=sum(c.records_in for c in ordered),
        records_out=sum(c.records_out for c in ordered),
        dlq=sum(c.dlq for c in ordered),
        run=max(c.run for c in ordered),
        committed_at=max(c.committed_at for c in ordered),
        driver_checkpoints=drivers,
        shard=-1,
    )


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A rejected input record with the reason and where it came from."""

    reason: str  # machine-stable, e.g. "undecodable", "op out of range", "not live"
    detail: str | None
    topic: str
    partition: int
    offset: int
    timestamp: int | None  # the input record's Kafka timestamp, epoch ms
    key: bytes | None
    value: bytes | None
    pipeline: str
    # more headers (name, value), after the others: a late event's window and watermark (not in the record's value)
    headers: tuple[tuple[str, str], ...] = ()


def dead_letter_headers(letter: DeadLetter) -> list[tuple[str, bytes]]:
    """The Kafka headers of a dead letter (UTF-8; numbers in decimal).
    `refold.detail` is left out when there is no detail."""
    headers = [("refold.reason", letter.reason.encode())]
    if letter.detail is not None:
        headers.append(("refold.detail", letter.detail.encode()))
    headers += [
        ("refold.topic", letter.topic.encode()),
        ("refold.partition", str(letter.partition).encode()),
        ("refold.offset", str(letter.offset).encode()),
        ("refold.pipeline", letter.pipeline.encode()),
    ]
    headers += [(name, value.encode()) for name, value in letter.headers]
    return headers


# Avro --------------------------------------------------------------------------------


@functools.cache
def _checkpoint_schema() -> dict[str, Any]:
    return load_schema("checkpoint")


@functools.cache
def _checkpoint_schema_without(*names: str) -> dict[str, Any]:
    """The checkpoint schema as written before its fields `names` existed."""
    raw = orjson.loads(schema_path("checkpoint").read_bytes())
    raw["fields"] = [f for f in raw["fields"] if f["name"] not in names]
    parsed = parse_schema(raw, named_schemas={})
    assert isinstance(parsed, dict)
    return parsed


# fields added since: before view partitioning, before runs, before shards
_OLDER_CHECKPOINTS = (("view_partitioning",), ("view_partitioning", "run"), ("view_partitioning", "run", "shard"))


@functools.cache
def _dead_letter_schema() -> dict[str, Any]:
    return load_schema("deadletter")


def _write(schema: dict[str, Any], record: dict[str, Any]) -> bytes:
    stream = BytesIO()
    schemaless_writer(stream, schema, record, strict=True)
    return stream.getvalue()


def _read(schema: dict[str, Any], data: bytes, what: str, reader: dict[str, Any] | None = None) -> dict[str, Any]:
    stream = BytesIO(data)
    try:
        record = schemaless_reader(stream, schema, reader)
    except Exception as exc:  # any failure to read: not a record we wrote
        raise InternalError(f"cannot decode a {what} record ({len(data)} bytes): {type(exc).__name__}: {exc}") from exc
    left = len(data) - stream.tell()
    if left:
        raise InternalError(f"cannot decode a {what} record: {left} bytes left over")
    assert isinstance(record, dict)
    return record


def encode_checkpoint(checkpoint: Checkpoint) -> bytes:
    return _write(
        _checkpoint_schema(),
        {
            "pipeline": checkpoint.pipeline,
            "writer": checkpoint.writer,
            "batch": checkpoint.batch,
            "source_topic": checkpoint.source_topic,
            "offsets": [{"partition": p, "offset": o} for p, o in sorted(checkpoint.offsets.items())],
            "pending": [
                {"partition": p, "offset": r.offset, "key": r.key, "value": r.value, "timestamp": r.timestamp}
                for p, r in sorted(checkpoint.pending.items())
            ],
            "records_in": checkpoint.records_in,
            "records_out": checkpoint.records_out,
            "dlq": checkpoint.dlq,
            "committed_at": checkpoint.committed_at,
            "driver_checkpoints": dict(sorted(checkpoint.driver_checkpoints.items())),
            "shard": checkpoint.shard,
            "run": checkpoint.run,
            "view_partitioning": checkpoint.view_partitioning,
        },
    )


def decode_checkpoint(data: bytes) -> Checkpoint:
    """Raises InternalError for bytes that are not a checkpoint record. A record
    written before shards (no `shard`) reads as shard 0, one before runs as run 0, one
    before view partitioning as "key" (its shards wrote the view by murmur2)."""
    try:
        r = _read(_checkpoint_schema(), data, "checkpoint")
    except InternalError as exc:
        for missing in _OLDER_CHECKPOINTS:
            try:
                r = _read(_checkpoint_schema_without(*missing), data, "checkpoint", _checkpoint_schema())
                break
            except InternalError:
                continue
        else:
            raise exc from None
    return Checkpoint(
        pipeline=r["pipeline"],
        writer=r["writer"],
        batch=r["batch"],
        source_topic=r["source_topic"],
        offsets={o["partition"]: o["offset"] for o in r["offsets"]},
        pending={
            p["partition"]: PendingRecord(p["offset"], p["key"], p["value"], p["timestamp"]) for p in r["pending"]
        },
        records_in=r["records_in"],
        records_out=r["records_out"],
        dlq=r["dlq"],
        committed_at=r["committed_at"],
        driver_checkpoints=r["driver_checkpoints"],
        shard=r["shard"],
        run=r["run"],
        view_partitioning=r["view_partitioning"],
    )


_DEAD_LETTER_FIELDS = ("reason", "detail", "topic", "partition", "offset", "timestamp", "key", "value", "pipeline")


def encode_dead_letter(letter: DeadLetter) -> bytes:
    return _write(_dead_letter_schema(), {name: getattr(letter, name) for name in _DEAD_LETTER_FIELDS})


def decode_dead_letter(data: bytes) -> DeadLetter:
    """Raises InternalError for bytes that are not a dead-letter record."""
    r = _read(_dead_letter_schema(), data, "dead letter")
    return DeadLetter(**{name: r[name] for name in _DEAD_LETTER_FIELDS})
