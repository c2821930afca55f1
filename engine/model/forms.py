"""Converters between the stream forms of DESIGN.md §1, on `ChangelogEvent` sequences.

- **changelog**: all four ops; a `-C` is immediately followed by its `+C`.
- **retract**: `+A`/`-R` only. `to_retract` maps `-C`→`-R`, `+C`→`+A`;
  `from_retract` turns an adjacent `-R`, `+A` of one key back into `-C`, `+C`.
  Both keep the multiset of live rows.
- **upsert**: key → latest row, `None` (a tombstone) for a delete; meaningful for
  a stream with at most one live row per key. `to_upsert` / `from_upsert`.
- **Debezium** envelopes: `from_debezium`.

Keys are tuples of the `key` columns' values (`refold.model.changelog.key_of`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from refold.model.changelog import ChangelogEvent, Op, canonical_row, key_of

UpsertRecord = tuple[tuple[Any, ...], dict[str, Any] | None]

_TO_RETRACT = {Op.APPEND: Op.APPEND, Op.RETRACT: Op.RETRACT, Op.CORRECT_FROM: Op.RETRACT, Op.CORRECT_TO: Op.APPEND}


def to_retract(events: Iterable[ChangelogEvent]) -> list[ChangelogEvent]:
    """The retract form: `-C` becomes `-R`, `+C` becomes `+A`; rows and event times kept."""
    return [
        event if event.op is _TO_RETRACT[event.op] else ChangelogEvent(_TO_RETRACT[event.op], event.row, event.event_time)
        for event in events
    ]


def from_retract(events: Iterable[ChangelogEvent], key: Sequence[str]) -> list[ChangelogEvent]:
    """The changelog form of a retract stream: a `-R` immediately followed by an `+A`
    of the same key (the tuple of the `key` columns) becomes the pair `-C`, `+C`;
    every other event stays as it is. Events whose key is missing or null are never
    paired. (A `-C`/`+C` already in the input stays as it is too.)
    """
    out: list[ChangelogEvent] = []
    held: ChangelogEvent | None = None  # a -R that may start a pair
    held_key: tuple[Any, ...] | None = None
    for event in events:
        if held is not None:
            if event.op is Op.APPEND and _key_or_none(event.row, key) == held_key:
                out.append(ChangelogEvent(Op.CORRECT_FROM, held.row, held.event_time))
                out.append(ChangelogEvent(Op.CORRECT_TO, event.row, event.event_time))
                held = held_key = None
                continue
            out.append(held)
            held = held_key = None
        if event.op is Op.RETRACT:
            held_key = _key_or_none(event.row, key)
            if held_key is not None:
                held = event
                continue
        out.append(event)
    if held is not None:
        out.append(held)
    return out


def to_upsert(events: Iterable[ChangelogEvent], key: Sequence[str]) -> list[UpsertRecord]:
    """The upsert form: `(key, row)` for `+A`/`+C`, `(key, None)` (a tombstone) for
    `-R`; `-C` writes nothing (its `+C` overwrites the key). One record per event,
    in order: compaction keeps the latest. Only a stream with at most one live
    row per key survives this: for others the upsert form keeps the last row.
    Raises KeyError/ValueError for a missing or null key column.
    """
    out: list[UpsertRecord] = []
    for event in events:
        if event.op is Op.CORRECT_FROM:
            continue
        out.append((key_of(event.row, key), dict(event.row) if event.op.adds else None))
    return out


def from_upsert(
    records: Iterable[UpsertRecord],
    key: Sequence[str],
    *,
    last: dict[tuple[Any, ...], Mapping[str, Any]] | None = None,
) -> list[ChangelogEvent]:
    """The changelog of an upsert stream, from the last row per key:

    - a row for a key not seen (or deleted) → `+A` row
    - a row for a key with a different last row → `-C` old, `+C` new
    - a row equal to the key's last row (canonical bytes) → nothing: upsert
      writes are idempotent, a repeated write changes no view
    - a tombstone for a key with a last row → `-R` old
    - a tombstone for an unknown key → nothing: compaction may have removed the
      rows before it, or it deletes a key that never existed

    `last` is the key → last row map; pass your own dict to convert a stream in
    chunks (it is updated in place). The converted events carry no event time.
    Raises ValueError when a row's key columns disagree with its record key.
    """
    state: dict[tuple[Any, ...], Mapping[str, Any]] = {} if last is None else last
    out: list[ChangelogEvent] = []
    for record_key, row in records:
        old = state.get(record_key)
        if row is None:
            if old is not None:
                del state[record_key]
                out.append(ChangelogEvent(Op.RETRACT, old))
            continue
        try:
            row_key = key_of(row, key)
        except KeyError as exc:
            raise ValueError(f"upsert record for key {record_key!r}: {exc.args[0]}") from exc
        if row_key != tuple(record_key):
            raise ValueError(f"upsert record for key {record_key!r} holds a row of key {row_key!r}")
        if old is None:
            out.append(ChangelogEvent(Op.APPEND, row))
        elif canonical_row(old) != canonical_row(row):
            out.append(ChangelogEvent(Op.CORRECT_FROM, old))
            out.append(ChangelogEvent(Op.CORRECT_TO, row))
        else:
            continue
        state[record_key] = row
    return out


def from_debezium(envelope: Mapping[str, Any] | None) -> list[ChangelogEvent]:
    """The changelog events of one Debezium change event (its value, JSON-decoded),
    with or without the top-level `payload` wrapper of the JSON converter's
    `schemas.enable=true`:

    - `c` (create), `r` (snapshot read) → `+A` after
    - `u` (update) → `-C` before, `+C` after
    - `d` (delete) → `-R` before
    - `None` or `{"payload": null}` (the tombstone Debezium writes after a delete)
      → no events

    `event_time` is the envelope's `ts_ms` (else `source.ts_ms`). Raises ValueError
    for another op (e.g. `t` truncate, `m` message) naming it, and for a missing
    `before`/`after` the op needs (an update or delete without `before` needs the
    source table to log full old rows, e.g. PostgreSQL `REPLICA IDENTITY FULL`).
    """
    if envelope is None:
        return []
    payload = envelope.get("payload")
    if payload is None and "payload" in envelope and "op" not in envelope:
        return []  # the tombstone, wrapped: {"schema": ..., "payload": null}
    body: Mapping[str, Any] = payload if isinstance(payload, Mapping) and "op" in payload else envelope
    op = body.get("op")
    event_time = _debezium_time(body)
    if op in ("c", "r"):
        return [ChangelogEvent(Op.APPEND, _image(body, "after", op), event_time)]
    if op == "u":
        return [
            ChangelogEvent(Op.CORRECT_FROM, _image(body, "before", op), event_time),
            ChangelogEvent(Op.CORRECT_TO, _image(body, "after", op), event_time),
        ]
    if op == "d":
        return [ChangelogEvent(Op.RETRACT, _image(body, "before", op), event_time)]
    if op is None:
        raise ValueError("not a Debezium change event: no 'op' field")
    raise ValueError(f"unsupported Debezium op {op!r} (only c, r, u, d carry row changes)")


def _image(body: Mapping[str, Any], which: str, op: str) -> dict[str, Any]:
    image = body.get(which)
    if not isinstance(image, Mapping):
        hint = " (the source must log full old rows, e.g. REPLICA IDENTITY FULL)" if which == "before" else ""
        raise ValueError(f"Debezium op {op!r} without its {which!r} row{hint}")
    return dict(image)


def _debezium_time(body: Mapping[str, Any]) -> int | None:
    ts = body.get("ts_ms")
    if ts is None:
        source = body.get("source")
        if isinstance(source, Mapping):
            ts = source.get("ts_ms")
    if ts is None:
        return None
    if not isinstance(ts, int) or isinstance(ts, bool):
        raise ValueError(f"Debezium ts_ms must be an integer, got {ts!r}")
    return ts


def _key_or_none(row: Mapping[str, Any], key: Sequence[str]) -> tuple[Any, ...] | None:
    try:
        return key_of(row, key)
    except (KeyError, ValueError):
        return None
