"""The native core's windowed grouped views (`refold_native.WindowCore`, native/src/window)
against the Python path they replace (`WindowedReducer` + `Renderer`), byte for byte:
view, delta and state records and refusals (`late` and `bad event time` with their detail
and headers) over random windowed changelogs (tests/window_changelogs.py: out-of-order
and late times, ISO text, bad times, late corrections), tumble, hop and session windows
with and without a lateness, grouped and Top-N, emit `per_event` and `final`, every view
form, random batch cuts, and restarts where each core restores from the `P.state`
records the other one wrote."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

# imported, not skipped when missing: `make setup` builds it (native/)
import refold_native
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from refold_native import Unsupported
from window_changelogs import INTS, NUMBERS, WINDOWS, Unit, batched, window_changelogs

from refold.config import Pipeline, parse_pipeline
from refold.model.reasons import Reason
from refold.reduce import Rejected, SourceEvent
from refold.reduce.windowed import WindowedReducer
from refold.runtime.native import native_core, why_not
from refold.runtime.render import Renderer

COLUMNS: dict[str, Any] = {
    "total": {"sum": "v"}, "n": {"count": "*"}, "nv": {"count": "v"}, "mean": {"avg": "v"},
    "low": {"min": "v"}, "high": {"max": "v"}, "first_v": {"first": "v"}, "last_v": {"last": "v"},
    "lww": {"last_write_wins": "v"}, "values": {"set": "v"},
}


def windowed_pipeline(kind: str, lateness: str | None, form: str | None, delta: bool, emit: str = "per_event",
                      top_n: bool = False) -> Pipeline:
    window: dict[str, Any] = {"time": "ts", **WINDOWS[kind]}
    if lateness is not None:
        window["lateness"] = lateness
    outputs: dict[str, Any] = {}
    if form is not None:
        outputs["view"] = {"topic": "v", "form": form, "emit": emit}
    if delta or form is None:
        outputs["delta"] = {"topic": "d"}
    view: dict[str, Any] = {"key": ["k"], "columns": COLUMNS, "window": window}
    if top_n:
        view = {"top_n": {"n": 2, "order_by": {"v": "desc"}, "partition_by": ["k"]}, "window": window}
    return parse_pipeline({"pipeline": "windows", "source": {"topic": "t"}, "view": view, "outputs": outputs,
                           "spark": {"core": "native"}})


class PythonPath:
    """`ShardProcessor._reduce` of a windowed view and the records of a batch, in Python."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.reducer = WindowedReducer(pipeline.view, pipeline.outputs.view.emit if pipeline.outputs.view else "per_event")
        self.renderer = Renderer(pipeline)

    def apply_batch(self, units: Sequence[Sequence[tuple[SourceEvent, Any]]]) -> tuple[list, list, list, list]:
        rejected, changes = [], []
        for unit_index, unit in enumerate(units):
            try:
                changes.append((self.reducer.apply([event for event, _ in unit]), unit[0][0].tag[0]))
            except Rejected as exc:
                shown = exc.reason in (Reason.LATE, Reason.BAD_TIME)
                rejected.append((unit_index, exc.index, str(exc.reason), exc.detail if shown else None,
                                 tuple(exc.headers)))
        view = self.renderer.view(changes)
        deltas = self.renderer.deltas(self.reducer.take_deltas())
        state = self.reducer.take_state_changes()
        return rejected, view, deltas if self.pipeline.outputs.delta is not None else [], state


def _units(batch: Sequence[Unit]) -> list[list[tuple[SourceEvent, Any]]]:
    # the engine's reader refuses a lone -C or +C before any reducer sees it
    return [[(event, None) for event in unit] for unit in batch
            if not (len(unit) == 1 and unit[0].op.name in ("CORRECT_FROM", "CORRECT_TO"))]


