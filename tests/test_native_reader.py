"""The native core's reader (`GroupedCore.read` + `apply_read`, native/src/core/read.rs)
against the Python reader it stands in for (`UnitReader.read`, then the same core's
`apply_batch`): over random `jsonl` batches in several partitions — clean records and
every kind of record Python dead-letters or reads its own way — the native reader
either declines the batch (it had such a record) or gives the very same view, delta
and state records, dead letters, held-over `-C`s and touched keys. A clean batch it
must take."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from refold_native import Unsupported

from refold.codecs.jsonl import event_time_from_iso
from refold.config import Pipeline, parse_pipeline
from refold.model.reasons import Reason
from refold.recovery.records import PendingRecord
from refold.runtime.batch import DeadLetters, InputRecord, Outgoing, UnitReader
from refold.runtime.native import native_core, read_batch
from refold.runtime.shards import KeyCheck

COLUMNS = {"total": {"sum": "x"}, "n": {"count": "*"}, "best": {"max": "x"}, "latest": {"last": "w"}}


def make_pipeline(keyed: bool, form: str) -> Pipeline:
    source: dict[str, Any] = {"topic": "t"}
    if keyed:
        source["key"] = ["k"]
    return parse_pipeline({
        "pipeline": "reader",
        "source": source,
        "view": {"key": ["k"], "columns": COLUMNS},
        "outputs": {"view": {"topic": "v", "form": form}, "delta": {"topic": "d"}},
    })


class Side:
    """One reader with its own core, dead letters and held-over `-C`s."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.core = native_core(pipeline)
        assert self.core is not None
        self.keys = KeyCheck(pipeline)
        self.keys.verified = True  # a mismatch is a dead letter, not a stop, on both sides
        self.dead_letters = DeadLetters("t", "reader", False)
        self.reader = UnitReader(pipeline, self.dead_letters, self.keys)
        self.pending: dict[int, PendingRecord] = {}

    def python(self, fresh: Sequence[InputRecord]) -> tuple[Outgoing, set[bytes]]:
        out = Outgoing()
        read = self.reader.read(fresh, self.pending, out)
        touched = set(self.core.touched(read.units))
        refused, out.view, out.delta, out.state = self.core.apply_batch(read.units)
        for unit_index, index, reason, _detail in refused:
            self.dead_letters.refuse(out, read.units[unit_index], index, Reason(reason))
        out.dlq.sort(key=lambda letter: (letter.partition, letter.offset))
        self.pending = read.pending
        return out, touched

    def native(self, fresh: Sequence[InputRecord]) -> tuple[Outgoing, set[bytes]] | None:
        out = Outgoing()
        read = read_batch(self.core, self.reader, fresh, self.pending)
        if read is None:
            return None
        refused, out.view, out.delta, out.state = self.core.apply_read()
        read.refuse(refused, self.dead_letters, out)
        out.dlq.sort(key=lambda letter: (letter.partition, letter.offset))
        self.pending = read.pending
        return out, read.touched


# --------------------------------------------------------------------------------------
# Records

NAMES = ["ann", "bob", "cy"]
OPS = {"+A": ["+A", 0, "0"], "-R": ["-R", 1, "1"], "-C": ["-C", 2, "2"], "+C": ["+C", 3, "3"]}
# records the native reader must decline (Python dead-letters them or reads them its own way)
NOISE = ["not json", "array", "no op", "op X", "op true", "op float", "iso time", "float time", "null value",
         "orphan +C", "broken pair", "pair keys differ", "key mismatch", "key envelope", "unsupported",
         "big int", "float key"]


