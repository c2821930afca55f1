"""The native core inside the engine: the shards of a pipeline with `spark.core: native`
commit, batch by batch, exactly the records the same pipeline commits with the Python
reducer — view, delta and `P.state` records byte for byte, the same dead letters —
through real transactions, a value the core does not take (it falls back to Python
from its store), and a restart (it restores from its store). The core's own
differential tests are in tests/test_native_core.py."""

from __future__ import annotations

import random
import re
import uuid
from typing import Any

import orjson
import pytest
from engine_runs import Recording, RecordingProcessor

from refold.config import Pipeline, parse_pipeline
from refold.errors import ConfigError
from refold.kafka.io import ensure_topics
from refold.runtime.batch import InputRecord
from refold.runtime.exchange import view_pipeline
from refold.runtime.native import core_of, native_core, why_not
from refold.runtime.processor import BatchProcessor
from refold.spark.job import engine_topics

pytestmark = pytest.mark.kafka

PARTITIONS = 2
VIEW = {
    "key": ["player"],
    "columns": {
        "total": {"sum": "score"}, "games": {"count": "*"}, "best": {"max": "score"}, "low": {"min": "score"},
        "opening": {"first": "score"}, "team": {"last": "team"}, "mean": {"avg": "score"},
        "teams": {"set": "team"}, "scored": {"count": "score"},
    },
    "where": "team <> 'grey'",
}


def _pipeline(settings: dict[str, Any], source: str, core: str, view: dict[str, Any] = VIEW,
              form: str = "changelog") -> Pipeline:
    name = f"nc{core[0]}{uuid.uuid4().hex[:8]}"
    outputs: dict[str, Any] = {"view": {"topic": f"{name}.view", "form": form}}
    if "top_n" not in view:
        outputs["delta"] = {"topic": f"{name}.delta"}
    pipeline = parse_pipeline({
        "pipeline": name, "kafka": settings, "source": {"topic": source},
        "view": view,
        "outputs": outputs,
        "spark": {"core": core},
    })
    ensure_topics(settings, engine_topics(pipeline, PARTITIONS))
    return pipeline


def _batches(seed: int) -> list[list[InputRecord]]:
    """Four batches over 30 players in two partitions: appends, retractions of live and
    of never-seen rows, correction pairs, a -C left open at a batch's end, a record that
    is not JSON; the third batch has a float score (a summed column: the native core
    does not take it)."""
    rng = random.Random(seed)
    offsets = [0] * PARTITIONS
    live: list[dict[str, Any]] = []
    batches: list[list[InputRecord]] = []
    records: list[InputRecord] = []

    def emit(op: str, row: dict[str, Any], raw: bytes | None = None) -> None:
        partition = sum(row["player"].encode()) % PARTITIONS
        key = orjson.dumps({"player": row["player"]})
        value = raw if raw is not None else orjson.dumps({"op": op, **row})
        records.append(InputRecord(partition, offsets[partition], key, value, 1_000 + offsets[partition]))
        offsets[partition] += 1

    for number in range(4):
        for _ in range(300):
            roll = rng.random()
            row = {"player": f"p{rng.randrange(30)}", "score": rng.randrange(-5, 50),
                   "team": rng.choice(["red", "blue", "grey", None])}
            if roll < 0.55 or not live:
                emit("+A", row)
                live.append(row)
            elif roll < 0.7:
                emit("-R", live.pop(rng.randrange(len(live))))
            elif roll < 0.85:
                old = live.pop(rng.randrange(len(live)))
                new = {**old, "score": rng.randrange(-5, 50)}
                emit("-C", old)
                emit("+C", new)
                live.append(new)
            elif roll < 0.92:
                emit("-R", row)  # most likely not live: a dead letter
            elif roll < 0.95:
                emit("+A", row, raw=b"{not json")
            else:
                emit("+C", row)  # an orphan
        if number == 2:
            emit("+A", {"player": "p1", "score": 2.5, "team": "red"})
        held = None
        if number == 1:  # a -C at the end of the batch: its +C opens the next one
            held = live.pop()
            emit("-C", held)
        batches.append(records[:])
        records.clear()
        if held is not None:
            emit("+C", {**held, "score": 99})
            live.append({**held, "score": 99})
    return batches


