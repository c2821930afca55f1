"""Provenance: every view record's cause headers (`refold.cause`, `refold.retracts`) are
the reference's (`refold.reference_causes`), for random changelogs and random batch
cuts, through real transactions and a restart in the middle (the causes of what later
records retract come back from `P.state`), with the Python reducers and the native
core, grouped, Top-N and windowed (sessions; `emit: final`), each output form; read back from the broker as written; a
replay writes nothing again; `outputs.provenance: off` writes no headers. After kill -9
of the engine at each point of a batch and its restarts,
`test_crash.test_kill_9_at_each_point_then_restart` checks the run's causes byte for byte
against one clean run of the same input, and its trace index against the scan."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import pytest
from engine_runs import Recording, RecordingProcessor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refold.config import Pipeline, parse_pipeline
from refold.kafka.io import ensure_topics, read_to_end
from refold.model.changelog import Op
from refold.reduce import SourceEvent
from refold.reference_causes import headers_of, in_form, reference_causes
from refold.runtime.batch import InputRecord
from refold.runtime.processor import BatchProcessor
from refold.spark.job import engine_topics

pytestmark = pytest.mark.kafka

PARTITIONS = 2
GROUPED = {"key": ["g"], "columns": {"total": {"sum": "score"}, "best": {"max": "score"}, "n": {"count": "*"}}}
TOP_N = {"top_n": {"n": 2, "order_by": {"score": "desc"}, "partition_by": ["g"]}}
# windowed over the score as event time: corrections move rows between windows and sessions
SESSION = {**GROUPED, "window": {"time": "score", "session": {"gap": "3ms"}}}
SESSION_CLOSING = {**GROUPED, "window": {"time": "score", "session": {"gap": "3ms"}, "lateness": "2ms"}}
TUMBLE_CLOSING = {**GROUPED, "window": {"time": "score", "tumble": "4ms", "lateness": "3ms"}}


def _pipeline(settings_: dict[str, Any], source: str, view: dict[str, Any], form: str, core: str,
              provenance: bool = True, emit: str = "per_event") -> Pipeline:
    name = f"pv{uuid.uuid4().hex[:8]}"
    outputs: dict[str, Any] = {"view": {"topic": f"{name}.view", "form": form, "emit": emit}, "provenance": provenance}
    if "top_n" not in view and "session" not in view.get("window", {}):
        outputs["delta"] = {"topic": f"{name}.delta"}
    pipeline = parse_pipeline({"pipeline": name, "kafka": settings_, "source": {"topic": source},
                               "view": view, "outputs": outputs, "spark": {"core": core}})
    ensure_topics(settings_, engine_topics(pipeline, PARTITIONS))
    return pipeline


# a changelog: (op, group, score) steps over the live rows; -C/+C pairs correct a live row
steps = st.lists(st.tuples(st.sampled_from(["+A", "+A", "-R", "-C", "-X"]), st.integers(0, 3), st.integers(0, 9)),
                 min_size=1, max_size=40)


def _records(plan: list[tuple[str, int, int]]) -> tuple[list[InputRecord], dict[int, list[list[SourceEvent]]]]:
    """The input records in the order written, and each partition's units as the
    reference reads them (a retraction of a row that is not live `-X` is refused)."""
    offsets = [0] * PARTITIONS
    live: dict[int, list[dict[str, Any]]] = {}
    records: list[InputRecord] = []
    units: dict[int, list[list[SourceEvent]]] = {p: [] for p in range(PARTITIONS)}

    def emit(op: str, row: dict[str, Any]) -> SourceEvent:
        partition = row["g"] % PARTITIONS
        offset = offsets[partition]
        offsets[partition] += 1
        records.append(InputRecord(partition, offset, orjson.dumps({"g": row["g"]}),
                                   orjson.dumps({"op": op, **row}), 1_000 + offset))
        return SourceEvent(Op.parse(op), row, (1_000 + offset, partition, offset))

    for number, (op, g, score) in enumerate(plan):
        rows = live.setdefault(g, [])
        if op == "+A" or (op in ("-R", "-C") and not rows):
            row = {"g": g, "id": number, "score": score}
            rows.append(row)
            units[g % PARTITIONS].append([emit("+A", row)])
        elif op == "-R":
            row = rows.pop(score % len(rows))
            units[g % PARTITIONS].append([emit("-R", row)])
        elif op == "-C":
            at = score % len(rows)
            old, new = rows[at], {**rows[at], "score": score}
            rows[at] = new
            units[g % PARTITIONS].append([emit("-C", old), emit("+C", new)])
        else:  # a retraction of a row never added: a dead letter, nothing written
            units[g % PARTITIONS].append([emit("-R", {"g": g, "id": -1, "score": score})])
    return records, units


def _written(shard: Recording) -> list[tuple[bytes, str | None, Any]]:
    out = []
    for _batch, sent in shard.sent:
        for key, value, _ts, headers in sent.view:
            out.append((key, None if value is None else orjson.loads(value).get("op", "+A"), headers))
    return out


CASES = [("grouped", GROUPED, form, core, "per_event") for form in ("changelog", "retract", "upsert")
         for core in ("python", "native")]
CASES += [("topn", TOP_N, form, core, "per_event") for form in ("changelog", "retract") for core in ("python", "native")]
CASES += [("session", SESSION, form, core, "per_event") for form in ("changelog", "retract") for core in ("python", "native")]
# emit: final: a closed window's +A names the unit whose watermark advance closed it
CASES += [(name, view, "changelog", core, "final") for name, view in (("tumble", TUMBLE_CLOSING),
                                                                      ("session", SESSION_CLOSING))
          for core in ("python", "native")]
CASES += [("session-closing", SESSION_CLOSING, "upsert", "native", "per_event")]




def _case(index: int, case: tuple[str, Any, str, str, str]) -> Any:
    """`make test` runs one core per view kind and form, the cores taking turns so each
    kind meets both; the other core of the same pair runs in `make test-slow` (marker
    slow): the cores' headers are held byte-equal in memory by
    test_a_windowed_views_records_name_their_cause_and_what_they_retract and the
    native cores' differential tests."""
    name, _view, form, core, emit = case
    paired = sum(1 for other in CASES if other[0] == name and other[2] == form and other[4] == emit) > 1
    turn = ("python", "native")[index // 2 % 2]  # pairs are listed python, native: alternate which one stays
    marks = [pytest.mark.slow] if paired and core != turn else []
    return pytest.param(*case[1:], marks=marks, id=f"{name}-{form}-{core}-{emit}")


@pytest.mark.parametrize(("view", "form", "core", "emit"), [_case(i, case) for i, case in enumerate(CASES)])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=steps, data=st.data())
def test_every_view_record_names_the_reference_cause(bootstrap_servers, topic, view, form, core, emit, plan,
                                                     data) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    pipeline = _pipeline(settings_, source, view, form, core, emit=emit)
    records, units = _records(plan)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(records) - 1)), max_size=4)))
    batches = [records[a:b] for a, b in zip([0, *cuts], [*cuts, len(records)], strict=True) if a < b]
    restart = data.draw(st.integers(0, len(batches)))
    written: dict[int, list[Any]] = {p: [] for p in range(PARTITIONS)}
    for part in (batches[:restart], batches[restart:]):  # a restart: later retractions' causes from P.state
        processor = RecordingProcessor(pipeline, settings_)
        try:
            for batch in part:
                processor.process(batch)
            for index, shard in processor.shards.items():
                assert isinstance(shard, Recording)
                written[index] += _written(shard)
        finally:
            processor.close()
    view_spec = pipeline.view
    for partition in range(PARTITIONS):
        want = [(c.change.key_json(), None if op is None else op.code, headers_of(c))
                for op, c in in_form(reference_causes(view_spec, units[partition], emit), form)]
        assert written[partition] == want, f"partition {partition}"
    # as the broker has them: view partition = shard
    read: dict[int, list[Any]] = {p: [] for p in range(PARTITIONS)}
    for msg in read_to_end(settings_, pipeline.outputs.view.topic):
        read[msg.partition()].append((msg.key(), msg.headers()))
    for partition in range(PARTITIONS):
        assert read[partition] == [(key, headers) for key, _op, headers in written[partition]]
    # a replay of every batch writes nothing again
    processor = RecordingProcessor(pipeline, settings_)
    try:
        assert all(processor.process(batch) is None for batch in batches)
    finally:
        processor.close()


