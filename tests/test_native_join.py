"""The native join core (`refold_native.JoinCore`) against the Python reducer
(`refold.reduce.join.JoinReducer`), byte for byte: random changelogs of both sides
(appends, retractions, corrections that change the join key, many rows per key, nulls,
lists and objects in join columns, nested objects in either key order, retractions of
rows that are not live), random batch cuts, inner, left and full joins. Per unit the same
records (op, key, row bytes in their column order) or the same refusal (reason, index,
detail); per batch the same `P.state` records; and a store written by one continues in
the other: between batches either may forget what it holds and load what the next batch
touches, as a shard does, from the records the batches committed.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
import refold_native
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_join import Shard
from test_join import changelogs as join_changelogs
from test_join import records as join_records
from test_join import spec_of as join_spec_of

from refold.config import JoinSpec
from refold.model.changelog import Op
from refold.reduce import Rejected, SourceEvent, ViewChange
from refold.reduce.join import JoinReducer, state_prefix
from refold.reference_joins import reference_join
from refold.runtime.joins import as_units
from refold.runtime.native import join_reducer

Unit = tuple[int, list[SourceEvent]]

COLUMNS = {"id": "orders.id", "ck": "orders.cust", "amount": "orders.amount", "note": "orders.note",
           "cid": "customers.cid", "region": "customers.region", "tags": "customers.tags"}


def spec_of(kind: str, key: list[str] | None) -> JoinSpec:
    return JoinSpec(left="orders", right="customers", on=[("cust", "cid"), ("shop", "shop")],  # type: ignore[arg-type]
                    type=kind, columns=COLUMNS, key=key)


def native(spec: JoinSpec) -> Any:
    return refold_native.JoinCore(spec.sides_on, spec.outputs, spec.output_key, spec.type)


# random changelogs ----------------------------------------------------------------------

JOIN_VALUES = st.one_of(st.none(), st.integers(0, 3), st.sampled_from(["a", "b", 1.0, True, [1], {"x": 1}]))
PAYLOADS = st.one_of(st.none(), st.integers(-5, 5), st.sampled_from([0.5, -0.0, 0.0, "é", "", {"a": 1, "b": [2]},
                                                                      {"b": [2], "a": 1}, [1, {"z": None}]]))


@st.composite
def changelogs(draw: st.DrawFn) -> list[Unit]:
    live: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])

    def new_row(side: int) -> dict[str, Any]:
        shop = draw(st.sampled_from([1, 1, 1, 2]))
        if side == 0:
            row = {"id": draw(st.integers(0, 5)), "cust": draw(JOIN_VALUES), "shop": shop, "amount": draw(PAYLOADS)}
            if draw(st.booleans()):
                row["note"] = draw(PAYLOADS)
            return row
        row = {"cid": draw(JOIN_VALUES), "region": draw(st.sampled_from(["eu", "us", None])), "shop": shop}
        if draw(st.booleans()):
            row["tags"] = draw(PAYLOADS)
        return row

    units: list[Unit] = []
    offset = 0
    for _ in range(draw(st.integers(1, 50))):
        side = draw(st.integers(0, 1))
        rows = live[side]
        what = draw(st.sampled_from(["add", "add", "add", "copy", "retract", "correct", "correct", "stray"]))
        tag = (offset, side, offset)
        offset += 1
        if what == "copy" and rows:  # another copy of a live row
            row = dict(draw(st.sampled_from(rows)))
            rows.append(row)
            units.append((side, [SourceEvent(Op.APPEND, row, tag)]))
        elif what in ("add", "copy") or (what in ("retract", "correct") and not rows):
            row = new_row(side)
            rows.append(row)
            units.append((side, [SourceEvent(Op.APPEND, row, tag)]))
        elif what == "retract":
            row = rows.pop(draw(st.integers(0, len(rows) - 1)))
            units.append((side, [SourceEvent(Op.RETRACT, row, tag)]))
        elif what == "correct":
            old = rows.pop(draw(st.integers(0, len(rows) - 1)))
            new = dict(old)
            join_column = "cust" if side == 0 else "cid"
            new["amount" if side == 0 else "region"] = draw(PAYLOADS)
            if draw(st.booleans()):
                new[join_column] = draw(JOIN_VALUES)
            rows.append(new)
            units.append((side, [SourceEvent(Op.CORRECT_FROM, old, tag),
                                 SourceEvent(Op.CORRECT_TO, new, (offset, side, offset))]))
            offset += 1
        else:  # a retraction of a row that is not live, or a correction from one
            stray = new_row(side) | {"stray": True}
            if draw(st.booleans()):
                units.append((side, [SourceEvent(Op.RETRACT, stray, tag)]))
            else:
                units.append((side, [SourceEvent(Op.CORRECT_FROM, stray, tag),
                                     SourceEvent(Op.CORRECT_TO, new_row(side), (offset, side, offset))]))
                offset += 1
    return units


# the driver ------------------------------------------------------------------------------

Outcome = tuple[Any, ...]


def shown(changes: Sequence[ViewChange]) -> list[tuple[Any, ...]]:
    """Records as bytes: op, key, the row in its column order, the key's names."""
    return [(change.op, orjson.dumps(change.key), orjson.dumps(change.row), change.key_names) for change in changes]


