"""The native Top-N core (`refold_native.TopNCore`, native/src/topn/) against the Python
path it replaces: `TopNReducer` + `Renderer` (JSON rows, emit per_event), byte for
byte — view and state records, refusals, the view itself — over random Top-N views and
batches (ties, nulls, mixed kinds in order columns, several groups, restores from each
other's state records), and what it refuses to handle (`Unsupported`), which must
always be a value in the batch, never a bug."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import native_changelogs
import pytest

# imported, not skipped when missing: `make setup` builds it (native/)
from hypothesis import event, given, settings
from hypothesis import strategies as st
from native_changelogs import ChangelogSource, bad_anywhere, check_batch
from refold_native import TopNCore, Unsupported

from refold.config import Pipeline, parse_pipeline
from refold.model.changelog import Op
from refold.reduce import Rejected, SourceEvent
from refold.reduce.statecodec import state_value
from refold.reduce.topn import TopNReducer
from refold.reduce.values import key_bytes
from refold.runtime.render import Renderer

# --------------------------------------------------------------------------------------
# The Python path, as the shard runs it

# (n, order_by pairs, partition_by, columns or None, view form)
Spec = tuple[int, list[tuple[str, str]], list[str], list[str] | None, str]


def make_pipeline(spec: Spec) -> Pipeline:
    n, order_by, partition_by, columns, form = spec
    top_n: dict[str, Any] = {"n": n, "order_by": dict(order_by), "partition_by": list(partition_by)}
    if columns is not None:
        top_n["columns"] = list(columns)
    return parse_pipeline({
        "pipeline": "native-topn",
        "source": {"topic": "t"},
        "view": {"top_n": top_n},
        "outputs": {"view": {"topic": "v", "form": form}},
    })


def make_core(spec: Spec) -> TopNCore:
    n, order_by, partition_by, columns, form = spec
    return TopNCore(n, list(order_by), list(partition_by), columns, form)


class PythonPath:
    """`ShardProcessor._reduce` and the records of a batch, in Python."""

    def __init__(self, spec: Spec) -> None:
        self.pipeline = make_pipeline(spec)
        self.reducer = TopNReducer(self.pipeline.view)
        self.renderer = Renderer(self.pipeline)

    def apply_batch(self, units: Sequence[Sequence[tuple[SourceEvent, Any]]]) -> tuple[list, list, list, list]:
        rejected, changes = [], []
        for unit_index, unit in enumerate(units):
            try:
                changes.append((self.reducer.apply([event for event, _ in unit]), unit[0][0].tag[0]))
            except Rejected as exc:
                rejected.append((unit_index, exc.index, str(exc.reason), exc.detail))
        return rejected, self.renderer.view(changes), [], self.reducer.take_state_changes()

    def touched(self, units: Sequence[Sequence[tuple[SourceEvent, Any]]]) -> set[bytes]:
        keys = {self.reducer.state_key(event) for unit in units for event, _ in unit}
        keys.discard(None)
        return {key_bytes(key) for key in keys}


# --------------------------------------------------------------------------------------
# Which values the native core refuses (`Unsupported`): the test's own account


def unsupported_in(units: Sequence[Sequence[tuple[SourceEvent, Any]]], partition_by: Sequence[str]) -> bool:
    for unit in units:
        for source_event, _ in unit:
            row = source_event.row
            if type(row) is not dict or bad_anywhere(row):
                return True
            if any(type(row.get(k)) in (bool, float) for k in partition_by):
                return True
    return False


# --------------------------------------------------------------------------------------
# Random views and batches

ORDER = ("s", "t", "w")  # s: numbers; t: numbers, strings, booleans; w: anything scalar, or a list
OTHERS = ("x", "op", "n")  # a plain column, one named as the output's `op`, a nested one
TEXT = st.text(alphabet=st.sampled_from(['a', 'b', '"', '\\', '\n', '\x00', 'é', '\u2028', '😀', ' ']), max_size=3)
NESTED = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.5, -0.0, 1.0, 1e16, 1e-7]), TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner),
                            st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=5,
)


@st.composite
def topn_specs(draw: st.DrawFn) -> Spec:
    n = draw(st.sampled_from([1, 2, 3, 4, 11]))
    order = draw(st.lists(st.sampled_from(ORDER), min_size=1, max_size=2, unique=True))
    order_by = [(column, draw(st.sampled_from(["asc", "desc"]))) for column in order]
    partition_by = draw(st.sampled_from([[], ["g"], ["g", "k"], ["k", "g"], ["op"], ["g", "place"]]))
    columns = None
    if draw(st.booleans()):
        columns = draw(st.lists(st.sampled_from(("s", "t", "w", "x", "op", "n", "g", "absent")), min_size=1,
                                max_size=4, unique=True))
    form = draw(st.sampled_from(["changelog", "retract", "upsert"]))
    return n, order_by, partition_by, columns, form


class Source(ChangelogSource):
    """A Top-N's changelog: rows of its groups (`key`: `partition_by`) and order columns,
    ties likely."""

    odds = 4

    def group_value(self) -> Any:
        choice = self.draw(st.integers(0, 60))
        if choice == 0:
            return None
        if choice == 1:
            return ["list"]
        if choice == 2 and self.unsupported:
            return self.draw(st.sampled_from([True, 1.5, 2.0]))
        if choice == 3:
            return "z" * 65_537
        if choice < 30:
            return self.draw(st.integers(-1, 2))
        return self.draw(st.sampled_from(["a", "b", "é\"", "ab"]))

    def number(self) -> Any:
        """Ties are likely: a few small numbers, ints and floats that equal them."""
        return self.draw(st.sampled_from([0, 1, 2, 3, -1, 1.0, 2.5, -0.0, 0.0, 1e300, -1e300, 2**63 - 1, -(2**63),
                                          9007199254740993, 9007199254740992.0, None]))

    def mixed(self) -> Any:
        choice = self.draw(st.integers(0, 9))
        if choice < 4:
            return self.number()
        if choice < 7:
            return self.draw(st.sampled_from(["", "a", "b", "é", "a\"b", "zz"]))
        return self.draw(st.booleans())

    def fresh_row(self) -> dict[str, Any]:
        columns = {
            "s": self.number,
            "t": self.mixed,
            "w": lambda: [1] if self.draw(st.integers(0, 30)) == 0 else self.mixed(),
            "x": lambda: self.draw(st.integers(0, 3)),
            "op": lambda: self.draw(st.sampled_from(["+A", 7, None])),
            "n": lambda: self.draw(NESTED),
        }
        row: dict[str, Any] = {}
        for name in self.draw(st.permutations(list(columns))):
            if self.draw(st.integers(0, 5)) == 0:
                continue  # absent
            row[name] = columns[name]()
        for name in self.key:
            if self.draw(st.integers(0, 60)) == 0:
                continue  # missing partition column
            row[name] = self.group_value()
        if self.unsupported and self.draw(st.integers(0, 60)) == 0:
            row["x"] = self.draw(st.sampled_from([b"bytes", float("nan"), 2**64, "\ud800", {1: 2}]))
        return row

    def same_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """An equal row (canonical bytes): its columns in another order, a null column
        absent or an absent one null."""
        out = {}
        for name, value in self.draw(st.permutations(list(row.items()))):
            if value is None and self.draw(st.booleans()):
                continue
            out[name] = value
        if self.draw(st.integers(0, 4)) == 0:
            out["absent"] = None
        return out

class Pair(native_changelogs.Pair):
    """A `TopNCore` and the Python path (spec: `Spec`)."""

    def fresh(self) -> None:
        self.core = make_core(self.spec)
        self.python = PythonPath(self.spec)

    def unsupported(self, units: Sequence[Sequence[tuple[SourceEvent, Any]]]) -> bool:
        return unsupported_in(units, self.spec[2])

    def held(self) -> int:
        return len(self.python.reducer.groups)


def differential(spec: Spec, data: st.DataObject) -> None:
    """Random Top-N views, several batches in a row: the same records as the Python
    path, with restores from each other's state records in between."""
    pair = Pair(spec)
    source = Source(data, spec[2], unsupported=data.draw(st.integers(0, 3)) == 0)
    for _ in range(data.draw(st.integers(1, 6))):
        event(check_batch(pair, source.batch(), data.draw(st.integers(0, 3)) == 0))
        if data.draw(st.integers(0, 3)) == 0:
            pair.restore()  # a restore round trip of everything