def _native_rejected(rejected: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The core's refusals as the Python path's: the detail shown only for a windowed
    view's own reasons (as `refusal_shown` does)."""
    out = []
    for unit, index, reason, detail, headers in rejected:
        shown = reason in (Reason.LATE, Reason.BAD_TIME)
        out.append((unit, index, reason, detail if shown else None, tuple(headers)))
    return out


def _view(view: dict[Any, Any]) -> dict[bytes, bytes]:
    return {orjson.dumps(list(k)): orjson.dumps(v) for k, v in view.items()}


def run_both(pipeline: Pipeline, batches: list[list[Unit]], restarts: list[bool], values_may_float: bool) -> str:
    """Every batch through both cores; equal records. At a restart each side is new,
    restored from the state records the OTHER side wrote so far."""
    python = PythonPath(pipeline)
    core = native_core(pipeline)
    assert core is not None
    py_state: dict[bytes, bytes | None] = {}
    core_state: dict[bytes, bytes | None] = {}
    outcome = "ok"
    for batch, restart in zip(batches, restarts, strict=True):
        units = _units(batch)
        try:
            core.touched(units)
            got = core.apply_batch(units)
        except Unsupported:
            floats = any(type(e.row.get("v")) is float for unit in units for e, _ in unit)
            assert values_may_float and floats, "Unsupported without a float in a summed column"
            return "unsupported"
        want = python.apply_batch(units)
        assert _native_rejected(got[0]) == want[0], "rejected"
        assert got[1] == want[1], "view records"
        assert got[2] == want[2], "delta records"
        assert got[3] == want[3], "state records"
        assert _view(core.view()) == _view(python.reducer.view())
        if want[0]:
            outcome = "rejected"
        py_state.update(want[3])
        core_state.update(got[3])
        if restart:
            python = PythonPath(pipeline)
            python.reducer.restore(sorted((k, v) for k, v in core_state.items() if v is not None))
            core = native_core(pipeline)
            assert core is not None
            core.restore(sorted((k, v) for k, v in py_state.items() if v is not None))
            assert _view(core.view()) == _view(python.reducer.view())
    return outcome


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_tumble_and_hop_are_byte_for_byte_the_python_path(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["tumble", "hop", "hop-uneven"]))
    lateness = data.draw(st.sampled_from([None, "0ms", "5ms", "20ms"]))
    form = data.draw(st.sampled_from(["changelog", "retract", "upsert", None]))
    delta = data.draw(st.booleans())
    floats = data.draw(st.integers(0, 4)) == 0
    units = data.draw(window_changelogs(values=NUMBERS if floats else INTS, invalid=data.draw(st.booleans())))
    batches = data.draw(batched(units))
    restarts = data.draw(st.lists(st.booleans(), min_size=len(batches), max_size=len(batches)))
    event(run_both(windowed_pipeline(kind, lateness, form, delta), batches, restarts, floats))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_sessions_are_byte_for_byte_the_python_path(data: st.DataObject) -> None:
    # merges (an event between two sessions), splits (a retraction of the row that
    # joined them), corrections moving a row to another session, late events and the
    # `late` dead letters past the lateness, sessions closing, random batch cuts
    lateness = data.draw(st.sampled_from([None, "0ms", "5ms", "20ms"]))
    form = data.draw(st.sampled_from(["changelog", "retract", "upsert"]))  # (a session view has no delta output)
    floats = data.draw(st.integers(0, 4)) == 0
    units = data.draw(window_changelogs(values=NUMBERS if floats else INTS, invalid=data.draw(st.booleans())))
    batches = data.draw(batched(units))
    restarts = data.draw(st.lists(st.booleans(), min_size=len(batches), max_size=len(batches)))
    event(run_both(windowed_pipeline("session", lateness, form, False), batches, restarts, floats))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_emit_final_is_byte_for_byte_the_python_path(data: st.DataObject) -> None:
    # a unit's records are the windows (sessions) its watermark advance closed, named
    # by its cause; the state, deltas and refusals as with emit: per_event
    kind = data.draw(st.sampled_from(["tumble", "hop", "hop-uneven", "session"]))
    lateness = data.draw(st.sampled_from(["0ms", "5ms", "20ms"]))  # (emit: final needs one)
    form = data.draw(st.sampled_from(["changelog", "retract", "upsert"]))
    delta = kind != "session" and data.draw(st.booleans())
    floats = data.draw(st.integers(0, 4)) == 0
    units = data.draw(window_changelogs(values=NUMBERS if floats else INTS, invalid=data.draw(st.booleans())))
    batches = data.draw(batched(units))
    restarts = data.draw(st.lists(st.booleans(), min_size=len(batches), max_size=len(batches)))
    event(run_both(windowed_pipeline(kind, lateness, form, delta, emit="final"), batches, restarts, floats))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_windowed_top_n_is_byte_for_byte_the_python_path(data: st.DataObject) -> None:
    # the top 2 rows by `v` per key and window: places moving as rows come and go, late
    # events, windows closing (their groups' rows tombstoned), emit per_event and final
    kind = data.draw(st.sampled_from(["tumble", "hop", "hop-uneven"]))
    emit = data.draw(st.sampled_from(["per_event", "final"]))
    lateness = data.draw(st.sampled_from(["0ms", "5ms", "20ms"] if emit == "final" else [None, "0ms", "5ms", "20ms"]))
    form = data.draw(st.sampled_from(["changelog", "retract", "upsert"]))
    floats = data.draw(st.integers(0, 4)) == 0
    units = data.draw(window_changelogs(values=NUMBERS if floats else INTS, invalid=data.draw(st.booleans())))
    batches = data.draw(batched(units))
    restarts = data.draw(st.lists(st.booleans(), min_size=len(batches), max_size=len(batches)))
    pipeline = windowed_pipeline(kind, lateness, form, False, emit=emit, top_n=True)
    event(run_both(pipeline, batches, restarts, floats))


