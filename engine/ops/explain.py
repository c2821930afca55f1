"""`refold explain PIPELINE.yaml`: the view a pipeline runs, as the engine reads it.

For a view written in SQL (`view: {sql: …}`) this is the view spec the query became
(`refold.sql`), in the YAML form a pipeline may write instead; for any view, how it
runs: its output key, its shards (one per source partition when it is co-partitioned
with its source, else one that merges them) and the topics it writes; then its plan
(`refold.plan`) drawn as a tree, or as a Mermaid flowchart. Needs no broker: what
depends on the source's partitions or on earlier runs' state shows as not known yet.
"""

from __future__ import annotations

from typing import Any

import yaml

from refold.config import Pipeline
from refold.plan import Plan, plan_of, view_key
from refold.plan.draw import mermaid, tree
from refold.runtime.native import core_of, join_cores_of


def view_spec(pipeline: Pipeline) -> dict[str, Any]:
    """The `view:` mapping of the pipeline's view without its `sql` (the YAML twin)."""
    view = pipeline.view
    where: dict[str, Any] = {"where": view.where} if view.where is not None else {}
    if view.join is not None:
        where["join"] = view.join.model_dump(exclude_none=True)
        if not view.key:
            return where
    if view.window is not None:
        where["window"] = view.window.model_dump(exclude_none=True)
    if view.top_n is not None:
        return {"top_n": view.top_n.model_dump(exclude_none=True), **where}
    return {"key": list(view.key),
            "columns": {name: {spec.agg: spec.column} for name, spec in view.columns.items()}, **where}


def output_key_of(pipeline: Pipeline) -> list[str]:
    """The view output's key columns."""
    view = pipeline.view
    bounds = [] if view.window is None else ["window_start"] if view.window.kind == "session" else [
        "window_start", "window_end"]
    if view.top_n is not None:
        return [*view.top_n.partition_by, *bounds, "place"]
    return [*view.key, *bounds]


def window_text(pipeline: Pipeline) -> str:
    """What a windowed view's window does, in a line."""
    window = pipeline.view.window
    assert window is not None
    if window.kind == "tumble":
        what = f"tumble {window.tumble} over {window.time}"
    elif window.kind == "hop":
        assert window.hop is not None
        what = f"hop {window.hop.size} every {window.hop.slide} over {window.time}"
    else:
        assert window.session is not None
        what = f"sessions of {', '.join(pipeline.view.key)} with a gap of {window.session.gap} over {window.time}"
    if window.lateness is None:
        return what + "; no lateness: windows never close (exact forever, state grows with the windows)"
    return (what + f"; lateness {window.lateness}: a window closes when the shard's watermark (its largest "
            "event time applied minus the lateness) reaches its end, and later events for it are dead "
            "letters (late)")


def explain(pipeline: Pipeline, *, drawing: str = "tree") -> str:
    """The text `refold explain` prints: the view spec and how it runs, then its plan
    (`drawing`: "tree", or "mermaid" for the flowchart alone)."""
    plan = plan_of(pipeline)
    if drawing == "mermaid":
        return mermaid(plan)
    return summary(plan) + "\n#\n" + "\n".join(f"# {line}" for line in tree(plan).splitlines())


def summary(plan: Plan) -> str:
    """The view spec the pipeline runs and, in comment lines, how it runs (the plan's)."""
    pipeline = plan.pipeline
    view = pipeline.view
    lines = []
    if view.sql is not None:
        lines += ["# the view's SQL:", *("#   " + line for line in view.sql.strip().splitlines()),
                  "# is this view spec (the same as writing it in the pipeline file):"]
    lines.append(yaml.safe_dump({"view": view_spec(pipeline)}, sort_keys=False, default_flow_style=None).rstrip())
    output_key = output_key_of(pipeline)
    lines.append(f"# output key: {', '.join(output_key)}")
    if view.window is not None:
        lines.append(f"# window: {window_text(pipeline)}")
    source = plan.sources[0]
    keys = ", ".join(source.key) or "(none)"
    if view.join is not None:
        topics = " and ".join(s.topic for s in plan.sources)
        if plan.layout == "exchanged":
            regroup = "" if not plan.regrouped else \
                (f", their joined rows routed by {', '.join(view.key)} to {plan.stages[2].shards} shards of the "
                 f"grouped view through {plan.stages[2].inputs[0]}")
            lines.append(f"# shards: stage 1 one per partition pair of {topics}, routed by join key to "
                         f"{plan.stages[1].shards} join shards through {plan.stages[1].inputs[0]}{regroup}")
        else:
            lines.append(f"# shards: one per partition pair of {topics} (both keyed by their join columns)"
                         if plan.layout == "co-partitioned" else f"# shards: one, merging every partition of {topics}")
    elif plan.layout == "co-partitioned":
        lines.append(f"# shards: one per partition of {source.topic} (messages keyed by {keys}, "
                     f"within the view's grouping {', '.join(view_key(view))})")
    elif plan.layout == "exchanged":
        reduce = plan.stage("reduce")
        count = (f"{reduce.shards}" if pipeline.shards is not None else
                 "as many as the source has partitions (settled at the first start; a one-partition source: merged)")
        lines.append(f"# shards: stage 1 one per partition of {source.topic} (messages keyed by {keys}; "
                     f"live rows in {plan.first.state_topic}), routed by {', '.join(view_key(view)) or 'nothing'} "
                     f"to stage-2 shards through {reduce.inputs[0]}: {count}")
        if plan.ranked_globally:
            lines.append(f"# a global Top-N in shards: rows routed by {keys}, each shard's local top n to "
                         f"{plan.stage('rank').inputs[0]}, ranked again by one stage-3 task (more than one shard)")
    else:
        grouping = ", ".join(view_key(view)) or "none: a global Top-N"
        lines.append(f"# shards: one, merging every partition of {source.topic} (messages keyed by "
                     f"{keys}; the view groups by {grouping})")
    lines.append(f"# reduces in: {core_of(pipeline) if view.join is None else join_cores_of(pipeline)}")
    if pipeline.outputs.view is not None:
        output = pipeline.outputs.view
        partitioned = {"key": "partitioned by key (murmur2)", "shard": "a partition per writing shard"}.get(
            output.partitioning or "", "a partition per writing shard (unless earlier runs wrote it by key)")
        lines.append(f"# view output: {output.topic} ({output.form}, {partitioned})")
    if pipeline.outputs.delta is not None:
        lines.append(f"# delta output: {pipeline.outputs.delta.topic}")
    lines.append(f"# dead letters: {pipeline.dlq_topic}; state: {pipeline.state_topic}; "
                 f"checkpoints: {pipeline.checkpoints_topic}")
    return "\n".join(lines)
