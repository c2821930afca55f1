"""The plan: a pipeline's shape as one value, built once from its config (DESIGN.md §7).

`plan_of(pipeline, partitions)` turns a pipeline (its `shards` and
`outputs.view.partitioning` as `refold.recovery.layout` settles them at start, or as
written) and its source's partition count into a `Plan`: its sources, its stages, the
topics between them, each stage's shards, writer and transactional ids, and whether
the view is co-partitioned with its source. Start-up, recovery, the Spark job,
`refold explain` and `refold status` read the plan; none of them works a piece of it
out again. It depends on the config only: the engine's layers depend on it.

The stages a view runs in today (`Stage.name`):

- `view` (one stage): decode, validate and reduce, one shard per source partition
  (co-partitioned: the message-key columns are within the view key) or one shard that
  merges every partition (`shards: merged`).
- `route` → `reduce` (`shards: M`, `refold.runtime.exchange`): stage 1 decodes,
  validates and routes each unit by view key through `P.repartition` (M partitions);
  stage 2's M shards reduce; the driver closes each batch (`close_id`).
- … → `rank` (a global Top-N in M > 1 shards, `refold.runtime.tops`): stage 2 writes
  each shard's local top to `P.tops`; one stage-3 shard ranks them.
- `join` (one stage, `view.join`, `refold.runtime.joins`): decode and validate both
  sources, join, and reduce the grouped view over the join when there is one; one shard
  that merges every partition of both sources, or one per partition pair when both are
  keyed by their join columns with equal partition counts (co-partitioned).
- `route` → `join` (a join in `shards: M`, `refold.runtime.joinx`): stage 1 shard p
  decodes partition p of both sources and routes each unit by join key through
  `P.repartition`; stage 2's M shards join (and reduce the grouped view over the join).
- `route` → `join` → `reduce` (a join in `shards: M` whose grouped view is keyed
  outside the left side's join columns, `refold.runtime.joingroup`): stage 2's shards
  route the joined rows by view key through `P.regroup` (M partitions); stage 3's M
  shards reduce the grouped view; the driver closes `P.regroup` after stage 2.

A stage's shard s has the transactional id `<prefix>-<writer>-<s>`, its checkpoint
record `<writer>/<s>` in `P.checkpoints` and its state in partition s of its state
topic. These names are the contract with committed state: a pipeline that committed
keeps them (tests/test_plan.py pins them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from refold.config import Pipeline, ViewSpec
from refold.kafka.io import TopicSpec

Layout = Literal["co-partitioned", "exchanged", "merged"]


# The rules the plan is built by (also asked on their own by the reducers' checks) -------


RIGHT_PARTITIONS = 1 << 20  # a join's shards number its right source's partition p RIGHT_PARTITIONS + p


def view_key(view: ViewSpec) -> tuple[str, ...]:
    """The view's grouping columns: `key`, or a Top-N's `partition_by` (empty: global)."""
    if view.top_n is not None:
        return tuple(view.top_n.partition_by)
    return tuple(view.key)


def message_key(pipeline: Pipeline) -> tuple[str, ...]:
    """The columns the source's messages are keyed by: `source.key`, else the view key."""
    return tuple(pipeline.source.key) or view_key(pipeline.view)


def co_partitioned(pipeline: Pipeline) -> bool:
    """Whether every view key's events lie in one source partition: the message-key
    columns are a (non-empty) subset of the view-key columns."""
    if pipeline.view.join is not None:
        return join_co_partitioned(pipeline)
    keys = message_key(pipeline)
    return bool(keys) and set(keys) <= set(view_key(pipeline.view))


def join_co_partitioned(pipeline: Pipeline) -> bool:
    """Whether a join runs a shard per partition pair (shard p joins partition p of both
    sources): both sources are keyed by exactly their join columns (`sources.<name>.key`),
    of the same names on both sides in the same order (so equal join values are equal
    message keys, which the producers' partitioner puts in the same partition), `shards`
    is not `merged`, and a grouped view over the join, if any, has in its key an output
    column of each of the left side's join columns (the sources' partition counts must be
    equal: checked at start)."""
    join = pipeline.view.join
    if join is None or pipeline.shards == "merged" or join.sides_on[0] != join.sides_on[1]:
        return False
    for name, columns in zip((join.left, join.right), join.sides_on, strict=True):
        source = pipeline.sources.get(name)
        if source is None or tuple(source.key) != columns:
            return False
    if pipeline.view.key:
        left = {column for name, side, column in join.outputs if side == 0 and name in pipeline.view.key}
        return set(join.sides_on[0]) <= left
    return True