def test_deltas_and_dead_letters_name_their_cause_and_off_writes_none(bootstrap_servers, topic) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    records, _units = _records([("+A", 0, 5), ("+A", 0, 7), ("-C", 0, 1), ("-X", 2, 3), ("+A", 1, 2)])
    for provenance in (True, False):
        pipeline = _pipeline(settings_, topic(partitions=PARTITIONS), GROUPED, "changelog", "auto", provenance)
        processor = BatchProcessor(pipeline, settings_)
        try:
            processor.process(records)
        finally:
            processor.close()
        deltas = list(read_to_end(settings_, pipeline.outputs.delta.topic))
        letters = list(read_to_end(settings_, pipeline.dlq_topic))
        views = list(read_to_end(settings_, pipeline.outputs.view.topic))
        assert len(letters) == 1 and len(deltas) == 2 and len(views) == 6
        if not provenance:
            assert all(msg.headers() is None for msg in [*deltas, *views])
            assert "refold.cause" not in dict(letters[0].headers())
            continue
        # group 0 (partition 0): +A @0, +A @1, -C/+C @2-3; the delta names the last (the pair's -C)
        by_key = {orjson.loads(msg.key())["g"]: dict(msg.headers()) for msg in deltas}
        assert by_key[0] == {"refold.cause": b"0:2"}
        assert by_key[1] == {"refold.cause": b"1:0"}
        # group 2's not-live retraction: partition 0, offset 4
        assert dict(letters[0].headers())["refold.cause"] == b"0:4"


