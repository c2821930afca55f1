"""A re-grouping grouped view's stages in the native core against the Python way.

Stage 1 (`GroupedCore.route_with` + `route_read`, native/src/core/route.rs, after its
reader) against stage 1 with the Python reader and the view's checks in Python
(`RouteProcessor._reduce_natively`): over random batches of a changelog keyed by player,
a view per team in 1 or 3 shards, the same routed records to each `P.repartition`
partition (byte for byte, in order), dead letters, `P.rows` records and held-over
`-C`s; a batch the native reader declines goes the Python way in both.

Stage 2 (`read_routed` + `apply_read` of a `GroupedCore` or, for a Top-N per team, a
`TopNCore`: native/src/core/routed.rs) against `ExchangeReader.read` + `apply_batch`:
over what stage-1 shards of several source
partitions routed, interleaved, closed (or now and then not), the same view, delta and
state records and dead letters. No broker: the processors' commits are captured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from refold.config import parse_pipeline
from refold.recovery.records import Checkpoint
from refold.runtime.batch import InputRecord, Outgoing
from refold.runtime.exchange import ApplyProcessor, RouteProcessor, close_value

VIEW = {"key": ["team"], "columns": {"total": {"sum": "score"}, "n": {"count": "*"}, "best": {"max": "score"},
                                     "latest": {"last": "score"}}}


TOP_N = {"top_n": {"n": 2, "order_by": {"score": "desc"}, "partition_by": ["team"]}}


class DryRoute(RouteProcessor):
    """Stage 1's shard without a broker: each batch's outgoing records are kept."""

    def _commit(self, out: Outgoing, checkpoint: Checkpoint) -> None:
        self.sent = out

    def _stamp(self, state: Any, checkpoint: Checkpoint) -> None:
        pass  # the reducer keeps every key it met: nothing is loaded back


class DryApply(ApplyProcessor):
    """Stage 2's shard without a broker: each batch's outgoing records are kept."""

    def _commit(self, out: Outgoing, checkpoint: Checkpoint) -> None:
        self.sent = out

    def _stamp(self, state: Any, checkpoint: Checkpoint) -> None:
        pass


def _pipeline(shards: int, view: dict[str, Any]) -> Any:
    delta = {} if "top_n" in view else {"delta": {"topic": "route.delta"}}
    return parse_pipeline({
        "pipeline": "route", "kafka": {"bootstrap.servers": "127.0.0.1:9"}, "shards": shards,
        "source": {"topic": "scores", "key": ["player"]}, "view": view,
        "outputs": {"view": {"topic": "route.view"}, **delta},
    })


def _processor(shards: int, native_reads: bool, root: Path, shard: int = 0, kind: type = DryRoute,
               view: dict[str, Any] = VIEW) -> Any:
    """A stage's shard (`kind`: DryRoute or DryApply) of `view`, its native core reading
    or not (a Top-N's stage 1 never reads natively)."""
    processor = kind(_pipeline(shards, view), {"bootstrap.servers": "127.0.0.1:9"}, shard, state_root=root,
                     start=False)
    processor.lock()
    assert processor.core is not None and (processor.core_reads or (kind is DryRoute and "top_n" in view))
    processor.core_reads = native_reads
    return processor


def _process_spied(processor: Any, records: list[InputRecord]) -> list[str]:
    """`processor._process_once(records)`, and the names of the core's methods it called."""
    calls: list[str] = []
    if processor.core is not None:
        processor.core = _Spy(processor.core, calls)
    processor._process_once(records)
    if isinstance(processor.core, _Spy):
        processor.core = processor.core._core
    return calls


HYPOTHESIS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                                          HealthCheck.function_scoped_fixture]}


