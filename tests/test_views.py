"""The incremental reducer (refold.reduce) against the reference (refold.reference)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import fastavro
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refold.config import ViewSpec
from refold.model.changelog import Op
from refold.ops.verify import same
from refold.reduce import (
    Rejected,
    SourceEvent,
    compact_changes,
    decode_state,
    encode_state,
    make_reducer,
)
from refold.reference import fold_changelog, fold_deltas, reference_changelog, reference_deltas

GROUPED = ViewSpec.model_validate(
    {
        "key": ["k"],
        "columns": {
            "total": {"sum": "v"},
            "n": {"count": "*"},
            "nv": {"count": "v"},
            "mean": {"avg": "v"},
            "low": {"min": "v"},
            "high": {"max": "v"},
            "first_v": {"first": "v"},
            "last_t": {"last": "t"},
            "lww": {"last_write_wins": "v"},
            "teams": {"set": "t"},
        },
    }
)
INVERTIBLE = ViewSpec.model_validate({"key": ["k"], "columns": {"s": {"sum": "v"}, "c": {"count": "*"}}})
TOP = ViewSpec.model_validate({"top_n": {"n": 2, "order_by": {"v": "desc", "t": "asc"}, "partition_by": ["t"]}})
TOP_GLOBAL = ViewSpec.model_validate({"top_n": {"n": 3, "order_by": {"v": "asc"}}})
# a Top-N keeping two of the row's columns (`top_n.columns`, as a SQL view's SELECT list
# gives it): rows that differ only elsewhere render alike
TOP_PROJECTED = ViewSpec.model_validate(
    {"top_n": {"n": 2, "order_by": {"v": "desc"}, "partition_by": ["t"], "columns": ["v", "t"]}}
)
SPECS = [GROUPED, INVERTIBLE, TOP, TOP_GLOBAL, TOP_PROJECTED]


def E(op: str, tag: int, **row: Any) -> SourceEvent:
    return SourceEvent(Op.parse(op), row, (tag, 0, tag))


NUMBERS = st.one_of(st.none(), st.integers(-5, 5), st.sampled_from([0.1, 0.2, 2.5, -1.25]))
# every kind `value_order` ranks: numbers, strings, booleans (and nulls, ranked last)
MIXED = st.one_of(NUMBERS, st.sampled_from(["", "a", "b", "ab"]), st.booleans())


@st.composite
def changelogs(draw: st.DrawFn, values: st.SearchStrategy[Any] = NUMBERS) -> list[list[SourceEvent]]:
    """Random units: mostly valid (appends, retractions and corrections of live rows),
    some invalid (retractions of rows that are not live, null keys)."""
    live: list[dict[str, Any]] = []
    units: list[list[SourceEvent]] = []
    time = 0
    for _ in range(draw(st.integers(1, 60))):
        time += draw(st.integers(0, 3))
        tag = (time - draw(st.integers(0, 1)), draw(st.integers(0, 2)), len(units))
        fresh = {"k": draw(st.sampled_from(["a", "b", "c", None]) if draw(st.booleans()) else st.sampled_from(["a", "b"])),
                 "v": draw(values), "t": draw(st.sampled_from(["x", "y"]))}
        choice = draw(st.integers(0, 9))
        if choice < 5 or not live:
            units.append([SourceEvent(Op.APPEND, fresh, tag)])
            live.append(fresh)
        elif choice < 7:
            row = live.pop(draw(st.integers(0, len(live) - 1)))
            units.append([SourceEvent(Op.RETRACT, row, tag)])
        elif choice < 9:
            row = live.pop(draw(st.integers(0, len(live) - 1)))
            new = {**row, "v": draw(values)} if draw(st.booleans()) else fresh
            units.append([SourceEvent(Op.CORRECT_FROM, row, tag), SourceEvent(Op.CORRECT_TO, new, tag)])
            live.append(new)
        else:  # a retraction of a row that may well not be live
            units.append([SourceEvent(Op.RETRACT, fresh, tag)])
    return units


def run_incremental(spec: ViewSpec, units: list[list[SourceEvent]], cuts: list[int]):
    reducer = make_reducer(spec)
    changes, rejected, deltas, batches, state = [], [], [], [], {}
    batch_changes = []
    for index, unit in enumerate(units):
        try:
            out = reducer.apply(unit)
        except Rejected as exc:
            rejected.append((index, exc.reason))
            out = []
        changes.extend(out)
        batch_changes.extend(out)
        if index in cuts:
            deltas.extend(reducer.take_deltas())
            batches.append(compact_changes(batch_changes))
            batch_changes = []
            state.update(reducer.take_state_changes())
    deltas.extend(reducer.take_deltas())
    batches.append(compact_changes(batch_changes))
    state.update(reducer.take_state_changes())
    return reducer, changes, rejected, deltas, batches, state


def assert_same_changes(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.op, x.key) == (y.op, y.key) and same(dict(x.row), dict(y.row)), (x, y)


@pytest.mark.parametrize("spec", [TOP, TOP_GLOBAL, TOP_PROJECTED], ids=["desc-asc", "asc", "desc"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units=changelogs(MIXED))
def test_a_top_n_ranks_every_kind_of_value_as_the_reference(spec: ViewSpec, units: list[list[SourceEvent]]) -> None:
    """Numbers, strings and booleans in one order column, either direction (`_sort_key`
    reverses `value_order` for `desc` without comparing in Python where it can)."""
    reducer, changes, rejected, _deltas, _batches, _state = run_incremental(spec, units, [])
    expected = reference_changelog(spec, units)
    assert rejected == expected.rejected
    assert changes == expected.changes
    assert fold_changelog(changes) == expected.view == reducer.view()


@pytest.mark.parametrize("spec", SPECS, ids=["grouped", "invertible", "top-n", "top-n-global", "top-n-columns"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units=changelogs(), data=st.data())
def test_incremental_equals_reference(spec: ViewSpec, units, data) -> None:
    cuts = data.draw(st.sets(st.integers(0, max(len(units) - 1, 0))))
    reducer, changes, rejected, deltas, batches, state = run_incremental(spec, units, sorted(cuts))
    expected = reference_changelog(spec, units)
    assert rejected == expected.rejected
    assert changes == expected.changes  # exact numbers: bit-identical, not just close
    assert fold_changelog(changes) == expected.view == reducer.view()
    # per-batch compaction folds to the same view
    assert fold_changelog([c for batch in batches for c in batch]) == expected.view
    if spec.top_n is None:
        folded = fold_deltas(spec, deltas)
        assert folded.keys() == expected.view.keys()
        for key, row in expected.view.items():
            assert same(row, folded[key]), (key, row, folded[key])
        # the reference's deltas, cut at the same batches, are the engine's deltas
        bounds = [*sorted(cuts), len(units) - 1]
        start, ref_batches = 0, []
        for end in bounds:
            ref_batches.append(units[start : end + 1])
            start = end + 1
        assert reference_deltas(spec, ref_batches) == deltas
    # restore from the state changelog, then carry on: the same as never stopping
    restored = make_reducer(spec)
    restored.restore([(k, v) for k, v in state.items() if v is not None])
    assert restored.view() == reducer.view()
    more = units[: len(units) // 2]
    for unit in more:
        try:
            a = reducer.apply(unit)
        except Rejected:
            with pytest.raises(Rejected):
                restored.apply(unit)
            continue
        assert restored.apply(unit) == a


def test_retracting_the_max_falls_back_to_the_next() -> None:
    reducer = make_reducer(GROUPED)
    reducer.apply([E("+A", 1, k="a", v=5, t="x")])
    reducer.apply([E("+A", 2, k="a", v=9, t="y")])
    out = reducer.apply([E("-R", 3, k="a", v=9, t="y")])
    assert [c.op for c in out] == [Op.CORRECT_FROM, Op.CORRECT_TO]
    assert out[0].row["high"] == 9 and out[1].row["high"] == 5
    assert out[1].row["last_t"] == "x" and out[1].row["teams"] == [["x", 1]]
    out = reducer.apply([E("-R", 4, k="a", v=5, t="x")])
    assert [c.op for c in out] == [Op.RETRACT] and reducer.view() == {}


def test_retracting_a_top_n_member_promotes_the_next() -> None:
    reducer = make_reducer(TOP_GLOBAL)
    for i, v in enumerate([3, 1, 2, 4]):
        reducer.apply([E("+A", i, k="a", v=v, t="x")])
    out = reducer.apply([E("-R", 9, k="a", v=1, t="x")])
    assert [(c.op.code, c.row["place"], c.row["v"]) for c in out] == [
        ("-C", 1, 1), ("+C", 1, 2), ("-C", 2, 2), ("+C", 2, 3), ("-C", 3, 3), ("+C", 3, 4)]


def test_rejections_leave_state_unchanged() -> None:
    reducer = make_reducer(GROUPED)
    reducer.apply([E("+A", 1, k="a", v=1, t="x")])
    reducer.take_state_changes()
    before = reducer.view()
    for unit, reason in [
        ([E("-R", 2, k="a", v=2, t="x")], "not live"),
        ([E("+A", 2, k=None, v=2, t="x")], "null key"),
        ([E("+A", 2, k="a", v="two", t="x")], "schema mismatch"),
        ([E("-C", 2, k="a", v=7, t="x"), E("+C", 2, k="a", v=8, t="x")], "not live"),
    ]:
        with pytest.raises(Rejected) as failure:
            reducer.apply(unit)
        assert failure.value.reason == reason
        assert reducer.view() == before
    assert reducer.take_state_changes() == []
    assert [d["_count"] for d in reducer.take_deltas()] == [1]


def test_duplicate_rows_retract_the_latest_copy() -> None:
    reducer = make_reducer(GROUPED)
    reducer.apply([E("+A", 1, k="a", v=1, t="x")])
    reducer.apply([E("+A", 2, k="a", v=2, t="y")])
    reducer.apply([E("+A", 3, k="a", v=1, t="x")])
    assert reducer.view()[("a",)]["lww"] == 1
    out = reducer.apply([E("-R", 4, k="a", v=1, t="x")])  # removes the copy from tag 3
    assert out[1].row["lww"] == 2 and out[1].row["first_v"] == 1


def test_exact_float_sums() -> None:
    reducer = make_reducer(INVERTIBLE)
    for i, v in enumerate([0.1, 0.2, 0.3]):
        reducer.apply([E("+A", i, k="a", v=v)])
    assert reducer.view()[("a",)]["s"] == 0.6  # fsum, not 0.6000000000000001
    reducer.apply([E("-R", 5, k="a", v=0.1)])
    reducer.apply([E("-R", 6, k="a", v=0.2)])
    reducer.apply([E("-R", 7, k="a", v=0.3)])
    reducer.apply([E("+A", 8, k="a", v=2)])
    assert reducer.view()[("a",)]["s"] == 2 and type(reducer.view()[("a",)]["s"]) is int


_STATE_SCHEMA = fastavro.parse_schema(
    orjson.loads((Path(__file__).resolve().parent.parent / "schemas" / "avro" / "state.avsc").read_bytes())
)
_LONGS = st.integers(-(2**63), 2**63 - 1)
_TEXT = st.text(st.characters(exclude_categories=("Cs",)))  # JSON has no lone surrogates


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["KEY_SUMMARY", "LIVE_ROW"]),
    key=st.lists(st.one_of(_TEXT, _LONGS, st.booleans()), min_size=1, max_size=3),
    count=_LONGS,
    values=st.one_of(st.none(), st.lists(st.one_of(_LONGS, _TEXT, st.none()))),
    tags=st.lists(st.tuples(_LONGS, st.integers(-(2**31), 2**31 - 1), _LONGS), max_size=70),
)
def test_state_records_are_the_bytes_fastavro_writes(kind, key, count, values, tags) -> None:
    """encode_state writes Avro by hand for speed: it must be exactly fastavro's encoding."""
    record = {
        "kind": kind,
        "key": orjson.dumps(key).decode(),
        "count": count,
        "values": None if values is None else orjson.dumps(values).decode(),
        "tags": [{"event_time": t[0], "partition": t[1], "offset": t[2]} for t in tags],
    }
    buffer = io.BytesIO()
    fastavro.schemaless_writer(buffer, _STATE_SCHEMA, record)
    data = encode_state(kind, tuple(key), count, values, tags)
    assert data == buffer.getvalue()
    assert decode_state(data) == {"kind": kind, "key": tuple(key), "count": count, "values": values, "tags": tags}
    read = fastavro.schemaless_reader(io.BytesIO(data), _STATE_SCHEMA, None)
    assert read == record