class Source:
    """Random record batches over a few partitions: rows from a small pool (so that
    retractions find live copies, and some do not), each op in any of its spellings."""

    def __init__(self, data: st.DataObject, partitions: int, noisy: bool) -> None:
        self.data = data
        self.partitions = partitions
        self.noisy = noisy
        self.offsets = [0] * partitions
        self.live: list[list[dict[str, Any]]] = [[] for _ in range(partitions)]
        self.held: dict[int, dict[str, Any]] = {}  # partition -> the row of its held -C's +C
        self.dirty = False

    def _row(self, p: int) -> dict[str, Any]:
        d = self.data
        live = self.live[p]
        again = d.draw(st.booleans())
        if live and again:
            return dict(live[d.draw(st.integers(0, len(live) - 1))])
        row: dict[str, Any] = {"k": d.draw(st.sampled_from(NAMES)), "x": d.draw(st.integers(-5, 5))}
        if d.draw(st.booleans()):
            row["w"] = d.draw(st.sampled_from([None, "a", "b", 2]))
        if d.draw(st.integers(0, 5)) == 0:
            row["nested"] = {"z": [1, {"y": None}], "a": 1.5}
        return row

    def _value(self, op: str, row: dict[str, Any]) -> dict[str, Any]:
        d = self.data
        value: dict[str, Any] = {"op": d.draw(st.sampled_from(OPS[op]))}
        when = d.draw(st.integers(0, 3))
        if when == 1:
            value["event_time"] = d.draw(st.integers(0, 50))  # may go backwards
        elif when == 2:
            value["event_time"] = None
        value.update(row)
        if d.draw(st.integers(0, 8)) == 0:
            value["offset"] = 7  # output system columns: dropped on input
            value["system_time"] = 9
        return value

    def _record(self, p: int, value: dict[str, Any] | bytes | None, key: Any = None) -> InputRecord:
        offset = self.offsets[p]
        self.offsets[p] += 1
        if key is None and isinstance(value, dict) and "k" in value:
            key = {"k": value["k"]}
        key_bytes = orjson.dumps(key) if key is not None else None
        raw = orjson.dumps(value) if isinstance(value, dict) else value
        return InputRecord(p, offset, key_bytes, raw, 1_000 + offset)

    def _clean(self, p: int) -> list[InputRecord]:
        d = self.data
        live = self.live[p]
        kind = d.draw(st.sampled_from(["+A", "+A", "-R", "pair"]))
        row = self._row(p)
        if kind == "+A":
            live.append(row)
            return [self._record(p, self._value("+A", row))]
        if kind == "-R":
            if row in live:
                live.remove(row)
            return [self._record(p, self._value("-R", row))]
        new = {**row, "x": d.draw(st.integers(-5, 5))}
        if row in live:
            live.remove(row)
        live.append(new)
        return [self._record(p, self._value("-C", row)), self._record(p, self._value("+C", new))]

    def _noise(self, p: int) -> list[InputRecord]:
        d = self.data
        kind = d.draw(st.sampled_from(NOISE))
        event(f"noise: {kind}")
        row = self._row(p)
        plain = self._value("+A", row)
        if kind == "not json":
            return [self._record(p, b"{not json", {"k": row["k"]})]
        if kind == "array":
            return [self._record(p, b"[1, 2]", {"k": row["k"]})]
        if kind == "no op":
            return [self._record(p, {key: v for key, v in plain.items() if key != "op"})]
        if kind in ("op X", "op true", "op float"):
            return [self._record(p, {**plain, "op": {"op X": "X", "op true": True, "op float": 0.0}[kind]})]
        if kind == "iso time":
            return [self._record(p, {**plain, "event_time": "2026-11-25T10:00:00Z"})]
        if kind == "float time":
            return [self._record(p, {**plain, "event_time": 1.5})]
        if kind == "null value":
            return [self._record(p, None, {"k": row["k"]})]
        if kind == "orphan +C":
            return [self._record(p, self._value("+C", row))]
        if kind == "broken pair":
            return [self._record(p, self._value("-C", row)), self._record(p, self._value("+A", row))]
        if kind == "pair keys differ":
            return [self._record(p, self._value("-C", row)),
                    self._record(p, self._value("+C", {**row, "k": "zed"}))]
        if kind == "key mismatch":
            return [self._record(p, plain, {"k": "someone else"})]
        if kind == "key envelope":
            return [self._record(p, plain, {"schema": {}, "payload": {"k": row["k"]}})]
        if kind == "unsupported":
            return [self._record(p, {**plain, "x": 2.5})]  # a float in a summed column
        if kind == "big int":  # orjson reads past 64 bits as a float, past 63 as an int
            digits = d.draw(st.sampled_from([b"1180591620717411303424", b"18446744073709551615"]))
            return [self._record(p, orjson.dumps(plain)[:-1] + b',"w":' + digits + b"}", {"k": row["k"]})]
        return [self._record(p, {**plain, "k": 1.0}, {"k": 1})]  # float key

    def batch(self) -> list[InputRecord]:
        """The next batch, shuffled; `dirty` says whether it has noise."""
        d = self.data
        self.dirty = False
        records: list[InputRecord] = []
        for p in range(self.partitions):
            if p in self.held:  # the +C of the -C that ended the partition's last batch
                records.append(self._record(p, self._value("+C", self.held.pop(p))))
            for _ in range(d.draw(st.integers(0, 6))):
                if self.noisy and d.draw(st.integers(0, 6)) == 0:
                    self.dirty = True
                    records += self._noise(p)
                else:
                    records += self._clean(p)
            if d.draw(st.integers(0, 5)) == 0:  # a -C whose +C comes in the next batch
                row = self._row(p)
                new = {**row, "x": 0}
                if row in self.live[p]:
                    self.live[p].remove(row)
                self.live[p].append(new)
                records.append(self._record(p, self._value("-C", row)))
                self.held[p] = new
        order = d.draw(st.permutations(range(len(records))))  # Spark's order is not the offsets'
        return [records[i] for i in order]


