"""The driver's claim of a run's shards (`refold run`'s start, DESIGN.md §3).

Before a run's first batch the driver fences every shard's writer and commits each
shard's checkpoint again with the run's id: an older run's task that starts its
shard again finds the claim and stops.
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from refold import environment
from refold.config import Pipeline
from refold.kafka.transactions import FencedError, TransactionalWriter
from refold.plan import checkpoint_key, view_partitioning
from refold.recovery.records import Checkpoint, encode_checkpoint, first_checkpoint
from refold.recovery.restore import load_checkpoints

log = logging.getLogger(__name__)


def claim_shards(
    pipeline: Pipeline, settings: dict[str, Any], shards: list[int], run: int, checkpoint_partitions: int
) -> dict[int, Checkpoint]:
    """Fence every shard's writer, then commit each shard's checkpoint again with this
    `run` (nothing else changes: a local store stamped with it stays current). An older
    run's task that starts its shard again reads the claim and stops (another engine
    took over); one still holding a writer is fenced at its next commit. Returns the
    claimed checkpoints by shard (batch 0 for a shard that never committed)."""
    writers = {
        index: TransactionalWriter(
            settings,
            pipeline.transactional_id(index),
            timeout_ms=environment.transaction_timeout_ms(),
            label=f"pipeline {pipeline.pipeline!r} (shard {index})",
        )
        for index in shards
    }
    try:
        with ThreadPoolExecutor(max(1, min(8, len(shards))), thread_name_prefix="refold-fence") as pool:
            list(pool.map(lambda writer: writer.initialise(), writers.values()))  # open transactions settle
        committed = load_checkpoints(pipeline, settings)
        return {
            index: _claim(pipeline, settings, writer, index, run, index % checkpoint_partitions, committed.get(index))
            for index, writer in writers.items()
        }
    finally:
        for writer in writers.values():
            writer.close()


CLAIM_ATTEMPTS = 5


def _claim(pipeline: Pipeline, settings: dict[str, Any], writer: TransactionalWriter, index: int, run: int,
           partition: int, checkpoint: Checkpoint | None) -> Checkpoint:
    """Commit one shard's checkpoint again with `run`. An older run's task may fence the
    claim's writer in between (fenced itself by this run, it starts the shard again and
    initialises the same transactional id): then, after a random pause, initialise
    again, read the shard's checkpoint again (it may have committed a batch meanwhile)
    and claim again, so the newer run wins; the older task then finds the claim and stops."""
    for attempt in range(CLAIM_ATTEMPTS):
        claim = replace(checkpoint or first_checkpoint(pipeline, index), run=run,
                        view_partitioning=view_partitioning(pipeline))
        try:
            writer.begin()
            writer.send(pipeline.checkpoints_topic, checkpoint_key(pipeline.writer, index), encode_checkpoint(claim),
                        partition=partition)
            writer.commit()
            return claim
        except FencedError:
            if attempt == CLAIM_ATTEMPTS - 1:
                raise
            log.info("shard %d: the claim's writer was fenced (an older run's task started the shard again); "
                     "claiming again", index)
            time.sleep(random.uniform(0.1, 0.3) * 2**attempt)
            writer.initialise()
            checkpoint = load_checkpoints(pipeline, settings, only=(partition,)).get(index)
    raise AssertionError("unreachable")