def exchanged(pipeline: Pipeline) -> bool:
    """Whether the view re-groups in `shards: M` (`refold.runtime.exchange`): its stage 1
    runs one shard per source partition, as a co-partitioned view does."""
    return isinstance(pipeline.shards, int)


def by_partition(pipeline: Pipeline) -> bool:
    """Whether the first stage runs one shard per source partition (shard p reads
    partition p: co-partitioned, or a re-grouping view's stage 1) rather than one shard
    that merges them all."""
    return co_partitioned(pipeline) or exchanged(pipeline)


def close_id(pipeline: Pipeline) -> str:
    """The transactional id of a re-grouping view's driver close (`P-<writer>-close`)."""
    return pipeline.transactional_id("close")


def stage2_shards(pipeline: Pipeline) -> int:
    """A re-grouping view's stage-2 shards (`shards: M`): M; 0 for any other view."""
    return pipeline.shards if isinstance(pipeline.shards, int) else 0


def ranked_globally(pipeline: Pipeline) -> bool:
    """Whether the view is a global Top-N in more than one stage-2 shard (a stage 3
    ranks the shards' local tops: `refold.runtime.tops`)."""
    top_n = pipeline.view.top_n
    return top_n is not None and not top_n.partition_by and stage2_shards(pipeline) > 1


def view_partitioning(pipeline: Pipeline) -> str:
    """How the shards partition the view's records (`outputs.view.partitioning`, as
    settled at start): "shard" (shard s writes partition s) or "key" (murmur2)."""
    view = pipeline.outputs.view
    return view.partitioning if view is not None and view.partitioning is not None else "shard"


def checkpoint_key(writer: str, shard: int) -> bytes:
    """The key of a shard's record in `P.checkpoints`."""
    return f"{writer}/{shard}".encode()


def shard_writer(pipeline: Pipeline, shard: int) -> str:
    """The shard's writer name, `<writer>-<shard>`: its materializations' fence and
    checkpoint owner (the writer part of `P-<writer>-<shard>`)."""
    return f"{pipeline.writer}-{shard}"


def tops_topic(pipeline: Pipeline) -> str:
    """A global Top-N's stage-2 shards' local-top changes, one partition, read by stage 3."""
    return f"{pipeline.pipeline}.tops"


def trace_topic(pipeline: Pipeline) -> str:
    """The view's trace index (`refold.runtime.traceindex`), partitioned as the view."""
    return f"{pipeline.pipeline}.trace"


def tops_state_topic(pipeline: Pipeline) -> str:
    """A global Top-N's stage-3 state (compacted, one partition)."""
    return f"{pipeline.pipeline}.tops.state"


def view_pipeline(pipeline: Pipeline) -> Pipeline:
    """Stage 2's pipeline: the same view and outputs, its input `P.repartition`, its
    writer `<writer>.view` (its transactional ids, checkpoint records and stores)."""
    source = pipeline.source.model_copy(update={"topic": pipeline.repartition_topic})
    return pipeline.model_copy(update={"writer": f"{pipeline.writer}.view", "source": source})


def rank_pipeline(pipeline: Pipeline) -> Pipeline:
    """Stage 3's pipeline: the same view and outputs, its input `P.tops`, its writer
    `<writer>.top` (its transactional id, checkpoint record and store)."""
    source = pipeline.source.model_copy(update={"topic": tops_topic(pipeline)})
    return pipeline.model_copy(update={"writer": f"{pipeline.writer}.top", "source": source})


def regroups_join(pipeline: Pipeline) -> bool:
    """Whether a join in `shards: M` has a grouped view keyed outside the left side's join
    columns: its joined rows go through a second exchange (`P.regroup`) to a stage 3."""
    join = pipeline.view.join
    if join is None or not stage2_shards(pipeline) or not pipeline.view.key:
        return False
    left = {column for name, side, column in join.outputs if side == 0 and name in pipeline.view.key}
    return not set(join.sides_on[0]) <= left


