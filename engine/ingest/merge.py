"""The merge strategies (Open Data Fabric's): input rows + the topic's live rows → the
changelog that means them. Pure functions of their inputs, no Kafka: the ingest
(`refold.ingest.run`) feeds them the folded topic and writes what they yield.

| strategy | per input row | at the end |
|---|---|---|
| `snapshot`, primary key | new key `+A`; changed row `-C` old `+C` new; unchanged nothing | a live key absent from the snapshot `-R` old |
| `snapshot`, no key | — (a multiset diff by whole rows) | per distinct row, `+A` (new copies - live copies) times, or `-R` (live - new) times |
| `ledger` | a new key `+A`; a known key nothing (other values: a conflict, reported, not applied) | — |
| `upsert` | no row `+A`; another row `-C` old `+C` new; the same row nothing; deleted `-R` old | — |
| `append` | `+A` | — |

A snapshot's changes come in group-key order (the sorted message keys); the
others in input order. Bad input raises `BadInput` naming the file and line/row;
since the changes are spooled before anything is written, nothing is written.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from refold.errors import UserError
from refold.ingest.live import LiveRows, Row, Table, group_of
from refold.model.changelog import Op, canonical_row

STRATEGIES = ("snapshot", "ledger", "upsert", "append")


class BadInput(UserError):
    """An input row an ingest cannot take; `where` is its file and line or row."""

    def __init__(self, where: str, problem: str) -> None:
        self.where = where
        self.problem = problem
        super().__init__(f"{where}: {problem}; nothing written")


class TopicNotKeyed(UserError):
    """The topic holds more than one live row for a primary key."""


@dataclass(frozen=True, slots=True)
class InputRow:
    """One row of the input: its columns (JSON values), where it is (`file:line`), its
    event time (epoch ms), and whether it marks its key deleted (upsert)."""

    row: Row
    where: str
    event_time: int | None = None
    deleted: bool = False


@dataclass(frozen=True, slots=True)
class Change:
    """One changelog event to write: `group` is its message key; `after` the number of
    input rows whose changes are all written once this one is (the streaming
    strategies; None for a snapshot, which is recomputed whole on a rerun)."""

    op: Op
    row: Row
    event_time: int | None
    group: bytes
    after: int | None = None


def _group(item: InputRow, key_columns: Sequence[str]) -> bytes:
    group = group_of(item.row, key_columns)
    if group is None:
        missing = [c for c in key_columns if item.row.get(c) is None]
        what = "missing" if any(c not in item.row for c in missing) else "null"
        raise BadInput(item.where, f"primary key column {missing[0]!r} is {what}")
    return group


def _single(live: LiveRows, group: bytes, copies: list[Row]) -> Row | None:
    if len(copies) > 1:
        raise TopicNotKeyed(
            f"the topic holds {len(copies)} live rows for primary key {group.decode()}: "
            "an ingest by primary key needs at most one (retract the extra copies first)"
        )
    return copies[0] if copies else None


def differs(old: Row, new: Row, compare_columns: Sequence[str] | None) -> bool:
    """Whether `new` changes `old`: on `compare_columns` only when given (a null column
    equals an absent one), else on the whole row (`canonical_row`)."""
    if compare_columns:
        return any(
            orjson.dumps(old.get(c), option=orjson.OPT_SORT_KEYS) != orjson.dumps(new.get(c), option=orjson.OPT_SORT_KEYS)
            for c in compare_columns
        )
    return canonical_row(old) != canonical_row(new)


def _merge_join(
    left: Iterator[tuple[bytes, Any]], right: Iterator[tuple[bytes, Any]]
) -> Iterator[tuple[bytes, Any, Any]]:
    """(key, left value or None, right value or None) over two iterators sorted by key."""
    a, b = next(left, None), next(right, None)
    while a is not None or b is not None:
        if b is None or (a is not None and a[0] < b[0]):
            assert a is not None
            yield a[0], a[1], None
            a = next(left, None)
        elif a is None or b[0] < a[0]:
            yield b[0], None, b[1]
            b = next(right, None)
        else:
            yield a[0], a[1], b[1]
            a, b = next(left, None), next(right, None)


def snapshot(live: LiveRows, rows: Iterable[InputRow], scratch: Table, *, now: int,
             compare_columns: Sequence[str] | None = None) -> Iterator[Change]:
    """The changelog that turns the live rows into the snapshot `rows`."""
    key_columns = live.key_columns
    if not key_columns:
        if compare_columns:
            raise UserError("--compare-columns needs --primary-key (without one, rows compare whole)")
        yield from _multiset_snapshot(live, rows, scratch, now=now)
        return
    # staged per key: [where, event time] as JSON, a newline (never inside that JSON), the row as JSON
    for item in rows:
        group = _group(item, key_columns)
        seen = scratch.get(group)
        if seen is not None:
            first = orjson.loads(seen.split(b"\n", 1)[0])[0]
            raise BadInput(item.where, f"primary key {group.decode()} appears twice in the snapshot (first at {first})")
        scratch.put(group, orjson.dumps([item.where, item.event_time]) + b"\n" + orjson.dumps(item.row))
    for group, stored, staged in _merge_join(live.encoded_groups(), scratch.items()):
        if stored is not None and staged is not None and stored == b"[" + staged.split(b"\n", 1)[1] + b"]":
            continue  # one live row, the same JSON as the snapshot's: unchanged
        old = _single(live, group, orjson.loads(stored)) if stored is not None else None
        if staged is None:
            assert old is not None
            yield Change(Op.RETRACT, old, now, group)
            continue
        head, encoded = staged.split(b"\n", 1)
        event_time, new = orjson.loads(head)[1], orjson.loads(encoded)
        if old is None:
            yield Change(Op.APPEND, new, event_time, group)
        elif differs(old, new, compare_columns):
            yield Change(Op.CORRECT_FROM, old, event_time, group)
            yield Change(Op.CORRECT_TO, new, event_time, group)


def _multiset_snapshot(live: LiveRows, rows: Iterable[InputRow], scratch: Table, *,
                       now: int) -> Iterator[Change]:
    for item in rows:
        group = canonical_row(item.row)
        seen = scratch.get(group)
        count = orjson.loads(seen)[0] if seen is not None else 0
        first = orjson.loads(seen)[1:] if seen is not None else [item.event_time, item.row]
        scratch.put(group, orjson.dumps([count + 1, *first]))
    for group, copies, staged in _merge_join(live.groups(), scratch.items()):
        have = copies or []
        want, event_time, new = orjson.loads(staged) if staged is not None else (0, now, None)
        for _ in range(want - len(have)):
            yield Change(Op.APPEND, new, event_time, group)
        for old in have[want:]:
            yield Change(Op.RETRACT, old, now, group)


def ledger(live: LiveRows, rows: Iterable[InputRow], scratch: Table,
           conflicts: list[str], *, skipped: int = 0) -> Iterator[Change]:
    """`+A` for each row whose key is new; a known key's row again is nothing, with
    other values a conflict (appended to `conflicts`, not applied)."""
    key_columns = live.key_columns
    if not key_columns:
        raise UserError("--merge ledger needs --primary-key")
    for index, item in enumerate(rows, start=skipped):
        group = _group(item, key_columns)
        staged = scratch.get(group)
        known = orjson.loads(staged)[1] if staged is not None else _single(live, group, live.copies(group))
        if known is None:
            scratch.put(group, orjson.dumps([item.where, item.row]))
            yield Change(Op.APPEND, item.row, item.event_time, group, index + 1)
        elif canonical_row(known) != canonical_row(item.row):
            first = f" (first at {orjson.loads(staged)[0]})" if staged is not None else " (in the topic)"
            conflicts.append(f"{item.where}: primary key {group.decode()} is already in the ledger with "
                             f"other values{first}; not applied")


def upsert(live: LiveRows, rows: Iterable[InputRow], scratch: Table, *,
           skipped: int = 0) -> Iterator[Change]:
    """Each row replaces its key's row; a row marked deleted retracts it. (`skipped`:
    input rows a resumed ingest already wrote, for the changes' `after`.)"""
    key_columns = live.key_columns
    if not key_columns:
        raise UserError("--merge upsert needs --primary-key")
    for index, item in enumerate(rows, start=skipped):
        group = _group(item, key_columns)
        staged = scratch.get(group)
        if staged is not None:
            current = orjson.loads(staged)
        else:
            current = _single(live, group, live.copies(group))
        after = index + 1
        if item.deleted:
            if current is not None:
                yield Change(Op.RETRACT, current, item.event_time, group, after)
            scratch.put(group, b"null")
            continue
        if current is None:
            yield Change(Op.APPEND, item.row, item.event_time, group, after)
        elif canonical_row(current) != canonical_row(item.row):
            yield Change(Op.CORRECT_FROM, current, item.event_time, group, None)
            yield Change(Op.CORRECT_TO, item.row, item.event_time, group, after)
        scratch.put(group, orjson.dumps(item.row))


def append(key_columns: Sequence[str], rows: Iterable[InputRow], *, skipped: int = 0) -> Iterator[Change]:
    """`+A` for every row."""
    for index, item in enumerate(rows, start=skipped):
        group = _group(item, key_columns) if key_columns else canonical_row(item.row)
        yield Change(Op.APPEND, item.row, item.event_time, group, index + 1)
