"""The trace index `P.trace` (refold.runtime.traceindex): `refold trace --key` and
`--input` through it give exactly what a full scan of the view topic gives, for random
changelogs and random batch cuts through real transactions, every kind of shard that
writes a view (grouped, Top-N, windowed; co-partitioned, merged, a re-grouping view's
stage 2 and a global Top-N's stage 3, `--input` included), the Python reducers and the
native core; the index names every committed view record once; a replay writes no index
record again; a pipeline without an index falls back to the scan and says so. After a
kill -9 of the engine at each point of a batch and its restarts,
`test_crash.test_kill_9_at_each_point_then_restart` checks the index of that run with
`assert_index_answers_as_the_scan`, and `test_trace_join` a join's."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from refold.cli import trace, traceread
from refold.config import Pipeline, parse_pipeline
from refold.kafka.io import ensure_topics, read_to_end
from refold.plan import trace_topic
from refold.runtime.batch import InputRecord
from refold.runtime.processor import BatchProcessor
from refold.runtime.traceindex import build_entry, key_hash, parse, python_entry
from refold.spark.job import engine_topics

pytestmark = pytest.mark.kafka

PARTITIONS = 2
GROUPED = {"key": ["g"], "columns": {"total": {"sum": "score"}, "n": {"count": "*"}}}
REGROUPED = {"key": ["s"], "columns": {"total": {"sum": "score"}}}
TOP_N = {"top_n": {"n": 2, "order_by": {"score": "desc"}, "partition_by": ["g"]}}
GLOBAL_TOP_N = {"top_n": {"n": 2, "order_by": {"score": "desc"}}}
TUMBLE = {"time": "ts", "tumble": "20ms", "lateness": "1h"}
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {  # view, pipeline settings, core
    "grouped-python": (GROUPED, {}, "python"),
    "grouped-native": (GROUPED, {}, "native"),
    "grouped-upsert-native": (GROUPED, {"form": "upsert"}, "native"),
    "topn-python": (TOP_N, {}, "python"),
    "topn-native": (TOP_N, {}, "native"),
    "windowed-native": ({**GROUPED, "window": TUMBLE}, {}, "native"),
    "windowed-merged-python": ({**REGROUPED, "window": TUMBLE}, {}, "python"),
    "regrouped-stage2": (REGROUPED, {"shards": 2}, "auto"),
    "global-topn-stage3": (GLOBAL_TOP_N, {"shards": 2}, "auto"),
}

steps = st.lists(st.tuples(st.sampled_from(["+A", "+A", "-R", "-C"]), st.integers(0, 3), st.integers(0, 9)),
                 min_size=1, max_size=40)


def _pipeline(settings_: dict[str, Any], source: str, view: dict[str, Any], extra: dict[str, Any], core: str,
              provenance: bool = True) -> Pipeline:
    name = f"ti{uuid.uuid4().hex[:8]}"
    form = extra.get("form", "changelog")
    spec: dict[str, Any] = {
        "pipeline": name, "kafka": settings_, "source": {"topic": source, "key": ["g"]}, "view": view,
        "outputs": {"view": {"topic": f"{name}.view", "form": form}, "provenance": provenance},
        "spark": {"core": core}}
    if "shards" in extra:
        spec["shards"] = extra["shards"]
    pipeline = parse_pipeline(spec)
    ensure_topics(settings_, engine_topics(pipeline, PARTITIONS))
    return pipeline


def _records(plan: list[tuple[str, int, int]]) -> list[InputRecord]:
    """A changelog keyed by g: appends, retractions and corrections of live rows."""
    offsets = [0] * PARTITIONS
    live: dict[int, list[dict[str, Any]]] = {}
    records: list[InputRecord] = []

    def emit(op: str, row: dict[str, Any]) -> None:
        partition = row["g"] % PARTITIONS
        records.append(InputRecord(partition, offsets[partition], orjson.dumps({"g": row["g"]}),
                                   orjson.dumps({"op": op, **row}), 1_000 + len(records)))
        offsets[partition] += 1

    for number, (op, g, score) in enumerate(plan):
        rows = live.setdefault(g, [])
        if op == "+A" or not rows:
            row = {"g": g, "id": number, "score": score, "s": score % 3, "ts": number}
            rows.append(row)
            emit("+A", row)
        elif op == "-R":
            emit("-R", rows.pop(score % len(rows)))
        else:
            at = score % len(rows)
            old, new = rows[at], {**rows[at], "score": score, "s": score % 3}
            rows[at] = new
            emit("-C", old)
            emit("+C", new)
    return records


def _run(pipeline: Pipeline, settings_: dict[str, Any], batches: list[list[InputRecord]]) -> None:
    processor = BatchProcessor(pipeline, settings_)
    try:
        for batch in batches:
            processor.process(batch)
    finally:
        processor.close()


def _scanned(pipeline: Pipeline, settings_: dict[str, Any]) -> tuple[dict[bytes, list[Any]], dict[bytes, list[Any]]]:
    """The view records by message key and by cause, as a full scan finds them."""
    assert pipeline.outputs.view is not None
    by_key: dict[bytes, list[Any]] = {}
    by_cause: dict[bytes, list[Any]] = {}
    for msg in read_to_end(settings_, pipeline.outputs.view.topic):
        where = (msg.partition(), msg.offset())
        by_key.setdefault(msg.key(), []).append(where)
        by_cause.setdefault(dict(msg.headers() or [])["refold.cause"], []).append(where)
    return by_key, by_cause


def assert_index_answers_as_the_scan(pipeline: Pipeline, settings_: dict[str, Any], source: str = "",
                                     inputs: int | None = 6, *, fetched: bool = False) -> int:
    """Every key's trace and the first `inputs` inputs' (all when None) through the index
    equal the scan's, with no fallback; the index names every view record once. Returns
    the view records' count. A cause `<partition>:<offset>` is an event of `source`, a
    join's `<topic>:<partition>:<offset>` names its topic. `fetched`: every cause's record
    is in its source topic (each trace names its row, and nothing is noted); else the
    source topics hold no records, and only their delta and dead-letter topics' "is not
    there" is noted (they are read whole)."""
    by_key, by_cause = _scanned(pipeline, settings_)
    entries = list(traceread._parsed(settings_, trace_topic(pipeline)))
    named = [(e.partition, e.first + e.positions[i]) for e in entries for i in range(e.records)]
    assert sorted(named) == sorted(where for found in by_key.values() for where in found)
    notes: list[str] = []
    for key, where in by_key.items():
        got = trace.trace_key(pipeline, settings_, orjson.loads(key), note=notes.append)
        assert [(r["partition"], r["offset"]) for r in got] == sorted(where), key
        assert all(r["cause"] is not None and (not fetched or "row" in r["cause"]) for r in got)
    for cause in sorted(by_cause)[:inputs]:
        topic_, partition, offset = trace.cause_place(cause, source)
        got = trace.trace_input(pipeline, settings_, topic_, partition, offset, note=notes.append)
        assert sorted((r["partition"], r["offset"]) for r in got if r["output"] == "view") == sorted(by_cause[cause])
    # no scan of the view (a later stage's --input neither: its batches' source ranges are its causes')
    assert (notes if fetched else [n for n in notes if "is not there" not in n]) == [], notes
    return len(named)