MATCH_SCORES = [(1, 1, "Alice", 100), (1, 1, "Bob", 80), (2, 2, "Alice", 70), (2, 2, "Charlie", 90),
                (3, 3, "Bob", 60), (3, 3, "Charlie", 110)]  # RFC-015's (match_time, match_id, player_name, score)


def test_trace_names_the_match_result_behind_each_leaderboard_row(bootstrap_servers, topic) -> None:
    from io import StringIO

    from confluent_kafka import Producer

    from refold.cli import trace

    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=1)
    producer = Producer(settings_)
    values = [orjson.dumps({"op": "+A", "match_time": t, "match_id": m, "player_name": p, "score": s})
              for t, m, p, s in MATCH_SCORES]
    for value in values:
        producer.produce(source, value, None, 0)
    producer.flush(30)
    name = f"pt{uuid.uuid4().hex[:8]}"
    pipeline = parse_pipeline({"pipeline": name, "kafka": settings_, "source": {"topic": source},
                               "view": {"top_n": {"n": 2, "order_by": {"score": "desc"}}},
                               "outputs": {"view": {"topic": f"{name}.view"}}})
    ensure_topics(settings_, engine_topics(pipeline, 1))
    records = [InputRecord(0, offset, None, value, 1_000 + offset) for offset, value in enumerate(values)]
    processor = BatchProcessor(pipeline, settings_)
    try:
        processor.process(records[:3])
        processor.process(records[3:])
    finally:
        processor.close()

    # place 1: Alice's 100 (offset 0), then Charlie's 110 (offset 5) corrects it
    first = trace.trace_key(pipeline, settings_, {"place": 1})
    assert [(r["op"], r["row"]["player_name"], r["cause"]["offset"]) for r in first] == [
        ("+A", "Alice", 0), ("-C", "Alice", 5), ("+C", "Charlie", 5)]
    assert first[2]["cause"]["row"]["score"] == 110 and first[2]["cause"]["op"] == "+A"
    assert first[1]["retracts"]["offset"] == 0 and first[1]["retracts"]["row"]["player_name"] == "Alice"
    assert "retracts" not in first[0] and "retracts" not in first[2]
    # place 2: Bob's 80 (1), Charlie's 90 (3), Alice's 100 moved down by Charlie's 110 (5)
    second = trace.trace_key(pipeline, settings_, {"place": 2})
    assert [(r["op"], r["row"]["player_name"], r["cause"]["offset"]) for r in second] == [
        ("+A", "Bob", 1), ("-C", "Bob", 3), ("+C", "Charlie", 3), ("-C", "Charlie", 5), ("+C", "Alice", 5)]
    assert second[3]["retracts"]["offset"] == 3
    # what Charlie's 110 changed: both places; Bob's 60 (offset 4) changed nothing
    caused = trace.trace_input(pipeline, settings_, source, 0, 5)
    assert [(r["output"], r["op"], r["key"]["place"]) for r in caused] == [
        ("view", "-C", 1), ("view", "+C", 1), ("view", "-C", 2), ("view", "+C", 2)]
    assert trace.trace_input(pipeline, settings_, source, 0, 4) == []
    # the command's output: one JSON object per record; bounded by --since/--until
    out = StringIO()
    assert trace.run(pipeline, settings_, key='{"place": 1}', input_=None, since=1, until=None, as_json=True, out=out) == 0
    lines = [orjson.loads(line) for line in out.getvalue().splitlines()]
    assert [(line["op"], line["cause"]["offset"]) for line in lines] == [("-C", 5), ("+C", 5)]
    assert trace.run(pipeline, settings_, key='{"place": 1}', input_=None, since=None, until=1, as_json=False,
                     out=StringIO()) == 0
    assert trace.run(pipeline, settings_, key='{"place": 3}', input_=None, since=None, until=None, as_json=False,
                     out=StringIO()) == 1


