"""The native reduction core (`refold_native.GroupedCore`, native/) against the Python
path it replaces: `GroupedReducer` + `Renderer` (JSON rows, emit per_event), byte for
byte — view, delta and state records, refusals — over random views and batches;
its JSON writer and reader against orjson; and what it refuses to handle
(`Unsupported`), which must always be a value in the batch, never a bug."""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from typing import Any

import native_changelogs
import orjson
import pytest

# imported, not skipped when missing: `make setup` builds it (native/), and a skipped test
# would hide a build that failed
import refold_native as native
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from native_changelogs import I64, ChangelogSource, bad_anywhere, check_batch, view_bytes
from refold_native import GroupedCore, Unsupported

from refold.config import Pipeline, parse_pipeline
from refold.model.changelog import Op
from refold.reduce import Rejected, SourceEvent, decode_state
from refold.reduce.grouped import GroupedReducer
from refold.reduce.statecodec import row_key, state_value
from refold.reduce.values import key_bytes
from refold.runtime.render import Renderer

AGGS = ("sum", "count", "avg", "min", "max", "set", "first", "last", "last_write_wins")
SUMMED = ("sum", "avg")
MULTISET = ("min", "max", "set")

# --------------------------------------------------------------------------------------
# The Python path, as the shard runs it


def make_pipeline(key: Sequence[str], columns: Sequence[tuple[str, str, str]], form: str | None,
                  delta: bool) -> Pipeline:
    outputs: dict[str, Any] = {}
    if form is not None:
        outputs["view"] = {"topic": "v", "form": form}
    if delta or form is None:
        outputs["delta"] = {"topic": "d"}
    return parse_pipeline({
        "pipeline": "native",
        "source": {"topic": "t"},
        "view": {"key": list(key), "columns": {name: {agg: column} for name, agg, column in columns}},
        "outputs": outputs,
    })


class PythonPath:
    """`ShardProcessor._reduce` and the records of a batch, in Python."""

    def __init__(self, key: Sequence[str], columns: Sequence[tuple[str, str, str]], form: str | None,
                 delta: bool) -> None:
        self.pipeline = make_pipeline(key, columns, form, delta)
        self.delta = delta
        self.reducer = GroupedReducer(self.pipeline.view)
        self.renderer = Renderer(self.pipeline)

    def apply_batch(self, units: Sequence[Sequence[tuple[SourceEvent, Any]]]) -> tuple[list, list, list, list]:
        rejected, changes = [], []
        for unit_index, unit in enumerate(units):
            try:
                changes.append((self.reducer.apply([event for event, _ in unit]), unit[0][0].tag[0]))
            except Rejected as exc:
                rejected.append((unit_index, exc.index, str(exc.reason), exc.detail))
        view = self.renderer.view(changes)
        deltas = self.renderer.deltas(self.reducer.take_deltas())
        state = self.reducer.take_state_changes()
        return rejected, view, deltas if self.delta else [], state

    def touched(self, units: Sequence[Sequence[tuple[SourceEvent, Any]]]) -> set[bytes]:
        keys = {self.reducer.state_key(event) for unit in units for event, _ in unit}
        keys.discard(None)
        return {key_bytes(key) for key in keys}


# --------------------------------------------------------------------------------------
# Which values the native core refuses (`Unsupported`): the test's own account


def unsupported_in(units: Sequence[Sequence[tuple[SourceEvent, Any]]], key: Sequence[str],
                   columns: Sequence[tuple[str, str, str]]) -> bool:
    summed = {c for _, agg, c in columns if agg in SUMMED}
    multiset = {c for _, agg, c in columns if agg in MULTISET}
    for unit in units:
        for source_event, _ in unit:
            row = source_event.row
            if type(row) is not dict or bad_anywhere(row):
                return True
            for k in key:
                if type(row.get(k)) in (bool, float):
                    return True
            for c in summed:
                if type(row.get(c)) is float:
                    return True
            for c in multiset:
                v = row.get(c)
                if type(v) is bool or (type(v) is float and v == math.trunc(v)):
                    return True
    return False


