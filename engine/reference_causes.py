"""The reference of provenance: each record of a view's changelog with its cause, from
the reference reducer (`refold.reference`) and nothing of the engine's.

The rules (docs/SEMANTICS.md, "Provenance"): every record a unit writes names the
unit's cause — its first event's source partition and offset (a correction pair's
`-C`), whatever the view: a session view's unit that extends, merges or splits sessions,
an `emit: final` unit whose watermark advance closes windows; a `-R`/`-C` also names the cause of the record it takes back, which is the
cause of the latest `+A`/`+C` written for its output key. Here that is read off the
changelog itself, unit by unit: no per-key state of the engine's is involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from refold.config import ViewSpec
from refold.model.changelog import Op
from refold.reduce import SourceEvent, ViewChange
from refold.reference import ReferenceResult, _model_of, _step

Cause = tuple[int, int]


class CausedChange(NamedTuple):
    change: ViewChange
    cause: Cause
    retracts: Cause | None  # for a -R/-C: the cause of the record it takes back


def reference_causes(spec: ViewSpec, units: Sequence[Sequence[SourceEvent]],
                     emit: str = "per_event") -> list[CausedChange]:
    """One shard's units (in input order) → its view changelog, each change with its
    cause and retracted cause. Refused units write nothing. With `emit: final` (a
    windowed view) a window's `+A` is written by the unit whose watermark advance closed
    it, and names that unit's cause, as every record of a unit does."""
    model = _model_of(spec, emit)
    result = ReferenceResult()
    latest: dict[tuple[Any, ...], Cause] = {}  # output key -> the cause of its latest +A/+C
    out: list[CausedChange] = []
    for index, unit in enumerate(units):
        done = len(result.changes)
        if not _step(model, unit, index, result):
            continue
        cause = (unit[0].tag[1], unit[0].tag[2])
        for change in result.changes[done:]:
            retracts = None if change.op.adds else latest.get(change.key)
            if change.op.adds:
                latest[change.key] = cause
            out.append(CausedChange(change, cause, retracts))
    return out


def in_form(changes: Sequence[CausedChange], form: str) -> list[tuple[Op | None, CausedChange]]:
    """The records of an output form (docs/SEMANTICS.md): `changelog` as is; `retract`
    with each unit's retractions first; `upsert` without `-C` (a tombstone for `-R`:
    op None). Each with the op it is written as."""
    if form == "changelog":
        return [(c.change.op, c) for c in changes]
    if form == "upsert":
        return [(None if c.change.op is Op.RETRACT else Op.APPEND, c)
                for c in changes if c.change.op is not Op.CORRECT_FROM]
    out: list[tuple[Op | None, CausedChange]] = []
    at = 0
    while at < len(changes):  # a unit's changes: the same cause, one after the other
        end = at
        while end < len(changes) and changes[end].cause == changes[at].cause:
            end += 1
        unit = changes[at:end]
        ordered = [c for c in unit if not c.change.op.adds] + [c for c in unit if c.change.op.adds]
        out += [(Op.APPEND if c.change.op.adds else Op.RETRACT, c) for c in ordered]
        at = end
    return out


def headers_of(caused: CausedChange) -> list[tuple[str, bytes]]:
    """The cause headers the engine writes on the record."""
    headers = [("refold.cause", b"%d:%d" % caused.cause)]
    if caused.retracts is not None:
        headers.append(("refold.retracts", b"%d:%d" % caused.retracts))
    return headers