def test_a_state_record_in_blocks_with_sizes_and_bad_bytes() -> None:
    """Other Avro writers may cut the tags array into blocks with byte sizes; bad bytes are a ValueError."""
    good = encode_state("LIVE_ROW", ("k",), 2, None, [(5, 0, 1), (6, 0, 2)])
    assert decode_state(good)["tags"] == [(5, 0, 1), (6, 0, 2)]
    head = good[: good.index(b"\x04\x0a")]  # the array: one block of two tags
    blocked = head + b"\x01\x06\x0a\x00\x02" + b"\x01\x06\x0c\x00\x04" + b"\x00"  # two blocks of -1 (6 bytes)
    assert decode_state(blocked)["tags"] == [(5, 0, 1), (6, 0, 2)]
    for bad in (good[:-1], good + b"\x00", b"\x08" + good[1:], b""):
        with pytest.raises(ValueError):
            decode_state(bad)


@pytest.mark.parametrize("spec", SPECS, ids=["grouped", "invertible", "top-n", "top-n-global", "top-n-columns"])
def test_a_row_written_before_a_field_was_added_is_retracted_by_the_same_row_with_it_null(spec: ViewSpec) -> None:
    old_writer = {"k": "a", "v": 1, "t": "x"}
    new_writer = {**old_writer, "bonus": None}  # the producer's schema gained an optional field
    for added, retracted in ((old_writer, new_writer), (new_writer, old_writer)):
        reducer = make_reducer(spec)
        reducer.apply([SourceEvent(Op.APPEND, dict(added), (1, 0, 0))])
        reducer.apply([SourceEvent(Op.RETRACT, dict(retracted), (2, 0, 1))])  # not refused
        assert reducer.view() == {}
        units = [[SourceEvent(Op.APPEND, dict(added), (1, 0, 0))], [SourceEvent(Op.RETRACT, dict(retracted), (2, 0, 1))]]
        assert reference_changelog(spec, units).rejected == []


