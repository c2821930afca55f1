"""Joins of two changelogs: the engine's join reducer (`refold.reduce.join`) against the
independent reference (`refold.reference_joins`), record by record, through a shard's
RocksDB store (state beyond memory) and its `P.state` records (a restart); the final
joined table against DuckDB running the same SQL; a grouped view over the join's output.

The join is not wired into the runtime yet (the pipeline's plan comes first): the
driver here is what a shard does around its reducer — load the keys a batch touches
from the store, apply the units, write the batch's state changes to the store — with
random batch cuts and a reducer that forgets what it holds between batches.
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refold.config import JoinSpec, ViewSpec
from refold.model.changelog import Op
from refold.reduce import GroupedReducer, Rejected, SourceEvent, ViewChange
from refold.reduce.join import JOIN_RECORD_FIRST, JoinReducer, state_prefix
from refold.reference import reference_changelog
from refold.reference_joins import reference_join
from refold.sql import translate
from refold.state import ShardId, ShardStore, Stamp

Unit = tuple[int, list[SourceEvent]]

COLUMNS = {"id": "orders.id", "ck": "orders.cust", "amount": "orders.amount",
           "cid": "customers.cid", "region": "customers.region"}


def spec_of(kind: str, key: list[str] | None) -> JoinSpec:
    return JoinSpec(left="orders", right="customers", on=[("cust", "cid")], type=kind,  # type: ignore[arg-type]
                    columns=COLUMNS, key=key)


# random changelogs ----------------------------------------------------------------------

@st.composite
def changelogs(draw: st.DrawFn) -> list[Unit]:
    """Units of both sides: appends, retractions, corrections that may change the join
    key, many rows per key on both sides, null join keys, now and then a retraction of
    a row that is not live."""
    live: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
    keys = st.one_of(st.none(), st.integers(0, 3))

    def new_row(side: int) -> dict[str, Any]:
        if side == 0:
            return {"id": draw(st.integers(0, 6)), "cust": draw(keys), "amount": draw(st.integers(1, 9))}
        return {"cid": draw(keys), "region": draw(st.sampled_from(["eu", "us", "asia", None]))}

    units: list[Unit] = []
    offset = 0
    for _ in range(draw(st.integers(1, 40))):
        side = draw(st.integers(0, 1))
        rows = live[side]
        what = draw(st.sampled_from(["add", "add", "retract", "correct", "stray"]))
        tag = (offset, side, offset)
        offset += 1
        if what == "add" or (what in ("retract", "correct") and not rows):
            row = new_row(side)
            rows.append(row)
            units.append((side, [SourceEvent(Op.APPEND, row, tag)]))
        elif what == "retract":
            row = rows.pop(draw(st.integers(0, len(rows) - 1)))
            units.append((side, [SourceEvent(Op.RETRACT, row, tag)]))
        elif what == "correct":
            old = rows.pop(draw(st.integers(0, len(rows) - 1)))
            new = dict(old)
            if side == 0:
                new["amount"] = draw(st.integers(1, 9))
                if draw(st.booleans()):
                    new["cust"] = draw(keys)
            else:
                new["region"] = draw(st.sampled_from(["eu", "us", "asia"]))
                if draw(st.booleans()):
                    new["cid"] = draw(keys)
            rows.append(new)
            units.append((side, [SourceEvent(Op.CORRECT_FROM, old, tag),
                                 SourceEvent(Op.CORRECT_TO, new, (offset, side, offset))]))
            offset += 1
        else:  # a retraction of a row that is not live: refused, nothing changes
            units.append((side, [SourceEvent(Op.RETRACT, new_row(side) | {"stray": True}, tag)]))
    return units


# the driver: a shard's batches around the join reducer ------------------------------------

class Shard:
    """A join's shard without Kafka: the store, the reducer, and the `P.state` records
    the batches would have committed (latest value per record key)."""

    def __init__(self, spec: JoinSpec, root: Path, name: str = "j") -> None:
        self.spec = spec
        self.store = ShardStore.open(ShardId(name, "0", 0), root)
        self.reducer = JoinReducer(spec)
        self.held: set[bytes] = set()
        self.batch = 0
        self.pstate: dict[bytes, bytes] = {}

    def run(self, batch: Sequence[Unit]) -> tuple[list[ViewChange], list[int]]:
        """One batch: load what it touches, apply its units, commit its state changes.
        Returns its records and the indexes (in the batch) of the units refused."""
        wanted = set()
        for side, events in batch:
            for event in events:
                key = self.reducer.state_key(side, event)
                if key is not None:
                    wanted.add(state_prefix(key))
        self.reducer.restore(self.store.load_keys(wanted - self.held))
        self.held |= wanted
        changes: list[ViewChange] = []
        refused = []
        for index, (side, events) in enumerate(batch):
            try:
                changes.extend(self.reducer.apply(side, events))
            except Rejected:
                refused.append(index)
        self.batch += 1
        state = self.reducer.take_state_changes()
        for record_key, value in state:
            if value is None:
                self.pstate.pop(record_key, None)
            else:
                self.pstate[record_key] = value
        self.store.apply(state, Stamp(self.batch, self.batch))
        return changes, refused

    def forget(self) -> None:
        """An empty reducer: the next batches load what they touch from the store."""
        self.reducer = JoinReducer(self.spec)
        self.held = set()

    def close(self) -> None:
        self.store.close()


def run_cut(spec: JoinSpec, units: list[Unit], cuts: list[int], forgets: list[bool], root: Path,
            restart_at: int | None = None) -> tuple[list[ViewChange], list[int], Shard]:
    """The units in batches cut at `cuts`; the reducer forgets after batch i when
    `forgets[i]`; at batch `restart_at` the shard starts again on a new store restored
    from its `P.state` records alone."""
    shard = Shard(spec, root)
    changes: list[ViewChange] = []
    refused: list[int] = []
    bounds = [0, *sorted(set(cuts)), len(units)]
    for number, (start, end) in enumerate(itertools.pairwise(bounds)):
        if number == restart_at:
            records = sorted(shard.pstate.items())
            shard.close()
            shard = Shard(spec, root, name=f"restarted{number}")
            shard.pstate = dict(records)
            shard.store.apply(records, Stamp(shard.batch, 0))
        got, bad = shard.run(units[start:end])
        changes.extend(got)
        refused.extend(start + index for index in bad)
        if forgets[number % len(forgets)]:
            shard.forget()
    return changes, refused, shard


def records(changes: Sequence[ViewChange]) -> list[tuple[str, tuple[Any, ...], bytes]]:
    return [(change.op.code, change.key, orjson.dumps(change.row, option=orjson.OPT_SORT_KEYS))
            for change in changes]


def fold(changes: Sequence[ViewChange]) -> Counter[bytes]:
    """The joined table a changelog ends with, as a multiset of rows."""
    table: Counter[bytes] = Counter()
    for change in changes:
        row = orjson.dumps(change.row, option=orjson.OPT_SORT_KEYS)
        table[row] += 1 if change.op.adds else -1
        assert table[row] >= 0, f"{change.op.code} of a row the output does not hold: {change.row}"
    return +table


# the differential test -------------------------------------------------------------------

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]),
       key=st.sampled_from([None, ["id"], ["region"]]), data=st.data())
def test_join_equals_reference(units: list[Unit], kind: str, key: list[str] | None, data: st.DataObject) -> None:
    spec = spec_of(kind, key)
    cuts = data.draw(st.lists(st.integers(0, len(units)), max_size=6), label="cuts")
    forgets = data.draw(st.lists(st.booleans(), min_size=1, max_size=4), label="forgets")
    expected = reference_join(spec, units)
    with tempfile.TemporaryDirectory() as root:
        changes, refused, shard = run_cut(spec, units, cuts, forgets, Path(root))
        shard.close()
    assert refused == [index for index, _ in expected.rejected]
    assert records(changes) == records(expected.changes)
    assert fold(changes) == Counter(orjson.dumps(r, option=orjson.OPT_SORT_KEYS) for r in expected.rows)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]), data=st.data())
def test_join_restarts_from_its_state_records(units: list[Unit], kind: str, data: st.DataObject) -> None:
    """A shard that starts again on an empty store, restored from the `P.state` records
    alone, continues exactly: the whole output equals the reference's."""
    spec = spec_of(kind, ["id"])
    cuts = data.draw(st.lists(st.integers(0, len(units)), min_size=1, max_size=4), label="cuts")
    restart_at = data.draw(st.integers(1, len(set(cuts)) + 1), label="restart_at")
    expected = reference_join(spec, units)
    with tempfile.TemporaryDirectory() as root:
        changes, refused, shard = run_cut(spec, units, cuts, [False], Path(root), restart_at=restart_at)
        held = sorted(shard.store.items(JOIN_RECORD_FIRST))
        shard.close()
    assert refused == [index for index, _ in expected.rejected]
    assert records(changes) == records(expected.changes)
    # the store holds exactly each side's live rows (the columns the output takes), and
    # nothing of a key left empty
    restored = JoinReducer(spec)
    restored.restore(held)
    for side in (0, 1):
        kept = [column for _, s, column in spec.outputs if s == side]  # what a live row keeps
        live = Counter(orjson.dumps({c: row[c] for c in kept if c in row}, option=orjson.OPT_SORT_KEYS)
                       for row in expected.live[side])
        got: Counter[bytes] = Counter()
        for rows in restored.sides[side].values():
            for entry in rows.values():
                got[orjson.dumps(entry.row, option=orjson.OPT_SORT_KEYS)] += entry.count
        assert got == live


