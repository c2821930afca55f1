"""Equi-joins of two changelogs (`view.join`): the incremental reducer (docs/SEMANTICS.md,
Joins; `refold.reference_joins` is the model it is tested against).

State, per join key: each side's live rows as fingerprint (of the whole row) →
(copies, the row's columns that the output takes). The reducer holds only the join
keys a shard's batches touched; the rest is in the shard's store, one `P.state`
record per distinct live row of a side (`LIVE_ROW`, record key
`["j",key,"l"|"r",fp]`, values `{"s": "l"|"r", "r": row}`; a tombstone when its last
copy goes). `["j",` keeps them apart from a view's records (`[[`) and an upsert
source's last rows (`["u",`), so a join and the view over it may share a store. The
caller loads a key's records with `store.load_keys([state_prefix(key)])`.

A unit is one event or a `-C`/`+C` pair of one side: `apply(side, unit)`. An event
changes the join output only at its join key: against each live row of the other side
there, one joined row per pair of copies; an outer side's row with no match there is
joined with nulls. Per event the work is the number of matching rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from refold.config import JoinSpec
from refold.model.changelog import Op, canonical_row
from refold.model.reasons import Reason
from refold.reduce.statecodec import decode_state, state_value
from refold.reduce.types import Rejected, SourceEvent, ViewChange
from refold.reduce.values import fingerprint, key_bytes, key_problem

_SIDE_NAMES = ("l", "r")
_SIDE_TAGS = (b'"l"', b'"r"')
JOIN_RECORD_FIRST = b'["j",'  # every join state record key starts with it


def state_prefix(key: tuple[Any, ...]) -> bytes:
    """What `ShardStore.load_keys` takes to load one join key's records (both sides)."""
    return b'"j",' + key_bytes(key)


class _Live:
    """The live copies of one distinct row of a side under one join key."""

    __slots__ = ("count", "row")

    def __init__(self, count: int, row: dict[str, Any]) -> None:
        self.count = count
        self.row = row