def apply(reducer: Any, side: int, events: list[SourceEvent]) -> Outcome:
    try:
        return ("ok", shown(reducer.apply(side, events)))
    except Rejected as exc:
        return ("refused", exc.reason, exc.index, exc.detail)


def run(spec: JoinSpec, units: list[Unit], cuts: list[int], plan: list[str]) -> tuple[list[Outcome], list[Any]]:
    """The units in batches cut at `cuts`; before batch i the reducer is `plan[i]`:
    `keep` the one it has, `python`/`native`/`batch` (native, `apply_batch`) a new one
    that loads the keys the batch touches from the state records committed so far."""
    reducer: Any = JoinReducer(spec)
    pstate: dict[bytes, bytes] = {}
    held: set[bytes] = set()
    outcomes: list[Outcome] = []
    states: list[Any] = []
    bounds = [0, *sorted(set(cuts)), len(units)]
    for number, (start, end) in enumerate(itertools.pairwise(bounds)):
        batch = units[start:end]
        how = plan[number % len(plan)]
        if how != "keep":
            reducer = JoinReducer(spec) if how == "python" else native(spec)
            held = set()
        # as a shard: load the join keys the batch touches that the reducer does not hold
        prefixes = {b"[" + state_prefix(key) + b"," for side, events in batch for event in events
                    if (key := reducer.state_key(side, event)) is not None} - held
        reducer.restore([(k, v) for k, v in sorted(pstate.items()) if any(k.startswith(p) for p in prefixes)])
        held |= prefixes
        if how == "batch":
            rejected, changes, state = reducer.apply_batch(batch)
            refusals = {unit: (reason, index, detail) for unit, index, reason, detail in rejected}
            outcomes.extend(("refused", *refusals[i]) if i in refusals else ("ok", shown(changes[i]))
                            for i in range(len(batch)))
        else:
            outcomes.extend(apply(reducer, side, events) for side, events in batch)
            state = reducer.take_state_changes()
        assert reducer.take_deltas() == []
        states.append(state)
        for record_key, value in state:
            if value is None:
                pstate.pop(record_key, None)
            else:
                pstate[record_key] = value
    return outcomes, states


# the differential tests ----------------------------------------------------------------------

@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]),
       key=st.sampled_from([None, ["id"], ["region"], ["ck", "cid"]]), data=st.data())
def test_native_join_equals_python(units: list[Unit], kind: str, key: list[str] | None, data: st.DataObject) -> None:
    spec = spec_of(kind, key)
    cuts = data.draw(st.lists(st.integers(0, len(units)), max_size=6), label="cuts")
    plan = data.draw(st.lists(st.sampled_from(["keep", "python", "native", "batch"]), min_size=1, max_size=5),
                     label="plan")
    expected = run(spec, units, cuts, ["python"] + ["keep"] * 7)
    assert run(spec, units, cuts, ["native"] + ["keep"] * 7) == expected
    assert run(spec, units, cuts, ["batch"]) == expected
    assert run(spec, units, cuts, plan) == expected  # each continues from the other's records


def test_held_and_state_key_as_python() -> None:
    spec = spec_of("full", None)
    python, core = JoinReducer(spec), native(spec)
    units: list[Unit] = [(0, [SourceEvent(Op.APPEND, {"id": 1, "cust": 7, "shop": 1}, (0, 0, 0))]),
                         (1, [SourceEvent(Op.APPEND, {"cid": 7, "shop": 1, "region": "eu"}, (1, 0, 1))]),
                         (1, [SourceEvent(Op.APPEND, {"cid": 8, "shop": 2}, (2, 0, 2))])]
    for side, events in units:
        assert shown(core.apply(side, events)) == shown(python.apply(side, events))
    assert core.held() == python.held() == 2
    for event in (units[0][1][0], SourceEvent(Op.APPEND, {"cust": [1], "shop": 1}, (3, 0, 3)),
                  SourceEvent(Op.APPEND, {"cust": "x" * 70000}, (3, 0, 3)), SourceEvent(Op.APPEND, {}, (3, 0, 3))):
        assert core.state_key(0, event) == python.state_key(0, event)
        assert apply(core, 0, [event]) == apply(python, 0, [event])  # a refusal's reason and detail
    assert core.take_state_changes() == python.take_state_changes()


def test_a_value_it_does_not_hold_is_unsupported_and_changes_nothing() -> None:
    spec = spec_of("left", None)
    core = native(spec)
    core.apply(0, [SourceEvent(Op.APPEND, {"id": 1, "cust": 7, "shop": 1}, (0, 0, 0))])
    before = core.take_state_changes()
    assert len(before) == 1
    with pytest.raises(refold_native.Unsupported, match="64 bits"):
        core.apply(0, [SourceEvent(Op.APPEND, {"id": 2**70, "cust": 7, "shop": 1}, (1, 0, 1))])
    assert core.take_state_changes() == []
    assert core.held() == 1