# Grouped and Top-N co-partitioned run one core each in `make test` (the native grouped,
# the Python Top-N), the other in `make test-slow` (marker slow): the cores' index entries
# are byte-equal (test_the_native_entry_is_the_python_one) and their view records are
# (the native cores' differential tests). The windowed view re-grouped in shards, with the
# Python reducer, is in `make test-slow` too: `windowed-native` holds a windowed view's
# index, and `regrouped-stage2` a re-grouping view's.
SLOW_PAIRS = ("grouped-python", "topn-native", "windowed-merged-python")


@pytest.mark.parametrize("case", [pytest.param(case, marks=[pytest.mark.slow] if case in SLOW_PAIRS else [])
                                  for case in CASES])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # (no shrinking: each example runs the engine)
@given(plan=steps, data=st.data())
def test_trace_through_the_index_equals_the_scan(bootstrap_servers, topic, case, plan, data) -> None:
    view, extra, core = CASES[case]
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    pipeline = _pipeline(settings_, source, view, extra, core)
    records = _records(plan)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(records) - 1)), max_size=4)))
    batches = [records[a:b] for a, b in zip([0, *cuts], [*cuts, len(records)], strict=True) if a < b]
    _run(pipeline, settings_, batches)
    written = assert_index_answers_as_the_scan(pipeline, settings_, source)
    if not pipeline.shards:  # a replay writes nothing again, no index record either
        entries = len(list(read_to_end(settings_, trace_topic(pipeline))))
        _run(pipeline, settings_, batches)
        assert len(list(read_to_end(settings_, trace_topic(pipeline)))) == entries
        assert assert_index_answers_as_the_scan(pipeline, settings_, source, inputs=0) == written


def test_without_an_index_trace_scans_and_says_so(bootstrap_servers, topic) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    pipeline = _pipeline(settings_, source, GROUPED, {}, "auto", provenance=False)
    assert not any(spec.name == trace_topic(pipeline) for spec in engine_topics(pipeline, PARTITIONS))
    _run(pipeline, settings_, [_records([("+A", 1, 5), ("-C", 1, 7), ("+A", 2, 1)])])
    notes: list[str] = []
    got = trace.trace_key(pipeline, settings_, {"g": 1}, note=notes.append)
    assert [r["op"] for r in got] == ["+A", "-C", "+C"]
    assert notes == [f"no trace index ({trace_topic(pipeline)}): scanning {pipeline.outputs.view.topic}"]


def test_the_native_entry_is_the_python_one() -> None:
    import refold_native

    rows = [(b'{"k":%d}' % (i * 7919 % 13), b"v", 0, None) for i in range(300)]
    for view in ([], rows[:1], rows):
        assert refold_native.trace_entry(view, 2, 77, 5, [(0, 1, 9), (3, 4, 400)]) == python_entry(
            view, 2, 77, 5, [(0, 1, 9), (3, 4, 400)])


def test_an_entry_reads_back_as_built() -> None:
    keys = [b'{"g":%d}' % (i % 7) for i in range(50)]
    value = build_entry([(k, b"v", 0, None) for k in keys], 3, 1_000, 9, [(1, 40, 90)])
    entry = parse(value)
    assert (entry.partition, entry.first, entry.records, entry.batch) == (3, 1_000, 50, 9)
    assert entry.consumed(1, 40) and entry.consumed(1, 89) and not entry.consumed(1, 90) and not entry.consumed(0, 50)
    for k in set(keys):
        assert entry.offsets_of(key_hash(k)) == [1_000 + i for i, other in enumerate(keys) if other == k]
    assert entry.offsets_of(key_hash(b'{"g":99}')) == []
    with pytest.raises(ValueError):
        parse(b"\x02" + value[1:])
