"""`P.state` records (`schemas/avro/state.avsc`): their values in Avro's binary
encoding, written and read by hand, and their record keys.

A view key's summary (`KEY_SUMMARY`) is keyed `[key]`, each of its distinct live rows
(`LIVE_ROW`) `[key, fingerprint hex]`, an upsert source's last row of a message key
(`LAST_ROW`, `refold.runtime.upsert`) `["u",key]`, all compact JSON; a tombstone (value None)
under a record key ends that summary or row, so the latest value of each record key
is the whole state (`restore` reads nothing else)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from refold.reduce.types import Tag
from refold.reduce.values import key_bytes

_KIND_BYTES = {"KEY_SUMMARY": b"\x00", "LIVE_ROW": b"\x02", "LAST_ROW": b"\x04"}  # enum index, zig-zag
_KINDS = ("KEY_SUMMARY", "LIVE_ROW", "LAST_ROW")


def encode_state(kind: str, key: tuple[Any, ...], count: int, values: Any, tags: Sequence[Tag]) -> bytes:
    """One `P.state` record in Avro's binary encoding of `schemas/avro/state.avsc`.

    Written by hand because the engine writes one or two of these per input event and
    fastavro's `schemaless_writer` costs ~10 µs a call here against ~3 µs for this;
    `tests/test_views.py` holds the bytes equal to fastavro's, and `decode_state`'s
    reading equal to fastavro's, for random records."""
    return state_value(kind, key_bytes(key), count, values, tags)


def state_value(kind: str, key_json: bytes, count: int, values: Any, tags: Sequence[Tag]) -> bytes:
    """`encode_state` with the key already as its JSON list (`key_bytes`): a batch's
    state records of one key share it with their record keys."""
    out = bytearray(_KIND_BYTES[kind])
    _string(out, key_json)
    _long(out, count)
    if values is None:
        out.append(0)  # union branch 0: null
    else:
        out.append(2)  # union branch 1 (zig-zag): string
        _string(out, orjson.dumps(values))
    if tags:
        _long(out, len(tags))
        for event_time, partition, offset in tags:
            _long(out, event_time)
            _long(out, partition)
            _long(out, offset)
    out.append(0)  # end of the array
    return bytes(out)


def _long(out: bytearray, value: int) -> None:
    """Avro int/long: zig-zag, then base-128 varint, low groups first."""
    n = (value << 1) ^ (value >> 63)
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _string(out: bytearray, data: bytes) -> None:
    """Avro string/bytes: the length, then the bytes."""
    _long(out, len(data))
    out += data


def decode_state(data: bytes) -> dict[str, Any]:
    """A `P.state` record (Avro binary of `schemas/avro/state.avsc`) with its JSON
    fields parsed. Read by hand, as `encode_state` writes: recovery reads one or two
    per live key. Raises ValueError when the bytes are not such a record."""
    try:
        kind, pos = _read_long(data, 0)
        size, pos = _read_long(data, pos)
        key = tuple(orjson.loads(data[pos : pos + size]))
        pos += size
        count, pos = _read_long(data, pos)
        branch, pos = _read_long(data, pos)
        values = None
        if branch:
            size, pos = _read_long(data, pos)
            values = orjson.loads(data[pos : pos + size])
            pos += size
        tags: list[Tag] = []
        block, pos = _read_long(data, pos)
        while block:
            if block < 0:  # a block with its size in bytes (other writers may do this)
                block = -block
                _size, pos = _read_long(data, pos)
            for _ in range(block):
                event_time, pos = _read_long(data, pos)
                partition, pos = _read_long(data, pos)
                offset, pos = _read_long(data, pos)
                tags.append((event_time, partition, offset))
            block, pos = _read_long(data, pos)
        if pos != len(data) or kind not in (0, 1, 2) or branch not in (0, 1):
            raise ValueError("not a state record")
    except (IndexError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"not a state record: {exc}") from exc
    return {"kind": _KINDS[kind], "key": key, "count": count, "values": values, "tags": tags}


def _read_long(data: bytes, pos: int) -> tuple[int, int]:
    """The Avro long at `pos` and the position after it; IndexError past the end."""
    byte = data[pos]
    pos += 1
    n = byte & 0x7F
    shift = 7
    while byte & 0x80:
        byte = data[pos]
        pos += 1
        n |= (byte & 0x7F) << shift
        shift += 7
    return (n >> 1) ^ -(n & 1), pos


def row_key(key_json: bytes, fp: bytes) -> bytes:
    """The `P.state` record key of a live row: `[key, fp hex]` as JSON (`key_json` is
    `key_bytes(key)`; orjson writes no spaces, so this is `orjson.dumps([list(key), fp.hex()])`)."""
    return b"[" + key_json + b',"' + fp.hex().encode() + b'"]'


def row_fingerprint(record_key: bytes) -> bytes:
    """The row fingerprint a live row's record key (`row_key`) names."""
    return bytes.fromhex(orjson.loads(record_key)[1])


def last_row_key(key_json: bytes) -> bytes:
    """The `P.state` record key of an upsert source's last row of one message key:
    `["u",key]` as JSON (no view key's record key starts `["`: those start `[[`)."""
    return b'["u",' + key_json + b"]"


def summary_key(key_json: bytes) -> bytes:
    """The `P.state` record key of a key's summary: `[key]` as JSON."""
    return b"[" + key_json + b"]"
