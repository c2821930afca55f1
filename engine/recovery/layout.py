"""How a view's state and view topic are laid out, settled at start (`shards`, DESIGN.md
§3; `outputs.view.partitioning`).

A view whose key lacks a message-key column either merges every source partition in
one task (`shards: merged`) or re-groups in `shards: M` (`refold.runtime.exchange`):
its stage 2 keeps each view key's state in shard `shard_of(key, M)`. Both lay out the
state for good, so a run must keep the layout its pipeline's earlier runs committed:

- `shards` unset: the earlier runs' layout; for a new pipeline, M = the source's
  partition count (a one-partition source, or a view that cannot re-group in shards:
  merged);
- `shards: M` or `merged` against state laid out otherwise: a UserError that says
  what the state is (Refold does not move state between layouts).

What the earlier runs were is read from `P.checkpoints`: a stage-2 checkpoint
(`<writer>.view/<m>`, every shard claimed at each start) means shards, their count M;
none, and a committed batch of the writer, means merged.

The view topic is laid out the same way, once: partitioned by shard (shard s writes
partition s, so a partition has one writer and a `-C` lies right before its `+C`; a new
pipeline's default) or by key (murmur2, as the pipelines that committed before the
setting existed did, where another shard's record batch can fall between a `-C` and its
`+C`). Each checkpoint says which (`Checkpoint.view_partitioning`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from refold.config import Pipeline
from refold.errors import UserError
from refold.kafka.io import TopicSpec, partitions_of
from refold.plan import (
    Plan,
    co_partitioned,
    plan_of,
    ranked_globally,
    stage_writers,
    view_partitioning,
)
from refold.recovery.records import Checkpoint
from refold.recovery.restore import load_writers

log = logging.getLogger(__name__)


def settle_plan(pipeline: Pipeline, settings: Mapping[str, Any], partitions: int) -> Plan:
    """The plan this run runs (`refold.plan`): the pipeline as `settle_layout` settles it,
    over a source of `partitions` partitions."""
    return plan_of(settle_layout(pipeline, settings, partitions), partitions)


def settle_layout(pipeline: Pipeline, settings: Mapping[str, Any], partitions: int) -> Pipeline:
    """The pipeline with `shards` and `outputs.view.partitioning` as this run runs them
    (`settled`), from one read of `P.checkpoints`. `partitions`: the source's."""
    return settled(pipeline, _committed(pipeline, settings), partitions)


def settled(pipeline: Pipeline, committed: Mapping[str, Mapping[int, Checkpoint]], partitions: int) -> Pipeline:
    """The pipeline with `shards` and `outputs.view.partitioning` settled against the
    checkpoints its stages' writers committed (`committed`, by writer; a writer not in
    it committed nothing)."""
    by_writer = {writer: dict(committed.get(writer, {})) for writer in stage_writers(pipeline)}
    return settle_view_partitioning(settle_shards(pipeline, by_writer, partitions), by_writer, partitions)


def settle_shards(pipeline: Pipeline, committed: dict[str, dict[int, Checkpoint]], partitions: int) -> Pipeline:
    """The pipeline with `shards` as this run runs it: an int M or "merged" for a view
    that re-groups partitions (unchanged for a co-partitioned one). Raises UserError
    when the pipeline asks for a layout its state is not in."""
    if co_partitioned(pipeline):
        return pipeline
    if pipeline.view.join is not None and not isinstance(pipeline.shards, int):  # (unset: merged)
        return pipeline if pipeline.shards == "merged" else pipeline.model_copy(update={"shards": "merged"})
    earlier = _earlier_layout(pipeline, committed)
    asked = pipeline.shards
    if asked is None:
        if pipeline.shards_refusal() is not None:
            settled: int | str = "merged"
        elif earlier is not None:
            settled = earlier
        else:
            settled = partitions if partitions > 1 else "merged"
        if settled == earlier and ranked_globally(pipeline.model_copy(update={"shards": settled})):
            _check_ranked(pipeline, committed)
        if settled != "merged":
            log.info("pipeline %s re-groups in %d shards (%s)", pipeline.pipeline, settled,
                     "as its earlier runs did" if earlier is not None else "one per source partition")
        return pipeline.model_copy(update={"shards": settled})
    if ranked_globally(pipeline) and earlier == asked:
        _check_ranked(pipeline, committed)
    if earlier is not None and earlier != asked:
        now = "merged" if earlier == "merged" else f"shards: {earlier}"
        raise UserError(
            f"shards: pipeline {pipeline.pipeline!r} (writer {pipeline.writer!r}) committed its state as "
            f"{_describe(earlier)}; this run asks for {_describe(asked)}. Refold does not move state "
            f"between layouts: set `{now}` (or leave shards out), or run under a new `writer` to rebuild "
            "the view from the source"
        )
    return pipeline


