"""Values and keys, as every reducer (and `refold.reference`) sees them: row identity,
the order of output keys and of column values, key and column checks, exact sums,
and view changes as the difference of two rows.

Most of these run once or more per event: keep them free of per-call set-up."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from refold.model import jsonbytes
from refold.model.changelog import Op, canonical_row, legacy_canonical_row
from refold.model.reasons import Reason
from refold.reduce.types import Number, Rejected, ViewChange


def fingerprint(row: dict[str, Any]) -> bytes:
    """16 bytes naming a distinct row (equal rows ⇔ equal canonical bytes)."""
    return hashlib.blake2b(canonical_row(row), digest_size=16).digest()


def live_fingerprint(row: dict[str, Any], fp: bytes, live: Mapping[bytes, Any]) -> bytes:
    """The fingerprint under which `live` (a key's live rows) holds `row`: `fp`, or, for
    a row with null columns that is not held under it, the fingerprint it had before a
    null column equalled an absent one, when `live` holds it under that (state restored
    from records written then)."""
    if fp in live:
        return fp
    legacy = legacy_canonical_row(row)
    if legacy is not None:
        old = hashlib.blake2b(legacy, digest_size=16).digest()
        if old in live:
            return old
    return fp


def key_bytes(key: tuple[Any, ...]) -> bytes:
    """The order of output keys within a unit: their canonical JSON list bytes."""
    return jsonbytes.dumps(list(key))


def same_row(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Equal as rows are (canonical bytes: `1` and `1.0` differ); None equals only None."""
    if a is None or b is None:
        return a is b
    return canonical_row(a) == canonical_row(b)


def diff_changes(
    old: dict[str, Any] | None, new: dict[str, Any] | None, key: tuple[Any, ...], names: tuple[str, ...]
) -> list[ViewChange]:
    """The view records for one output key going from `old` to `new`."""
    if old is None:
        return [] if new is None else [ViewChange(Op.APPEND, key, new, names)]
    if new is None:
        return [ViewChange(Op.RETRACT, key, old, names)]
    if same_row(old, new):
        return []
    return [ViewChange(Op.CORRECT_FROM, key, old, names), ViewChange(Op.CORRECT_TO, key, new, names)]


def compact_changes(changes: Sequence[ViewChange]) -> list[ViewChange]:
    """`emit: per_batch`: per output key, the row before the batch against the row after it."""
    first: dict[tuple[Any, ...], tuple[dict[str, Any] | None, tuple[str, ...]]] = {}
    last: dict[tuple[Any, ...], dict[str, Any] | None] = {}
    for change in changes:
        if change.key not in first:
            before = None if change.op is Op.APPEND else change.row
            first[change.key] = (before, change.key_names)
        last[change.key] = change.row if change.op.adds else None
    out: list[ViewChange] = []
    for key in sorted(first, key=key_bytes):
        before, names = first[key]
        out.extend(diff_changes(before, last[key], key, names))
    return out


def exact(value: Number, floats: int) -> int | float:
    """An exact running sum as its output number (SEMANTICS.md: numbers are exact)."""
    return float(value) if floats else int(value)


def is_number(value: Any) -> bool:
    """An int or a float; not a bool, though Python counts it an int."""
    return type(value) is int or type(value) is float


MAX_KEY_CHARS = 64 * 1024  # a longer key is refused ("key too large"): outputs repeat it
_SCALARS = (str, int, float, bool)


def value_order(value: Any) -> tuple[int, Any]:
    """The total order of column values for min, max, set and Top-N (SEMANTICS.md):
    numbers, then strings, then booleans — so mixed types never fail to compare."""
    kind = type(value)
    if kind is int or kind is float:
        return (0, value)
    if kind is str:
        return (1, value)
    return (2, orjson.dumps(value))


def key_problem(parts: tuple[Any, ...]) -> tuple[str, str] | None:
    """Why key values cannot key a view (reason, detail), or None. Nulls are checked apart."""
    chars = 0
    for part in parts:
        if type(part) is str:
            chars += len(part)
        elif type(part) not in _SCALARS:
            return Reason.SCHEMA_MISMATCH, "a key column holds a list or an object"
    if chars > MAX_KEY_CHARS:
        return Reason.KEY_TOO_LARGE, f"{chars} characters, at most {MAX_KEY_CHARS}"
    return None


def checked_key(
    row: dict[str, Any], columns: Sequence[str], what: str, scalar_columns: Sequence[str], index: int
) -> tuple[Any, ...]:
    """The key of `row` over `columns`; Rejected (at `index` of its unit) when a key column
    is missing or null, not a scalar or too large, or one of `scalar_columns` holds a list
    or an object."""
    try:
        key = tuple(row[c] for c in columns)
    except KeyError as exc:
        raise Rejected(Reason.NULL_KEY, index, f"{what} column {exc.args[0]!r} is missing") from None
    if None in key:
        raise Rejected(Reason.NULL_KEY, index)
    problem = key_problem(key)
    if problem is not None:
        raise Rejected(problem[0], index, problem[1])
    detail = scalar_problem(row, scalar_columns)
    if detail is not None:
        raise Rejected(Reason.SCHEMA_MISMATCH, index, detail)
    return key


def scalar_problem(row: dict[str, Any], columns: Sequence[str]) -> str | None:
    """The detail when one of `columns` (ordered or counted by value) is a list or an object."""
    for column in columns:
        value = row.get(column)
        if value is not None and type(value) not in _SCALARS:
            return f"{column!r} holds a list or an object"
    return None