def test_a_closed_windows_top_n_group_leaves_no_state_record() -> None:
    from refold.model.changelog import Op
    rows = [({"k": "a", "ts": 101, "v": 1}, (1, 0, 0)), ({"k": "a", "ts": 103, "v": 2}, (2, 0, 1)),
            ({"k": "a", "ts": 130, "v": 3}, (3, 0, 2))]  # the watermark reaches 125: [100, 110) closes
    batch = [[SourceEvent(Op.APPEND, row, tag)] for row, tag in rows]
    pipeline = windowed_pipeline("tumble", "5ms", "changelog", False, top_n=True)
    assert run_both(pipeline, [batch[:2], batch[2:]], [False, False], False) == "ok"
    core = native_core(pipeline)
    assert core is not None
    first = dict(core.apply_batch(_units(batch[:2]))[3])
    assert first[b'[["a",100,110]]'] is not None  # the group's places' causes
    closed = dict(core.apply_batch(_units(batch[2:]))[3])
    window = b'[["a",100,110]'
    assert {k: v for k, v in closed.items() if k.startswith(window)} == {k: None for k in first if k.startswith(window)}


def test_emit_final_writes_a_window_once_as_it_closes_named_by_the_unit_that_closed_it() -> None:
    from refold.model.changelog import Op
    rows = [({"k": "b", "ts": 101, "v": 1}, (1, 0, 0)), ({"k": "a", "ts": 103, "v": 2}, (2, 0, 1)),
            ({"k": "a", "ts": 104, "v": 3}, (3, 0, 2)), ({"k": "a", "ts": 116, "v": 4}, (4, 0, 3))]
    batch = [[SourceEvent(Op.APPEND, row, tag)] for row, tag in rows]
    for kind in ("tumble", "session"):
        pipeline = windowed_pipeline(kind, "5ms", "changelog", False, emit="final")
        assert run_both(pipeline, [batch], [False], False) == "ok"
        core = native_core(pipeline)
        assert core is not None
        view = core.apply_batch(_units(batch))[1]
        # the watermark reaches 111 at offset 3: [100, 110) closes (a session [101, 114) does not)
        got = [(orjson.loads(v)["k"], orjson.loads(v)["total"], headers) for _, v, _, headers in view]
        assert got == ([("a", 5, [("refold.cause", b"0:3")]), ("b", 1, [("refold.cause", b"0:3")])]
                       if kind == "tumble" else [("b", 1, [("refold.cause", b"0:3")])])


def test_a_session_merges_and_splits_as_python_does() -> None:
    from refold.model.changelog import Op
    a = [({"k": "a", "ts": 100, "v": 1}, (1, 0, 0)), ({"k": "a", "ts": 118, "v": 2}, (2, 0, 1)),
         ({"k": "a", "ts": 109, "v": 3}, (3, 0, 2))]  # two sessions (gap 10ms), then the row that joins them
    batch = [[SourceEvent(Op.APPEND, row, tag)] for row, tag in a]
    batch.append([SourceEvent(Op.RETRACT, {"k": "a", "ts": 109, "v": 3}, (4, 0, 3))])  # split again
    pipeline = windowed_pipeline("session", None, "changelog", False)
    assert run_both(pipeline, [batch], [False], False) == "ok"
    core = native_core(pipeline)
    assert core is not None
    view = [orjson.loads(v) for _, v, _, _ in core.apply_batch(_units(batch))[1]]
    assert [(r["op"], r["window_start"], r["window_end"], r["total"]) for r in view] == [
        ("+A", 100, 110, 1), ("+A", 118, 128, 2),
        ("-C", 100, 110, 1), ("+C", 100, 128, 6), ("-R", 118, 128, 2),
        ("-C", 100, 128, 6), ("+C", 100, 110, 1), ("+A", 118, 128, 2)]