def regroup_topic(pipeline: Pipeline) -> str:
    """A regrouping join's joined rows routed by view key, a partition per stage-3 shard."""
    return f"{pipeline.pipeline}.regroup"


def regroup_state_topic(pipeline: Pipeline) -> str:
    """A regrouping join's stage-3 state (the grouped view's), a partition per shard."""
    return f"{pipeline.pipeline}.regroup.state"


def regroup_pipeline(pipeline: Pipeline) -> Pipeline:
    """Stage 3's pipeline of a regrouping join: the same view and outputs, its input
    `P.regroup`, its writer `<writer>.group` (its transactional ids, checkpoints, stores)."""
    source = pipeline.source.model_copy(update={"topic": regroup_topic(pipeline)})
    return pipeline.model_copy(update={"writer": f"{pipeline.writer}.group", "source": source})


def stage_writers(pipeline: Pipeline) -> tuple[str, str, str, str]:
    """The writers a pipeline's stages may commit under, whatever its layout:
    `<writer>`, `<writer>.view`, `<writer>.top`, `<writer>.group` (what `P.checkpoints`
    is read for)."""
    return (pipeline.writer, f"{pipeline.writer}.view", f"{pipeline.writer}.top", f"{pipeline.writer}.group")


# The value --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Topic:
    """A topic of the plan: its name, its role, its partitions (None: not the engine's
    to make, or not known before the source's partitions are) and whether compacted."""

    name: str
    role: str  # source, repartition, rows, tops, tops state, regroup, regroup state, view, delta, dead letters, ...
    partitions: int | None
    compacted: bool = False

    def spec(self) -> TopicSpec:
        assert self.partitions is not None, self.name
        return TopicSpec(self.name, self.partitions, compacted=self.compacted)


@dataclass(frozen=True, slots=True)
class Source:
    """One of the pipeline's sources: "source", or a join's two, named as in `sources:`."""

    name: str
    topic: str
    format: str
    form: str
    key: tuple[str, ...]  # the columns its messages are keyed by
    partitions: int | None


@dataclass(frozen=True, slots=True)
class Stage:
    """One stage: what it does (`steps`), what it reads and writes, its shards (None:
    one per source partition, known once the source's partitions are), its writer and
    its pipeline (the config its shards run with: its writer and input topic)."""

    name: str  # view, route, reduce, rank, join (a regrouping join: route, join, reduce)
    steps: tuple[str, ...]  # decode, validate, route, reduce, rank, join
    pipeline: Pipeline
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    state_topic: str
    shards: int | None
    by_partition: bool  # shard s reads input partition s (else one shard merges them all)

    @property
    def writer(self) -> str:
        return self.pipeline.writer

    @property
    def shard_indexes(self) -> list[int]:
        assert self.shards is not None, self.name
        return list(range(self.shards))

    def transactional_id(self, shard: int | str) -> str:
        return self.pipeline.transactional_id(shard)

    @property
    def transactional_ids(self) -> tuple[str, ...]:
        return tuple(self.transactional_id(shard) for shard in self.shard_indexes)

    def checkpoint_key(self, shard: int) -> bytes:
        return checkpoint_key(self.writer, shard)


@dataclass(frozen=True, slots=True)
class Plan:
    """A pipeline's shape (see the module's docstring)."""

    pipeline: Pipeline  # as settled (shards, view partitioning)
    layout: Layout
    sources: tuple[Source, ...]
    stages: tuple[Stage, ...]
    topics: tuple[Topic, ...]
    close_id: str | None  # the driver's close transaction (a re-grouping view)
    view_writers: int | None  # the shards that write the view (None: one per source partition, not yet known)

    @property
    def co_partitioned(self) -> bool:
        """Whether the first stage runs one shard per source partition (co-partitioned,
        or a re-grouping view's stage 1), rather than one that merges them."""
        return self.stages[0].by_partition

    @property
    def exchanged(self) -> bool:
        return self.layout == "exchanged"

    @property
    def ranked_globally(self) -> bool:
        return self.stages[-1].name == "rank"

    @property
    def regrouped(self) -> bool:
        """A join's grouped view reduced in a stage 3 (`regroups_join`)."""
        return len(self.stages) == 3 and self.stages[-1].name == "reduce"

    @property
    def stage2_shards(self) -> int:
        return self.stages[1].shards or 0 if self.exchanged else 0

    @property
    def first(self) -> Stage:
        return self.stages[0]

    @property
    def later(self) -> tuple[Stage, ...]:
        """The stages after the first (a re-grouping view's reduce and rank)."""
        return self.stages[1:]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"pipeline {self.pipeline.pipeline!r} has no stage {name!r}")

    def topic(self, role: str) -> Topic | None:
        return next((topic for topic in self.topics if topic.role == role), None)

    @property
    def writers(self) -> tuple[str, ...]:
        return tuple(stage.writer for stage in self.stages)

    def engine_topics(self) -> list[TopicSpec]:
        """The topics the engine makes (all but the sources), as specs."""
        return [topic.spec() for topic in self.topics if topic.role != "source"]


