"""A micro-batch, exactly once per shard: split by shard, each shard's part committed in
the shard's own transaction.

`BatchProcessor` runs a view's shards in one process, one after the other: the tests'
and the benchmarks' harness (the engine runs each shard in a Spark task,
`refold.spark.tasks`). It owns one `ShardProcessor` (`refold.runtime.shard`) per shard of the
view (`refold.runtime.shards`): one per source partition for a co-partitioned view,
one for all partitions otherwise. Each batch's records are split by shard and each
shard with records runs its part, one after the other: a shard without records in a
batch commits nothing. Batches are atomic per shard (as in Kafka Streams): a crash
between two shards' commits leaves the first committed and the second to run again
from its own checkpoint.

At start every shard's writer is initialised first (fencing older instances and
settling their open transactions), then every shard restores its state and
checkpoint from Kafka; `offsets` are then the starting offsets of every partition,
each from the shard that covers it.

A re-grouping view in `shards` (`refold.runtime.exchange`) runs its stage 1 as these
shards (`RouteProcessor`, one per source partition); after them the batch is closed
and each stage-2 shard (`ApplyProcessor`) reduces its part, one after the other. At
start, what an earlier instance's stage 1 committed and its stage 2 did not is closed
and reduced first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from refold.config import Pipeline
from refold.connectors.runtime import Executor
from refold.errors import UserError
from refold.kafka.io import ensure_topics, partitions_of
from refold.kafka.transactions import FencedError
from refold.plan import regroup_topic, regroups_join
from refold.recovery.layout import check_view_partitions, exchange_topics, settle_layout
from refold.runtime.batch import InputRecord
from refold.runtime.exchange import ApplyProcessor, Closer, RouteProcessor, read_closed
from refold.runtime.hooks import NO_HOOKS, Hooks
from refold.runtime.joingroup import RegroupProcessor
from refold.runtime.joinread import check_join_partitions
from refold.runtime.joins import JoinShardProcessor
from refold.runtime.joinx import JoinApplyProcessor, JoinRouteProcessor
from refold.runtime.shard import ATTEMPTS, BatchStats, ShardProcessor
from refold.runtime.shards import (
    KeyCheck,
    check_state_partitions,
    exchanged,
    plan_shards,
    stage2_shards,
)
from refold.runtime.tops import RankProcessor, ranked_globally, tops_topic

__all__ = ["ATTEMPTS", "BatchProcessor", "BatchStats", "InputRecord", "ShardProcessor"]

log = logging.getLogger(__name__)


class BatchProcessor:
    """A view's shards in this process, one batch at a time.

    `hooks` are the chaos tests' crash and stall points (`refold.runtime.hooks`);
    `shard_type` (and `_make_shard`) is the seam the benchmarks replace."""

    shard_type: type[ShardProcessor] = ShardProcessor

    def __init__(
        self,
        pipeline: Pipeline,
        settings: dict[str, Any],
        executor: Executor | None = None,
        *,
        hooks: Hooks = NO_HOOKS,
    ) -> None:
        if (refusal := pipeline.run_refusal()) is not None:
            raise UserError(refusal)
        source = partitions_of(settings, pipeline.source.topic)
        pipeline = settle_layout(pipeline, settings, len(source))  # `shards` etc. as the engine settles them
        if pipeline.view.join is not None:
            check_join_partitions(pipeline, settings, len(source))
        if exchanged(pipeline):
            ensure_topics(
                settings,
                exchange_topics(pipeline, max(pipeline.partitions, len(source))),
                replication_factor=pipeline.replication_factor,
            )
        self.pipeline = pipeline
        self.settings = settings
        self.executor = executor
        self.hooks = hooks
        self.plan = plan_shards(pipeline)
        self.keys = KeyCheck(pipeline)  # one per run: the first record checked stops a run keyed otherwise
        self.last = BatchStats()
        self.shards: dict[int, ShardProcessor] = {}
        self.appliers: dict[int, ShardProcessor] = {}  # a re-grouping view's stage 2, by shard
        self.ranker: ShardProcessor | None = None  # a global Top-N's stage 3 (refold.runtime.tops)
        self.groupers: dict[int, ShardProcessor] = {}  # a regrouping join's stage 3 (refold.runtime.joingroup)
        self.closer: Closer | None = None
        self.run = int(time.time() * 1000)
        self._state_partitions = self._checkpoint_partitions = 0  # read once every shard is fenced
        try:
            self._start([shard.index for shard in self.plan.shards(source)])
            check_view_partitions(pipeline, settings, len(source))  # (after the fences: an ACL's refusal first)
            if exchanged(pipeline):
                self._start_appliers()
        except BaseException:
            self.close()
            raise

    def _start(self, indexes: Sequence[int]) -> None:
        """Make the shards, fence every one (older instances' open transactions settle)
        before any reads Kafka, check the recovery log's topics, restore each."""
        made = [self._make_shard(index) for index in indexes]
        self.shards.update(zip(indexes, made, strict=True))
        for shard in made:
            shard.lock()  # its store: a second attempt on this machine waits here
            shard.fence()
        if not self._state_partitions:
            self._state_partitions = len(partitions_of(self.settings, self.pipeline.state_topic))
            self._checkpoint_partitions = len(partitions_of(self.settings, self.pipeline.checkpoints_topic))
        for shard in made:
            check_state_partitions(self.pipeline, self._state_partitions, shard.shard)
            shard.checkpoint_partition = shard.shard % self._checkpoint_partitions
        for shard in made:
            shard.restore()
            shard.suspend()  # its store's lock is held only while it runs a batch

    def _start_appliers(self) -> None:
        """Stage 2's shards, fenced then restored, the driver's close writer, and what an
        earlier instance's stage 1 left for them (closed and reduced)."""
        self.closer = Closer(self.pipeline, self.settings)
        for index in range(stage2_shards(self.pipeline)):
            applier = self.appliers[index] = self.applier_type(
                self.pipeline, self.settings, index, self.executor, hooks=self.hooks, start=False,
                checkpoint_partition=index % self._checkpoint_partitions)
            applier.lock()
            applier.fence()
        for index in range(stage2_shards(self.pipeline) if regroups_join(self.pipeline) else 0):
            grouper = self.groupers[index] = RegroupProcessor(
                self.pipeline, self.settings, index, self.executor, hooks=self.hooks, start=False,
                checkpoint_partition=index % self._checkpoint_partitions)
            grouper.lock()
            grouper.fence()
        if ranked_globally(self.pipeline):
            ranker = self.ranker = RankProcessor(self.pipeline, self.settings, 0, self.executor, hooks=self.hooks,
                                                 start=False, checkpoint_partition=0)
            ranker.lock()
            ranker.fence()
        for applier in self._later_stages():
            applier.restore()
            applier.suspend()
        self._apply()

    def _apply(self) -> list[BatchStats]:
        """Close the batch and run each stage-2 shard's part of it."""
        assert self.closer is not None
        close = self.closer.close(self.run)
        committed = []
        for index, applier in self.appliers.items():
            part = read_closed(self.settings, self.pipeline, index, applier.offsets.get(index, 0), close)
            stats = _run_shard(applier, part)
            if stats is not None:
                committed.append(stats)
        if self.groupers:  # a regrouping join's stage 3, once every stage-2 shard committed
            close = self.closer.close(self.run, regroup=True)
            for index, grouper in self.groupers.items():
                part = read_closed(self.settings, self.pipeline, index, grouper.offsets.get(index, 0), close,
                                   topic=regroup_topic(self.pipeline))
                stats = _run_shard(grouper, part)
                if stats is not None:
                    committed.append(stats)
        if self.ranker is not None:  # stage 3, once every stage-2 shard committed
            close = self.closer.close(self.run, tops=True)
            part = read_closed(self.settings, self.pipeline, 0, self.ranker.offsets.get(0, 0), close,
                               topic=tops_topic(self.pipeline))
            stats = _run_shard(self.ranker, part)
            if stats is not None:
                committed.append(stats)
        return committed

    @property
    def applier_type(self) -> type[ShardProcessor]:
        """Stage 2's shard: a re-grouping view's, or a join's through the exchange."""
        return JoinApplyProcessor if self.pipeline.view.join is not None else ApplyProcessor

    def _later_stages(self) -> list[ShardProcessor]:
        """A re-grouping view's stage-2 shards, a regrouping join's stage 3, a global Top-N's stage 3."""
        return [*self.appliers.values(), *self.groupers.values(), *([self.ranker] if self.ranker is not None else [])]

    def _make_shard(self, index: int) -> ShardProcessor:
        """A shard's processor, not started (`fence`, then `restore`; its
        `checkpoint_partition` is set in between)."""
        shard_type = RouteProcessor if exchanged(self.pipeline) else self.shard_type
        if self.pipeline.view.join is not None and not issubclass(shard_type, JoinShardProcessor):
            shard_type = JoinRouteProcessor if exchanged(self.pipeline) else JoinShardProcessor
        return shard_type(
            self.pipeline,
            self.settings,
            index,
            self.executor,
            hooks=self.hooks,
            keys=self.keys,
            start=False,
        )

    def close(self) -> None:
        for shard in [*self.shards.values(), *self._later_stages()]:
            shard.close()
        if self.closer is not None:
            self.closer.shutdown()

    @property
    def offsets(self) -> dict[int, int]:
        """The committed input offsets: partition -> next offset to read, each from the
        shard that covers it."""
        offsets: dict[int, int] = {}
        for shard in self.shards.values():
            offsets.update(shard.offsets)
        return offsets

    @property
    def aborts(self) -> int:
        """Transactions that failed and were run again, all shards."""
        return sum(shard.aborts for shard in self.shards.values())

    def process(self, records: Sequence[InputRecord]) -> BatchStats | None:
        """Run each shard's records of one batch (each in its shard's transaction).
        Returns the batch's stats over the shards that committed, or None when no shard
        committed anything (every record was already committed).

        Raises FencedError (another instance took over), OperationalError (a shard's
        transaction failed `ATTEMPTS` times), RecordError (strict mode), UserError (the
        messages are not keyed as `source.key` says)."""
        started = time.monotonic()
        committed: list[BatchStats] = []
        for index, part in sorted(self.plan.split(records).items()):
            if index not in self.shards:  # a partition added to the source while running
                self._start([index])
            stats = _run_shard(self.shards[index], part)
            if stats is not None:
                committed.append(stats)
        if not committed:
            return None
        self.last = together(committed, time.monotonic() - started)
        if self.closer is not None:
            self.last = with_outputs(self.last, self._apply())
        return self.last


def _run_shard(shard: ShardProcessor, part: Sequence[InputRecord]) -> BatchStats | None:
    """One shard's part, with its store held for the length of it. A store that moved
    since the shard's last batch means another instance ran the shard: this one is
    fenced (FencedError), as its next transaction would be."""
    try:
        if not shard.resume():
            raise FencedError(
                f"pipeline {shard.pipeline.pipeline!r} shard {shard.shard}: another instance committed "
                "batches of this shard since this one's last; this instance stops"
            )
        return shard.process(part)
    finally:
        shard.suspend()


def with_outputs(routed: BatchStats, applied: Sequence[BatchStats]) -> BatchStats:
    """A re-grouping view's batch: what stage 1 read, refused and routed, with the
    records stage 2 wrote (its inputs are stage 1's routed units: not counted again)."""
    return replace(routed, records_out=routed.records_out + sum(s.records_out for s in applied),
                   out_by_topic=_by_topic([routed, *applied]),
                   commit_seconds=routed.commit_seconds + sum(s.commit_seconds for s in applied))


def _by_topic(parts: Sequence[BatchStats]) -> dict[str, int]:
    """The parts' records per output topic, summed."""
    out_by_topic: dict[str, int] = {}
    for stats in parts:
        for topic, count in stats.out_by_topic.items():
            out_by_topic[topic] = out_by_topic.get(topic, 0) + count
    return out_by_topic


def together(parts: Sequence[BatchStats], seconds: float) -> BatchStats:
    """One batch's stats over the shards that committed it."""
    return BatchStats(
        batch=max(s.batch for s in parts),
        records_in=sum(s.records_in for s in parts),
        records_out=sum(s.records_out for s in parts),
        dead_letters=sum(s.dead_letters for s in parts),
        skipped=sum(s.skipped for s in parts),
        tombstones=sum(s.tombstones for s in parts),
        seconds=seconds,
        commit_seconds=sum(s.commit_seconds for s in parts),
        committed_at=max(s.committed_at for s in parts),
        out_by_topic=_by_topic(parts),
        shards=len(parts),
    )
