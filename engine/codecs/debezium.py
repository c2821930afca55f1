"""Source `format: debezium-json`: Debezium change events as changelog events.

A Debezium record value (JSON converter, with or without the `payload` wrapper
of `schemas.enable=true`) becomes the events of `refold.model.forms.from_debezium`
(DESIGN.md §1): `c`/`r` → `+A` after; `u` → `-C` before, `+C` after; `d` →
`-R` before. An update is one input record but two events: the pair shares the
record's partition and offset, so nothing can come between them.

A null value, or `{"schema": …, "payload": null}`, is the tombstone Debezium
writes after a delete for log compaction: it carries no change, so it decodes to
no events (the engine skips and counts it); it is not a bad record.

Failures, with their dead-letter reason (always a `DecodeError`):

| reason | when |
|---|---|
| `undecodable` | not JSON, or not a JSON object |
| `schema mismatch` | no `op`, an op other than c/r/u/d, a missing `before`/`after` image, a non-integer `ts_ms`, an image that is not an object or that has a system column (`op`, `event_time`, ...) |
"""

from __future__ import annotations

from typing import ClassVar

import orjson

from refold.codecs.base import BadRecord, SourceDecoder
from refold.model.changelog import SYSTEM_COLUMNS, ChangelogEvent
from refold.model.forms import from_debezium
from refold.model.reasons import Reason


class DebeziumJsonDecoder(SourceDecoder):
    """Decodes Debezium JSON values; one record gives zero, one or two events."""

    format: ClassVar[str] = "debezium-json"

    def _events_of(self, value: bytes | None) -> list[ChangelogEvent]:
        """The events of one Debezium record value (`[]` for a tombstone)."""
        if value is None:
            return []
        try:
            envelope = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise BadRecord(Reason.UNDECODABLE, f"not JSON: {exc}") from exc
        if envelope is None:
            return []
        if type(envelope) is not dict:
            raise BadRecord(Reason.UNDECODABLE, f"not a JSON object but a JSON {type(envelope).__name__}")
        try:
            events = from_debezium(envelope)
        except ValueError as exc:
            raise BadRecord(Reason.SCHEMA_MISMATCH, str(exc)) from exc
        for event in events:
            if not SYSTEM_COLUMNS.isdisjoint(event.row):
                clash = sorted(SYSTEM_COLUMNS.intersection(event.row))
                raise BadRecord(
                    Reason.SCHEMA_MISMATCH, f"the row has system columns {clash}; rename them in the source"
                )
        return events