def test_customer_moving_region_corrects_each_order() -> None:
    """A customer corrected from one region to another: each of its orders' joined rows
    is corrected in place (its key, the order id, stays)."""
    spec = spec_of("left", ["id"])
    customer = {"cid": 1, "region": "eu"}
    units: list[Unit] = [
        (0, [SourceEvent(Op.APPEND, {"id": 10, "cust": 1, "amount": 5}, (0, 0, 0))]),
        (0, [SourceEvent(Op.APPEND, {"id": 11, "cust": 1, "amount": 7}, (1, 0, 1))]),
        (1, [SourceEvent(Op.APPEND, customer, (2, 1, 0))]),
        (1, [SourceEvent(Op.CORRECT_FROM, customer, (3, 1, 1)),
             SourceEvent(Op.CORRECT_TO, {"cid": 1, "region": "us"}, (3, 1, 2))]),
        (1, [SourceEvent(Op.RETRACT, {"cid": 1, "region": "us"}, (4, 1, 3))]),
    ]
    reducer = JoinReducer(spec)
    engine = [reducer.apply(side, events) for side, events in units]
    assert [[(c.op.code, c.key, c.row["region"]) for c in unit] for unit in engine] == [
        [("+A", (10,), None)],
        [("+A", (11,), None)],
        [("-R", (10,), None), ("+A", (10,), "eu"), ("-R", (11,), None), ("+A", (11,), "eu")],
        [("-C", (10,), "eu"), ("+C", (10,), "us"), ("-C", (11,), "eu"), ("+C", (11,), "us")],
        [("-R", (10,), "us"), ("+A", (10,), None), ("-R", (11,), "us"), ("+A", (11,), None)],
    ]
    assert records([c for unit in engine for c in unit]) == records(reference_join(spec, units).changes)


