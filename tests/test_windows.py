"""Windowed views (docs/windows.md): the reducer with hand-written expectations, then a
windowed view's shards on a real broker (watermark, closing, late dead letters,
restart and rebuild from `P.state`)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from refold.config import ViewSpec, load_pipeline, parse_pipeline
from refold.errors import ConfigError
from refold.kafka.io import ensure_topics, read_to_end
from refold.model.changelog import Op
from refold.model.reasons import Reason
from refold.ops.explain import explain
from refold.ops.verify import verify
from refold.recovery.records import decode_dead_letter
from refold.reduce import Rejected, SourceEvent, make_reducer
from refold.reduce.windowed import event_time_of, time_text
from refold.runtime.batch import InputRecord
from refold.runtime.native import native_core, why_not
from refold.runtime.processor import BatchProcessor
from refold.spark.job import engine_topics

H = 3_600_000
A, R, CF, CT = Op.APPEND, Op.RETRACT, Op.CORRECT_FROM, Op.CORRECT_TO


def _view(window: dict[str, Any], **spec: Any) -> ViewSpec:
    if "top_n" not in spec:
        spec.setdefault("key", ["team"])
        spec.setdefault("columns", {"total": {"sum": "score"}, "n": {"count": "*"}})
    return ViewSpec.model_validate({**spec, "window": {"time": "ts", **window}})


class _Run:
    """A reducer fed one unit at a time; each unit's records as (op, key, row) or the refusal."""

    def __init__(self, spec: ViewSpec, emit: str = "per_event") -> None:
        self.reducer = make_reducer(spec, emit)
        self.offset = 0

    def __call__(self, *events: tuple[Op, dict[str, Any]]) -> Any:
        unit = []
        for op, row in events:
            unit.append(SourceEvent(op, row, (0, 0, self.offset)))
            self.offset += 1
        try:
            return [(c.op, c.key, c.row) for c in self.reducer.apply(unit)]
        except Rejected as rejected:
            return rejected


# event time ------------------------------------------------------------------------------

def test_event_time_reads_epoch_ms_and_iso_text_and_refuses_the_rest() -> None:
    assert event_time_of({"ts": 1_700_000_000_123}, "ts") == (1_700_000_000_123, False)
    assert event_time_of({"ts": "2023-11-14T22:13:20.123Z"}, "ts") == (1_700_000_000_123, True)
    assert event_time_of({"ts": "2023-11-14T23:13:20.1239+01:00"}, "ts") == (1_700_000_000_123, True)  # floored
    assert event_time_of({"ts": "2023-11-14 22:13:20"}, "ts") == (1_700_000_000_000, True)  # no offset: UTC
    assert event_time_of({"ts": "1969-12-31T23:59:59.9995Z"}, "ts") == (-1, True)  # floored below the epoch too
    assert event_time_of({}, "ts") == "'ts' is missing"
    assert event_time_of({"ts": None}, "ts") == "'ts' is null"
    for bad in (1.5, True, [1], "yesterday"):
        assert isinstance(event_time_of({"ts": bad}, "ts"), str)
    assert time_text(1_700_000_000_000) == "2023-11-14T22:13:20Z"
    assert time_text(1_700_000_000_120) == "2023-11-14T22:13:20.120Z"
    assert time_text(-1) == "1969-12-31T23:59:59.999Z"


# tumble and hop --------------------------------------------------------------------------