def _records(data: st.DataObject, start: list[int], partitions: int) -> list[InputRecord]:
    """A batch over `partitions`: appends, retractions (some of rows not live), corrections
    that move a row between teams, and now and then a record the native reader declines
    or a unit the view refuses."""
    records = []
    for p in range(partitions):
        for _ in range(data.draw(st.integers(0, 8))):
            player = f"p{data.draw(st.integers(0, 3)) * partitions + p}"
            row = {"player": player, "team": data.draw(st.sampled_from(["t0", "t1", "t2", "t3"])),
                   "score": data.draw(st.integers(0, 5))}
            kind = data.draw(st.sampled_from(["+A", "+A", "-R", "pair", "odd"]))
            if kind == "odd":
                odd = data.draw(st.sampled_from(["null team", "list score", "float score", "no op", "-C alone"]))
                event(f"odd: {odd}")
                if odd == "null team":
                    values = [{"op": "+A", **row, "team": None}]
                elif odd == "list score":
                    values = [{"op": "+A", **row, "score": [1]}]  # the view refuses a summed list
                elif odd == "float score":
                    values = [{"op": "+A", **row, "score": 1.5}]  # the native core does not sum floats
                elif odd == "no op":
                    values = [{**row}]
                else:
                    values = [{"op": "-C", **row}, {"op": "+A", **row}]
            elif kind == "pair":
                moved = {**row, "team": data.draw(st.sampled_from(["t0", "t1", "t2", "t3"]))}
                values = [{"op": "-C", **row}, {"op": "+C", **moved}]
            else:
                values = [{"op": kind, **row}]
            for value in values:
                value["event_time"] = data.draw(st.integers(0, 30))  # may go backwards
                key = orjson.dumps({"player": player})
                records.append(InputRecord(p, start[p], key, orjson.dumps(value), 1))
                start[p] += 1
    return records


@settings(max_examples=150, **HYPOTHESIS)
@given(data=st.data())
def test_stage_one_routes_natively_as_in_python(tmp_path_factory: Any, data: st.DataObject) -> None:
    shards = data.draw(st.sampled_from([1, 3]))
    partitions = 1  # a stage-1 shard reads one source partition (merge keys are by offset)
    python = _processor(shards, False, tmp_path_factory.mktemp("python"))
    native = _processor(shards, True, tmp_path_factory.mktemp("native"))
    offsets = [0] * partitions
    try:
        for _ in range(data.draw(st.integers(1, 4))):
            batch = _records(data, offsets, partitions)
            if not batch:
                continue
            python._process_once(batch)
            calls = _process_spied(native, batch)
            event("routed natively" if "route_read" in calls else "declined")
            want, got = python.sent, native.sent
            event("python" if native.core is None else "native core")
            assert got.exchange == want.exchange
            assert [list(values) for values in got.exchange.values()] == [list(v) for v in want.exchange.values()]
            assert got.dlq == want.dlq
            assert got.state == want.state
            assert native.checkpoint.pending == python.checkpoint.pending
            if python.core is None or native.core is None:
                return  # a value the native core does not take: each goes on in Python
    finally:
        python.close()
        native.close()


def test_a_clean_batch_routes_in_the_native_core(tmp_path: Path) -> None:
    native = _processor(3, True, tmp_path)
    batch = [InputRecord(0, o, orjson.dumps({"player": "p0"}), orjson.dumps(v), 1) for o, v in enumerate([
        {"op": "+A", "player": "p0", "team": "t1", "score": 4, "event_time": 3},
        {"op": "-C", "player": "p0", "team": "t1", "score": 4, "event_time": 2},
        {"op": "+C", "player": "p0", "team": "t2", "score": 5, "event_time": 2},
        {"op": "-R", "player": "p0", "team": "t9", "score": 1, "event_time": 4},  # not live: refused
    ])]
    try:
        calls = _process_spied(native, batch)
    finally:
        native.close()
    assert "route_read" in calls  # the batch went through the native reader and router
    routed = sorted(value for values in native.sent.exchange.values() for value in values)
    assert b'[[3,0,0],[[3,0,0,0,{"player":"p0","team":"t1","score":4}]]]' in routed
    assert [letter.reason for letter in native.sent.dlq] == ["not live"]


class _Spy:
    """The core, noting which of its methods the shard calls."""

    def __init__(self, core: Any, calls: list[str]) -> None:
        self._core, self._calls = core, calls

    def __getattr__(self, name: str) -> Any:
        self._calls.append(name)
        return getattr(self._core, name)