def _run(pipeline: Pipeline, settings: dict[str, Any], batches: list[list[InputRecord]],
         cores: set[str] | None = None) -> dict[int, list[Any]]:
    """Every batch through a processor, then a restarted one for the last; what each shard
    sent per batch. `cores`: gets the names of the cores the shards ended with."""
    sent: dict[int, list[Any]] = {}
    processor = RecordingProcessor(pipeline, settings)
    try:
        for records in batches[:-1]:
            processor.process(records)
        _collect(processor, sent)
    finally:
        processor.close()
    restarted = RecordingProcessor(pipeline, settings)
    try:
        restarted.process(batches[-1])
        _collect(restarted, sent)
        if cores is not None:
            cores |= {type(shard.core).__name__ for shard in (*processor.shards.values(), *restarted.shards.values())}
    finally:
        restarted.close()
    return sent


def _collect(processor: BatchProcessor, sent: dict[int, list[Any]]) -> None:
    for index, shard in processor.shards.items():
        assert isinstance(shard, Recording)
        for batch, out in shard.sent:
            sent.setdefault(index, []).append((
                batch, out.view, out.delta, out.state,
                [(letter.partition, letter.offset, letter.reason) for letter in out.dlq],
            ))


def test_native_shards_commit_what_python_shards_commit(bootstrap_servers, topic) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    batches = _batches(7)
    python = _run(_pipeline(settings, source, "python"), settings, batches)
    native_pipeline = _pipeline(settings, source, "native")
    native = _run(native_pipeline, settings, batches)
    assert sorted(native) == sorted(python) == list(range(PARTITIONS))
    for shard in python:
        assert [b[0] for b in native[shard]] == [b[0] for b in python[shard]] == [1, 2, 3, 4]
        for ours, theirs in zip(native[shard], python[shard], strict=True):
            assert ours == theirs, f"shard {shard}, batch {theirs[0]}"
    sent = [record for shard in python.values() for batch in shard for record in batch[1]]
    assert len(sent) > 500  # the batches did something
    assert any(batch[4] for shard in python.values() for batch in shard)  # and had dead letters


@pytest.mark.parametrize("form", ["changelog", "upsert"])
def test_native_top_n_shards_commit_what_python_shards_commit(bootstrap_servers, topic, form) -> None:
    # each player's best two scores (ties by team, nulls last), the rows the view's
    # `where` holds: the same batches, a float score included (a Top-N core ranks it)
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    batches = _batches(13)
    view = {"top_n": {"n": 2, "order_by": {"score": "desc", "team": "asc"}, "partition_by": ["player"]},
            "where": VIEW["where"]}
    python = _run(_pipeline(settings, source, "python", view, form), settings, batches)
    native_pipeline = _pipeline(settings, source, "native", view, form)
    cores: set[str] = set()
    native = _run(native_pipeline, settings, batches, cores)
    assert cores == {"TopNCore"}  # no shard fell back to Python
    assert sorted(native) == sorted(python) == list(range(PARTITIONS))
    for shard in python:
        assert [b[0] for b in native[shard]] == [b[0] for b in python[shard]] == [1, 2, 3, 4]
        for ours, theirs in zip(native[shard], python[shard], strict=True):
            assert ours == theirs, f"shard {shard}, batch {theirs[0]}"
    assert sum(len(batch[1]) for shard in python.values() for batch in shard) > 200


def test_the_float_batch_falls_back_and_a_new_processor_runs_native_again(bootstrap_servers, topic) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    pipeline = _pipeline(settings, source, "native")
    batches = _batches(11)
    processor = RecordingProcessor(pipeline, settings)
    try:
        for records in batches[:2]:
            processor.process(records)
        assert all(shard.core is not None for shard in processor.shards.values())
        processor.process(batches[2])  # p1's float score: its shard falls back to Python
        fallen = {index for index, shard in processor.shards.items() if shard.core is None}
        assert fallen == {sum(b"p1") % PARTITIONS}
    finally:
        processor.close()
    again = RecordingProcessor(pipeline, settings)
    try:
        assert all(shard.core is not None for shard in again.shards.values())
    finally:
        again.close()