@pytest.mark.parametrize("source_spec", [
    {"format": "jsonl", "key": ["player"]},  # a re-grouping view in shards: stage 2 names the original event
    {"format": "jsonl", "key": ["player"], "form": "upsert"},  # the cause is the table record
], ids=["exchange", "upsert"])
def test_causes_after_an_exchange_and_of_an_upsert_source(bootstrap_servers, topic, source_spec) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    name = f"px{uuid.uuid4().hex[:8]}"
    upsert = source_spec.get("form") == "upsert"
    pipeline = parse_pipeline({
        "pipeline": name, "kafka": settings_, "source": {"topic": source, **source_spec},
        **({} if upsert else {"shards": 2}),
        "view": {"key": ["team"], "columns": {"total": {"sum": "score"}}},
        "outputs": {"view": {"topic": f"{name}.view"}}})
    ensure_topics(settings_, engine_topics(pipeline, PARTITIONS))
    rows = [("ann", "red", 1), ("bob", "red", 2), ("cat", "blue", 3), ("ann", "red", 5), ("bob", "blue", 7)]
    offsets = [0] * PARTITIONS
    records, by_cause = [], {}
    teams: dict[bytes, set[str]] = {}
    teams_of: dict[str, str] = {}
    for player, team, score in rows:
        partition = len(player) % PARTITIONS if player != "bob" else 1
        row = {"player": player, "team": team, "score": score}
        value = orjson.dumps(row if upsert else {"op": "+A", **row})
        records.append(InputRecord(partition, offsets[partition], orjson.dumps({"player": player}), value, 1_000))
        cause = b"%d:%d" % (partition, offsets[partition])
        by_cause[cause] = row
        # the teams the record changes: its own, and (an upsert replaces the player's row) the one it leaves
        teams[cause] = {team, *([teams_of[player]] if upsert and player in teams_of else [])}
        teams_of[player] = team
        offsets[partition] += 1
    processor = BatchProcessor(pipeline, settings_)
    try:
        processor.process(records)
    finally:
        processor.close()
    written = list(read_to_end(settings_, pipeline.outputs.view.topic))
    assert written
    latest: dict[bytes, bytes] = {}
    for msg in sorted(written, key=lambda m: (m.partition(), m.offset())):
        headers = dict(msg.headers())
        record = orjson.loads(msg.value())
        assert record["team"] in teams[headers["refold.cause"]]  # an input record that changes the team
        if record["op"] in ("-C", "-R"):
            assert headers["refold.retracts"] == latest[msg.key()]
        else:
            latest[msg.key()] = headers["refold.cause"]