# --------------------------------------------------------------------------------------
# Random views and batches

KEY_NAMES = ("k", "g")
SOURCES = ("x", "y", "w", "n")  # x, y numbers; w strings and numbers; n nested values
OUT_NAMES = ("total", "n", "op", "_count", "mean", "low", "high", "bag", "first_w", "last_n", "lww")

TEXT = st.text(alphabet=st.sampled_from(['a', 'b', '"', '\\', '\n', '\x00', '\x1f', '\x7f', 'é', '\u2028', '😀', ' ']),
               max_size=4)
FLOATS = st.sampled_from([0.5, -2.25, 1e16, 1e-7, 0.1, 5e-324, 1.7976931348623157e308, 123456789.5, 2.5e-5, 3.75])
NESTED = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 3), FLOATS, st.just(-0.0), st.just(1.0), TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner),
                            st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=6,
)


@st.composite
def view_specs(draw: st.DrawFn) -> tuple[list[str], list[tuple[str, str, str]], str | None, bool]:
    key = draw(st.sampled_from([["k"], ["k", "g"], ["g", "k"]]))
    names = draw(st.lists(st.sampled_from(OUT_NAMES), min_size=1, max_size=5, unique=True))
    columns = []
    for name in names:
        agg = draw(st.sampled_from(AGGS))
        if agg == "count":
            source = draw(st.sampled_from(("*", *SOURCES)))
        elif agg in SUMMED:
            source = draw(st.sampled_from(("x", "y")))
        elif agg in MULTISET:
            source = draw(st.sampled_from(("x", "w")))
        else:
            source = draw(st.sampled_from(SOURCES))
        columns.append((name, agg, source))
    form = draw(st.sampled_from(["changelog", "retract", "upsert", None]))
    delta = draw(st.booleans())
    return key, columns, form, delta


class Source(ChangelogSource):
    """A grouped view's changelog: rows of the view's key and its reduced columns."""

    def key_value(self) -> Any:
        choice = self.draw(st.integers(0, 40))
        if choice == 0:
            return None
        if choice == 1:
            return ["list"]
        if choice == 2 and self.unsupported:
            return self.draw(st.sampled_from([True, 1.5, 2.0]))
        if choice == 3:
            return self.draw(TEXT)
        if choice == 4:
            return "z" * 65_537
        if choice < 20:
            return self.draw(st.integers(-2, 3))
        return self.draw(st.sampled_from(["a", "b", "c", "ab"]))

    def number(self) -> Any:
        choice = self.draw(st.integers(0, 40))
        if choice == 0:
            return None
        if choice == 1:
            return "seven"
        if choice == 2:
            return True
        if choice == 3 and self.unsupported:
            return 1.5
        if choice == 4:
            return self.draw(st.integers(-(2**40), 2**40))
        if choice == 5:
            return [1]
        return self.draw(st.integers(-5, 20))

    def scalar(self) -> Any:
        choice = self.draw(st.integers(0, 40))
        if choice == 0:
            return None
        if choice == 1 and self.unsupported:
            return self.draw(st.sampled_from([True, 2.0, -0.0]))
        if choice == 2:
            return {"a": 1}
        if choice < 12:
            return self.draw(st.sampled_from([0.5, -2.25, 3.75, 1e-7, -1.5]))
        if choice < 25:
            return self.draw(st.integers(-3, 6))
        return self.draw(st.sampled_from(["", "a", "b", "é", "a\"b", "zz"]))

    def fresh_row(self) -> dict[str, Any]:
        row: dict[str, Any] = {}
        columns = {
            "x": self.number,
            "y": self.number,
            "w": self.scalar,
            "n": lambda: self.draw(NESTED),
            "extra": lambda: self.draw(NESTED),
        }
        order = list(columns)
        order = self.draw(st.permutations(order))
        for name in order:
            if self.draw(st.integers(0, 9)) == 0:
                continue  # absent
            row[name] = columns[name]()
        for name in self.key:
            if self.draw(st.integers(0, 60)) == 0:
                continue  # missing key column
            row[name] = self.key_value()
        if self.unsupported and self.draw(st.integers(0, 80)) == 0:
            row["extra"] = self.draw(st.sampled_from([b"bytes", float("nan"), 2**64, "\ud800", {1: 2}]))
        return row

    def same_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """An equal row (canonical bytes): its columns in another order, a null column
        absent or an absent one null, a nested dict's keys in another order."""
        columns = list(row.items())
        columns = self.draw(st.permutations(columns))
        out = {}
        for name, value in columns:
            if value is None and self.draw(st.booleans()):
                continue
            if isinstance(value, dict):
                value = dict(reversed(list(value.items())))
            out[name] = value
        if self.draw(st.integers(0, 4)) == 0:
            out["absent"] = None
        return out