def plan_of(pipeline: Pipeline, partitions: int | None = None) -> Plan:
    """The plan of `pipeline` over a source of `partitions` partitions (None: not known,
    as for `refold explain` without a broker; shard counts that depend on it are None).
    A join's `partitions` are its left source's (its right one's must equal them when
    the join is co-partitioned; a merged join runs one shard whatever they are)."""
    if pipeline.view.join is not None:
        return _join_plan(pipeline, partitions)
    source = Source("source", pipeline.source.topic, pipeline.source.format, pipeline.source.form,
                    message_key(pipeline), partitions)
    made = max(pipeline.partitions, partitions) if partitions is not None else None  # P.state etc.
    writing = "reduce"
    if co_partitioned(pipeline):
        layout: Layout = "co-partitioned"
    elif exchanged(pipeline) or (pipeline.shards is None and pipeline.shards_refusal() is None
                                 and (partitions is None or partitions > 1)):
        layout = "exchanged"  # (`shards` unset: settled at start; M = the source's partitions for a new one)
    else:
        layout = "merged"
    m = stage2_shards(pipeline) or (partitions if layout == "exchanged" else None)
    dlq, state, checkpoints = pipeline.dlq_topic, pipeline.state_topic, pipeline.checkpoints_topic
    view_out = pipeline.outputs.view
    outputs = tuple(t.topic for t in (view_out, pipeline.outputs.delta) if t is not None)
    first_shards = partitions if layout != "merged" else 1
    stages: list[Stage]
    exchange: list[Topic] = []
    if layout != "exchanged":
        stages = [Stage("view", ("decode", "validate", "reduce"), pipeline, (pipeline.source.topic,),
                        (*outputs, dlq), state, first_shards, layout == "co-partitioned")]
    else:
        route = Stage("route", ("decode", "validate", "route"), pipeline, (pipeline.source.topic,),
                      (pipeline.repartition_topic, dlq), pipeline.rows_topic, partitions, True)
        ranked = (pipeline.view.top_n is not None and not pipeline.view.top_n.partition_by
                  and (m is None or m > 1))
        reduce = Stage("reduce", ("reduce",), view_pipeline(pipeline), (pipeline.repartition_topic,),
                       (tops_topic(pipeline),) if ranked else (*outputs, dlq), state, m, True)
        stages = [route, reduce]
        exchange += [Topic(pipeline.repartition_topic, "repartition", m),
                   Topic(pipeline.rows_topic, "rows", made, compacted=True)]
        if ranked:
            stages.append(Stage("rank", ("rank",), rank_pipeline(pipeline), (tops_topic(pipeline),), (*outputs, dlq),
                                tops_state_topic(pipeline), 1, False))
            exchange += [Topic(tops_topic(pipeline), "tops", 1),
                       Topic(tops_state_topic(pipeline), "tops state", 1, compacted=True)]
            writing = "rank"
    topics = [Topic(pipeline.source.topic, "source", partitions),
              Topic(checkpoints, "checkpoints", made, compacted=True),
              Topic(state, "state", None if made is None else max(made, stage2_shards(pipeline)), compacted=True),
              Topic(dlq, "dead letters", 1), *exchange]
    writers = next(stage for stage in stages if stage.name in ("view", writing)).shards
    if view_out is not None:
        # Partitioned by shard, each writing shard has a partition of its own. A Top-N
        # leaderboard is small and its places change together: one partition per writer
        # (one for a global Top-N) keeps each leaderboard's changelog in one total order.
        by_shard = writers if view_partitioning(pipeline) == "shard" else 1
        if by_shard is None or made is None:
            count = None
        else:
            count = by_shard if pipeline.view.is_top_n else max(made, by_shard)
        topics.append(Topic(view_out.topic, "view", count, compacted=view_out.form == "upsert"))
        if pipeline.outputs.provenance and view_partitioning(pipeline) == "shard":  # (refold.runtime.traceindex)
            topics.append(Topic(trace_topic(pipeline), "trace", count))
    if pipeline.outputs.delta is not None:
        topics.append(Topic(pipeline.outputs.delta.topic, "delta", made))
    return Plan(pipeline, layout, (source,), tuple(stages), tuple(topics),
                close_id(pipeline) if layout == "exchanged" else None, writers)


