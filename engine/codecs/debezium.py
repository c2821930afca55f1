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

from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import orjson

from refold.codecs.base import BadRecord, SourceDecoder, json_object
from refold.model.changelog import SYSTEM_COLUMNS, ChangelogEvent
from refold.model.forms import debezium_time, from_debezium
from refold.model.reasons import Reason


class DebeziumJsonDecoder(SourceDecoder):
    """Decodes Debezium JSON values; one record gives zero, one or two events."""

    format: ClassVar[str] = "debezium-json"

    def _events_of(self, value: bytes | None) -> list[ChangelogEvent]:
        """The events of one Debezium record value (`[]` for a tombstone)."""
        envelope = None if value is None else json_object(value)
        if envelope is None:
            return []
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


class DebeziumChange(NamedTuple):
    """One Debezium change as the engine applies it (`refold.runtime.tables`): `kind`
    `c` (a create or a snapshot read), `u` or `d`; the `before` image as the event
    carries it (None when it has none: an update under PostgreSQL's default replica
    identity; key columns only for a delete there), the `after` image (c, u)."""

    kind: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    event_time: int | None


def debezium_change(value: bytes | None) -> DebeziumChange | None:
    """The change of one Debezium record value; None for a tombstone. Raises BadRecord
    (the reasons of `DebeziumJsonDecoder`, except that a missing `before` is allowed:
    the engine completes it from the key's last row)."""
    envelope = None if value is None else json_object(value)
    if envelope is None:
        return None
    payload = envelope.get("payload")
    if payload is None and "payload" in envelope and "op" not in envelope:
        return None  # the tombstone, wrapped
    body: Mapping[str, Any] = payload if isinstance(payload, Mapping) and "op" in payload else envelope
    op = body.get("op")
    if op not in ("c", "r", "u", "d"):
        detail = "not a Debezium change event: no 'op' field" if op is None else (
            f"unsupported Debezium op {op!r} (only c, r, u, d carry row changes)")
        raise BadRecord(Reason.SCHEMA_MISMATCH, detail)
    try:
        event_time = debezium_time(body)
    except ValueError as exc:
        raise BadRecord(Reason.SCHEMA_MISMATCH, str(exc)) from exc
    before = _image(body, "before", required=False)
    after = _image(body, "after", required=op != "d")
    return DebeziumChange("c" if op == "r" else op, before, after, event_time)


def _image(body: Mapping[str, Any], which: str, *, required: bool) -> dict[str, Any] | None:
    image = body.get(which)
    if image is None and not required:
        return None
    if not isinstance(image, Mapping):
        raise BadRecord(Reason.SCHEMA_MISMATCH, f"Debezium op {body.get('op')!r} without its {which!r} row")
    if not SYSTEM_COLUMNS.isdisjoint(image):
        clash = sorted(SYSTEM_COLUMNS.intersection(image))
        raise BadRecord(Reason.SCHEMA_MISMATCH, f"the row has system columns {clash}; rename them in the source")
    return dict(image)


def debezium_key(key: bytes | None) -> tuple[str] | None:
    """The identity of a Debezium record key (the table's key, with or without the
    converter's `schema`/`payload` envelope): its JSON object with sorted fields, as a
    one-element tuple; None for a record without a key (a table without one). Raises
    BadRecord."""
    if key is None:
        return None
    try:
        parsed = orjson.loads(key)
    except orjson.JSONDecodeError as exc:
        raise BadRecord(Reason.KEY_MISMATCH, f"the key is not JSON: {exc}") from exc
    if isinstance(parsed, dict) and set(parsed) == {"schema", "payload"}:
        parsed = parsed["payload"]
    if not isinstance(parsed, dict):
        raise BadRecord(Reason.KEY_MISMATCH, "the key is not a JSON object (Debezium keys a row by its table's key)")
    return (orjson.dumps(parsed, option=orjson.OPT_SORT_KEYS).decode(),)