class Pair(native_changelogs.Pair):
    """A `GroupedCore` and the Python path (spec: key, columns, form, delta)."""

    def fresh(self) -> None:
        key, columns, form, delta = self.spec
        self.core = GroupedCore(list(key), list(columns), form, delta)
        self.python = PythonPath(key, columns, form, delta)

    def unsupported(self, units: Sequence[Sequence[tuple[SourceEvent, Any]]]) -> bool:
        key, columns, _form, _delta = self.spec
        return unsupported_in(units, key, columns)

    def held(self) -> int:
        return len(self.python.reducer.keys)


def differential(spec: tuple, data: st.DataObject) -> None:
    """Random views, several batches in a row: the same records as the Python path,
    with restores from each other's state records in between."""
    pair = Pair(spec)
    source = Source(data, spec[0], unsupported=data.draw(st.integers(0, 3)) == 0)
    for _ in range(data.draw(st.integers(1, 5))):
        restore_touched = data.draw(st.integers(0, 3)) == 0
        event(check_batch(pair, source.batch(), restore_touched))
        if data.draw(st.integers(0, 3)) == 0:
            pair.restore()  # a restore round trip of everything
            assert view_bytes(pair.core.view()) == view_bytes(pair.python.reducer.view())


# `differential` over random views: 150 in `make test`, 1,000 in `make test-slow`
test_differential, test_differential_thorough = native_changelogs.two_tiers(differential, view_specs())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_differential_every_aggregation(data: st.DataObject) -> None:
    """Every aggregation at once, over longer runs of batches."""
    columns = [("total", "sum", "x"), ("n", "count", "*"), ("nx", "count", "n"), ("mean", "avg", "y"),
               ("low", "min", "w"), ("high", "max", "x"), ("bag", "set", "w"), ("first_n", "first", "n"),
               ("last_w", "last", "w"), ("lww", "last_write_wins", "x")]
    spec = (["k"], columns, data.draw(st.sampled_from(["changelog", "retract", "upsert"])), True)
    pair = Pair(spec)
    source = Source(data, ["k"], unsupported=False)
    for _ in range(data.draw(st.integers(3, 8))):
        outcome = check_batch(pair, source.batch(), data.draw(st.integers(0, 4)) == 0)
        assert outcome != "unsupported"
        event(outcome)


# --------------------------------------------------------------------------------------
# Fixed cases

BENCH = (["player_name"], [("total", "sum", "score"), ("games", "count", "*"), ("best", "max", "score"),
                           ("latest", "last", "score")], "changelog", True)


def E(op: Op, row: dict[str, Any], t: int = 1) -> tuple:
    return ((SourceEvent(op, row, (t, 0, t)), None),)