# `differential` over random Top-N views: 150 in `make test`, 1,000 in `make test-slow`
test_differential, test_differential_thorough = native_changelogs.two_tiers(differential, topn_specs())


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(1, 20), direction=st.sampled_from(["asc", "desc"]))
def test_differential_large_group(seed: int, n: int, direction: str) -> None:
    """One group of thousands of live rows (Python's ranking turns into a SortedList past
    512, the core's splits into chunks past 1,024), ranks moving near the top and far
    below it, restores in between."""
    rng = random.Random(seed)
    pair = Pair((n, [("s", direction)], [], None, "changelog"))
    live: list[dict[str, Any]] = []
    offset = 0
    for round_ in range(4):
        units = []
        for _ in range(1_500):
            offset += 1
            row = {"s": rng.randrange(400) if offset % 7 else rng.choice([None, 1.5, "a", True]), "x": offset}
            live.append(row)
            units.append(((SourceEvent(Op.APPEND, row, (offset, 0, offset)), None),))
        for _ in range(600):
            offset += 1
            row = live.pop(rng.randrange(len(live)))
            units.append(((SourceEvent(Op.RETRACT, row, (offset, 0, offset)), None),))
        assert check_batch(pair, units, round_ == 2) == "ok"
        pair.restore()


# --------------------------------------------------------------------------------------
# Fixed cases


def E(op: Op, row: dict[str, Any], t: int = 1) -> tuple:
    return ((SourceEvent(op, row, (t, 0, t)), None),)


