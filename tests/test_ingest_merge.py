"""The snapshot merge, property-tested: for random sequences of snapshots (keys added,
changed, removed and re-added; compound keys; compare_columns; nulls), the topic's
changelog after each ingest folds (with the reference) to exactly that snapshot, and
each ingest's changelog is the minimal one. Most examples run the diff without a
broker; a few go through the real one."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refold.ingest import BadInput, ingest, merge
from refold.ingest.live import LiveRows, LocalTable, MemoryTable
from refold.ingest.merge import Change, InputRow
from refold.kafka.io import read_to_end
from refold.model.changelog import Op, canonical_row
from refold.reduce import ViewChange
from refold.reference import fold_changelog

KEY = ["k1", "k2"]
Row = dict[str, Any]

values = st.one_of(st.none(), st.integers(-3, 3), st.sampled_from(["x", "y", "é"]))
keys = st.tuples(st.integers(0, 4), st.sampled_from(["a", "b"]))


typed_a = st.one_of(st.none(), st.integers(-3, 3))  # a file's column keeps one type
typed_b = st.one_of(st.none(), st.sampled_from(["x", "y", "é"]))


@st.composite
def snapshots(draw: st.DrawFn, typed: bool = False) -> list[list[Row]]:
    """A few snapshots over a small key space, so keys come, change, go and come back."""
    a, b = (typed_a, typed_b) if typed else (values, values)
    out = []
    for _ in range(draw(st.integers(1, 5))):
        chosen = draw(st.lists(keys, unique=True, max_size=8))
        out.append([{"k1": k1, "k2": k2, "a": draw(a), "b": draw(b)} for k1, k2 in chosen])
    return out


def _view(changes: Sequence[tuple[Op, Row]], key: Sequence[str]) -> dict[tuple[Any, ...], Row]:
    return fold_changelog(ViewChange(op, tuple(row[c] for c in key), row, tuple(key)) for op, row in changes)


def _expected(previous: dict[tuple[Any, ...], Row], snapshot: list[Row],
              compare: Sequence[str] | None) -> tuple[dict[tuple[Any, ...], Row], int]:
    """The rows the topic must hold after the snapshot, and the minimal number of changes."""
    out, count = {}, 0
    for row in snapshot:
        key = (row["k1"], row["k2"])
        old = previous.get(key)
        if old is None:
            out[key], count = row, count + 1
        elif merge.differs(old, row, compare):
            out[key], count = row, count + 2
        else:
            out[key] = old  # unchanged (on the compared columns): the topic keeps its row
    count += sum(1 for key in previous if key not in out)
    return out, count


def _ingest_in_memory(live: LiveRows, snapshot: list[Row], compare: Sequence[str] | None,
                      now: int) -> list[Change]:
    rows = [InputRow(dict(r), f"snapshot:line {i + 1}", now) for i, r in enumerate(snapshot)]
    with MemoryTable() as scratch:
        changes = list(merge.snapshot(live, rows, scratch, now=now, compare_columns=compare))
    i = 0
    while i < len(changes):  # what the topic's fold applies: the -C/+C pairs as one unit
        unit = changes[i:i + 2] if changes[i].op is Op.CORRECT_FROM else changes[i:i + 1]
        assert live.apply([(c.op, c.row) for c in unit]) is None
        i += len(unit)
    return changes


@settings(max_examples=300, deadline=None)
@given(sequence=snapshots(), compare=st.sampled_from([None, ["a"], ["a", "b"]]))
def test_snapshot_by_key_folds_to_each_snapshot_minimally(sequence: list[list[Row]],
                                                          compare: list[str] | None) -> None:
    topic: list[tuple[Op, Row]] = []
    with MemoryTable() as state:
        live = LiveRows(KEY, state)
        for number, snapshot in enumerate(sequence):
            before = _view(topic, KEY)
            want, minimal = _expected(before, snapshot, compare)
            changes = _ingest_in_memory(live, snapshot, compare, now=number)
            topic.extend((c.op, c.row) for c in changes)
            assert _view(topic, KEY) == want
            assert len(changes) == minimal
            assert all(c.group == orjson.dumps({"k1": c.row["k1"], "k2": c.row["k2"]}) for c in changes)


@settings(max_examples=200, deadline=None)
@given(sequence=st.lists(st.lists(st.fixed_dictionaries({"v": st.integers(0, 3), "w": values}), max_size=8),
                         min_size=1, max_size=5))
def test_snapshot_without_key_is_the_multiset_diff(sequence: list[list[Row]]) -> None:
    live_rows: Counter[bytes] = Counter()
    with MemoryTable() as state:
        live = LiveRows([], state)
        for number, snapshot in enumerate(sequence):
            changes = _ingest_in_memory(live, snapshot, None, now=number)
            want = Counter(canonical_row(r) for r in snapshot)
            assert len(changes) == sum(((want - live_rows) + (live_rows - want)).values())  # minimal
            for change in changes:
                live_rows[canonical_row(change.row)] += change.op.diff
            assert +live_rows == want


def test_a_duplicate_key_in_a_snapshot_names_both_lines(tmp_path: Path) -> None:
    with LocalTable(tmp_path) as state, LocalTable(tmp_path) as scratch:
        rows = [InputRow({"k1": 1, "k2": "a"}, "s.csv:line 2"), InputRow({"k1": 1, "k2": "a"}, "s.csv:line 5")]
        with pytest.raises(BadInput, match=r"s\.csv:line 5: primary key .* twice .*first at s\.csv:line 2"):
            list(merge.snapshot(LiveRows(KEY, state), rows, scratch, now=0))


# The same on the real broker: a few examples -------------------------------------------------------


@pytest.mark.kafka
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequence=snapshots(typed=True), compare=st.sampled_from([None, ["a"]]))
def test_snapshots_on_the_broker(bootstrap_servers: str, tmp_path: Path, sequence: list[list[Row]],
                                 compare: list[str] | None) -> None:
    config = {"bootstrap.servers": bootstrap_servers}
    name = f"t-ingest-property-{uuid.uuid4().hex[:10]}"
    expected: dict[tuple[Any, ...], Row] = {}
    seen = 0
    for number, snapshot in enumerate(sequence):
        path = tmp_path / f"{name}-{number}.jsonl"
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in snapshot))
        expected, minimal = _expected(expected, snapshot, compare)
        result = ingest(config, name, [str(path)], merge_strategy="snapshot", primary_key=KEY,
                        compare_columns=compare, partitions=2, now=number, name=f"snapshot {number}")
        assert result.written == minimal
        records = [orjson.loads(m.value() or b"null") for m in read_to_end(config, name)]
        by_key: dict[bytes, list[tuple[Op, Row]]] = {}
        for record in records:
            op = Op.parse(record.pop("op"))
            record.pop("event_time", None)
            by_key.setdefault(orjson.dumps([record["k1"], record["k2"]]), []).append((op, record))
        assert len(records) == seen + minimal
        seen = len(records)
        folded = {}
        for changes in by_key.values():  # a key's records are in one partition, in order
            folded.update(_view(changes, KEY))
        assert folded == expected