def settle_view_partitioning(pipeline: Pipeline, committed: dict[str, dict[int, Checkpoint]],
                             partitions: int) -> Pipeline:
    """The pipeline with `outputs.view.partitioning` settled: what its earlier runs
    committed ("key" for checkpoints from before the setting), else what it asks, else
    "shard". Raises UserError when it asks for the other one: moving a key's records to
    another partition would split its changelog (and leave a compacted topic two rows)."""
    view = pipeline.outputs.view
    if view is None:
        return pipeline
    done = {c.view_partitioning for stage in committed.values() for c in stage.values() if c.batch > 0}
    earlier = "key" if "key" in done else "shard" if done else None
    asked = view.partitioning
    if earlier is not None and asked is not None and asked != earlier:
        raise UserError(
            f"outputs.view.partitioning: pipeline {pipeline.pipeline!r} (writer {pipeline.writer!r}) committed "
            f"its view partitioned by {_PARTITIONED[earlier]}; this run asks for {_PARTITIONED[asked]}. Refold "
            f"does not move a key's records between partitions: set `partitioning: {earlier}` (or leave it out), "
            "or run under a new `writer` (and a new view topic) to rebuild the view from the source"
        )
    settled = earlier or asked or "shard"
    if settled == "key" and view_writers(pipeline, partitions) > 1:
        log.warning("pipeline %s writes its view by key (murmur2), as its earlier runs did: a -C and its +C may "
                    "have another shard's records between them in a partition; a new `writer` and view topic "
                    "write it by shard (CHANGELOG.md, 0.1.0, view partitions)",
                    pipeline.pipeline)
    outputs = pipeline.outputs.model_copy(update={"view": view.model_copy(update={"partitioning": settled})})
    return pipeline.model_copy(update={"outputs": outputs})


_PARTITIONED = {"shard": "shard (partitioning: shard)", "key": "key, murmur2 (partitioning: key)"}


def view_writers(pipeline: Pipeline, partitions: int) -> int:
    """How many shards write the view (`Plan.view_writers`; `partitions`: the source's)."""
    writers = plan_of(pipeline, partitions).view_writers
    assert writers is not None
    return writers


def check_view_partitions(pipeline: Pipeline, settings: Mapping[str, Any], partitions: int) -> None:
    """`check_plan_view_partitions` of the pipeline's plan over `partitions` source partitions."""
    check_plan_view_partitions(plan_of(pipeline, partitions), settings)


def check_plan_view_partitions(plan: Plan, settings: Mapping[str, Any]) -> None:
    """UserError unless a view partitioned by shard has a partition for each of its
    writing shards (`Plan.view_writers`)."""
    pipeline = plan.pipeline
    view = pipeline.outputs.view
    if view is None or view_partitioning(pipeline) != "shard":
        return
    writers, have = plan.view_writers or 1, len(partitions_of(settings, view.topic))
    if have < writers:
        raise UserError(
            f"outputs.view: {view.topic} has {have} partition(s), and pipeline {pipeline.pipeline!r} writes its "
            f"view from {writers} shards, each to a partition of its own (partitioning: shard): add partitions "
            f"to {view.topic} (kafka-topics --alter --partitions {writers}), or name a new view topic"
        )


def exchange_topics(pipeline: Pipeline, partitions: int) -> list[TopicSpec]:
    """A re-grouping view's own topics, as the plan has them: `P.repartition`, `P.rows`
    (and a global Top-N's `P.tops`, `P.tops.state`; a regrouping join's `P.regroup`,
    `P.regroup.state`). `partitions`: what the engine
    makes its topics with."""
    roles = ("repartition", "rows", "tops", "tops state", "regroup", "regroup state")
    return [topic.spec() for topic in plan_of(pipeline, partitions).topics if topic.role in roles]


def _committed(pipeline: Pipeline, settings: Mapping[str, Any]) -> dict[str, dict[int, Checkpoint]]:
    """The checkpoints of the writer's stages (`<writer>`, `<writer>.view`, `<writer>.top`),
    by writer, in one read of `P.checkpoints` (all empty for a new pipeline)."""
    writers = list(stage_writers(pipeline))
    try:
        partitions_of(settings, pipeline.checkpoints_topic)
    except UserError:
        return {writer: {} for writer in writers}  # a new pipeline: the engine creates its topics next
    return load_writers(pipeline, settings, writers)


def _earlier_layout(pipeline: Pipeline, committed: dict[str, dict[int, Checkpoint]]) -> int | str | None:
    """The layout the writer's earlier runs committed: M (stage-2 shards claimed),
    "merged" (a committed batch and no stage 2), or None (nothing committed yet)."""
    stage2 = committed[stage_writers(pipeline)[1]]
    if stage2:
        return max(stage2) + 1
    if any(checkpoint.batch > 0 for checkpoint in committed[pipeline.writer].values()):
        return "merged"
    return None


def _check_ranked(pipeline: Pipeline, committed: dict[str, dict[int, Checkpoint]]) -> None:
    """UserError for a global Top-N that committed in shards before stage 3 ranked it
    (its stage 3): its rows all lie in one stage-2 shard, not by message key."""
    _writer, view_writer, rank_writer, _group_writer = stage_writers(pipeline)
    if any(c.batch > 0 for c in committed[view_writer].values()) and not committed[rank_writer]:
        raise UserError(
            f"shards: pipeline {pipeline.pipeline!r} (writer {pipeline.writer!r}) is a global Top-N whose state an "
            "earlier Refold committed in one stage-2 shard; this one spreads its rows over the shards by message key "
            "and ranks them in a stage 3. Run it under a new `writer` to rebuild the view from the source"
        )


def _describe(layout: int | str) -> str:
    if layout == "merged":
        return "one shard merging every source partition (shards: merged)"
    return f"{layout} stage-2 shards (shards: {layout})"
