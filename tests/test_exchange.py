"""A re-grouping view in shards (`shards: M`, refold.runtime.exchange): stage 1 per
source partition, the close, stage 2 per shard, against the reference."""

from __future__ import annotations

import heapq
import random
import uuid
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from refold.cli.produce import produce
from refold.config import Pipeline, load_pipeline, parse_pipeline
from refold.dev.testing import Workload, generate
from refold.errors import ConfigError, OperationalError
from refold.kafka.io import ensure_topics, open_transactions, read_to_end
from refold.model.changelog import Op
from refold.ops.status import later_stages, print_status
from refold.ops.verify import by_key, output_key, read_view_changes, verify
from refold.recovery.records import decode_dead_letter
from refold.recovery.restore import load_checkpoints
from refold.reduce import SourceEvent
from refold.reduce.values import key_bytes
from refold.reference import merge_partitions, reference_changelog
from refold.runtime.batch import InputRecord, Outgoing
from refold.runtime.exchange import ExchangeReader, merge_keys, shard_of, view_pipeline
from refold.runtime.processor import BatchProcessor
from refold.runtime.shards import stage2_shards
from refold.runtime.tops import rank_pipeline, ranked_globally
from refold.spark.job import engine_topics, run_pipeline

PARTITIONS = 3
VIEWS = {
    "grouped": {"key": ["team"], "columns": {"total": {"sum": "score"}, "n": {"count": "*"},
                                             "best": {"max": "score"}, "latest": {"last": "score"},
                                             "mean": {"avg": "score"}, "opening": {"first": "score"}}},
    "top_n": {"top_n": {"n": 2, "order_by": {"score": "desc"}, "partition_by": ["team"]}},
    "global_top_n": {"top_n": {"n": 3, "order_by": {"score": "desc"}}},
    "filtered": {"key": ["team"], "columns": {"n": {"count": "*"}, "low": {"min": "score"}}, "where": "score > 20"},
}


def _pipeline(settings_: dict[str, Any], source: str, view: dict[str, Any], shards: int, core: str = "auto") -> Pipeline:
    name = f"ex{uuid.uuid4().hex[:8]}"
    outputs: dict[str, Any] = {"view": {"topic": f"{name}.view"}}
    if "key" in view:
        outputs["delta"] = {"topic": f"{name}.delta"}
    pipeline = parse_pipeline({"pipeline": name, "kafka": settings_, "shards": shards, "outputs": outputs,
                               "spark": {"core": core},
                               "source": {"topic": source, "format": "jsonl", "key": ["player"]}, "view": view})
    ensure_topics(settings_, engine_topics(pipeline, PARTITIONS))
    return pipeline


def _changelog(seed: int, units: int) -> dict[int, list[list[dict[str, Any]]]]:
    """Per source partition, its units of rows (each with `op`), keyed by player
    (player i lives in partition i mod 3): appends, retractions, corrections that move
    a row between teams, and bad units (a retraction of a row that is not live, a `-C`
    without its `+C`, a null team)."""
    rng = random.Random(seed)
    live: dict[str, list[dict[str, Any]]] = {}
    out: dict[int, list[list[dict[str, Any]]]] = {p: [] for p in range(PARTITIONS)}
    for _ in range(units):
        player = f"p{rng.randrange(7)}"
        partition = int(player[1:]) % PARTITIONS
        rows = live.setdefault(player, [])
        fresh = {"player": player, "team": f"t{rng.randrange(3)}", "score": rng.randrange(0, 60)}
        choice = rng.randrange(20)
        if choice < 8 or not rows:
            if choice == 19:
                fresh["team"] = None  # refused: a null view key
            else:
                rows.append(fresh)
            out[partition].append([{"op": "+A", **fresh}])
        elif choice < 12:
            out[partition].append([{"op": "-R", **rows.pop(rng.randrange(len(rows)))}])
        elif choice < 17:
            old = rows.pop(rng.randrange(len(rows)))
            rows.append(fresh)
            out[partition].append([{"op": "-C", **old}, {"op": "+C", **fresh}])
        elif choice == 17:
            out[partition].append([{"op": "-R", **fresh, "score": 999}])  # not live
        else:
            out[partition].append([{"op": "-C", **rows[0]}])  # its +C never comes
    for partition, units in out.items():  # no -C left waiting for its +C at the end
        units.append([{"op": "+A", "player": f"p{partition}", "team": "t0", "score": 1}])
    return out