def test_bench_view_and_legacy_fingerprint() -> None:
    pair = Pair(BENCH)
    p = {"player_name": "ann"}
    batch = [
        E(Op.APPEND, {**p, "score": 5, "team": None}, 1),
        E(Op.APPEND, {**p, "score": 7}, 2),
        E(Op.RETRACT, {**p, "score": 5}, 3),  # null column equals absent
        E(Op.RETRACT, {**p, "score": 5}, 4),  # not live any more
        ((SourceEvent(Op.CORRECT_FROM, {**p, "score": 7}, (5, 0, 5)), None),
         (SourceEvent(Op.CORRECT_TO, {"player_name": "bob", "score": 1}, (5, 0, 6)), None)),
    ]
    assert check_batch(pair, batch, False) == "rejected"
    # a live row stored under its legacy fingerprint (nulls kept), as older state records name it
    legacy = {**p, "score": 9, "team": None}
    old = GroupedReducer(make_pipeline(*BENCH).view)
    old.apply([SourceEvent(Op.APPEND, legacy, (9, 0, 9))])
    records = []
    for record_key, value in old.take_state_changes():
        if decode_state(value)["kind"] == "LIVE_ROW":
            fp = hashlib.blake2b(orjson.dumps(legacy, option=orjson.OPT_SORT_KEYS), digest_size=16).digest()
            record_key = row_key(key_bytes(("ann",)), fp)
        records.append((record_key, value))
    pair.fresh()
    pair.core.restore(records)
    pair.python.reducer.restore(records)
    pair.store = dict(records)
    assert check_batch(pair, [E(Op.RETRACT, {**p, "score": 9, "team": None}, 10)], False) == "ok"
    assert len(pair.core) == 0


def test_rejections_and_details() -> None:
    spec = (["k"], [("s", "sum", "x"), ("m", "max", "w")], "changelog", True)
    pair = Pair(spec)
    batch = [
        E(Op.APPEND, {"x": 1}),  # key missing
        E(Op.APPEND, {"k": None, "x": 1}),  # null key
        E(Op.APPEND, {"k": [1], "x": 1}),
        E(Op.APPEND, {"k": "é" * 65_537, "x": 1}),
        E(Op.APPEND, {"k": "a", "x": "1"}),
        E(Op.APPEND, {"k": "a", "x": False}),
        E(Op.APPEND, {"k": "a", "w": [1]}),
        E(Op.APPEND, {"k": "a", "x": 1, "w": 2}),
        ((SourceEvent(Op.CORRECT_FROM, {"k": "a", "x": 2}, (2, 0, 2)), None),
         (SourceEvent(Op.CORRECT_TO, {"k": "a", "x": "bad"}, (2, 0, 3)), None)),
        ((SourceEvent(Op.CORRECT_FROM, {"k": "a", "x": 2}, (2, 0, 2)), None),
         (SourceEvent(Op.CORRECT_TO, {"k": "a", "x": 3}, (2, 0, 3)), None)),
    ]
    got = pair.core.apply_batch(batch)
    assert [r[:3] for r in got[0]] == [(0, 0, "null key"), (1, 0, "null key"), (2, 0, "schema mismatch"),
                                       (3, 0, "key too large"), (4, 0, "schema mismatch"), (5, 0, "schema mismatch"),
                                       (6, 0, "schema mismatch"), (8, 1, "schema mismatch"), (9, 0, "not live")]
    pair.fresh()
    assert check_batch(pair, batch, False) == "rejected"


@pytest.mark.parametrize("row", [
    {"k": "a", "x": 1.5},  # a float summed
    {"k": True, "x": 1},  # a boolean key
    {"k": 1.5, "x": 1},  # a float key
    {"k": "a", "x": 2**63},  # past 64 bits
    {"k": "a", "x": 1, "w": True},  # a boolean among max's values
    {"k": "a", "x": 1, "w": 2.0},  # an integral float among max's values
    {"k": "a", "x": 1, "o": float("inf")},
    {"k": "a", "x": 1, "o": b"bytes"},
    {"k": "a", "x": 1, "o": {1: "non-str key"}},
    {"k": "a", "x": 1, "o": "\ud800"},
])
def test_unsupported(row: dict[str, Any]) -> None:
    core = GroupedCore(["k"], [("s", "sum", "x"), ("m", "max", "w"), ("n", "count", "*")], "changelog", True)
    with pytest.raises(Unsupported):
        core.apply_batch([E(Op.APPEND, row)])