@pytest.mark.parametrize("spec", SPECS, ids=["grouped", "invertible", "top-n", "top-n-global", "top-n-columns"])
def test_state_written_when_null_columns_counted_still_retracts(spec: ViewSpec) -> None:
    """State records of a row with a null column written before null equalled absent
    are named by the row's old fingerprint: a retraction still finds them."""
    import hashlib

    from refold.model.changelog import legacy_canonical_row
    from refold.reduce.statecodec import row_fingerprint

    row = {"k": "a", "v": 1, "t": "x", "bonus": None}
    writer = make_reducer(spec)
    writer.apply([SourceEvent(Op.APPEND, dict(row), (1, 0, 0))])
    legacy = legacy_canonical_row(row)
    assert legacy is not None
    old_fp = hashlib.blake2b(legacy, digest_size=16).digest().hex().encode()
    records = []
    for record_key, value in writer.take_state_changes():
        assert value is not None
        if record_key.count(b",") and record_key.endswith(b'"]'):  # a live row: [key, fp hex]
            record_key = record_key.replace(row_fingerprint(record_key).hex().encode(), old_fp)
        records.append((record_key, value))
    reader = make_reducer(spec)
    reader.restore(records)
    assert reader.view() == writer.view()
    reader.apply([SourceEvent(Op.RETRACT, dict(row), (2, 0, 1))])
    assert reader.view() == {}
