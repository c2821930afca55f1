"""Kafka as the recovery log (DESIGN.md §3).

`P.checkpoints` (compacted, one record per writer and shard, key `<writer>/<shard>`)
holds each shard's committed input offsets; `P.state` (compacted, partition = shard)
holds the changelog of each shard's reducer state. A shard writes both inside each
of its transactions, so reading its checkpoint record and its state partition to
their end with read_committed gives a consistent pair: the shard's state exactly as
of its checkpoint.

Spark's checkpoint directory is only a cache of the offsets: when it does not
match Kafka's committed offsets it is wiped and the query starts again from
Kafka's offsets.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import orjson

from refold.config import Pipeline
from refold.errors import UserError
from refold.kafka.io import next_visible_offsets, read_to_end
from refold.recovery.records import Checkpoint, combined, decode_checkpoint

log = logging.getLogger(__name__)


def load_checkpoints(
    pipeline: Pipeline, settings: Mapping[str, Any], only: Collection[int] | None = None
) -> dict[int, Checkpoint]:
    """The last committed checkpoint of each shard of this pipeline's writer, by shard
    (empty on a first start), read from the partitions `only` of `P.checkpoints` when
    given. Raises UserError for a writer's checkpoint from before shards (key
    `<writer>`): its state is not laid out by shard."""
    return load_writers(pipeline, settings, [pipeline.writer], only)[pipeline.writer]


def load_writers(
    pipeline: Pipeline, settings: Mapping[str, Any], writers: Collection[str], only: Collection[int] | None = None
) -> dict[str, dict[int, Checkpoint]]:
    """`load_checkpoints` of each of `writers` (a re-grouping view's stages: `<writer>`,
    `<writer>.view`, `<writer>.top`), in one read of `P.checkpoints`."""
    latest: dict[str, dict[int, Checkpoint]] = {writer: {} for writer in writers}
    for msg in read_to_end(settings, pipeline.checkpoints_topic, only=only):
        key, value = msg.key() or b"", msg.value()
        if value is None:
            continue
        writer, _, shard = key.decode(errors="replace").rpartition("/")
        if not writer and shard in latest:
            raise UserError(
                f"{pipeline.checkpoints_topic}: writer {shard!r} committed with an earlier Refold (one "
                f"checkpoint per writer, key {shard!r}); this one commits one per shard (key "
                f"'{shard}/<shard>') with its state in P.state partition = shard. Run it under a new "
                "`writer` (or pipeline name) to rebuild the views from the source, or delete "
                f"{pipeline.checkpoints_topic} and {pipeline.state_topic} and their outputs first"
            )
        if writer in latest and shard.isascii() and shard.isdigit():
            latest[writer][int(shard)] = decode_checkpoint(value)
    return latest


def load_checkpoint(pipeline: Pipeline, settings: Mapping[str, Any]) -> Checkpoint | None:
    """The writer's shards' last checkpoints as one (`records.combined`: every
    partition's offsets, counters summed), or None when no shard committed a batch yet
    (a run's claim of a shard that never committed is batch 0)."""
    return combined([c for c in load_checkpoints(pipeline, settings).values() if c.batch > 0])


# Spark's checkpoint directory -------------------------------------------------------


def spark_committed_offsets(directory: Path, topic: str) -> dict[int, int] | None:
    """The end offsets of the last batch Spark recorded as committed, or None when
    there is none or a later batch was planned and not committed."""
    commits = directory / "commits"
    offsets = directory / "offsets"
    if not commits.is_dir() or not offsets.is_dir():
        return None
    done = sorted(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    planned = sorted(int(p.name) for p in offsets.iterdir() if p.name.isdigit())
    if not done or planned[-1] != done[-1]:
        # No batch, or one planned but never committed (a crash mid-batch): Spark would
        # replay it from its own log; starting afresh from Kafka's offsets is simpler and safe.
        return None
    lines = (offsets / str(done[-1])).read_text().splitlines()
    # v1 / batch metadata / one line of offsets per source
    for line in lines[2:]:
        try:
            parsed = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(parsed, dict) and topic in parsed:
            return {int(p): int(o) for p, o in parsed[topic].items()}
    return None


def reconcile_spark_checkpoint(
    directory: Path, topic: str, kafka_offsets: Mapping[int, int], settings: Mapping[str, Any]
) -> bool:
    """Keep Spark's checkpoint only when its committed offsets agree with Kafka's.

    They agree when, per partition, they are equal or only transaction markers and
    aborted records lie between them: Spark's end offsets count the source's last
    marker, Refold's stop after the last record it reduced. Returns True when the
    directory was kept. Anything else (missing, behind, ahead past a record,
    unreadable) wipes it: the query then starts from Kafka's offsets.
    """
    if not directory.exists():
        return False
    try:
        spark = spark_committed_offsets(directory, topic)
    except (OSError, ValueError) as exc:
        log.warning("Spark checkpoint %s is unreadable (%s); starting from Kafka's offsets", directory, exc)
        spark = None
    agree = spark is not None and _same_records(spark, kafka_offsets, topic, settings)
    if not agree:
        if spark is not None or any(directory.iterdir()):
            log.warning(
                "Spark checkpoint %s disagrees with Kafka's committed offsets "
                "(spark=%s, kafka=%s); discarding it: Kafka is authoritative",
                directory,
                spark,
                dict(kafka_offsets),
            )
        shutil.rmtree(directory)
    return agree


def _same_records(spark: Mapping[int, int], kafka: Mapping[int, int], topic: str, settings: Mapping[str, Any]) -> bool:
    """No committed record lies between Spark's and Kafka's offset on any partition.

    (A partition Kafka has no offset for was never read: its offset there counts as 0.)"""
    ahead: dict[int, int] = {}
    for partition in set(spark) | set(kafka):
        ours, theirs = kafka.get(partition, 0), spark.get(partition)
        if theirs is None or theirs < ours:
            return False
        if theirs > ours:
            ahead[partition] = ours
    visible = next_visible_offsets(settings, topic, ahead)
    return all(visible[p] >= spark[p] for p in ahead)