def test_null_join_keys_never_match() -> None:
    spec = spec_of("full", None)
    reducer = JoinReducer(spec)
    left = reducer.apply(0, [SourceEvent(Op.APPEND, {"id": 1, "cust": None, "amount": 3}, (0, 0, 0))])
    right = reducer.apply(1, [SourceEvent(Op.APPEND, {"cid": None, "region": "eu"}, (1, 1, 0))])
    assert [(c.op.code, c.row["id"], c.row["region"]) for c in [*left, *right]] == [("+A", 1, None), ("+A", None, "eu")]
    with pytest.raises(Rejected, match="not live"):
        reducer.apply(1, [SourceEvent(Op.RETRACT, {"cid": None, "region": "us"}, (2, 1, 1))])


# the joined table against DuckDB --------------------------------------------------------

JOIN_SQL = {
    "inner": "SELECT o.id, o.amount, c.region FROM orders AS o JOIN customers AS c ON o.cust = c.cid",
    "left": "SELECT o.id, o.amount, c.region FROM orders o LEFT OUTER JOIN customers c ON o.cust = c.cid",
    "full": "SELECT o.id, c.cid, o.amount, c.region FROM orders o FULL OUTER JOIN customers c ON c.cid = o.cust",
}


def duckdb_rows(sql: str, live: tuple[list[dict[str, Any]], list[dict[str, Any]]]) -> Counter[bytes]:
    """What DuckDB gives for `sql` over the two sides' live rows."""
    con = duckdb.connect()
    try:
        con.execute("CREATE TABLE orders (id INTEGER, cust INTEGER, amount INTEGER)")
        con.execute("CREATE TABLE customers (cid INTEGER, region VARCHAR)")
        for row in live[0]:
            con.execute("INSERT INTO orders VALUES (?, ?, ?)", [row["id"], row["cust"], row["amount"]])
        for row in live[1]:
            con.execute("INSERT INTO customers VALUES (?, ?)", [row["cid"], row["region"]])
        cursor = con.execute(sql)
        names = [d[0] for d in cursor.description]
        return Counter(orjson.dumps(dict(zip(names, row, strict=True)), option=orjson.OPT_SORT_KEYS)
                       for row in cursor.fetchall())
    finally:
        con.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]), data=st.data())