def _join_plan(pipeline: Pipeline, partitions: int | None) -> Plan:
    """A join's plan: one `join` stage over both sources (see the module's docstring)."""
    join = pipeline.view.join
    assert join is not None
    paired = join_co_partitioned(pipeline)
    sources = []
    for name in (join.left, join.right):
        spec = pipeline.sources[name]
        sources.append(Source(name, spec.topic, spec.format, spec.form, tuple(spec.key),
                              partitions if name == join.left or paired else None))
    made = max(pipeline.partitions, partitions) if partitions is not None else None
    dlq, state, checkpoints = pipeline.dlq_topic, pipeline.state_topic, pipeline.checkpoints_topic
    view_out = pipeline.outputs.view
    outputs = tuple(t.topic for t in (view_out, pipeline.outputs.delta) if t is not None)
    m = stage2_shards(pipeline)
    shards = m or (partitions if paired else 1)
    steps = ("decode", "validate", "join", *(("reduce",) if pipeline.view.key else ()))
    inputs = tuple(s.topic for s in sources)
    exchange: list[Topic] = []
    stages: tuple[Stage, ...]
    if m:  # through the exchange: stage 1 routes partition p of both sources by join key
        route = Stage("route", ("decode", "validate", "route"), pipeline, inputs,
                      (pipeline.repartition_topic, dlq), pipeline.rows_topic, partitions, True)
        exchange = [Topic(pipeline.repartition_topic, "repartition", m),
                    Topic(pipeline.rows_topic, "rows", made, compacted=True)]
        if regroups_join(pipeline):  # the joined rows through a second exchange, by view key
            regroup, regroup_state = regroup_topic(pipeline), regroup_state_topic(pipeline)
            stages = (route, Stage("join", ("join", "route"), view_pipeline(pipeline), (pipeline.repartition_topic,),
                                   (regroup, dlq), state, m, True),
                      Stage("reduce", ("reduce",), regroup_pipeline(pipeline), (regroup,), (*outputs, dlq),
                            regroup_state, m, True))
            exchange += [Topic(regroup, "regroup", m), Topic(regroup_state, "regroup state", m, compacted=True)]
        else:
            stages = (route, Stage("join", steps[2:], view_pipeline(pipeline), (pipeline.repartition_topic,),
                                   (*outputs, dlq), state, m, True))
    else:
        stages = (Stage("join", steps, pipeline, inputs, (*outputs, dlq), state, shards, paired),)
    topics = [*(Topic(s.topic, "source", s.partitions) for s in sources),
              Topic(checkpoints, "checkpoints", made, compacted=True),
              Topic(state, "state", None if made is None else max(made, m), compacted=True),
              Topic(dlq, "dead letters", 1), *exchange]
    if view_out is not None:
        by_shard = shards if view_partitioning(pipeline) == "shard" else 1
        count = None if by_shard is None or made is None else max(made, by_shard)
        topics.append(Topic(view_out.topic, "view", count, compacted=view_out.form == "upsert"))
        if pipeline.outputs.provenance and view_partitioning(pipeline) == "shard":  # (refold.runtime.traceindex)
            topics.append(Topic(trace_topic(pipeline), "trace", count))
    if pipeline.outputs.delta is not None:
        topics.append(Topic(pipeline.outputs.delta.topic, "delta", made))
    layout: Layout = "exchanged" if m else "co-partitioned" if paired else "merged"
    return Plan(pipeline, layout, tuple(sources), stages, tuple(topics), close_id(pipeline) if m else None, shards)