def test_spark_core_native_refuses_a_view_it_cannot_run(bootstrap_servers, topic) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    grouped = _pipeline(settings, topic(partitions=PARTITIONS), "auto")
    assert core_of(grouped) == "the native core (refold_native)"
    assert core_of(grouped.model_copy(update={"spark": grouped.spark.model_copy(update={"core": "python"})})) == (
        "Python (spark.core: python)")
    top_n = {"top_n": {"n": 3, "partition_by": ["team"], "order_by": {"score": "desc"}}}
    pipeline = parse_pipeline({"pipeline": "x", "kafka": settings, "source": {"topic": "s"}, "view": top_n,
                               "outputs": {"view": {"topic": "x.view"}}, "spark": {"core": "native"}})
    assert why_not(pipeline) is None  # a Top-N view runs in its own core (TopNCore)
    assert type(native_core(pipeline)).__name__ == "TopNCore"
    # a global Top-N in shards: stage 2 ranks each shard's rows and stage 3 the shards' tops, in Python
    ranked = {"top_n": {"n": 3, "order_by": {"score": "desc"}}}
    refusal = "a global Top-N in shards ranks its shards' rows in Python (refold.runtime.tops)"
    for core, expect in (("native", ConfigError), ("auto", None)):
        pipeline = parse_pipeline({"pipeline": "x", "kafka": settings, "source": {"topic": "s", "key": ["player"]},
                                   "view": ranked, "shards": 2, "outputs": {"view": {"topic": "x.view"}},
                                   "spark": {"core": core}})
        assert why_not(pipeline) == refusal
        assert core_of(pipeline) == f"Python ({refusal})"  # `refold explain`
        assert why_not(view_pipeline(pipeline)) == refusal  # stage 2's shards (ApplyProcessor)
        if expect is None:
            assert native_core(pipeline) is None
        else:
            with pytest.raises(expect, match=re.escape(f"spark.core: native, but {refusal}")):
                native_core(pipeline)


def _clean_batches(seed: int, players: int) -> list[list[InputRecord]]:
    """Four batches of appends, retractions and correction pairs of live rows only (the
    native core reads every one of them itself)."""
    rng = random.Random(seed)
    offsets = [0] * PARTITIONS
    live: list[dict[str, Any]] = []
    batches: list[list[InputRecord]] = []
    records: list[InputRecord] = []

    def emit(op: str, row: dict[str, Any]) -> None:
        partition = sum(row["player"].encode()) % PARTITIONS
        records.append(InputRecord(partition, offsets[partition], orjson.dumps({"player": row["player"]}),
                                   orjson.dumps({"op": op, **row}), 1_000 + offsets[partition]))
        offsets[partition] += 1

    for _ in range(4):
        for _ in range(250):
            roll = rng.random()
            if roll < 0.6 or not live:
                row = {"player": f"p{rng.randrange(players)}", "score": rng.randrange(50), "team": "red"}
                emit("+A", row)
                live.append(row)
            elif roll < 0.8:
                emit("-R", live.pop(rng.randrange(len(live))))
            else:
                old = live.pop(rng.randrange(len(live)))
                new = {**old, "score": rng.randrange(50)}
                emit("-C", old)
                emit("+C", new)
                live.append(new)
        batches.append(records[:])
        records.clear()
    return batches


@pytest.mark.parametrize("kind", ["grouped", "top_n"])
def test_a_native_read_past_the_key_cache_commits_every_change(bootstrap_servers, topic, kind) -> None:
    # A batch the core read itself that takes the shard past `spark.state_cache_keys`:
    # the shard starts empty (a new core) and the new core reads the batch again. (A
    # reader that empties the core after it read loses that batch's view, delta and
    # state records.) Byte for byte what Python commits.
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    batches = _clean_batches(5, players=120)
    view = {key: value for key, value in VIEW.items() if key != "where"}
    if kind == "top_n":
        view = {"top_n": {"n": 3, "order_by": {"score": "asc"}, "partition_by": ["player"], "columns": ["score"]}}
    sent = {}
    for core, cache in (("python", 200_000), ("native", 40)):
        name = f"nk{core[0]}{uuid.uuid4().hex[:8]}"
        outputs = {"view": {"topic": f"{name}.view"}, "delta": {"topic": f"{name}.delta"}}
        if kind == "top_n":
            del outputs["delta"]
        pipeline = parse_pipeline({
            "pipeline": name, "kafka": settings, "source": {"topic": source}, "view": view,
            "outputs": outputs, "spark": {"core": core, "state_cache_keys": cache},
        })
        ensure_topics(settings, engine_topics(pipeline, PARTITIONS))
        cores: set[str] = set()
        sent[core] = _run(pipeline, settings, batches, cores)
        assert cores == {"NoneType" if core == "python" else type(native_core(pipeline)).__name__}
    assert sorted(sent["native"]) == sorted(sent["python"]) == list(range(PARTITIONS))
    for shard, batches_sent in sent["python"].items():
        assert [b[0] for b in batches_sent] == [1, 2, 3, 4]
        for ours, theirs in zip(sent["native"][shard], batches_sent, strict=True):
            assert ours == theirs, f"shard {shard}, batch {theirs[0]}"
    # grouped: every event a view record; Top-N: those that change a player's best three
    assert sum(len(b[1]) for shard in sent["native"].values() for b in shard) >= (1000 if kind == "grouped" else 300)