def test_leaderboard_of_design_md() -> None:
    """DESIGN.md §2's `match_scores`, a top-2 by score desc, in every form."""
    rows = [(1, 1, "Alice", 100), (1, 1, "Bob", 80), (2, 2, "Alice", 70), (2, 2, "Charlie", 90), (3, 3, "Bob", 60),
            (3, 3, "Charlie", 110)]
    for form in ("changelog", "retract", "upsert"):
        pair = Pair((2, [("score", "desc")], [], None, form))
        units = [E(Op.APPEND, {"match_time": t, "match_id": m, "player_name": p, "score": s}, i)
                 for i, (t, m, p, s) in enumerate(rows, start=1)]
        assert check_batch(pair, units, False) == "ok"
        assert [row["player_name"] for row in sorted(pair.core.view().values(), key=lambda r: r["place"])] == [
            "Charlie", "Alice"]


def test_places_past_nine_across_groups() -> None:
    """A correction that moves a group's best row to another group: both groups' places
    change in one unit, ordered by their output keys' JSON (`["a",10]` before `["a",2]`)."""
    for form in ("changelog", "retract", "upsert"):
        pair = Pair((12, [("s", "desc")], ["g"], ["s"], form))
        units = [E(Op.APPEND, {"g": "a", "s": s}, s) for s in range(1, 14)]
        units += [E(Op.APPEND, {"g": "b", "s": s}, 20 + s) for s in range(1, 14)]
        units.append(((SourceEvent(Op.CORRECT_FROM, {"g": "b", "s": 13}, (40, 0, 40)), None),
                      (SourceEvent(Op.CORRECT_TO, {"g": "a", "s": 14}, (40, 0, 41)), None)))
        assert check_batch(pair, units[:-1], False) == "ok"
        assert check_batch(pair, units[-1:], False) == "ok"


def test_rejections_and_details() -> None:
    spec: Spec = (2, [("s", "desc")], ["g"], None, "changelog")
    pair = Pair(spec)
    batch = [
        E(Op.APPEND, {"s": 1}),  # partition column missing
        E(Op.APPEND, {"g": None, "s": 1}),
        E(Op.APPEND, {"g": [1], "s": 1}),
        E(Op.APPEND, {"g": "é" * 65_537, "s": 1}),
        E(Op.APPEND, {"g": "a", "s": [1]}),  # an order column holds a list
        E(Op.RETRACT, {"g": "a", "s": 1}),  # not live
        E(Op.APPEND, {"g": "a", "s": 1}),
        ((SourceEvent(Op.CORRECT_FROM, {"g": "a", "s": 1}, (2, 0, 2)), None),
         (SourceEvent(Op.CORRECT_TO, {"g": "a", "s": {"no": 1}}, (2, 0, 3)), None)),
        ((SourceEvent(Op.CORRECT_FROM, {"g": "a", "s": 2}, (2, 0, 2)), None),
         (SourceEvent(Op.CORRECT_TO, {"g": "a", "s": 3}, (2, 0, 3)), None)),
    ]
    got = pair.core.apply_batch(batch)
    assert [r[:3] for r in got[0]] == [(0, 0, "null key"), (1, 0, "null key"), (2, 0, "schema mismatch"),
                                       (3, 0, "key too large"), (4, 0, "schema mismatch"), (5, 0, "not live"),
                                       (7, 1, "schema mismatch"), (8, 0, "not live")]
    assert got[0][0][3] == "partition column 'g' is missing"
    pair.fresh()
    assert check_batch(pair, batch, False) == "rejected"


@pytest.mark.parametrize("row", [
    {"g": True, "s": 1},  # a boolean group value
    {"g": 1.5, "s": 1},  # a float group value
    {"g": "a", "s": 2**63},  # past 64 bits
    {"g": "a", "s": 1, "o": float("inf")},
    {"g": "a", "s": 1, "o": b"bytes"},
    {"g": "a", "s": 1, "o": {1: "non-str key"}},
    {"g": "a", "s": 1, "o": "\ud800"},
])
def test_unsupported(row: dict[str, Any]) -> None:
    core = make_core((3, [("s", "asc")], ["g"], None, "changelog"))
    with pytest.raises(Unsupported):
        core.apply_batch([E(Op.APPEND, row)])


def test_constructor_restore_and_no_view_output() -> None:
    with pytest.raises(ValueError):
        TopNCore(3, [("s", "sideways")], [], None, "changelog")
    with pytest.raises(ValueError):
        TopNCore(3, [("s", "asc")], [], None, "sideways")
    with pytest.raises(ValueError):
        TopNCore(0, [("s", "asc")], [], None, "changelog")
    core = TopNCore(1, [("s", "asc")], [], None, None)
    for bad in (b"", b"\x00", b"\x02\x04[]\x02"):
        with pytest.raises(ValueError):
            core.restore([(b'[[],"00000000000000000000000000000000"]', bad)])
    rejected, view, delta, state = core.apply_batch([E(Op.APPEND, {"s": 2}), E(Op.APPEND, {"s": 1}, 2)])
    # no view output: state only, two rows and the group's summary (its places' causes)
    assert (rejected, view, delta, len(state)) == ([], [], [], 3)
    assert (b"[[]]", state_value("KEY_SUMMARY", b"[]", 1, {"c": [[0, 2]]}, ())) in state
    assert core.view() == {(1,): {"place": 1, "s": 1}}
    assert len(core) == 1