def test_joined_table_equals_duckdb(units: list[Unit], kind: str, data: st.DataObject) -> None:
    """The SQL translated to a join spec, run by the engine over the changelogs, ends
    with the table DuckDB computes from the same SQL over both sides' live rows."""
    sql = JOIN_SQL[kind]
    spec = JoinSpec.model_validate(translate(sql).spec["join"])
    cuts = data.draw(st.lists(st.integers(0, len(units)), max_size=4), label="cuts")
    with tempfile.TemporaryDirectory() as root:
        changes, refused, shard = run_cut(spec, units, cuts, [True, False], Path(root))
        shard.close()
    live: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
    for index, (side, events) in enumerate(units):  # each side's live rows, folded apart from both joins
        if index in refused:
            continue
        for event in events:
            if event.op.adds:
                live[side].append(event.row)
            else:
                live[side].remove(event.row)
    assert fold(changes) == duckdb_rows(sql, live)


# a grouped view over the join's output ----------------------------------------------------

def as_units(changes: Sequence[ViewChange]) -> list[list[SourceEvent]]:
    """A join's records as the units a view over it reads: a `-C` with its `+C`."""
    units: list[list[SourceEvent]] = []
    for offset, change in enumerate(changes):
        event = SourceEvent(change.op, change.row, (offset, 0, offset))
        if change.op is Op.CORRECT_TO:
            units[-1].append(event)
        else:
            units.append([event])
    return units


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]))
def test_grouped_view_over_the_join(units: list[Unit], kind: str) -> None:
    """Revenue per region over the join: the grouped reducer fed the engine join's
    records equals the reference grouped view over the reference join's records."""
    spec = spec_of(kind, ["id"])
    view = ViewSpec.model_validate({"key": ["region"], "columns": {"revenue": {"sum": "amount"},
                                                                    "orders": {"count": "id"}}})
    reducer = JoinReducer(spec)
    joined = []
    for side, events in units:
        with contextlib.suppress(Rejected):
            joined.extend(reducer.apply(side, events))
    grouped = GroupedReducer(view)
    got = []
    rejected = []
    for index, unit in enumerate(as_units(joined)):
        try:
            got.extend(grouped.apply(unit))
        except Rejected as exc:
            rejected.append((index, exc.reason))
    expected = reference_changelog(view, as_units(reference_join(spec, units).changes))
    assert records(got) == records(expected.changes)
    assert rejected == expected.rejected  # null regions (unmatched orders) are refused alike


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]))
def test_grouped_join_sql_equals_duckdb(units: list[Unit], kind: str) -> None:
    """Revenue per region in SQL: translated into a join and a grouped view over it, run
    by the join reducer and the grouped reducer, it ends with DuckDB's table for the same
    query over both sides' live rows (groups of a null region left out: Refold refuses
    a null key, SQL groups nulls together)."""
    written = {"inner": "JOIN", "left": "LEFT JOIN", "full": "FULL OUTER JOIN"}[kind]
    sql = (f"SELECT c.region, SUM(o.amount) AS revenue, COUNT(o.id) AS orders\n"
           f"FROM orders o {written} customers c ON o.cust = c.cid GROUP BY c.region")
    translated = translate(sql).spec
    join = JoinSpec.model_validate(translated["join"])
    view = ViewSpec.model_validate({name: translated[name] for name in ("key", "columns")})
    reducer = JoinReducer(join)
    live: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
    joined = []
    for side, events in units:
        try:
            joined.extend(reducer.apply(side, events))
        except Rejected:
            continue
        for event in events:
            if event.op.adds:
                live[side].append(event.row)
            else:
                live[side].remove(event.row)
    grouped = GroupedReducer(view)
    for unit in as_units(joined):
        with contextlib.suppress(Rejected):  # a null region
            grouped.apply(unit)
    got = Counter(orjson.dumps(row, option=orjson.OPT_SORT_KEYS) for row in grouped.view().values())
    expected = duckdb_rows(sql.replace("GROUP BY", "WHERE c.region IS NOT NULL GROUP BY"), live)
    # DuckDB's SUM of no non-null values is NULL; Refold's is 0 (docs/sql.md)
    assert got == Counter(orjson.dumps({**orjson.loads(row), "revenue": orjson.loads(row)["revenue"] or 0},
                                       option=orjson.OPT_SORT_KEYS) for row in expected.elements())