def _produce(bootstrap: str, source: str, changelog: dict[int, list[list[dict[str, Any]]]]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for partition, units in changelog.items():
        for offset, row in enumerate(row for unit in units for row in unit):
            event = {**row, "event_time": _time(partition, offset)}
            producer.produce(source, orjson.dumps(event), orjson.dumps({"player": row["player"]}), partition=partition)
    assert producer.flush(30) == 0


def _time(partition: int, offset: int) -> int:
    """Event times that interleave the partitions, growing within each (the
    partitions' merge order when they do not: `test_merge_keys_order_units_as_the_one_shard_merge`)."""
    return offset * 10 + (partition * 7) % 10


def _batches(records: list[InputRecord], cuts: list[int]) -> list[list[InputRecord]]:
    """The records in batches: batch b holds each partition's records whose place
    among that partition's units is below the b-th cut (cuts fall between units)."""
    by_partition: dict[int, list[list[InputRecord]]] = {}
    for record in sorted(records):
        units = by_partition.setdefault(record.partition, [])
        op = orjson.loads(record.value)["op"]
        if op == "+C" and units and orjson.loads(units[-1][-1].value)["op"] == "-C":
            units[-1].append(record)
        else:
            units.append([record])
    bounds = [*sorted(set(cuts)), 10**9]
    batches: list[list[InputRecord]] = [[] for _ in bounds]
    for units in by_partition.values():
        for place, unit in enumerate(units):
            batches[next(b for b, bound in enumerate(bounds) if place < bound)].extend(unit)
    return [batch for batch in batches if batch]


def _view_changes(pipeline: Pipeline, settings_: dict[str, Any]) -> Any:
    """The committed view changelog, once the last commits' markers are written: a
    transaction's markers follow `commit_transaction`'s return, and a read right after it
    saw an empty view topic (CI, beside a chaos run). The dead letters and the
    repartition topic are read after it, so they are waited for too."""
    assert pipeline.outputs.view is not None
    topics = [pipeline.outputs.view.topic, pipeline.dlq_topic, pipeline.repartition_topic]
    assert not open_transactions(settings_, topics, timeout=30)
    return read_view_changes(pipeline, settings_)


def check_one_writer_per_view_partition(pipeline: Pipeline, settings_: dict[str, Any],
                                        writer_of: Callable[[dict[str, Any]], int]) -> None:
    """The view topic partitioned by shard: each record in the partition of the shard
    that wrote it (`writer_of` its row), so a partition has one writer, and each `-C`
    right before its `+C` there (DESIGN.md §1)."""
    assert pipeline.outputs.view is not None and pipeline.outputs.view.partitioning == "shard"
    partitions: dict[int, list[tuple[str, tuple[Any, ...]]]] = {}
    for msg in read_to_end(settings_, pipeline.outputs.view.topic):
        row = orjson.loads(msg.value())
        assert msg.partition() == writer_of(row), (msg.partition(), row)
        partitions.setdefault(msg.partition(), []).append((row["op"], output_key(pipeline, row)))
    assert partitions, "no view records"
    for records in partitions.values():
        for (op, key), (next_op, next_key) in zip(records, [*records[1:], ("end", ())], strict=True):
            if op == "-C":
                assert (next_op, next_key) == ("+C", key)


def stage2_writer(pipeline: Pipeline) -> Callable[[dict[str, Any]], int]:
    """The shard that writes a view row of a re-grouping view in shards: stage 3 for a
    global Top-N in more than one shard, else the stage-2 shard of its routing key."""
    if ranked_globally(pipeline):
        return lambda row: 0
    top_n = pipeline.view.top_n
    columns = top_n.partition_by if top_n is not None else pipeline.view.key
    return lambda row: shard_of(key_bytes(tuple(row[c] for c in columns)), stage2_shards(pipeline))


def _expected(pipeline: Pipeline, batches: list[list[InputRecord]]) -> Any:
    """The reference's changelog over the batches: each batch's partitions merged by tag."""
    units = []
    for batch in batches:
        partitions: dict[int, list[SourceEvent]] = {}
        for record in sorted(batch):
            row = orjson.loads(record.value)
            op = Op[{"+A": "APPEND", "-R": "RETRACT", "-C": "CORRECT_FROM", "+C": "CORRECT_TO"}[row.pop("op")]]
            tag = (row.pop("event_time"), record.partition, record.offset)
            partitions.setdefault(record.partition, []).append(SourceEvent(op, row, tag))
        units += merge_partitions(partitions)
    return reference_changelog(pipeline.view, units)


def _cores_taking_turns() -> list[Any]:
    """Each view in 1 and 3 shards with the native cores (`auto`: stage 1's live rows and
    stage 2 in Rust) and without (`python`). `make test` runs one core per view and shard
    count, the cores taking turns so that each view and each shard count meets both; the
    other core of the pair runs in `make test-slow` (marker slow): the Rust and the
    Python stages are held to the same records in memory by the differential tests of
    test_native_core, test_native_topn and test_native_route."""
    cases = []
    for v, view in enumerate(VIEWS):
        for s, shards in enumerate((1, 3)):
            turn = ("python", "auto")[(v + s) % 2]  # a global Top-N in 3 shards with auto: its stage 2 stays Python
            cases += [pytest.param(view, shards, core, marks=[] if core == turn else [pytest.mark.slow],
                                   id=f"{view}-{shards}-{core}") for core in ("auto", "python")]
    return cases


@pytest.mark.kafka
@pytest.mark.parametrize(("view", "shards", "core"), _cores_taking_turns())
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # a shrink would take minutes of Kafka
@given(seed=st.integers(0, 2**16), cuts=st.lists(st.integers(1, 40), max_size=3))
def test_a_regrouping_view_in_shards_equals_the_reference_per_key(
    bootstrap_servers: str, topic: Any, view: str, shards: int, core: str, seed: int, cuts: list[int]
) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    _produce(bootstrap_servers, source, _changelog(seed, 90))
    records = [InputRecord(m.partition(), m.offset(), m.key(), m.value(), m.timestamp()[1])
               for m in read_to_end(settings_, source)]
    pipeline = _pipeline(settings_, source, VIEWS[view], shards, core)
    batches = _batches(records, cuts)
    processor = BatchProcessor(pipeline, settings_)
    try:
        assert sorted(processor.appliers) == list(range(shards))
        for batch in batches:
            processor.process(batch)
        assert processor.process(batches[0]) is None  # a replay: nothing again
        if core == "auto":  # stage 2 in Rust, but a global Top-N's (LocalTops, in Python)
            native = "TopNCore" if "top_n" in VIEWS[view] else "GroupedCore"
            want = "NoneType" if view == "global_top_n" and shards > 1 else native
            assert {type(applier.core).__name__ for applier in processor.appliers.values()} == {want}
    finally:
        processor.close()

    expected = _expected(pipeline, batches)
    assert by_key(_view_changes(pipeline, settings_)) == by_key(expected.changes)
    letters = [decode_dead_letter(m.value()) for m in read_to_end(settings_, pipeline.dlq_topic)]
    assert len(letters) == len({(letter.partition, letter.offset) for letter in letters})  # each once
    if "where" not in VIEWS[view]:  # (the engine's reader refuses an unpaired -C before the filter sees it)
        assert sorted(letter.reason for letter in letters) == sorted(reason for _, reason in expected.rejected)
    assert all(letter.topic == source for letter in letters)
    report = verify(pipeline, settings_)
    assert report.anomalies == [], report.anomalies
    check_one_writer_per_view_partition(processor.pipeline, settings_, stage2_writer(processor.pipeline))
    # stage 2's checkpoints cover P.repartition; stage 1's the source
    assert set(load_checkpoints(view_pipeline(pipeline), settings_)) == set(range(shards))
    assert {p for c in load_checkpoints(pipeline, settings_).values() for p in c.offsets} == set(range(PARTITIONS))
    ranked = load_checkpoints(rank_pipeline(pipeline), settings_)  # a global Top-N in shards: stage 3 ranked it
    assert set(ranked) == ({0} if view == "global_top_n" and shards > 1 else set())


@pytest.mark.kafka
def test_stage_two_catches_up_at_start_with_what_stage_one_left(bootstrap_servers: str, topic: Any,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    _produce(bootstrap_servers, source, _changelog(7, 60))
    records = [InputRecord(m.partition(), m.offset(), m.key(), m.value(), m.timestamp()[1])
               for m in read_to_end(settings_, source)]
    pipeline = _pipeline(settings_, source, VIEWS["grouped"], 2)
    processor = BatchProcessor(pipeline, settings_)
    try:
        monkeypatch.setattr(processor, "_apply", lambda: [])  # the engine stops after stage 1
        processor.process(records)
    finally:
        processor.close()
    assert _view_changes(pipeline, settings_) == []
    # `refold status`: stage 2's lag is the routed units it has not applied (closes are not lag)
    routed = sum(1 for m in read_to_end(settings_, pipeline.repartition_topic) if m.value()[:1] == b"[")
    [stage] = later_stages(pipeline, settings_)
    assert stage.name == "stage 2" and sum(row.lag for row in stage.rows) == routed > 0
    print_status(pipeline)
    assert f"stage 2 (writer 0.view) from {pipeline.repartition_topic}" in capsys.readouterr().out
    monkeypatch.undo()
    BatchProcessor(pipeline, settings_).close()  # the next start closes and reduces it
    expected = _expected(pipeline, [records])
    assert by_key(_view_changes(pipeline, settings_)) == by_key(expected.changes)
    assert [sum(row.lag for row in stage.rows) for stage in later_stages(pipeline, settings_)] == [0]


@pytest.mark.kafka
def test_a_value_the_native_cores_do_not_take_falls_back_to_python_in_both_stages(
    bootstrap_servers: str, topic: Any
) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    changelog = _changelog(5, 40)
    changelog[1].insert(3, [{"op": "+A", "player": "p1", "team": "t0", "score": 2**63 + 5}])  # past i64
    _produce(bootstrap_servers, source, changelog)
    records = [InputRecord(m.partition(), m.offset(), m.key(), m.value(), m.timestamp()[1])
               for m in read_to_end(settings_, source)]
    pipeline = _pipeline(settings_, source, VIEWS["grouped"], 2)
    processor = BatchProcessor(pipeline, settings_)
    try:
        assert all(shard.core is not None for shard in [*processor.shards.values(), *processor.appliers.values()])
        processor.process(records)
        assert processor.shards[1].core is None  # stage 1 of partition 1 checks in Python from here
        assert processor.shards[0].core is not None
        team = shard_of(key_bytes(("t0",)), 2)
        assert processor.appliers[team].core is None  # the stage-2 shard of team t0 reduces in Python
    finally:
        processor.close()
    expected = _expected(pipeline, [records])
    assert by_key(_view_changes(pipeline, settings_)) == by_key(expected.changes)
    letters = [decode_dead_letter(m.value()) for m in read_to_end(settings_, pipeline.dlq_topic)]
    assert sorted(letter.reason for letter in letters) == sorted(reason for _, reason in expected.rejected)


@pytest.mark.kafka
def test_a_global_top_n_ranks_at_the_next_start_what_stage_two_left(bootstrap_servers: str, topic: Any) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    _produce(bootstrap_servers, source, _changelog(3, 90))
    records = [InputRecord(m.partition(), m.offset(), m.key(), m.value(), m.timestamp()[1])
               for m in read_to_end(settings_, source)]
    batches = _batches(records, [12])
    pipeline = _pipeline(settings_, source, VIEWS["global_top_n"], 3)
    processor = BatchProcessor(pipeline, settings_)
    try:
        assert processor.ranker is not None
        processor.process(batches[0])
        processor.ranker, ranker = None, processor.ranker  # the engine stops after stage 2 of the next batch
        processor.process(batches[1])
        processor.ranker = ranker
    finally:
        processor.close()
    assert by_key(_view_changes(pipeline, settings_)) == by_key(_expected(pipeline, batches[:1]).changes)
    assert _expected(pipeline, batches).changes != _expected(pipeline, batches[:1]).changes  # (the test can fail)
    assert [stage.name for stage in later_stages(pipeline, settings_)] == ["stage 2", "stage 3"]
    assert sum(row.lag for row in later_stages(pipeline, settings_)[1].rows) > 0  # local-top changes not ranked
    BatchProcessor(pipeline, settings_).close()  # the next start closes P.tops and ranks it
    assert by_key(_view_changes(pipeline, settings_)) == by_key(_expected(pipeline, batches).changes)
    assert [sum(row.lag for row in stage.rows) for stage in later_stages(pipeline, settings_)] == [0, 0]
    assert verify(pipeline, settings_).anomalies == []


def test_segments_merge_by_the_first_tag_of_each_unit_before_routing() -> None:
    def routed(offset: int, first: tuple[int, int, int], events: list[tuple[int, int, int, int]]) -> InputRecord:
        value = orjson.dumps([list(first), [[t, p, o, op, {"o": o}] for t, p, o, op in events]])
        return InputRecord(0, offset, None, value, 0)

    records = [
        routed(0, (9, 1, 5), [(9, 1, 5, 0)]),
        routed(1, (5, 0, 3), [(8, 0, 4, 3)]),  # the +C of a pair whose -C (t=5) went elsewhere
        routed(2, (7, 2, 1), [(7, 2, 1, 0)]),
        InputRecord(0, 3, None, b'{"close":[1,1]}', 0),
        routed(4, (1, 1, 9), [(1, 1, 9, 1)]),
        InputRecord(0, 5, None, b'{"close":[1,2]}', 0),
    ]
    units = ExchangeReader().read(records, {}, Outgoing()).units
    assert [[event.row["o"] for event, _ in unit] for unit in units] == [[4], [1], [5], [9]]
    assert units[0][0][0].op is Op.CORRECT_TO and units[0][0][1].offset == 1


def test_shards_of_view_keys_are_stable_and_spread() -> None:
    keys = [orjson.dumps([f"team{i}"]) for i in range(300)]
    assert [shard_of(k, 4) for k in keys] == [shard_of(k, 4) for k in keys]
    assert all(0 <= shard_of(k, 4) < 4 for k in keys)
    assert min(sum(1 for k in keys if shard_of(k, 4) == s) for s in range(4)) > 40


@pytest.mark.parametrize("change, message", [
    ({"source": {"topic": "s"}}, "needs source.key"),
    ({"source": {"topic": "s", "key": ["team"]}}, "co-partitioned"),
    ({"source": {"topic": "s", "key": ["player"], "form": "upsert"}}, "jsonl changelog"),
])
def test_shards_is_for_a_regrouping_view_of_a_keyed_changelog(change: dict[str, Any], message: str) -> None:
    base = {"pipeline": "p", "shards": 2, "view": VIEWS["grouped"], "outputs": {"view": {"topic": "v"}}}
    with pytest.raises(ConfigError, match=message):
        parse_pipeline({**base, **change})


@settings(max_examples=300, deadline=None)
@given(times=st.lists(st.lists(st.integers(0, 6), max_size=7), min_size=1, max_size=4), data=st.data())
def test_merge_keys_order_units_as_the_one_shard_merge(times: list[list[int]], data: st.DataObject) -> None:
    """Event times need not grow within a partition: any subset of the units a shard
    gets (its own, the ones not refused) comes out in the one-shard merge's order."""
    streams = [[((SourceEvent(Op.APPEND, {"p": p, "o": o}, (t, p, o)), InputRecord(p, o, None, None, 0)),)
                for o, t in enumerate(partition_times)] for p, partition_times in enumerate(times)]
    merged = [unit[0][0].row for unit in heapq.merge(*streams, key=lambda unit: unit[0][0].tag)]
    routed: list[InputRecord] = []
    for units in streams:
        keys = merge_keys(units)
        for (event, record), in units:
            if data.draw(st.booleans()):
                value = orjson.dumps([keys[record.offset], [[*event.tag, int(event.op), event.row]]])
                routed.append(InputRecord(0, len(routed), None, value, 0))
    got = [unit[0][0].row for unit in ExchangeReader().read(routed, {}, Outgoing()).units]
    kept = {(row["p"], row["o"]) for row in got}
    assert got == [row for row in merged if (row["p"], row["o"]) in kept]


# The engine: stage 1, the close and stage 2 as Spark tasks -------------------------------------------


def _engine_pipeline(source: str, view: dict[str, Any], tmp: Any, shards: int, **extra: Any) -> Pipeline:
    name = f"xs{uuid.uuid4().hex[:8]}"
    outputs: dict[str, Any] = {"view": {"topic": f"{name}.view", "form": extra.pop("form", "changelog")}}
    if "key" in view:
        outputs["delta"] = {"topic": f"{name}.delta"}
    return parse_pipeline({"pipeline": name, "shards": shards, "outputs": outputs, "view": view, "trigger": "200ms",
                           "source": {"topic": source, "format": "jsonl", "key": ["player_name"]},
                           "spark": {"checkpoint_dir": str(tmp / name)}, **extra})


@pytest.mark.kafka
@pytest.mark.spark
def test_the_engine_runs_a_regrouping_view_in_shards_exactly_once_across_a_restart(
    bootstrap_servers: str, topic: Any, tmp_path: Any, spark: Any
) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    rows = [orjson.dumps(r) for r in generate(Workload(events=3000, keys=150, seed=17))]
    view = {"key": ["team"], "columns": {"total": {"sum": "score"}, "n": {"count": "*"}, "best": {"max": "score"},
                                         "latest": {"last": "score"}, "teams": {"set": "bonus"}}}
    pipeline = _engine_pipeline(source, view, tmp_path, 3, max_batch_events=400)
    produce(settings_, source, rows[:1800], ["player_name"], progress=False, per_transaction=300)
    first = run_pipeline(pipeline, bootstrap_servers, until_idle=1.0, spark=spark, quiet=True)
    assert first.batches >= 3
    produce(settings_, source, rows[1800:], ["player_name"], progress=False, per_transaction=300)
    run_pipeline(pipeline, bootstrap_servers, until_idle=1.0, spark=spark, quiet=True)
    report = verify(pipeline, settings_)
    assert report.anomalies == [], report.anomalies
    assert report.events == len(rows) and report.view_records > 0 and report.delta_records > 0
    routed = load_checkpoints(pipeline, settings_)  # stage 1: one shard per source partition
    assert sorted(routed) == list(range(PARTITIONS)) and sum(c.records_in for c in routed.values()) == len(rows)
    applied = load_checkpoints(view_pipeline(pipeline), settings_)  # stage 2: one per shard
    assert sorted(applied) == [0, 1, 2]
    assert all(set(c.offsets) == {index} for index, c in applied.items())
    # what stage 2 committed is deleted from P.repartition
    admin = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": "t"})
    lows = [admin.get_watermark_offsets(TopicPartition(pipeline.repartition_topic, m), timeout=30)[0] for m in range(3)]
    admin.close()
    assert all(0 < low <= applied[m].offsets[m] for m, low in enumerate(lows)), (lows, applied)
    # every shard's view keys are its own: each view key's records come from one stage-2 shard
    teams = {c.key for c in _view_changes(pipeline, settings_)}
    assert len({shard_of(orjson.dumps(list(team)), 3) for team in teams}) >= 2


@pytest.mark.kafka
@pytest.mark.spark
def test_a_failure_of_stage_two_beside_the_next_stage_one_stops_the_run_and_the_next_catches_up(
    bootstrap_servers: str, topic: Any, tmp_path: Any, spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from refold.spark import job

    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    rows = [orjson.dumps(r) for r in generate(Workload(events=1200, keys=60, seed=5))]
    pipeline = _engine_pipeline(source, VIEWS["grouped"], tmp_path, 2, max_batch_events=300)
    produce(settings_, source, rows, ["player_name"], progress=False, per_transaction=300)
    apply, calls = job._Batches.apply, []

    def failing(self: Any, spark_: Any, close: bytes | None = None) -> Any:
        calls.append(close)
        if len([c for c in calls if c is not None]) == 2:  # the second batch's later stages
            raise OperationalError("stage 2 failed")
        return apply(self, spark_, close)

    monkeypatch.setattr(job._Batches, "apply", failing)
    with pytest.raises(OperationalError, match="stage 2 failed"):
        run_pipeline(pipeline, bootstrap_servers, until_idle=5.0, spark=spark, quiet=True)
    assert calls[0] is None  # the start's catch-up closes for itself
    monkeypatch.undo()
    run_pipeline(pipeline, bootstrap_servers, until_idle=1.0, spark=spark, quiet=True)  # the next run catches up
    report = verify(pipeline, settings_)
    assert report.anomalies == [] and report.events == len(rows), report.anomalies


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.parametrize("form", ["changelog", "retract", "upsert"])
def test_the_rfc015_leaderboard_in_three_shards_gives_the_rfc_tables(
    form: str, bootstrap_servers: str, topic: Any, tmp_path: Any, spark: Any
) -> None:
    from test_engine import RFC015_TABLES, rfc015_table

    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    with open("examples/match_scores.jsonl", "rb") as handle:
        produce(settings_, source, handle.read().splitlines(), ["player_name"], progress=False)
    sql = load_pipeline("examples/leaderboard.yaml").view.sql
    assert sql is not None
    pipeline = _engine_pipeline(source, {"sql": sql.replace("from match_scores\n", f"from `{source}`\n")},
                                tmp_path, 3, form=form)
    run_pipeline(pipeline, bootstrap_servers, until_idle=1.0, spark=spark, quiet=True)
    assert rfc015_table(pipeline, settings_, form) == RFC015_TABLES[form]
    # the players' rows ranked in two stage-2 shards (by message key: Alice and Charlie in
    # shard 1, Bob in 0), their local tops again in stage 3
    # (each batch closes every P.repartition partition and P.tops once: shard 2 read closes only)
    applied = load_checkpoints(view_pipeline(pipeline), settings_)
    closes = applied[2].offsets[2]
    assert applied[0].offsets[0] > closes and applied[1].offsets[1] > closes
    ranked = load_checkpoints(rank_pipeline(pipeline), settings_)[0]
    assert ranked.batch > 0 and ranked.offsets[0] > closes


def test_explain_names_a_regrouping_views_stages() -> None:
    from refold.ops.explain import explain

    pipeline = parse_pipeline({"pipeline": "p", "shards": 4, "view": VIEWS["grouped"], "outputs": {"view": {"topic": "v"}},
                               "source": {"topic": "scores", "key": ["player"]}})
    text = explain(pipeline)
    assert "# shards: stage 1 one per partition of scores (messages keyed by player; live rows in p.rows), " \
           "routed by team to stage-2 shards through p.repartition: 4\n" in text
    unset = explain(pipeline.model_copy(update={"shards": None}))
    assert "through p.repartition: as many as the source has partitions" in unset
    merged = explain(pipeline.model_copy(update={"shards": "merged"}))
    assert "# shards: one, merging every partition of scores" in merged
    assert "stage-3" not in text
    ranked = parse_pipeline({"pipeline": "p", "shards": 3, "view": VIEWS["global_top_n"], "outputs": {"view": {"topic": "v"}},
                             "source": {"topic": "scores", "key": ["player"]}})
    assert "# a global Top-N in shards: rows routed by player, each shard's local top n to p.tops, ranked again by " \
           "one stage-3 task" in explain(ranked)