@settings(max_examples=100, **HYPOTHESIS)
@given(data=st.data())
def test_stage_two_reads_natively_as_in_python(tmp_path_factory: Any, data: st.DataObject) -> None:
    shards = data.draw(st.sampled_from([1, 3]))
    partitions = data.draw(st.integers(1, 3))
    shard = data.draw(st.integers(0, shards - 1))
    view = data.draw(st.sampled_from([VIEW, TOP_N]))  # a grouped view, or a Top-N per team
    event("top_n" if view is TOP_N else "grouped")
    routes = [_processor(shards, False, tmp_path_factory.mktemp("route"), p, view=view) for p in range(partitions)]
    python = _processor(shards, False, tmp_path_factory.mktemp("python"), shard, DryApply, view)
    native = _processor(shards, True, tmp_path_factory.mktemp("native"), shard, DryApply, view)
    offsets, routed, closes = [0] * partitions, [], 0
    try:
        for _ in range(data.draw(st.integers(1, 4))):
            batch = _records(data, offsets, partitions)
            sent: list[list[bytes]] = []
            for p, route in enumerate(routes):
                mine = [record for record in batch if record.partition == p]
                route.sent = Outgoing()
                if mine:
                    route._process_once(mine)
                sent.append(list(route.sent.exchange.get(shard, [])))
            while any(sent):  # the stage-1 shards' commits land in any order
                p = data.draw(st.sampled_from([p for p, values in enumerate(sent) if values]))
                routed.append(sent[p].pop(0))
            if data.draw(st.integers(0, 5)) > 0:  # (else: the engine stopped before its close)
                closes += 1
                routed.append(close_value(1, closes))
            if routed and data.draw(st.booleans()):  # stage 2 reads its closed segments
                records = [InputRecord(shard, python.checkpoint.offsets.get(shard, 0) + i, None, value, 1)
                           for i, value in enumerate(routed)]
                records.reverse()  # any order: the reader takes them by offset
                routed = []
                python._process_once(records)
                calls = _process_spied(native, records)
                event("read natively" if "read_routed" in calls and "apply_read" in calls else "declined")
                want, got = python.sent, native.sent
                assert got.view == want.view
                assert got.delta == want.delta
                assert got.state == want.state
                assert got.dlq == want.dlq
                assert native.checkpoint.offsets == python.checkpoint.offsets
                if python.core is None or native.core is None:
                    return  # a value the native core does not take: each goes on in Python
    finally:
        for processor in [*routes, python, native]:
            processor.close()


def test_a_clean_segment_is_read_in_the_native_core(tmp_path: Path) -> None:
    """Two source partitions' routed units, merged by merge key within a segment, the
    segments in order, through the native reader."""
    native = _processor(1, True, tmp_path, 0, DryApply)
    values = [
        b'[[5,1,0],[[5,1,0,0,{"player":"p1","team":"t1","score":2}]]]',
        b'[[3,0,0],[[3,0,0,0,{"player":"p0","team":"t1","score":4}]]]',
        b'[[3,0,0],[[1,0,1,0,{"player":"p2","team":"t1","score":7}]]]',  # its partition's greatest first tag
        close_value(1, 1),
        b'[[2,0,2],[[2,0,2,0,{"player":"p0","team":"t1","score":1}]]]',  # the next batch: after the close
        close_value(1, 2),
    ]
    try:
        calls = _process_spied(native, [InputRecord(0, o, None, v, 1) for o, v in enumerate(values)])
    finally:
        native.close()
    assert "read_routed" in calls and "apply_read" in calls
    rows = [(orjson.loads(value), dict(headers)) for _key, value, _ts, headers in native.sent.view]
    totals = [row["total"] for row, _ in rows if row["op"] in ("+A", "+C")]
    assert totals == [4, 11, 13, 14]  # partition 0's two units (merge key [3,0,0]) before partition 1's
    # each names its original source event (the routed unit's tag: partition, offset)
    causes = [headers["refold.cause"] for row, headers in rows if row["op"] in ("+A", "+C")]
    assert causes == [b"0:0", b"0:1", b"1:0", b"0:2"]
