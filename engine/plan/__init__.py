"""The plan: a pipeline's shape as one value (`refold.plan.plan`), and its drawing
(`refold.plan.draw`)."""

from refold.plan.plan import (
    RIGHT_PARTITIONS,
    Plan,
    Source,
    Stage,
    Topic,
    by_partition,
    checkpoint_key,
    close_id,
    co_partitioned,
    exchanged,
    join_co_partitioned,
    message_key,
    plan_of,
    rank_pipeline,
    ranked_globally,
    regroup_pipeline,
    regroup_state_topic,
    regroup_topic,
    regroups_join,
    shard_writer,
    stage2_shards,
    stage_writers,
    tops_state_topic,
    tops_topic,
    trace_topic,
    view_key,
    view_partitioning,
    view_pipeline,
)

__all__ = ["RIGHT_PARTITIONS", "Plan", "Source", "Stage", "Topic", "by_partition", "checkpoint_key", "close_id", "co_partitioned", "exchanged", "join_co_partitioned", "message_key",
           "plan_of", "rank_pipeline", "ranked_globally", "regroup_pipeline",
           "regroup_state_topic", "regroup_topic", "regroups_join", "shard_writer", "stage2_shards", "stage_writers",
           "tops_state_topic", "tops_topic", "trace_topic", "view_key", "view_partitioning", "view_pipeline"]
