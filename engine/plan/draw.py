"""The plan drawn: a text tree (`refold explain`) and a Mermaid flowchart (`--mermaid`, for docs)."""

from __future__ import annotations

from refold.plan.plan import Plan, Stage, Topic

_ROLES = {"source": "source", "repartition": "routed units, a partition per stage-2 shard",
          "rows": "stage 1's live rows per message key", "tops": "the stage-2 shards' local tops",
          "tops state": "stage 3's state", "regroup": "joined rows by view key, a partition per stage-3 shard",
          "regroup state": "stage 3's state, partition = shard", "view": "view", "trace": "trace index, partition = view partition", "delta": "delta", "dead letters": "dead letters",
          "state": "state, partition = shard", "checkpoints": "a record per stage writer and shard"}


def _shards(stage: Stage) -> str:
    if stage.shards is None:
        return ("a shard per source partition, shard p reads partition p" if stage.by_partition
                else "as many shards as the source has partitions")
    count = f"{stage.shards} shard{'s' if stage.shards != 1 else ''}"
    if stage.by_partition:
        return f"{count}, shard p reads partition p of its input"
    return f"{count}, merging every input partition" if stage.shards == 1 else count


def _partitions(topic: Topic, least: int) -> str:
    if topic.partitions is None:
        return f"as many partitions as the source (at least {least})" if topic.role != "view" else \
            "a partition per writing shard"
    return f"{topic.partitions} partition{'s' if topic.partitions != 1 else ''}"


def tree(plan: Plan) -> str:
    """The plan as a text tree: its sources, its stages in order (each with its shards,
    writer, transactional ids and checkpoint keys, what it reads and writes), its topics."""
    pipeline = plan.pipeline
    lines = [f"plan {pipeline.pipeline} (writer {pipeline.writer}; {plan.layout})"]
    lines.append("├─ sources")
    for number, source in enumerate(plan.sources, 1):
        keyed = ", ".join(source.key) or "nothing"
        partitions = "" if source.partitions is None else f", {source.partitions} partitions"
        lines.append(f"│  {'└─' if number == len(plan.sources) else '├─'} {source.name}: {source.topic} ({source.format} {source.form}, keyed by {keyed}"
                     f"{partitions})")
    lines.append("├─ stages")
    for number, stage in enumerate(plan.stages, 1):
        last = number == len(plan.stages)
        branch, stem = ("└─", "   ") if last else ("├─", "│  ")
        lines.append(f"│  {branch} {number}. {stage.name}: {' → '.join(stage.steps)} ({_shards(stage)})")
        ids = stage.transactional_id("<shard>")
        lines.append(f"│  {stem}   writer {stage.writer}: transactional ids {ids}, checkpoints "
                     f"{stage.writer}/<shard> in {pipeline.checkpoints_topic}")
        lines.append(f"│  {stem}   reads {', '.join(stage.inputs)}")
        lines.append(f"│  {stem}   writes {', '.join(stage.outputs)}; state in {stage.state_topic}")
    if plan.close_id is not None:
        later = "".join(f", then, once every stage-{n - 1} shard committed, in {stage.inputs[0]}"
                        for n, stage in enumerate(plan.stages[2:], 3))
        lines.append(f"├─ the driver closes each batch in {plan.stages[1].inputs[0]}{later} "
                     f"(transactional id {plan.close_id})")
    lines.append("└─ topics")
    width = max(len(topic.name) for topic in plan.topics)
    for topic in plan.topics:
        compacted = ", compacted" if topic.compacted else ""
        what = "the source's partitions" if topic.role == "source" and topic.partitions is None else \
            _partitions(topic, pipeline.partitions)
        lines.append(f"   {topic.name:<{width}}  {_ROLES.get(topic.role, topic.role)}: {what}{compacted}")
    return "\n".join(lines)


def mermaid(plan: Plan) -> str:
    """The plan as a Mermaid flowchart: topics as cylinders, stages as boxes, an arrow
    for each topic a stage reads or writes (its state and checkpoints dotted)."""
    pipeline = plan.pipeline
    ids = {topic.name: f"t{index}" for index, topic in enumerate(plan.topics)}
    lines = ["flowchart LR"]
    for topic in plan.topics:
        lines.append(f'  {ids[topic.name]}[("{topic.name}<br/>{_ROLES.get(topic.role, topic.role)}")]')
    for number, stage in enumerate(plan.stages, 1):
        ids_text = stage.transactional_id("#lt;shard#gt;")
        lines.append(f'  s{number}["{number}. {stage.name}: {", ".join(stage.steps)}<br/>{_shards(stage)}'
                     f'<br/>{ids_text}"]')
    for number, stage in enumerate(plan.stages, 1):
        for name in stage.inputs:
            lines.append(f"  {ids[name]} --> s{number}")
        for name in stage.outputs:
            lines.append(f"  s{number} --> {ids[name]}")
        lines.append(f"  s{number} -.-> {ids[stage.state_topic]}")
        lines.append(f"  s{number} -.-> {ids[pipeline.checkpoints_topic]}")
    return "\n".join(lines)
