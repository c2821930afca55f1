"""`shards` settled at start (refold.recovery.layout): a new re-grouping pipeline runs
in as many shards as its source has partitions, and every later run keeps the layout
its state was committed in, or refuses to start."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from test_exchange import (
    VIEWS,
    _batches,
    _changelog,
    _expected,
    _produce,
    check_one_writer_per_view_partition,
)

from refold.config import Pipeline, parse_pipeline
from refold.errors import UserError
from refold.kafka.io import TopicSpec, ensure_topics, partitions_of, read_to_end
from refold.ops.verify import by_key, read_view_changes
from refold.recovery.layout import settle_layout
from refold.recovery.restore import load_checkpoints
from refold.runtime.batch import InputRecord
from refold.runtime.processor import BatchProcessor
from refold.spark.job import engine_topics


def _pipeline(settings_: dict[str, Any], source: str, name: str, **extra: Any) -> Pipeline:
    spec = {"pipeline": name, "kafka": settings_, "outputs": {"view": {"topic": f"{name}.view"}},
            "source": {"topic": source, "format": "jsonl", "key": ["player"]}, "view": VIEWS["grouped"], **extra}
    return parse_pipeline(spec)


def _records(settings_: dict[str, Any], source: str) -> list[InputRecord]:
    return [InputRecord(m.partition(), m.offset(), m.key(), m.value(), m.timestamp()[1])
            for m in read_to_end(settings_, source)]


def _run(pipeline: Pipeline, settings_: dict[str, Any], records: list[InputRecord]) -> Pipeline:
    """One instance over `records`; returns the pipeline as it settled it."""
    processor = BatchProcessor(pipeline, settings_)
    try:
        processor.process(records)
        return processor.pipeline
    finally:
        processor.close()


def test_a_new_regrouping_pipeline_runs_one_shard_per_source_partition_and_keeps_it(
    bootstrap_servers: str, topic: Any
) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    _produce(bootstrap_servers, source, _changelog(11, 80))
    records = _records(settings_, source)
    pipeline = _pipeline(settings_, source, f"lay{uuid.uuid4().hex[:8]}")
    assert pipeline.shards is None
    ensure_topics(settings_, engine_topics(pipeline, 3))  # as a test creates them: no exchange topics yet

    first, second = _batches(records, [25])
    assert _run(pipeline, settings_, first).shards == 3
    assert len(partitions_of(settings_, pipeline.repartition_topic)) == 3  # the engine made its topics
    assert _run(pipeline, settings_, second).shards == 3  # the next run reads the layout back
    assert by_key(read_view_changes(pipeline, settings_)) == by_key(_expected(pipeline, [first, second]).changes)

    for asked in (2, "merged"):
        with pytest.raises(UserError, match=r"committed its state as 3 stage-2 shards \(shards: 3\)"):
            BatchProcessor(pipeline.model_copy(update={"shards": asked}), settings_)
    assert settle_layout(pipeline.model_copy(update={"shards": 3}), settings_, 3).shards == 3


def test_a_pipeline_that_ran_merged_stays_merged(bootstrap_servers: str, topic: Any) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    _produce(bootstrap_servers, source, _changelog(12, 60))
    records = _records(settings_, source)
    pipeline = _pipeline(settings_, source, f"lay{uuid.uuid4().hex[:8]}", shards="merged")
    ensure_topics(settings_, engine_topics(pipeline, 3))
    first, second = _batches(records, [20])
    assert _run(pipeline, settings_, first).shards == "merged"

    unset = pipeline.model_copy(update={"shards": None})  # e.g. a pipeline from before `shards`
    assert _run(unset, settings_, second).shards == "merged"
    assert by_key(read_view_changes(pipeline, settings_)) == by_key(_expected(pipeline, [first, second]).changes)
    with pytest.raises(UserError, match=r"as one shard merging every source partition \(shards: merged\); "
                                        r"this run asks for 3 stage-2 shards"):
        settle_layout(pipeline.model_copy(update={"shards": 3}), settings_, 3)


def test_where_shards_cannot_run_the_default_is_merged(bootstrap_servers: str, topic: Any) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    name = f"lay{uuid.uuid4().hex[:8]}"
    one_partition = _pipeline(settings_, topic(partitions=1), name)
    assert settle_layout(one_partition, settings_, 1).shards == "merged"  # nothing to run in parallel
    upsert = parse_pipeline({"pipeline": name, "kafka": settings_, "outputs": {"view": {"topic": f"{name}.view"}},
                             "source": {"topic": topic(partitions=3), "form": "upsert", "key": ["player"]},
                             "view": VIEWS["grouped"]})
    assert settle_layout(upsert, settings_, 3).shards == "merged"  # stage 1 reads changelogs
    co_partitioned = _pipeline(settings_, topic(partitions=3), name, view={"key": ["player"], "columns": {"n": {"count": "*"}}})
    assert settle_layout(co_partitioned, settings_, 3).shards is None  # one shard per partition already


def test_a_co_partitioned_view_writes_each_shards_records_to_its_own_partition(
    bootstrap_servers: str, topic: Any
) -> None:
    """A view keyed by (player, team) over messages keyed by player: shard p (source
    partition p) writes view partition p alone, whatever the view key hashes to."""
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    _produce(bootstrap_servers, source, _changelog(13, 90))
    records = _records(settings_, source)
    pipeline = _pipeline(settings_, source, f"lay{uuid.uuid4().hex[:8]}",
                         view={"key": ["player", "team"], "columns": {"n": {"count": "*"}, "best": {"max": "score"}}})
    ensure_topics(settings_, engine_topics(pipeline, 3))
    batches = _batches(records, [30, 60])
    settled = pipeline
    for batch in batches:
        settled = _run(pipeline, settings_, batch)
    assert settled.outputs.view is not None and settled.outputs.view.partitioning == "shard"
    assert by_key(read_view_changes(settled, settings_)) == by_key(_expected(settled, batches).changes)
    # player i's messages lie in source partition i mod 3 (test_exchange._changelog)
    check_one_writer_per_view_partition(settled, settings_, lambda row: int(row["player"][1:]) % 3)
    assert {c.view_partitioning for c in load_checkpoints(settled, settings_).values()} == {"shard"}


def test_a_view_written_by_key_stays_by_key_and_refuses_to_move(bootstrap_servers: str, topic: Any) -> None:
    """A pipeline whose earlier runs wrote the view by murmur2 (every pipeline from before
    `partitioning`: their checkpoints read as "key") keeps it; asking for shards refuses."""
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    _produce(bootstrap_servers, source, _changelog(14, 60))
    records = _records(settings_, source)
    pipeline = _pipeline(settings_, source, f"lay{uuid.uuid4().hex[:8]}")
    by_murmur = _with_partitioning(pipeline, "key")
    ensure_topics(settings_, engine_topics(by_murmur, 3))
    first, second = _batches(records, [20])
    assert _run(by_murmur, settings_, first).outputs.view.partitioning == "key"  # type: ignore[union-attr]
    assert _run(pipeline, settings_, second).outputs.view.partitioning == "key"  # type: ignore[union-attr]
    assert by_key(read_view_changes(pipeline, settings_)) == by_key(_expected(pipeline, [first, second]).changes)
    with pytest.raises(UserError, match=r"committed its view partitioned by key, murmur2 \(partitioning: key\); "
                                        r"this run asks for shard \(partitioning: shard\)"):
        settle_layout(_with_partitioning(pipeline, "shard"), settings_, 3)


def test_a_view_topic_with_too_few_partitions_for_its_shards_is_refused(bootstrap_servers: str, topic: Any) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    pipeline = _pipeline(settings_, source, f"lay{uuid.uuid4().hex[:8]}", shards=3)
    assert pipeline.outputs.view is not None
    ensure_topics(settings_, [TopicSpec(pipeline.outputs.view.topic, 2)])  # made before, by hand
    ensure_topics(settings_, engine_topics(pipeline, 3))  # the others, as the engine makes them
    with pytest.raises(UserError, match=rf"{pipeline.outputs.view.topic} has 2 partition\(s\), and pipeline "
                                        r".* writes its view from 3 shards"):
        BatchProcessor(pipeline, settings_)


def _with_partitioning(pipeline: Pipeline, partitioning: str) -> Pipeline:
    assert pipeline.outputs.view is not None
    view = pipeline.outputs.view.model_copy(update={"partitioning": partitioning})
    return pipeline.model_copy(update={"outputs": pipeline.outputs.model_copy(update={"view": view})})