@pytest.mark.parametrize("view", [GROUPED, TOP_N], ids=["grouped", "topn"])
def test_state_without_causes_loads_and_its_next_retraction_names_none(view) -> None:
    # P.state written before causes were kept: a grouped key's summary without "c", a
    # Top-N group without its `[group]` summary. Both cores load it; the record a
    # retraction takes back has an unknown cause (no refold.retracts), the next ones a known one.
    from refold.reduce import decode_state, make_reducer
    from refold.reduce.statecodec import state_value
    from refold.runtime.native import native_core
    from refold.runtime.render import Renderer

    pipeline = parse_pipeline({"pipeline": "old", "source": {"topic": "s"}, "view": view,
                               "outputs": {"view": {"topic": "v"}}})
    first = make_reducer(pipeline.view)
    first.apply([SourceEvent(Op.APPEND, {"g": 0, "id": 0, "score": 5}, (1, 0, 0))])
    old = []
    for key, value in first.take_state_changes():
        assert value is not None
        record = decode_state(value)
        if record["kind"] == "KEY_SUMMARY":
            if "top_n" in view:
                continue  # no [group] summary
            values = {k: v for k, v in record["values"].items() if k != "c"}
            value = state_value("KEY_SUMMARY", orjson.dumps(list(record["key"])), record["count"], values, ())
        old.append((key, value))
    event = SourceEvent(Op.APPEND, {"g": 0, "id": 1, "score": 9}, (2, 0, 1))
    later = SourceEvent(Op.APPEND, {"g": 0, "id": 2, "score": 12}, (3, 0, 2))
    python = make_reducer(pipeline.view)
    python.restore(old)
    renderer = Renderer(pipeline)
    py_records = renderer.view([(python.apply([event]), 2), (python.apply([later]), 3)])
    core = native_core(pipeline)
    assert core is not None
    core.restore(old)
    _rejected, native_records, _delta, _state = core.apply_batch([((event, None),), ((later, None),)])
    assert native_records == py_records
    headers = [dict(h) for _k, _v, _ts, h in py_records]
    assert headers[0] == {"refold.cause": b"0:1"}  # a -C of a record whose cause is unknown
    assert {"refold.cause": b"0:2", "refold.retracts": b"0:1"} in headers  # known from here on


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=steps)
def test_a_global_top_n_in_shards_names_the_reference_cause(bootstrap_servers, topic, plan) -> None:
    # stage 3 ranks the entries each unit moved in the shards' local tops: its records
    # name the unit's input event, not an entry's (one batch: the one-shard view's order)
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    name = f"pg{uuid.uuid4().hex[:8]}"
    pipeline = parse_pipeline({"pipeline": name, "kafka": settings_, "source": {"topic": source, "key": ["g"]},
                               "shards": 2, "view": {"top_n": {"n": 2, "order_by": {"score": "desc"}}},
                               "outputs": {"view": {"topic": f"{name}.view"}}})
    ensure_topics(settings_, engine_topics(pipeline, PARTITIONS))
    records, units = _records(plan)
    processor = BatchProcessor(pipeline, settings_)
    try:
        processor.process(records)
    finally:
        processor.close()
    merged = sorted((unit for partition in units.values() for unit in partition), key=lambda unit: unit[0].tag)
    want = [(c.change.key_json(), headers_of(c)) for c in reference_causes(pipeline.view, merged)]
    assert pipeline.outputs.view is not None
    got = [(msg.key(), msg.headers()) for msg in read_to_end(settings_, pipeline.outputs.view.topic)]
    assert got == want


@pytest.mark.parametrize("window", [{"tumble": "10ms"}, {"hop": {"size": "10ms", "slide": "5ms"}},
                                    {"session": {"gap": "5ms"}}], ids=["tumble", "hop", "session"])
def test_a_windowed_views_records_name_their_cause_and_what_they_retract(window) -> None:
    # docs/SEMANTICS.md, Provenance: a windowed view's records as a grouped view's: each
    # names its unit, a -C/-R the cause of the record it takes back; a session's too, as
    # events extend (1012), merge (1016: the sessions from 1000 and 1020) and split them
    # (the retraction of 1004); the same headers from both cores and the reference's
    from refold.reduce import make_reducer
    from refold.runtime.native import native_core
    from refold.runtime.render import Renderer

    view = {"key": ["g"], "columns": {"n": {"count": "*"}}, "window": {"time": "ts", **window}}
    pipeline = parse_pipeline({"pipeline": "w", "source": {"topic": "s"}, "outputs": {"view": {"topic": "v"}},
                               "view": view})
    rows = [(Op.APPEND, {"g": 0, "id": i, "ts": ts}) for i, ts in enumerate([1_000, 1_004, 1_008, 1_020, 1_012, 1_016])]
    rows.append((Op.RETRACT, {"g": 0, "id": 1, "ts": 1_004}))
    events = [SourceEvent(op, row, (offset, 0, offset)) for offset, (op, row) in enumerate(rows)]
    python = make_reducer(pipeline.view)
    py_records = Renderer(pipeline).view([(python.apply([event]), event.row["ts"]) for event in events])
    core = native_core(pipeline)
    assert core is not None
    _rejected, native_records, _delta, _state = core.apply_batch([((event, None),) for event in events])
    assert [(k, v, h) for k, v, _ts, h in native_records] == [(k, v, h) for k, v, _ts, h in py_records]
    want = [(c.change.key_json(), headers_of(c)) for c in reference_causes(pipeline.view, [[e] for e in events])]
    assert [(k, h) for k, _v, _ts, h in py_records] == want
    headers = [(orjson.loads(value)["op"], dict(h or [])) for _key, value, _ts, h in py_records]
    assert len(headers) > len(events)
    latest: dict[bytes, bytes] = {}
    for (op, h), (key, *_rest) in zip(headers, py_records, strict=True):
        assert h["refold.cause"] in {b"0:%d" % offset for offset in range(len(events))}
        if op in ("-C", "-R"):
            assert h["refold.retracts"] == latest[key]
        else:
            latest[key] = h["refold.cause"]
    if "session" in window:  # the merge retracts the later session window; the split names the merge's cause
        assert ("-R", {"refold.cause": b"0:5", "refold.retracts": b"0:3"}) in headers
        assert ("-C", {"refold.cause": b"0:6", "refold.retracts": b"0:5"}) in headers
    off = parse_pipeline({"pipeline": "w", "source": {"topic": "s"}, "view": view,
                          "outputs": {"view": {"topic": "v"}, "provenance": False}})
    quiet = native_core(off)
    assert quiet is not None
    _rejected, native_records, _delta, _state = quiet.apply_batch([((event, None),) for event in events])
    assert len(native_records) == len(py_records)
    assert all(h is None for _k, _v, _ts, h in native_records)  # outputs.provenance: off