def test_a_tumble_window_groups_by_key_and_window_and_a_late_event_is_refused_naming_its_window() -> None:
    run = _Run(_view({"tumble": "1h", "lateness": "30m"}))
    assert run((A, {"team": "a", "score": 1, "ts": 10})) == [
        (A, ("a", 0, H), {"team": "a", "window_start": 0, "window_end": H, "total": 1, "n": 1})]
    assert run((A, {"team": "a", "score": 2, "ts": H + 5})) == [
        (A, ("a", H, 2 * H), {"team": "a", "window_start": H, "window_end": 2 * H, "total": 2, "n": 1})]
    # watermark H + 5 - 30m: the first hour is still open, so a late event corrects it
    assert run((A, {"team": "a", "score": 5, "ts": 20})) == [
        (CF, ("a", 0, H), {"team": "a", "window_start": 0, "window_end": H, "total": 1, "n": 1}),
        (CT, ("a", 0, H), {"team": "a", "window_start": 0, "window_end": H, "total": 6, "n": 2})]
    assert run((A, {"team": "b", "score": 1, "ts": 2 * H})) != []  # watermark 1.5h: the first hour closes
    late = run((R, {"team": "a", "score": 5, "ts": 20}))
    assert isinstance(late, Rejected) and late.reason == Reason.LATE and late.index == 0
    assert dict(late.headers) == {"refold.window_start": "0", "refold.window_end": str(H),
                                  "refold.watermark": str(2 * H - H // 2)}
    # the closed window's state is gone: tombstones for its summary and its rows
    state = dict(run.reducer.take_state_changes())
    assert state[b'[["a",0,3600000]]'] is None
    assert state[b'["wm"]'] is not None


def test_a_hop_event_falls_in_every_window_that_holds_it_and_iso_time_gives_iso_bounds() -> None:
    run = _Run(_view({"hop": {"size": "1h", "slide": "30m"}}))
    changes = run((A, {"team": "a", "score": 3, "ts": "1970-01-01T01:10:00Z"}))
    assert [(op, key) for op, key, _row in changes] == [
        (A, ("a", "1970-01-01T00:30:00Z", "1970-01-01T01:30:00Z")),
        (A, ("a", "1970-01-01T01:00:00Z", "1970-01-01T02:00:00Z"))]
    # epoch ms of the same instant fall in windows of their own (the bounds' representation differs)
    assert len(run((A, {"team": "a", "score": 1, "ts": H + 600_000}))) == 2
    assert len(run.reducer.view()) == 4


def test_a_correction_across_windows_retracts_in_one_and_appends_in_the_other() -> None:
    run = _Run(_view({"tumble": "1h"}))
    run((A, {"team": "a", "score": 1, "ts": 10}))
    assert run((CF, {"team": "a", "score": 1, "ts": 10}), (CT, {"team": "a", "score": 1, "ts": H})) == [
        (R, ("a", 0, H), {"team": "a", "window_start": 0, "window_end": H, "total": 1, "n": 1}),
        (A, ("a", H, 2 * H), {"team": "a", "window_start": H, "window_end": 2 * H, "total": 1, "n": 1})]


def test_checks_come_in_order_key_then_time_then_lateness_and_a_pair_refuses_both_halves() -> None:
    run = _Run(_view({"tumble": "1h", "lateness": "0s"}))
    refused = run((A, {"score": 1, "ts": "nonsense"}))
    assert isinstance(refused, Rejected) and refused.reason == Reason.NULL_KEY
    refused = run((A, {"team": "a", "score": 1, "ts": 1.5}))
    assert isinstance(refused, Rejected) and refused.reason == Reason.BAD_TIME
    run((A, {"team": "a", "score": 1, "ts": 5 * H}))
    refused = run((CF, {"team": "a", "score": 1, "ts": 5 * H}), (CT, {"team": "a", "score": 2, "ts": 10}))
    assert isinstance(refused, Rejected) and (refused.reason, refused.index) == (Reason.LATE, 1)
    refused = run((R, {"team": "a", "score": 9, "ts": 5 * H}))
    assert isinstance(refused, Rejected) and refused.reason == Reason.NOT_LIVE
    assert run.reducer.watermark == 5 * H  # refused units do not move it


def test_emit_final_writes_each_window_once_when_it_closes() -> None:
    run = _Run(_view({"tumble": "1h", "lateness": "0s"}), emit="final")
    assert run((A, {"team": "b", "score": 1, "ts": 10})) == []
    assert run((A, {"team": "a", "score": 2, "ts": 20})) == []
    assert run((A, {"team": "a", "score": 2, "ts": 30}), ) == []
    assert run((A, {"team": "a", "score": 7, "ts": H})) == [
        (A, ("a", 0, H), {"team": "a", "window_start": 0, "window_end": H, "total": 4, "n": 2}),
        (A, ("b", 0, H), {"team": "b", "window_start": 0, "window_end": H, "total": 1, "n": 1})]


def test_a_top_n_ranks_per_window() -> None:
    spec = _view({"tumble": "1h", "lateness": "0s"},
                 top_n={"n": 1, "order_by": {"score": "desc"}, "partition_by": ["team"]})
    run = _Run(spec)
    assert run((A, {"team": "a", "score": 2, "ts": 10, "who": "x"})) == [
        (A, ("a", 0, H, 1), {"team": "a", "window_start": 0, "window_end": H, "place": 1,
                             "score": 2, "ts": 10, "who": "x"})]
    assert [op for op, _k, _r in run((A, {"team": "a", "score": 5, "ts": 20, "who": "y"}))] == [CF, CT]
    assert run((A, {"team": "a", "score": 1, "ts": H, "who": "z"}))[0][1] == ("a", H, 2 * H, 1)
    final = _Run(spec, emit="final")
    final((A, {"team": "a", "score": 2, "ts": 10, "who": "x"}))
    assert final((A, {"team": "a", "score": 1, "ts": H + 1})) == [
        (A, ("a", 0, H, 1), {"team": "a", "window_start": 0, "window_end": H, "place": 1,
                             "score": 2, "ts": 10, "who": "x"})]


# sessions --------------------------------------------------------------------------------

def _s(start: int, end: int, total: int, n: int) -> dict[str, Any]:
    return {"team": "a", "window_start": start, "window_end": end, "total": total, "n": n}


def test_a_session_merges_when_a_row_fills_the_gap_and_splits_when_it_is_retracted() -> None:
    run = _Run(_view({"session": {"gap": "10ms"}}))
    assert run((A, {"team": "a", "score": 1, "ts": 100})) == [(A, ("a", 100), _s(100, 110, 1, 1))]
    assert run((A, {"team": "a", "score": 2, "ts": 115})) == [(A, ("a", 115), _s(115, 125, 2, 1))]
    # 108 is less than a gap from both: one session; the later one's key is gone
    assert run((A, {"team": "a", "score": 4, "ts": 108})) == [
        (CF, ("a", 100), _s(100, 110, 1, 1)), (CT, ("a", 100), _s(100, 125, 7, 3)),
        (R, ("a", 115), _s(115, 125, 2, 1))]
    # its retraction splits them again
    assert run((R, {"team": "a", "score": 4, "ts": 108})) == [
        (CF, ("a", 100), _s(100, 125, 7, 3)), (CT, ("a", 100), _s(100, 110, 1, 1)),
        (A, ("a", 115), _s(115, 125, 2, 1))]
    # an earlier row moves the start: the old key retracted, the new one appended (in
    # output-key order: the keys' JSON bytes, `["a",100]` before `["a",95]`)
    assert run((A, {"team": "a", "score": 1, "ts": 95})) == [
        (R, ("a", 100), _s(100, 110, 1, 1)), (A, ("a", 95), _s(95, 110, 2, 2))]


def test_a_session_closes_past_the_watermark_and_an_event_inside_an_open_one_is_not_late() -> None:
    run = _Run(_view({"session": {"gap": "10ms"}, "lateness": "20ms"}), emit="final")
    assert run((A, {"team": "a", "score": 1, "ts": 100})) == []
    assert run((A, {"team": "a", "score": 1, "ts": 125})) == []  # watermark 105
    assert run((A, {"team": "a", "score": 3, "ts": 131})) == [(A, ("a", 100), _s(100, 110, 1, 1))]  # wm 111
    refused = run((A, {"team": "a", "score": 3, "ts": 100}))
    assert isinstance(refused, Rejected) and refused.reason == Reason.LATE
    assert dict(refused.headers)["refold.window_end"] == "110"

    run = _Run(_view({"session": {"gap": "10ms"}, "lateness": "0s"}))
    for t in (100, 105, 109, 115):  # one session [100, 125); watermark 115
        run((A, {"team": "a", "score": 1, "ts": t}))
    # 102 + gap <= 115, but 102 is inside the open session: applied
    assert [op for op, _k, _r in run((A, {"team": "a", "score": 1, "ts": 102}))] == [CF, CT]
    refused = run((A, {"team": "a", "score": 1, "ts": 90}))
    assert isinstance(refused, Rejected) and refused.reason == Reason.LATE


def test_state_records_restore_a_reducer_that_goes_on_as_the_first() -> None:
    for window in ({"tumble": "1h", "lateness": "1h"}, {"session": {"gap": "10ms"}, "lateness": "1s"},
                   {"hop": {"size": "2h", "slide": "1h"}, "lateness": "1h"}):
        first, events = _Run(_view(window)), [
            (A, {"team": "a", "score": 1, "ts": 10}), (A, {"team": "b", "score": 2, "ts": 15}),
            (A, {"team": "a", "score": 3, "ts": 18}), (R, {"team": "a", "score": 1, "ts": 10})]
        for event in events:
            first(event)
        store: dict[bytes, bytes | None] = dict(first.reducer.take_state_changes())
        second = _Run(_view(window))
        second.reducer.restore(sorted((k, v) for k, v in store.items() if v is not None))
        assert second.reducer.view() == first.reducer.view()
        assert second.reducer.watermark == first.reducer.watermark
        later = (A, {"team": "a", "score": 5, "ts": 3 * H})
        assert second(later) == first(later)


def test_session_windows_reduce_natively_with_either_emit() -> None:
    raw: dict[str, Any] = {
        "pipeline": "w", "source": {"topic": "s"}, "spark": {"core": "native"},
        "view": {"key": ["team"], "columns": {"n": {"count": "*"}},
                 "window": {"time": "ts", "session": {"gap": "1h"}, "lateness": "1h"}},
        "outputs": {"view": {"topic": "w.view"}}}
    assert why_not(parse_pipeline(raw)) is None
    assert native_core(parse_pipeline(raw)) is not None
    raw["outputs"]["view"]["emit"] = "final"
    assert why_not(parse_pipeline(raw)) is None
    assert native_core(parse_pipeline(raw)) is not None


@pytest.mark.parametrize(("extra", "setting"), [
    ({"view": {"top_n": {"n": 3, "order_by": {"score": "desc"}, "partition_by": ["team"]},
               "window": {"time": "ts", "session": {"gap": "5m"}}}}, "view.window.session"),
    ({"outputs": {"view": {"topic": "w.view"}, "delta": {"topic": "w.delta"}}}, "outputs.delta"),
    ({"outputs": {"view": {"topic": "w.view", "emit": "per_batch"}}}, "outputs.view.emit"),
    ({"shards": 2, "source": {"topic": "s", "key": ["player"]}}, "shards"),
])
def test_what_windowed_views_do_not_support_is_a_config_error_naming_the_setting(extra, setting) -> None:
    raw: dict[str, Any] = {
        "pipeline": "w", "source": {"topic": "s"},
        "view": {"key": ["team"], "columns": {"n": {"count": "*"}}, "window": {"time": "ts", "session": {"gap": "5m"}}},
        "outputs": {"view": {"topic": "w.view"}}}
    raw.update(extra)
    with pytest.raises(ConfigError, match=setting.replace(".", r"\.")):
        parse_pipeline(raw)


def test_the_hourly_example_corrects_an_open_hour_and_dead_letters_an_event_for_a_closed_one() -> None:
    pipeline = load_pipeline(Path(__file__).parent.parent / "examples" / "hourly.yaml")
    rows = [orjson.loads(line) for line in
            (Path(__file__).parent.parent / "examples" / "hourly_scores.jsonl").read_bytes().splitlines()]
    changes, letters = _replayed(pipeline, rows)
    nine = {"window_start": "2024-05-01T09:00:00Z", "window_end": "2024-05-01T10:00:00Z"}
    # the late correction of bob's score, within the horizon: the blue 9h row corrected
    assert ("+C", {"team": "blue", **nine, "points": 6, "plays": 1, "best": 6}) in changes
    # eve's late event (09:55 after 10:05 was applied) still counts in red's 9h window
    assert ("+C", {"team": "red", **nine, "points": 9, "plays": 3, "best": 5}) in changes
    assert letters == [(8, Reason.LATE)]  # bob's 09:40 after the watermark reached 10:05
    text = explain(pipeline)
    assert "# output key: team, window_start, window_end" in text and "lateness 15m" in text


# a windowed view's shards on a real broker -----------------------------------------------

def _records(rows: list[dict[str, Any]], start: int) -> list[InputRecord]:
    return [InputRecord(0, start + i, orjson.dumps({"team": row["team"]}), orjson.dumps(row), 0)
            for i, row in enumerate(rows)]


@pytest.mark.kafka
def test_a_windowed_view_keeps_its_watermark_and_closed_windows_through_a_restart_and_a_rebuild(
        bootstrap_servers: str, topic: Any, tmp_path: Path) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=1)
    name = f"pw{uuid.uuid4().hex[:8]}"
    pipeline = parse_pipeline({
        "pipeline": name, "kafka": settings, "source": {"topic": source}, "spark": {"state_dir": str(tmp_path)},
        "view": {"key": ["team"], "columns": {"total": {"sum": "score"}},
                 "window": {"time": "ts", "tumble": "1h", "lateness": "10m"}},
        "outputs": {"view": {"topic": f"{name}.view"}, "delta": {"topic": f"{name}.delta"}}})
    ensure_topics(settings, engine_topics(pipeline, 1))
    t0 = "2026-01-01T00:"
    first = [{"op": "+A", "team": "red", "score": 3, "ts": t0 + "05:00Z"},
             {"op": "+A", "team": "red", "score": 4, "ts": t0 + "50:00Z"},
             {"op": "+A", "team": "red", "score": 1, "ts": "2026-01-01T01:15:00Z"},  # watermark 01:05: 00:00 closes
             {"op": "-R", "team": "red", "score": 3, "ts": t0 + "05:00Z"},  # late
             {"op": "+A", "team": "red", "score": 2, "ts": "2026-01-01T01:01:00Z"}]
    processor = BatchProcessor(pipeline, settings)
    try:
        processor.process(_records(first[:3], 0))
        processor.process(_records(first[3:], 3))
    finally:
        processor.close()
    again = [{"op": "+A", "team": "red", "score": 9, "ts": t0 + "59:59Z"},  # late (the watermark survived)
             {"op": "-C", "team": "red", "score": 2, "ts": "2026-01-01T01:01:00Z"},
             {"op": "+C", "team": "red", "score": 5, "ts": "2026-01-01T01:02:00Z"}]
    processor = BatchProcessor(pipeline, settings)  # a restart: the local store as it is
    try:
        processor.process(_records(again[:1], 5))
    finally:
        processor.close()
    shutil.rmtree(tmp_path)  # a rebuild from P.state
    processor = BatchProcessor(pipeline, settings)
    try:
        assert processor.shards[0].recovery is not None and processor.shards[0].recovery.how != "as is"
        processor.process(_records(again[1:], 6))
    finally:
        processor.close()
    view = [(orjson.loads(m.key()), orjson.loads(m.value())) for m in read_to_end(settings, f"{name}.view")]
    h0 = {"team": "red", "window_start": "2026-01-01T00:00:00Z", "window_end": "2026-01-01T01:00:00Z"}
    h1 = {"team": "red", "window_start": "2026-01-01T01:00:00Z", "window_end": "2026-01-01T02:00:00Z"}
    assert view == [
        (h0, {"op": "+A", **h0, "total": 3}),
        (h0, {"op": "-C", **h0, "total": 3}), (h0, {"op": "+C", **h0, "total": 7}),
        (h1, {"op": "+A", **h1, "total": 1}),
        (h1, {"op": "-C", **h1, "total": 1}), (h1, {"op": "+C", **h1, "total": 3}),
        (h1, {"op": "-C", **h1, "total": 3}), (h1, {"op": "+C", **h1, "total": 6}),
    ]
    letters = list(read_to_end(settings, pipeline.dlq_topic))
    assert [decode_dead_letter(m.value()).offset for m in letters] == [3, 5]
    assert {decode_dead_letter(m.value()).reason for m in letters} == {Reason.LATE}
    headers = dict((k, v.decode()) for k, v in letters[1].headers())
    assert headers["refold.reason"] == "late"
    assert (headers["refold.window_start"], headers["refold.window_end"]) == (h0["window_start"], h0["window_end"])
    assert headers["refold.watermark"] == "2026-01-01T01:05:00Z"
    deltas = [orjson.loads(m.key()) for m in read_to_end(settings, f"{name}.delta")]
    assert h0 in deltas and h1 in deltas  # a delta is keyed by the output key
    # the closed hour's state is tombstoned in P.state (its latest record is a tombstone)
    latest: dict[bytes, bytes | None] = {}
    for message in read_to_end(settings, pipeline.state_topic):
        latest[message.key()] = message.value()
    assert [k for k, v in latest.items() if v is not None and b"T00:00:00Z" in k] == []
    assert any(b"T00:00:00Z" in k for k in latest)


# the engine: Spark local[2] and the real broker ------------------------------------------

def _replayed(pipeline: Any, rows: list[dict[str, Any]]) -> tuple[list[tuple[Any, ...]], list[tuple[int, str]]]:
    """The view records and dead letters (offset, reason) of one reducer fed `rows` in
    order, one unit per event or `-C`/`+C` pair: what a one-partition source's shard
    must write whatever its batches."""
    view_output = pipeline.outputs.view
    reducer = make_reducer(pipeline.view, view_output.emit)
    changes: list[tuple[Any, ...]] = []
    letters: list[tuple[int, str]] = []
    offset = 0
    while offset < len(rows):
        size = 2 if rows[offset]["op"] == "-C" else 1
        unit = [SourceEvent(Op.parse(r["op"]), {k: v for k, v in r.items() if k != "op"}, (0, 0, offset + i))
                for i, r in enumerate(rows[offset:offset + size])]
        try:
            changes += [(c.op.code, c.row) for c in reducer.apply(unit)]
        except Rejected as rejected:
            letters += [(offset + i, rejected.reason if i == rejected.index else Reason.CORRECTION_PAIR_REJECTED)
                        for i in range(size)]
        offset += size
    return changes, letters


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.parametrize("emit", ["per_event", "final"])
def test_the_engine_runs_a_windowed_view_with_lateness_through_a_restart(
        bootstrap_servers: str, topic: Any, tmp_path: Path, spark: Any, emit: str) -> None:
    from refold.cli.produce import produce
    from refold.spark.job import run_pipeline

    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=1)
    name = f"pe{uuid.uuid4().hex[:8]}"
    pipeline = parse_pipeline({
        "pipeline": name, "source": {"topic": source},
        "view": {"key": ["team"], "columns": {"total": {"sum": "score"}, "games": {"count": "*"}},
                 "window": {"time": "ts", "tumble": "1h", "lateness": "30m"}},
        "outputs": {"view": {"topic": f"{name}.view", "emit": emit}},
        "trigger": "200ms", "max_batch_events": 7, "spark": {"checkpoint_dir": str(tmp_path / name)}})
    rows: list[dict[str, Any]] = []
    for i in range(60):  # event times going forward 10 minutes a row, with late ones and late corrections
        t = 1_700_000_000_000 + i * 600_000
        team = ["red", "blue"][i % 2]
        rows.append({"op": "+A", "team": team, "score": i, "ts": t})
        if i % 7 == 6:
            rows.append({"op": "+A", "team": team, "score": 100 + i, "ts": t - 3 * 600_000})  # within the horizon
            rows.append({"op": "+A", "team": team, "score": 200 + i, "ts": t - 12 * 600_000})  # late
        if i % 9 == 8:
            old = rows[-1]  # (a late row's correction is refused: not live)
            rows.append({"op": "-C", **{k: v for k, v in old.items() if k != "op"}})
            rows.append({"op": "+C", **{k: v for k, v in old.items() if k != "op"}, "score": -1})

    def send(part: list[dict[str, Any]]) -> None:
        produce(settings, source, [orjson.dumps(r) for r in part], ["team"], progress=False, per_transaction=50)

    send(rows[:40])
    run_pipeline(pipeline, bootstrap_servers, until_idle=1.0, spark=spark, quiet=True)
    send(rows[40:])
    run_pipeline(pipeline, bootstrap_servers, until_idle=1.0, spark=spark, quiet=True)  # a restart
    expected, expected_letters = _replayed(pipeline, rows)
    view = [orjson.loads(m.value()) for m in read_to_end(settings, f"{name}.view")]
    assert [(r.pop("op"), r) for r in view] == expected
    offsets = [m.offset() for m in read_to_end(settings, source)]  # (transaction markers take offsets too)
    letters = [decode_dead_letter(m.value()) for m in read_to_end(settings, pipeline.dlq_topic)]
    assert sorted((d.offset, d.reason) for d in letters) == [(offsets[i], reason) for i, reason in expected_letters]
    assert any(reason == Reason.LATE for _o, reason in expected_letters)
    if emit == "final":
        assert {op for op, _row in expected} == {"+A"}
    report = verify(pipeline, settings)  # `refold verify`: the reference, one watermark per shard
    assert report.anomalies == [] and report.view_records == len(view)
