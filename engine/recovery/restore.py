"""Kafka as the recovery log (DESIGN.md §3).

`P.checkpoints` (compacted, one record per writer) holds the committed input
offsets; `P.state` (compacted) holds the changelog of the reducer's state. Both
are written inside each batch's transaction, so reading them to their end with
read_committed gives a consistent pair: the state exactly as of the checkpoint.

Spark's checkpoint directory is only a cache of the offsets: when it does not
match Kafka's committed offsets it is wiped and the query starts again from
Kafka's offsets.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from refold.config import Pipeline
from refold.kafka.io import next_visible_offsets, read_to_end
from refold.recovery.records import Checkpoint, decode_checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Recovered:
    """A writer's committed checkpoint (None on a first start) and the state as of it."""

    checkpoint: Checkpoint | None
    state: list[tuple[bytes, bytes]]  # latest value per state key, tombstones dropped


def load_checkpoint(pipeline: Pipeline, settings: Mapping[str, Any]) -> Checkpoint | None:
    """The last committed checkpoint of this pipeline's writer, or None on a first start."""
    writer_key = pipeline.writer.encode()
    latest: Checkpoint | None = None
    for msg in read_to_end(settings, pipeline.checkpoints_topic):
        value = msg.value()
        if msg.key() == writer_key and value is not None:
            latest = decode_checkpoint(value)
    return latest


def load_state(pipeline: Pipeline, settings: Mapping[str, Any]) -> list[tuple[bytes, bytes]]:
    """The latest value of every live state key in `P.state`."""
    latest: dict[bytes, bytes | None] = {}
    for msg in read_to_end(settings, pipeline.state_topic):
        latest[msg.key() or b""] = msg.value()
    return [(k, v) for k, v in latest.items() if v is not None]


def recover(pipeline: Pipeline, settings: Mapping[str, Any]) -> Recovered:
    """The checkpoint and the state, read to their ends with read_committed: consistent,
    as both are written in each batch's transaction. (Call it after the writer's
    `init_transactions`, which settles any transaction of ours still open.)"""
    checkpoint = load_checkpoint(pipeline, settings)
    state = load_state(pipeline, settings) if checkpoint is not None else []
    return Recovered(checkpoint, state)


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