@pytest.mark.parametrize("window", [{"tumble": "10ms"}, {"session": {"gap": "5ms"}}], ids=["tumble", "session"])
def test_session_causes_come_back_from_state_and_emit_final_names_the_closing_unit(window) -> None:
    # a restart between two units: what the second retracts is known from the `[key]`
    # record, in both cores, either restoring the other's state; emit: final's +A names
    # the unit whose watermark advance closed the window (the reference's rule)
    from refold.reduce import make_reducer
    from refold.reduce.windowed import WindowedReducer
    from refold.runtime.native import native_core
    from refold.runtime.render import Renderer

    spec = {"key": ["g"], "columns": {"n": {"count": "*"}}, "window": {"time": "ts", **window, "lateness": "0ms"}}
    pipeline = parse_pipeline({"pipeline": "w", "source": {"topic": "s"}, "outputs": {"view": {"topic": "v"}},
                               "view": spec})
    first = SourceEvent(Op.APPEND, {"g": 0, "id": 0, "ts": 1_000}, (0, 0, 7))
    second = SourceEvent(Op.APPEND, {"g": 0, "id": 1, "ts": 1_002}, (0, 0, 8))
    python = make_reducer(pipeline.view)
    python.apply([first])
    py_state = python.take_state_changes()
    state = [(k, v) for k, v in py_state if v is not None]
    core = native_core(pipeline)
    assert core is not None
    _rejected, _view, _delta, core_state = core.apply_batch([((first, None),)])
    assert core_state == py_state  # the same records, the session's `[key]` with its cause included
    for restored in (make_reducer(pipeline.view), native_core(pipeline)):
        assert restored is not None
        restored.restore(state)
        if isinstance(restored, WindowedReducer):
            records = Renderer(pipeline).view([(restored.apply([second]), 1_002)])
        else:
            records = restored.apply_batch([((second, None),)])[1]
        assert [dict(h) for _k, _v, _ts, h in records] == [{"refold.cause": b"0:8", "refold.retracts": b"0:7"},
                                                             {"refold.cause": b"0:8"}]
    final = parse_pipeline({"pipeline": "w", "source": {"topic": "s"},
                            "outputs": {"view": {"topic": "v", "emit": "final"}}, "view": spec})
    reducer = WindowedReducer(final.view, emit="final")
    later = SourceEvent(Op.APPEND, {"g": 0, "id": 2, "ts": 1_030}, (0, 0, 9))
    units = [[first], [second], [later]]
    records = Renderer(final).view([(reducer.apply(unit), unit[0].row["ts"]) for unit in units])
    assert [dict(h) for _k, _v, _ts, h in records] == [{"refold.cause": b"0:9"}]
    want = reference_causes(final.view, units, "final")
    assert [(k, h) for k, _v, _ts, h in records] == [(c.change.key_json(), headers_of(c)) for c in want]
