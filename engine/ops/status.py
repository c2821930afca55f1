"""`refold status`: committed offsets, lag, last batch and counters of a pipeline, and
one line per shard (its partitions, batch, committed offsets and last commit; a join's
right source's partition p shows as `R<p>`, and each source has its lag table). A
re-grouping view in shards adds its later stages: stage 2's shards and lag on
`P.repartition`, a global Top-N's stage 3 and its lag on `P.tops` (routed records and
local-top changes not yet applied; the driver's close records are not lag)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from refold.config import Pipeline
from refold.errors import PrerequisiteError, UserError
from refold.kafka.io import consumer_config, partitions_of, read_to_end
from refold.plan import RIGHT_PARTITIONS, Plan, plan_of, stage_writers
from refold.recovery.layout import settle_shards
from refold.recovery.records import Checkpoint, combined
from refold.recovery.restore import load_checkpoints, load_writers

EXACT_LAG_LIMIT = 100_000  # offsets; past this the lag is the offset distance


@dataclass(frozen=True, slots=True)
class PartitionStatus:
    partition: int
    committed: int | None
    end: int
    lag: int  # committed records not yet reduced (transaction markers take offsets too)
    exact: bool


def pipeline_status(pipeline: Pipeline, settings: dict[str, Any]) -> tuple[Any, list[PartitionStatus]]:
    """The writer's shards' checkpoints as one (`records.combined`; None before the first
    commit) and every source partition's committed offset, end and lag."""
    checkpoint, rows, _shards = shard_status(pipeline, settings)
    return checkpoint, rows


def shard_status(
    pipeline: Pipeline, settings: dict[str, Any]
) -> tuple[Checkpoint | None, list[PartitionStatus], list[Checkpoint]]:
    """`pipeline_status`, and each shard's own checkpoint, in shard order."""
    shards = sorted(load_checkpoints(pipeline, settings).values(), key=lambda c: c.shard)
    checkpoint = combined(shards)
    offsets = checkpoint.offsets if checkpoint else {}
    rows = _lag(settings, pipeline.source.topic, {p: o for p, o in offsets.items() if p < RIGHT_PARTITIONS})
    return checkpoint, rows, shards


def right_source_lag(pipeline: Pipeline, settings: dict[str, Any], checkpoint: Checkpoint | None) -> list[PartitionStatus]:
    """A join's right source's partitions: committed offset (numbered `RIGHT_PARTITIONS` + p
    in the checkpoint), end and lag."""
    assert pipeline.view.join is not None
    offsets = checkpoint.offsets if checkpoint else {}
    return _lag(settings, pipeline.sources[pipeline.view.join.right].topic,
                {p - RIGHT_PARTITIONS: o for p, o in offsets.items() if p >= RIGHT_PARTITIONS})


@dataclass(frozen=True, slots=True)
class StageStatus:
    """A later stage of a re-grouping view in shards: its name, writer, input topic,
    shards' checkpoints and the lag of each of its input partitions."""

    name: str
    writer: str
    topic: str
    shards: list[Checkpoint]
    rows: list[PartitionStatus]


def committed_plan(pipeline: Pipeline, settings: dict[str, Any]) -> tuple[Plan, dict[str, dict[int, Checkpoint]]]:
    """The plan the pipeline's committed state is laid out in (its earlier runs' `shards`,
    whatever the file asks now), and every stage writer's checkpoints by shard."""
    committed = load_writers(pipeline, settings, stage_writers(pipeline))
    partitions = len(partitions_of(settings, pipeline.source.topic))
    if pipeline.view.join is not None:  # a join in shards: M is laid out by its join shards' checkpoints
        joined = committed[stage_writers(pipeline)[1]]
        laid_out = pipeline.model_copy(update={"shards": max(joined) + 1}) if joined else pipeline
        return plan_of(laid_out, partitions), committed
    try:
        laid_out = settle_shards(pipeline.model_copy(update={"shards": None}), committed, partitions)
    except UserError:  # state an earlier Refold laid out otherwise: as the file says
        laid_out = pipeline
    return plan_of(laid_out, partitions), committed


def later_stages(pipeline: Pipeline, settings: dict[str, Any]) -> list[StageStatus]:
    """The plan's stages after the first (a re-grouping view's stage 2, a global Top-N's
    stage 3, a join's join shards and a regrouping join's stage 3) that committed, with their checkpoints (none for any other view)."""
    stages = []
    plan, committed = committed_plan(pipeline, settings)
    for number, stage in enumerate(plan.later, 2):
        shards = sorted(committed[stage.writer].values(), key=lambda c: c.shard)
        if shards:
            topic = stage.inputs[0]
            offsets = {p: o for c in shards for p, o in c.offsets.items()}
            stages.append(StageStatus(f"stage {number}", stage.writer, topic, shards,
                                      _lag(settings, topic, offsets, units=True)))
    return stages


def _lag(settings: dict[str, Any], topic: str, committed: dict[int, int], units: bool = False,
         exact_limit: int = EXACT_LAG_LIMIT) -> list[PartitionStatus]:
    """Every partition of `topic`: its committed offset, end and lag (exact while the
    offsets lie within `exact_limit`; `units`: a stage's input, whose close records
    are not lag)."""
    consumer = Consumer(consumer_config(settings))
    try:
        ends = {}
        for p in partitions_of(settings, topic):
            _low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
            ends[p] = high
    finally:
        consumer.close()
    return records_lag(settings, topic, committed, ends, units=units, exact_limit=exact_limit)