def test_late_events_beyond_the_horizon_are_dead_lettered_as_python_does() -> None:
    from refold.model.changelog import Op
    rows = [({"k": "a", "ts": 100, "v": 1}, (1, 0, 0)), ({"k": "a", "ts": 200, "v": 2}, (2, 0, 1)),
            ({"k": "a", "ts": 105, "v": 3}, (3, 0, 2)),  # its window [100, 110) closed at watermark 195
            ({"k": "a", "ts": "1970-01-01T00:00:00.105Z", "v": 3}, (4, 0, 3)),  # the same, as text
            ({"k": "a", "ts": "yesterday", "v": 4}, (5, 0, 4)), ({"k": "a", "v": 4}, (6, 0, 5))]
    batch = [[SourceEvent(Op.APPEND, row, tag)] for row, tag in rows]
    pipeline = windowed_pipeline("tumble", "5ms", "changelog", True)
    assert run_both(pipeline, [batch], [False], False) == "rejected"
    core = native_core(pipeline)
    assert core is not None
    rejected = core.apply_batch(_units(batch))[0]
    assert [(r[2], r[3]) for r in rejected] == [
        ("late", "window [100, 110) closed: watermark 195"),
        ("late", "window [1970-01-01T00:00:00.100Z, 1970-01-01T00:00:00.110Z) closed: "
                 "watermark 1970-01-01T00:00:00.195Z"),
        ("bad event time", "'ts' is not ISO-8601 text"), ("bad event time", "'ts' is missing")]
    assert rejected[0][4] == (("refold.window_start", "100"), ("refold.window_end", "110"),
                              ("refold.watermark", "195"))


def test_the_native_core_takes_tumble_hop_and_session_grouped_or_top_n_either_emit() -> None:
    assert why_not(windowed_pipeline("tumble", "5ms", "changelog", True)) is None
    assert why_not(windowed_pipeline("hop", None, "retract", False)) is None
    assert why_not(windowed_pipeline("session", "5ms", "upsert", False)) is None
    assert isinstance(native_core(windowed_pipeline("hop", None, None, True)), refold_native.WindowCore)
    assert isinstance(native_core(windowed_pipeline("session", None, "changelog", False)), refold_native.WindowCore)
    assert why_not(windowed_pipeline("session", "5ms", "changelog", False, emit="final")) is None
    assert why_not(windowed_pipeline("hop", "5ms", "upsert", True, emit="final")) is None
    assert why_not(windowed_pipeline("tumble", None, "changelog", False, top_n=True)) is None
    assert isinstance(native_core(windowed_pipeline("hop", "5ms", "retract", False, emit="final", top_n=True)),
                      refold_native.WindowCore)


# the `[key]` summary of view key `["a"]` whose two records' causes are 0:7 and 1:9, as the
# session and Top-N cores (and refold.reduce.statecodec) wrote it before they shared a writer
SUMMARY = bytes.fromhex("000a5b2261225d0402267b2263223a5b5b302c375d2c5b312c395d5d7d00")


def test_the_key_summary_of_state_written_before_is_read_and_written_the_same_by_both_cores() -> None:
    from refold.model.changelog import Op
    from refold.reduce.statecodec import row_key, state_value
    from refold.reduce.values import fingerprint

    def unit(op: Op, row: dict[str, Any], tag: tuple[int, int, int]) -> list[tuple[SourceEvent, Any]]:
        return [(SourceEvent(op, row, tag), None)]

    def cores() -> list[Any]:
        session = native_core(windowed_pipeline("session", None, "changelog", False))
        return [session, refold_native.TopNCore(2, [("v", "desc")], ["k"], None, "changelog")]

    # two sessions of "a" (the Top-N: its places 1 and 2), written by offsets 7 and 9
    rows = [({"k": "a", "ts": 100, "v": 2}, (1, 0, 7)), ({"k": "a", "ts": 130, "v": 1}, (2, 1, 9))]
    for core in cores():
        state = core.apply_batch([unit(Op.APPEND, row, tag) for row, tag in rows])[3]
        assert (b'[["a"]]', SUMMARY) in state
    live = [(row_key(b'["a"]', fingerprint(row)), state_value("LIVE_ROW", b'["a"]', 1, row, [tag])) for row, tag in rows]
    for core in cores():
        core.restore(sorted([*live, (b'[["a"]]', SUMMARY)]))
        _, view, _, state = core.apply_batch([unit(Op.RETRACT, rows[1][0], (3, 0, 10))])
        assert [(orjson.loads(v)["op"], headers) for _, v, _, headers in view] == [
            ("-R", [("refold.cause", b"0:10"), ("refold.retracts", b"1:9")])]
        assert (b'[["a"]]', state_value("KEY_SUMMARY", b'["a"]', 1, {"c": [[0, 7]]}, ())) in state