def test_unsupported_sums() -> None:
    core = GroupedCore(["k"], [("s", "sum", "x")], "changelog", True)
    core.apply_batch([E(Op.APPEND, {"k": 1, "x": 2**63 - 1})])
    with pytest.raises(Unsupported):  # the sum leaves 64 bits
        core.apply_batch([E(Op.APPEND, {"k": 1, "x": 1})])
    core = GroupedCore(["k"], [("a", "avg", "x")], "changelog", True)
    with pytest.raises(Unsupported):  # an average of a sum past 2**53
        core.apply_batch([E(Op.APPEND, {"k": 1, "x": 2**53})])


def test_constructor_and_restore_errors() -> None:
    with pytest.raises(ValueError):
        GroupedCore(["k"], [("s", "median", "x")], "changelog", True)
    with pytest.raises(ValueError):
        GroupedCore(["k"], [("s", "sum", "x")], "sideways", True)
    core = GroupedCore(["k"], [("s", "sum", "x")], None, False)
    for bad in (b"", b"\x00", b"\x00\x06[1]", b"\x00\x06[1]\x02\x00\x00\x00", b"\x08\x06[1]\x02\x00\x00"):
        with pytest.raises(ValueError):
            core.restore([(b"[[1]]", bad)])
    rejected, view, delta, state = core.apply_batch([E(Op.APPEND, {"k": 1, "x": 2})])
    assert (rejected, view, delta) == ([], [], [])
    # the summary keeps the cause of the key's view row (partition 0, offset 1)
    assert (b"[[1]]", state_value("KEY_SUMMARY", b"[1]", 1, {"s": {"x": ["2", 0]}, "nn": {}, "c": [0, 1]}, ())) in state
    assert core.view() == {(1,): {"k": 1, "s": 2}}
    assert len(core) == 1


# --------------------------------------------------------------------------------------
# The JSON writer and reader against orjson

JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(*I64), st.floats(allow_nan=False, allow_infinity=False),
              st.text()),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                            st.dictionaries(st.text(max_size=4), inner, max_size=4)),
    max_leaves=12,
)


def _no_surrogates(value: Any) -> bool:
    return not bad_anywhere(value)


@settings(max_examples=1500, deadline=None)
@given(value=JSON.filter(_no_surrogates), sort=st.booleans())
def test_json_writer(value: Any, sort: bool) -> None:
    option = orjson.OPT_SORT_KEYS if sort else None
    assert native._dumps(value, sort) == orjson.dumps(value, option=option)
    assert orjson.loads(native._dumps(value)) == native._loads(orjson.dumps(value))


@settings(max_examples=3000, deadline=None)
@given(bits=st.integers(0, 2**64 - 1))
def test_json_floats(bits: int) -> None:
    x = struct.unpack("<d", struct.pack("<Q", bits))[0]
    if math.isfinite(x):
        assert native._dumps(x) == orjson.dumps(x)
        assert native._loads(orjson.dumps(x)) == x


@pytest.mark.parametrize("x", [1e16, 1e15, 1e-7, 1e-6, 1e-5, 0.1, 5e-324, 1.7976931348623157e308, -0.0, 0.0,
                               123456789.0, 2.5e-5, 1e22, 1e23, 9007199254740993.0, 2.2250738585072014e-308,
                               -1.5e-300, 0.3])
def test_json_float_edges(x: float) -> None:
    assert native._dumps(x) == orjson.dumps(x)


def test_json_strings() -> None:
    every = "".join(chr(i) for i in range(0x100)) + "\u2028\u2029\ufeff\U0001f600"
    assert native._dumps(every) == orjson.dumps(every)
    assert native._dumps({"b": {"z": 1, "a": (1, [None])}, "a": 1}, True) == orjson.dumps(
        {"b": {"z": 1, "a": (1, [None])}, "a": 1}, option=orjson.OPT_SORT_KEYS)
    for bad in (b"[1,]", b"{\"a\" 1}", b"01", b"\"\\x\"", b"[1] x", b"nul", b"\"\x01\""):
        with pytest.raises(ValueError):
            native._loads(bad)
    with pytest.raises(Unsupported):
        native._loads(b"18446744073709551616")