def records_lag(settings: dict[str, Any], topic: str, committed: dict[int, int], ends: dict[int, int], *,
                units: bool = False, exact_limit: int = EXACT_LAG_LIMIT,
                timeout: float = 120.0) -> list[PartitionStatus]:
    """The lag of each partition of `ends` (its end offsets) past `committed`: the records
    still to read, counted while the offsets between lie within `exact_limit` (transaction
    markers and aborted records take offsets and are no lag), else, or when reading them
    takes over `timeout` seconds (a transaction still open), the offset distance."""
    gap = {p: max(end - committed.get(p, 0), 0) for p, end in ends.items()}
    exact = sum(gap.values()) <= exact_limit
    if exact and any(gap.values()):  # count the readable records: markers and aborted records are not lag
        counts = dict.fromkeys(ends, 0)
        behind = [p for p, g in gap.items() if g]
        try:
            for msg in read_to_end(settings, topic, start={p: committed.get(p, 0) for p in behind}, only=behind,
                                   timeout=timeout):
                if not units or (msg.value() or b"")[:1] != b"{":
                    counts[msg.partition() or 0] += 1
            gap = counts
        except PrerequisiteError:  # an open transaction holds the end back: offsets it is
            exact = False
    return [PartitionStatus(p, committed.get(p), ends[p], gap[p], exact) for p in sorted(ends)]


def ran(pipeline: Pipeline, settings: dict[str, Any]) -> bool:
    """Whether the pipeline ever ran on this cluster: its `P.checkpoints` topic exists
    (`refold run` makes it before anything else)."""
    try:
        partitions_of(settings, pipeline.checkpoints_topic)
    except PrerequisiteError:  # Kafka unreachable, not authorized: not an answer
        raise
    except UserError:  # the topic does not exist
        return False
    return True


def print_status(pipeline: Pipeline, bootstrap: str | None = None) -> bool:
    """Print the pipeline's status; False (and a line saying so) when it never ran."""
    settings = pipeline.kafka_settings(bootstrap)
    if not ran(pipeline, settings):
        print(f"pipeline {pipeline.pipeline} never ran on {settings.get('bootstrap.servers')}: "
              f"there is no {pipeline.checkpoints_topic} topic (`refold run` starts it)")
        return False
    checkpoint, rows, shards = shard_status(pipeline, settings)
    join = pipeline.view.join
    sources = pipeline.source.topic if join is None else \
        f"{pipeline.source.topic} (L) joined with {pipeline.sources[join.right].topic} (R)"
    print(f"pipeline {pipeline.pipeline}  source {sources}  writer {pipeline.writer}")
    if checkpoint is None:
        print("  no committed batch yet")
    else:
        age = time.time() - checkpoint.committed_at / 1000
        print(
            f"  last batch {checkpoint.batch} committed {age:,.0f}s ago; "
            f"records in {checkpoint.records_in:,}, out {checkpoint.records_out:,}, "
            f"dead letters {checkpoint.dlq:,}"
        )
        if checkpoint.pending:
            print(f"  held -C awaiting its +C in partitions {', '.join(map(_label, sorted(checkpoint.pending)))}")
        _print_shards(shards)
    if join is not None:
        print(f"  {pipeline.source.topic} (L)")
    _print_lag(rows)
    if join is not None:
        print(f"  {pipeline.sources[join.right].topic} (R)")
        _print_lag(right_source_lag(pipeline, settings, checkpoint))
    for stage in later_stages(pipeline, settings):
        print(f"{stage.name} (writer {stage.writer}) from {stage.topic}")
        _print_shards(stage.shards)
        _print_lag(stage.rows)
    return True


def _print_lag(rows: list[PartitionStatus]) -> None:
    print(f"  {'partition':>9}  {'committed':>12}  {'end':>12}  {'lag':>10}")
    for row in rows:
        committed = "-" if row.committed is None else f"{row.committed:,}"
        print(f"  {row.partition:>9}  {committed:>12}  {row.end:>12,}  {row.lag:>10,}")
    approx = "" if all(r.exact for r in rows) else " (offsets, approximate)"
    print(f"  total lag {sum(r.lag for r in rows):,}{approx}")


def _print_shards(shards: list[Checkpoint]) -> None:
    """One line per shard: its partitions, batch, committed offsets and last commit."""
    print(f"  {'shard':>5}  {'partitions':<12}  {'batch':>8}  {'committed offsets':<28}  last commit")
    now = time.time()
    for shard in shards:
        partitions = ",".join(_label(p) for p in sorted(shard.offsets)) or "-"
        offsets = " ".join(f"{_label(p)}:{o:,}" for p, o in sorted(shard.offsets.items())) or "-"
        age = f"{now - shard.committed_at / 1000:,.0f}s ago" if shard.committed_at else "-"  # none yet
        print(f"  {shard.shard:>5}  {partitions:<12}  {shard.batch:>8,}  {offsets:<28}  {age}")


def _label(partition: int) -> str:
    """A checkpoint's partition as printed: a join's right source's partition p as `R<p>`
    (a join's left source's partitions are its source's partitions, as any view's)."""
    return f"R{partition - RIGHT_PARTITIONS}" if partition >= RIGHT_PARTITIONS else str(partition)
