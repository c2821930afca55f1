"""Source `format: debezium-json`: Debezium change events as changelog events.

A Debezium record value (JSON converter, with or without the `payload` wrapper
of `schemas.enable=true`) becomes the events of `refold.model.forms.from_debezium`
(DESIGN.md §1): `c`/`r` → `+A` after; `u` → `-C` before, `+C` after; `d` →
`-R` before. An update is one input record but two events: the pair shares the
record's partition and offset, so nothing can come between them.

A null value, or `{"schema": …, "payload": null}`, is the tombstone Debezium
writes after a delete for log compaction: it carries no change, so it decodes to
no events (the engine skips and counts it); it is not a bad record.

Failures, with their dead-letter reason:

| reason | when |
|---|---|
| `undecodable` | not JSON, or not a JSON object |
| `schema mismatch` | no `op`, an op other than c/r/u/d, a missing `before`/`after` image, a non-integer `ts_ms`, an image that is not an object or that has a system column (`op`, `event_time`, ...) |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import orjson

from refold.errors import DecodeError, RecordError, RecordSource
from refold.model.changelog import SYSTEM_COLUMNS, ChangelogEvent
from refold.model.forms import from_debezium
from refold.model.reasons import Reason


class DebeziumJsonDecoder:
    """Decodes Debezium JSON values; one record gives zero, one or two events."""

    format: ClassVar[str] = "debezium-json"

    def decode_records(
        self,
        values: Sequence[bytes | None],
        offsets: Sequence[int] | None = None,
        *,
        topic: str | None = None,
        partition: int | None = None,
    ) -> list[list[ChangelogEvent] | RecordError]:
        """Per value, in order: its events (`[]` for a tombstone) or a DecodeError
        naming `topic[partition]@offset` and keeping the raw bytes."""
        out: list[list[ChangelogEvent] | RecordError] = []
        for index, value in enumerate(values):
            try:
                out.append(decode_envelope(value))
            except _BadEnvelope as bad:
                offset = offsets[index] if offsets is not None else index
                error = DecodeError(bad.reason, RecordSource(topic, partition, offset), detail=bad.detail, value=value)
                error.__cause__ = bad.__cause__
                out.append(error)
        return out


class _BadEnvelope(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


def decode_envelope(value: bytes | None) -> list[ChangelogEvent]:
    """The changelog events of one Debezium record value. Raises _BadEnvelope."""
    if value is None:
        return []
    try:
        envelope = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise _BadEnvelope(Reason.UNDECODABLE, f"not JSON: {exc}") from exc
    if envelope is None:
        return []
    if type(envelope) is not dict:
        raise _BadEnvelope(Reason.UNDECODABLE, f"not a JSON object but a JSON {type(envelope).__name__}")
    try:
        events = from_debezium(envelope)
    except ValueError as exc:
        raise _BadEnvelope(Reason.SCHEMA_MISMATCH, str(exc)) from exc
    for event in events:
        if not SYSTEM_COLUMNS.isdisjoint(event.row):
            clash = sorted(SYSTEM_COLUMNS.intersection(event.row))
            raise _BadEnvelope(Reason.SCHEMA_MISMATCH, f"the row has system columns {clash}; rename them in the source")
    return events
