"""The engine's windowed views against `refold.reference`, record by record: random
windowed changelogs (out-of-order and late times, late corrections and retractions,
ISO text, bad times), random batch cuts, and at each cut maybe a new reducer restored
from the `P.state` records so far (a restart, a rebuild). Then the same through a
`BatchProcessor` on the real broker."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from window_changelogs import Unit, batched, window_changelogs, window_view, windowed_views

from refold.config import ViewSpec, parse_pipeline
from refold.kafka.io import TopicSpec, ensure_topics, read_to_end
from refold.model.changelog import Op
from refold.model.reasons import Reason
from refold.recovery.records import decode_dead_letter
from refold.reduce import Rejected, SourceEvent, make_reducer
from refold.reference import merge_partitions, reference_changelog
from refold.reference_windows import window_deltas
from refold.runtime.batch import InputRecord
from refold.runtime.processor import BatchProcessor
from refold.spark.job import engine_topics

_CUT = {Op.CORRECT_FROM: Reason.UNPAIRED_CORRECT_FROM, Op.CORRECT_TO: Reason.ORPHAN_CORRECT_TO}


def _records(changes: Sequence[Any]) -> list[tuple[Op, tuple[Any, ...], bytes]]:
    """Changes as (op, key, row bytes): rows compare as their JSON (1 and 1.0 differ)."""
    return [(c.op, tuple(c.key), orjson.dumps(c.row)) for c in changes]


def _engine(spec: ViewSpec, emit: str, batches: list[list[Unit]], restarts: list[bool]) -> dict[str, Any]:
    """The engine's reducer over the batches: its records, dead letters, deltas per batch,
    final view and watermark; after a batch where `restarts` says so, a new reducer
    restored from the state records written so far."""
    reducer = make_reducer(spec, emit)
    state: dict[bytes, bytes | None] = {}
    changes: list[Any] = []
    letters: list[tuple[int, int, str]] = []
    deltas: list[dict[str, Any]] = []
    index = 0
    for batch, restart in zip(batches, restarts, strict=True):
        for unit in batch:
            if len(unit) == 1 and unit[0].op in _CUT:  # the engine's reader refuses these (refold.runtime.batch)
                letters.append((index, 0, _CUT[unit[0].op]))
                index += 1
                continue
            try:
                changes += reducer.apply(unit)
            except Rejected as rejected:
                letters += [(index, i, rejected.reason if i == rejected.index else Reason.CORRECTION_PAIR_REJECTED)
                            for i in range(len(unit))]
            index += 1
        deltas += reducer.take_deltas()
        state.update(reducer.take_state_changes())
        if restart:
            reducer = make_reducer(spec, emit)
            reducer.restore(sorted((k, v) for k, v in state.items() if v is not None))
    return {"changes": _records(changes), "letters": letters, "deltas": deltas,
            "view": {k: orjson.dumps(v) for k, v in reducer.view().items()},
            "watermark": getattr(reducer, "watermark", None)}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_the_engine_writes_what_the_reference_writes(data: st.DataObject) -> None:
    spec, emit = data.draw(windowed_views())
    units = data.draw(window_changelogs(invalid=data.draw(st.booleans())))
    batches = data.draw(batched(units))
    restarts = data.draw(st.lists(st.booleans(), min_size=len(batches), max_size=len(batches)))
    engine = _engine(spec, emit, batches, restarts)
    expected = reference_changelog(spec, units, emit)
    assert engine["letters"] == expected.dead_letters
    assert engine["changes"] == _records(expected.changes)
    # the reference's view is the output's (closed windows keep their last row); the
    # engine holds the open windows': each as the reference has it
    if emit == "per_event":
        reference_view = {k: orjson.dumps(v) for k, v in expected.view.items()}
        assert {k: reference_view.get(k) for k in engine["view"]} == engine["view"]
        if spec.window is not None and spec.window.lateness is None:  # nothing closes: the same view
            assert engine["view"] == reference_view
    if spec.window is not None and spec.window.lateness is not None:
        assert engine["watermark"] == expected.watermark


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_tumble_and_hop_deltas_are_the_reference_deltas(data: st.DataObject) -> None:
    spec, emit = data.draw(windowed_views(kinds=("tumble", "hop", "hop-uneven"), top_n=False))
    units = data.draw(window_changelogs())
    batches = data.draw(batched(units))
    engine = _engine(spec, emit, batches, [False] * len(batches))
    assert [orjson.dumps(d) for d in engine["deltas"]] == [orjson.dumps(d) for d in window_deltas(spec, batches)]


# through the shards, on the real broker ---------------------------------------------------

@pytest.mark.kafka  # 10 examples, each a shard on the broker; the space of views and changelogs is the
# in-memory tests' above (150 and 60 examples of the same strategies)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_a_windowed_views_shard_writes_what_the_reference_writes(bootstrap_servers: str, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["tumble", "hop", "session"]))
    lateness = data.draw(st.sampled_from([None, "0ms", "5ms"]))
    top_n = data.draw(st.sampled_from([None, 2])) if kind != "session" else None
    emit = "final" if lateness is not None and data.draw(st.booleans()) else "per_event"
    spec = window_view(kind, lateness, top_n)
    where = data.draw(st.sampled_from([None, "v > 0", "v IS NOT NULL OR k = 'a'"]))
    if where is not None:  # (the shard filters units before its reducer; the reference itself)
        spec = spec.model_copy(update={"where": where})
    units = data.draw(window_changelogs(invalid=True, max_units=40))
    batches = data.draw(batched(units))
    settings_ = {"bootstrap.servers": bootstrap_servers}
    name = f"wd{uuid.uuid4().hex[:8]}"
    view = spec.model_dump(exclude_none=True, exclude={"sql"}, by_alias=True)
    # messages keyed by `v`: not co-partitioned, so one shard merges the source (a windowed view never re-groups)
    pipeline = parse_pipeline({"pipeline": name, "kafka": settings_, "source": {"topic": f"{name}.in", "key": ["v"]},
                               "view": {k: v for k, v in view.items() if v not in ([], {})},
                               "outputs": {"view": {"topic": f"{name}.view", "emit": emit}}})
    ensure_topics(settings_, [TopicSpec(f"{name}.in", 1), *engine_topics(pipeline, 1)])
    offset = 0
    wire: list[SourceEvent] = []  # the events as the engine reads them, tagged (event time, partition, offset)
    processor = BatchProcessor(pipeline, settings_)
    try:
        for number, batch in enumerate(batches):
            records = []
            for unit in batch:
                for event in unit:
                    value = {"op": event.op.code, "event_time": event.tag[0], **event.row}
                    records.append(InputRecord(0, offset, None, orjson.dumps(value), 0))
                    wire.append(event._replace(tag=(event.tag[0], 0, offset)))
                    offset += 1
            processor.process(records)
            if number % 2:  # a restart now and then
                processor.close()
                processor = BatchProcessor(pipeline, settings_)
    finally:
        processor.close()
    # the units as the engine reads them from one partition: a cut pair's halves, side by
    # side, are a pair again
    units = merge_partitions({0: wire})
    expected = reference_changelog(spec, units, emit)
    written = [orjson.loads(m.value()) for m in read_to_end(settings_, f"{name}.view")]
    assert [orjson.dumps({"op": c.op.code, **c.row}) for c in expected.changes] == [orjson.dumps(r) for r in written]
    first = [0]
    for unit in units:
        first.append(first[-1] + len(unit))
    letters = sorted((d.offset, d.reason) for d in
                     (decode_dead_letter(m.value()) for m in read_to_end(settings_, pipeline.dlq_topic)))
    assert letters == [(first[unit] + position, reason) for unit, position, reason in expected.dead_letters]
