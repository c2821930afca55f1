"""Source `format: debezium-json`: envelopes to changelog events, bad envelopes as errors."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from refold.codecs import DebeziumJsonDecoder, OneEventPerRecord, source_decoder
from refold.config import parse_pipeline
from refold.errors import ConfigError, DecodeError, RecordError
from refold.model.changelog import ChangelogEvent, Op

ALICE = {"id": 1, "player_name": "Alice", "score": 100}
ALICE2 = {"id": 1, "player_name": "Alice", "score": 120}


def envelope(op: str, before: Any = None, after: Any = None, *, ts: int | None = 1_700_000_000_000,
             wrapped: bool = False) -> bytes:
    body: dict[str, Any] = {"op": op, "before": before, "after": after, "source": {"ts_ms": 5, "table": "scores"}}
    if ts is not None:
        body["ts_ms"] = ts
    if wrapped:  # the JSON converter with schemas.enable=true
        return orjson.dumps({"schema": {"type": "struct", "name": "scores.Envelope"}, "payload": body})
    return orjson.dumps(body)


def decode(*values: bytes | None) -> list[list[ChangelogEvent] | RecordError]:
    return DebeziumJsonDecoder().decode_records(list(values), list(range(10, 10 + len(values))), topic="cdc", partition=2)


@pytest.mark.parametrize("wrapped", [False, True])
def test_ops_map_to_changelog_events(wrapped: bool) -> None:
    ts = 1_700_000_000_000
    got = decode(
        envelope("r", after=ALICE, wrapped=wrapped),
        envelope("c", after={**ALICE, "id": 2, "player_name": "Bob"}, wrapped=wrapped),
        envelope("u", before=ALICE, after=ALICE2, wrapped=wrapped),
        envelope("d", before=ALICE2, wrapped=wrapped),
    )
    assert got == [
        [ChangelogEvent(Op.APPEND, ALICE, ts)],
        [ChangelogEvent(Op.APPEND, {**ALICE, "id": 2, "player_name": "Bob"}, ts)],
        [ChangelogEvent(Op.CORRECT_FROM, ALICE, ts), ChangelogEvent(Op.CORRECT_TO, ALICE2, ts)],
        [ChangelogEvent(Op.RETRACT, ALICE2, ts)],
    ]


def test_event_time_falls_back_to_source_ts_ms() -> None:
    (events,) = decode(envelope("c", after=ALICE, ts=None))
    assert isinstance(events, list) and events[0].event_time == 5


@pytest.mark.parametrize(
    "value",
    [None, b"null", orjson.dumps({"schema": {"type": "struct"}, "payload": None})],
    ids=["null value", "json null", "wrapped null payload"],
)
def test_tombstones_decode_to_no_events(value: bytes | None) -> None:
    assert decode(value) == [[]]


@pytest.mark.parametrize(
    ("value", "reason", "detail"),
    [
        (b"\x00\x01binary", "undecodable", "not JSON"),
        (b"[1, 2]", "undecodable", "JSON list"),
        (orjson.dumps({"before": None, "after": ALICE}), "schema mismatch", "no 'op'"),
        (envelope("t"), "schema mismatch", "unsupported Debezium op 't'"),
        (envelope("u", after=ALICE2), "schema mismatch", "REPLICA IDENTITY FULL"),
        (envelope("d"), "schema mismatch", "without its 'before'"),
        (envelope("c", after=None), "schema mismatch", "without its 'after'"),
        (envelope("c", after=ALICE, ts="yesterday"), "schema mismatch", "ts_ms must be an integer"),  # type: ignore[arg-type]
        (envelope("c", after={**ALICE, "op": "x"}), "schema mismatch", "system columns ['op']"),
    ],
)
def test_bad_envelopes_are_record_errors(value: bytes, reason: str, detail: str) -> None:
    (error,) = decode(value)
    assert isinstance(error, DecodeError)
    assert error.reason == reason
    assert detail in (error.detail or "")
    assert (error.source.topic, error.source.partition, error.source.offset) == ("cdc", 2, 10)
    assert error.value == value  # the raw bytes travel to the dead-letter topic


def test_a_batch_goes_on_past_bad_records() -> None:
    got = decode(b"{", envelope("c", after=ALICE), None)
    assert isinstance(got[0], RecordError) and got[0].source.offset == 10
    assert got[1] == [ChangelogEvent(Op.APPEND, ALICE, 1_700_000_000_000)]
    assert got[2] == []


def test_pipeline_format_selects_the_decoder() -> None:
    base = {"pipeline": "p", "view": {"key": ["id"], "columns": {"n": {"count": "*"}}}, "outputs": {"view": {"topic": "v"}}}
    debezium = parse_pipeline({**base, "source": {"topic": "cdc", "format": "debezium-json"}})
    assert isinstance(source_decoder(debezium), DebeziumJsonDecoder)
    jsonl = parse_pipeline({**base, "source": {"topic": "in"}})
    assert isinstance(source_decoder(jsonl), OneEventPerRecord)
    (events,) = source_decoder(jsonl).decode_records([b'{"op": "+A", "id": 1}'])
    assert events == [ChangelogEvent(Op.APPEND, {"id": 1})]
    with pytest.raises(ConfigError, match=r"source\.format"):
        parse_pipeline({**base, "source": {"topic": "cdc", "format": "debezium-avro"}})