class JoinReducer:
    """An equi-join of two changelogs: inner, left outer or full outer."""

    def __init__(self, spec: JoinSpec) -> None:
        self.spec = spec
        self.on = spec.sides_on
        self.outputs = spec.outputs
        self.key_names = tuple(spec.output_key)
        self.outer = (spec.type in ("left", "full"), spec.type == "full")
        # the columns of each side a joined row takes: all a live row keeps (its identity
        # is the fingerprint of the whole row, taken before)
        self.kept = tuple(tuple(dict.fromkeys(c for _, s, c in self.outputs if s == side)) for side in (0, 1))
        # per side: join key bytes -> fingerprint -> live copies
        self.sides: tuple[dict[bytes, dict[bytes, _Live]], dict[bytes, dict[bytes, _Live]]] = ({}, {})
        self.totals: tuple[dict[bytes, int], dict[bytes, int]] = ({}, {})
        self._dirty: set[tuple[int, bytes, bytes]] = set()

    # apply ------------------------------------------------------------------------------

    def join_key(self, side: int, row: dict[str, Any], index: int = 0) -> tuple[Any, ...]:
        """The row's join key (a missing column is null); Rejected when a join column
        holds a list or an object, or is too large."""
        key = tuple(row.get(column) for column in self.on[side])
        problem = key_problem(tuple(part for part in key if part is not None))
        if problem is not None:
            raise Rejected(problem[0], index, problem[1])
        return key

    def state_key(self, side: int, event: SourceEvent) -> tuple[Any, ...] | None:
        """The join key whose state `apply` reads for the event (None: it is refused anyway)."""
        try:
            return self.join_key(side, event.row)
        except Rejected:
            return None

    def apply(self, side: int, unit: Sequence[SourceEvent]) -> list[ViewChange]:
        """Apply one unit of one side (0 left, 1 right); its join records in order.
        Raises Rejected (state unchanged) when it retracts a row the side does not hold."""
        prepared = []
        pending: dict[tuple[bytes, bytes], int] = {}
        for index, event in enumerate(unit):
            key = self.join_key(side, event.row, index)
            kb = key_bytes(key)
            fp = fingerprint(event.row)
            have = pending.get((kb, fp))
            if have is None:
                entry = self.sides[side].get(kb, {}).get(fp)
                have = entry.count if entry is not None else 0
            step = 1 if event.op.adds else -1
            if have + step < 0:
                raise Rejected(Reason.NOT_LIVE, index)
            pending[(kb, fp)] = have + step
            prepared.append((event, key, kb, fp))
        net: dict[bytes, list[Any]] = {}  # output row identity -> [row, copies added - removed]
        for event, key, kb, fp in prepared:
            self._event(side, key, kb, fp, event.row, 1 if event.op.adds else -1, net)
        paired = len(unit) == 2 and unit[0].op is Op.CORRECT_FROM
        return self._changes(net, paired)

    def _event(self, side: int, key: tuple[Any, ...], kb: bytes, fp: bytes, row: dict[str, Any],
               sign: int, net: dict[bytes, list[Any]]) -> None:
        other = 1 - side
        matches = self.sides[other].get(kb) if None not in key else None
        total = self.totals[side].get(kb, 0)
        if matches:
            for live in matches.values():
                self._emit(side, row, live.row, sign * live.count, net)
            # the other side's rows lose their null-padded row on this side's first
            # copy, and get it back when its last goes
            if self.outer[other] and total + min(sign, 0) == 0:
                for live in matches.values():
                    self._emit(other, live.row, None, -sign * live.count, net)
        elif self.outer[side]:
            self._emit(side, row, None, sign, net)
        self._store(side, key, kb, fp, row, sign)

    def _store(self, side: int, key: tuple[Any, ...], kb: bytes, fp: bytes, row: dict[str, Any], sign: int) -> None:
        rows = self.sides[side].setdefault(kb, {})
        entry = rows.get(fp)
        if entry is None:
            entry = rows[fp] = _Live(0, {c: row[c] for c in self.kept[side] if c in row})
        entry.count += sign
        if entry.count == 0:
            del rows[fp]
            if not rows:
                del self.sides[side][kb]
        total = self.totals[side].get(kb, 0) + sign
        if total:
            self.totals[side][kb] = total
        else:
            self.totals[side].pop(kb, None)
        self._dirty.add((side, kb, fp))

    def _emit(self, side: int, row: dict[str, Any], other: dict[str, Any] | None, copies: int,
              net: dict[bytes, list[Any]]) -> None:
        """Count `copies` of the joined row of `row` (of `side`) with `other` (None: nulls)."""
        pair = (row, other) if side == 0 else (other, row)
        out = {name: (None if pair[s] is None else pair[s].get(column)) for name, s, column in self.outputs}  # type: ignore[union-attr]
        identity = canonical_row(out)
        held = net.get(identity)
        if held is None:
            net[identity] = [out, copies]
        else:
            held[1] += copies

    def _changes(self, net: dict[bytes, list[Any]], paired: bool) -> list[ViewChange]:
        """The unit's records from its net change (docs/SEMANTICS.md, Joins: their order)."""
        names = self.key_names
        if len(net) == 1:  # most units: one joined row added or removed
            ((row, copies),) = net.values()
            if not copies:
                return []
            key = tuple(row[name] for name in names)
            op = Op.APPEND if copies > 0 else Op.RETRACT
            return [ViewChange(op, key, row, names)] * abs(copies)
        keys: dict[bytes, tuple[Any, ...]] = {}
        gone: dict[bytes, list[tuple[bytes, dict[str, Any]]]] = {}
        came: dict[bytes, list[tuple[bytes, dict[str, Any]]]] = {}
        for identity, (row, copies) in net.items():
            if not copies:
                continue
            key = tuple(row[name] for name in names)
            order = key_bytes(key)
            keys[order] = key
            into = came if copies > 0 else gone
            into.setdefault(order, []).extend([(identity, row)] * abs(copies))
        out: list[ViewChange] = []
        for order in sorted(keys):
            key = keys[order]
            olds = sorted(gone.get(order, ()), key=_first)
            news = sorted(came.get(order, ()), key=_first)
            pairs = min(len(olds), len(news)) if paired else 0
            for (_, old), (_, new) in zip(olds[:pairs], news[:pairs], strict=True):
                out.append(ViewChange(Op.CORRECT_FROM, key, old, names))
                out.append(ViewChange(Op.CORRECT_TO, key, new, names))
            out.extend(ViewChange(Op.RETRACT, key, old, names) for _, old in olds[pairs:])
            out.extend(ViewChange(Op.APPEND, key, new, names) for _, new in news[pairs:])
        return out

    # batch boundaries ----------------------------------------------------------------------

    def take_deltas(self) -> list[dict[str, Any]]:
        """A join has no delta output (its rows are not reduced)."""
        return []

    def take_state_changes(self) -> list[tuple[bytes, bytes | None]]:
        records: list[tuple[bytes, bytes | None]] = []
        for side, kb, fp in self._dirty:
            record_key = JOIN_RECORD_FIRST + kb + b"," + _SIDE_TAGS[side] + b',"' + fp.hex().encode() + b'"]'
            entry = self.sides[side].get(kb, {}).get(fp)
            if entry is None:
                records.append((record_key, None))
            else:
                values = {"s": _SIDE_NAMES[side], "r": entry.row}
                records.append((record_key, state_value("LIVE_ROW", kb, entry.count, values, ())))
        self._dirty = set()
        records.sort(key=lambda r: r[0])
        return records

    def restore(self, records: Iterable[tuple[bytes, bytes]]) -> None:
        """Hold the join keys these records are of (every record of each), replacing what
        was held of them; other keys stay."""
        restored: set[bytes] = set()
        for record_key, value in records:
            record = decode_state(value)
            key = tuple(record["key"])
            kb = key_bytes(key)
            if kb not in restored:
                restored.add(kb)
                for side in (0, 1):
                    self.sides[side].pop(kb, None)
                    self.totals[side].pop(kb, None)
            side = _SIDE_NAMES.index(record["values"]["s"])
            fp = bytes.fromhex(orjson.loads(record_key)[3])
            self.sides[side].setdefault(kb, {})[fp] = _Live(record["count"], record["values"]["r"])
            self.totals[side][kb] = self.totals[side].get(kb, 0) + record["count"]

    def held(self) -> int:
        """The join keys held in memory."""
        return len(set(self.sides[0]) | set(self.sides[1]))


def _first(item: tuple[bytes, dict[str, Any]]) -> bytes:
    return item[0]