def test_the_selector() -> None:
    spec = spec_of("inner", None)
    assert isinstance(join_reducer(spec, "python"), JoinReducer)
    assert isinstance(join_reducer(spec, "auto"), refold_native.JoinCore)
    assert isinstance(join_reducer(spec, "native"), refold_native.JoinCore)


class AlternatingShard(Shard):
    """`test_join`'s shard (a real RocksDB store) whose reducer is the native core and
    the Python one in turn: each new one loads what it touches from the other's records."""

    def __init__(self, spec: JoinSpec, root: Path) -> None:
        super().__init__(spec, root)
        self.turns = 0
        self.forget()

    def forget(self) -> None:
        self.turns += 1
        self.reducer = native(self.spec) if self.turns % 2 else JoinReducer(self.spec)
        self.held = set()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units=join_changelogs(), kind=st.sampled_from(["inner", "left", "full"]), data=st.data())
def test_a_store_written_by_one_continues_in_the_other(units: list[Unit], kind: str, data: st.DataObject) -> None:
    """Through a shard's store, the reducers taking turns batch by batch give the
    reference join's records and refusals."""
    spec = join_spec_of(kind, ["id"])
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(units)), min_size=1, max_size=6), label="cuts")))
    expected = reference_join(spec, units)
    changes: list[ViewChange] = []
    refused: list[int] = []
    with tempfile.TemporaryDirectory() as root:
        shard = AlternatingShard(spec, Path(root))
        try:
            for start, end in itertools.pairwise([0, *cuts, len(units)]):
                got, bad = shard.run(units[start:end])
                changes.extend(got)
                refused.extend(start + index for index in bad)
                shard.forget()
        finally:
            shard.close()
    assert refused == [index for index, _ in expected.rejected]
    assert join_records(changes) == join_records(expected.changes)


def _view_core() -> Any:
    """A grouped view per region over the join, with deltas and causes naming either source."""
    columns = [("ids", "sum", "id"), ("orders", "count", "*"), ("last", "last", "amount")]
    core = refold_native.GroupedCore(["region"], columns, "changelog", True)
    core.provenance = True
    core.name_join_causes("orders", "customers", 1)
    return core


def _joined_then_viewed(join: Any, view: Any, batch: list[Unit]) -> tuple[Any, ...]:
    """The shard's two calls: the join's records as `ViewChange`s, then as the view's units."""
    rejected, changes, join_state = join.apply_batch(batch)
    units, sources = [], []
    for number, ((_side, events), made) in enumerate(zip(batch, changes, strict=True)):
        for sub in as_units(made, events[0].tag):
            units.append([(event, None) for event in sub])
            sources.append(number)
    view.touched(units)
    view_rejected, out_view, delta, state = view.apply_batch(units)
    view_refused = [(sources[unit], reason, detail) for unit, _index, reason, detail in view_rejected]
    return sorted(rejected), view_refused, out_view, delta, state, join_state


def _joined_into_the_view(join: Any, view: Any, batch: list[Unit]) -> tuple[Any, ...]:
    """`GroupedCore.join_read`: the joined records never Python objects."""
    rejected = view.join_read(join, [(side, [(event, None) for event in events]) for side, events in batch])
    view.touched_read()
    view_rejected, out_view, delta, state = view.apply_read()
    view_refused = [(records[0], reason, detail) for records, _index, reason, detail in view_rejected]
    return sorted(rejected), view_refused, out_view, delta, state, join.take_state_changes()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]), data=st.data())
def test_a_view_fed_by_join_read_writes_what_it_writes_fed_the_joined_records(
        units: list[Unit], kind: str, data: st.DataObject) -> None:
    """A grouped view over the join, fed in one call (`join_read`) or through the join's
    `ViewChange`s: the same refusals of the join and of the view (named by source unit),
    the same view, delta and state records, headers included, batch after batch."""
    spec = spec_of(kind, None)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(units)), max_size=6), label="cuts")))
    cores = [(native(spec), _view_core()), (native(spec), _view_core())]
    for start, end in itertools.pairwise([0, *cuts, len(units)]):
        batch = units[start:end]
        fed = [_outcome(how, *pair, batch) for how, pair in zip((_joined_into_the_view, _joined_then_viewed), cores,
                                                                 strict=True)]
        assert fed[0] == fed[1]
        if fed[0] == "unsupported":  # (a shard reduces the view in Python from here)
            break


def _outcome(how: Any, join: Any, view: Any, batch: list[Unit]) -> Any:
    try:
        return how(join, view, batch)
    except refold_native.Unsupported:  # (a float in a sum, a float key: the view's core holds neither)
        return "unsupported"