def test_the_runtime_refuses_a_join_it_cannot_run_in_one_line() -> None:
    """A join whose grouped view takes `FIRST` of the joined rows (they have no input
    order of their own) validates; the engine refuses to run it, before it reads Kafka
    or starts Spark, with one line naming the column. (A join in `shards: M` with a view
    keyed outside the join key runs: tests/test_join_exchange.py.)"""
    from refold.config import parse_pipeline
    from refold.errors import UserError
    from refold.runtime.processor import BatchProcessor
    from refold.spark.job import run_pipeline

    pipeline = parse_pipeline({
        "pipeline": "revenue", "outputs": {"view": {"topic": "revenue"}}, "shards": 4,
        "sources": {"orders": {"topic": "orders"}, "customers": {"topic": "customers"}},
        "view": {"sql": "SELECT c.region, FIRST(o.amount) AS first_amount FROM orders o JOIN customers c "
                        "ON o.cust = c.cid GROUP BY c.region"},
    })
    for run in (lambda: BatchProcessor(pipeline, {"bootstrap.servers": "127.0.0.1:1"}),
                lambda: run_pipeline(pipeline, "127.0.0.1:1")):
        with pytest.raises(UserError, match=r"^view.columns.first_amount: first orders rows by their input "
                                            r"event; over a join's rows it is not supported yet$") as raised:
            run()
        assert "\n" not in str(raised.value)
