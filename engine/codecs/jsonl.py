"""Format `jsonl`: one JSON object per record value.

An event is `{"op": ..., "event_time": ..., ...row}`: `op` as its code (`"+A"`)
or its number (`0`, `"0"`); `event_time` optional, epoch ms or an ISO-8601 string
(converted to ms; UTC when it has no offset). The output system columns `offset`
and `system_time` are dropped on input. Bad values decode to the reasons of
`refold.codecs.base`.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, Final

import orjson

from refold.codecs.base import BadRecord, Codec, check_row
from refold.errors import InvalidEventError
from refold.model.changelog import ChangelogEvent, Op
from refold.model.reasons import Reason

_MISSING: Final = object()
_OPS: Final[dict[object, Op]] = {
    **{op.code: op for op in Op},
    **{int(op): op for op in Op},
    **{str(int(op)): op for op in Op},
}
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_MS: Final = timedelta(milliseconds=1)


def event_time_from_iso(text: str) -> int:
    """Epoch milliseconds of an ISO-8601 date-time (UTC when it has no offset),
    truncated to the millisecond. Raises ValueError."""
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - _EPOCH) // _ONE_MS


class JsonlCodec(Codec):
    """One JSON object per record value: `op` (code or number), optional
    `event_time` (epoch ms, or an ISO-8601 string, converted to ms), row columns.

    Fields `offset` and `system_time` are output system columns: dropped on input.
    `encode` writes `op` as its code, then `event_time` (when set), then the row.
    A bool is not an op (`true` is `op out of range`), nor an event time.
    """

    format: ClassVar[str] = "jsonl"

    def _events_of(self, value: bytes | None) -> list[ChangelogEvent]:
        if value is None:
            raise BadRecord.tombstone()
        try:
            record = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise BadRecord(Reason.UNDECODABLE, f"not JSON: {exc}") from exc
        if type(record) is not dict:
            raise BadRecord(Reason.UNDECODABLE, f"not a JSON object but a JSON {type(record).__name__}")
        raw_op = record.pop("op", _MISSING)
        kind = type(raw_op)
        op = _OPS.get(raw_op) if kind is str or kind is int else None
        if op is None:
            if raw_op is _MISSING:
                raise BadRecord(Reason.SCHEMA_MISMATCH, "missing field 'op'")
            raise BadRecord(
                Reason.OP_OUT_OF_RANGE, f"op must be one of +A, -R, -C, +C or 0..3, got {raw_op!r}", InvalidEventError
            )
        event_time = record.pop("event_time", None)
        if event_time is not None and type(event_time) is not int:
            event_time = _json_event_time(event_time)
        if "offset" in record or "system_time" in record:
            record.pop("offset", None)
            record.pop("system_time", None)
        return [ChangelogEvent(op, record, event_time)]

    def encode(self, event: ChangelogEvent) -> bytes:
        check_row(event)
        record: dict[str, Any] = {"op": event.op.code}
        if event.event_time is not None:
            record["event_time"] = event.event_time
        record.update(event.row)
        try:
            return orjson.dumps(record)
        except orjson.JSONEncodeError as exc:
            raise ValueError(f"the event's row is not JSON: {exc}") from exc


def _json_event_time(value: object) -> int:
    """The event time of a non-integer JSON `event_time` (the error path but for ISO strings)."""
    if isinstance(value, str):
        try:
            return event_time_from_iso(value)
        except ValueError as exc:
            raise BadRecord(Reason.SCHEMA_MISMATCH, f"event_time is not ISO-8601: {value!r}") from exc
    raise BadRecord(
        Reason.SCHEMA_MISMATCH,
        f"event_time must be epoch milliseconds (an integer) or an ISO-8601 string, got {value!r}",
    )