def _same(a: tuple[Outgoing, set[bytes]], b: tuple[Outgoing, set[bytes]]) -> None:
    (one, touched_one), (two, touched_two) = a, b
    assert two.view == one.view
    assert two.delta == one.delta
    assert two.state == one.state
    assert two.dlq == one.dlq
    assert touched_two == touched_one


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_the_native_reader_reads_as_the_python_reader_or_declines(data: st.DataObject) -> None:
    pipeline = make_pipeline(keyed=data.draw(st.booleans()), form=data.draw(st.sampled_from(["changelog", "retract"])))
    python, native = Side(pipeline), Side(pipeline)
    source = Source(data, data.draw(st.integers(1, 3)), noisy=data.draw(st.booleans()))
    for _ in range(data.draw(st.integers(1, 5))):
        fresh = source.batch()
        try:
            want = python.python(fresh)
        except Unsupported:
            event("unsupported")
            with pytest.raises(Unsupported):  # the native reader declines, or its core refuses too
                if native.native(fresh) is None:
                    native.python(fresh)
            return
        got = native.native(fresh)
        if got is None:
            assert source.dirty, "a clean batch was declined"
            event("declined")
            got = native.python(fresh)  # as the engine does
        else:
            event("read natively")
        _same(want, got)
        assert native.pending == python.pending


def test_a_clean_batch_is_read_natively_and_its_held_correction_waits() -> None:
    pipeline = make_pipeline(keyed=True, form="changelog")
    python, native = Side(pipeline), Side(pipeline)
    native.keys.verified = False

    def rec(p: int, offset: int, value: dict[str, Any], ts: int = 5) -> InputRecord:
        return InputRecord(p, offset, orjson.dumps({"k": value["k"]}), orjson.dumps(value), ts)

    first = [
        rec(1, 0, {"op": "+A", "k": "ann", "x": 3, "event_time": 9}),
        rec(0, 0, {"op": 0, "k": "bob", "x": 1}),  # event time: the record's timestamp
        rec(0, 1, {"op": "1", "k": "bob", "x": 2}),  # not live: a dead letter
        rec(1, 1, {"op": "-C", "k": "ann", "x": 3}),  # its +C comes in the next batch
    ]
    want, got = python.python(first), native.native(first)
    assert got is not None
    _same(want, got)
    assert native.keys.verified
    assert [letter.reason for letter in got[0].dlq] == [Reason.NOT_LIVE]
    assert native.pending == python.pending
    assert list(native.pending) == [1] and native.pending[1].offset == 1
    second = [rec(1, 2, {"op": "+C", "k": "ann", "x": 4})]
    want, got = python.python(second), native.native(second)
    assert got is not None
    _same(want, got)
    assert native.pending == python.pending == {}
    assert native.core.view() == python.core.view()
    assert native.core.view()[("ann",)]["total"] == 4


def test_a_batch_with_a_bad_record_is_declined_whole() -> None:
    pipeline = make_pipeline(keyed=False, form="changelog")
    side = Side(pipeline)
    key = b'{"k":"ann"}'
    records = [InputRecord(0, 0, key, b'{"op": "+A", "k": "ann", "x": 1}', 1),
               InputRecord(0, 1, key, b'{"op": "+A", "k": "ann", "event_time": "2026-11-25"}', 1)]
    assert side.native(records) is None
    out, _ = side.python(records)
    # the ISO event time is Python's to read: both apply (+A, then -C/+C of the key)
    assert [record[2] for record in out.view] == [1] + [event_time_from_iso("2026-11-25")] * 2
