"""`refold explain` draws the plan (`refold.plan`): a text tree, and Mermaid for the docs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from refold.cli.main import main
from refold.config import load_pipeline, parse_pipeline
from refold.ops.explain import explain
from refold.plan import plan_of

ROOT = Path(__file__).resolve().parent.parent

# The pipelines docs/ARCHITECTURE.md draws (besides examples/totals.yaml)
REGROUPING = {"pipeline": "teams", "shards": 4, "source": {"topic": "scores", "format": "jsonl", "key": ["player"]},
              "view": {"key": ["team"], "columns": {"total": {"sum": "score"}}},
              "outputs": {"view": {"topic": "teams.view"}, "delta": {"topic": "teams.delta"}}}
GLOBAL_TOP_N = {"pipeline": "board", "shards": 3, "source": {"topic": "scores", "format": "jsonl", "key": ["player"]},
                "view": {"top_n": {"n": 3, "order_by": {"score": "desc"}, "columns": ["player", "score"]}},
                "outputs": {"view": {"topic": "board.view"}}}

REGIONS = {"pipeline": "regions", "shards": 3,
           "sources": {"orders": {"topic": "orders", "format": "jsonl"}, "customers": {"topic": "customers", "format": "jsonl"}},
           "view": {"sql": "SELECT c.region, SUM(o.amount) AS revenue FROM orders o JOIN customers c ON o.cust = c.id "
                           "GROUP BY c.region"},
           "outputs": {"view": {"topic": "regions.view"}}}


def _drawn() -> dict[str, Any]:
    return {"totals": load_pipeline(ROOT / "examples" / "totals.yaml"), "teams": parse_pipeline(REGROUPING),
            "board": parse_pipeline(GLOBAL_TOP_N), "regions": parse_pipeline(REGIONS)}


def test_the_tree_names_each_stage_its_shards_ids_and_topics() -> None:
    text = explain(parse_pipeline(GLOBAL_TOP_N))
    tree = text[text.index("# plan board"):]
    assert "# plan board (writer 0; exchanged)" in tree
    for line in ("1. route: decode → validate → route (a shard per source partition, shard p reads partition p)",
                 "2. reduce: reduce (3 shards, shard p reads partition p of its input)",
                 "3. rank: rank (1 shard, merging every input partition)",
                 "writer 0.view: transactional ids board-0.view-<shard>, checkpoints 0.view/<shard> in board.checkpoints",
                 "writer 0.top: transactional ids board-0.top-<shard>, checkpoints 0.top/<shard> in board.checkpoints",
                 "the driver closes each batch in board.repartition, then, once every stage-2 shard committed, in "
                 "board.tops (transactional id board-0-close)",
                 "board.repartition  routed units, a partition per stage-2 shard: 3 partitions",
                 "board.tops.state   stage 3's state: 1 partition, compacted"):
        assert line in tree, line
    one = explain(load_pipeline(ROOT / "examples" / "totals.yaml"))
    assert "1. view: decode → validate → reduce (a shard per source partition, shard p reads partition p)" in one
    assert "writes totals.view, totals.delta, totals.dlq; state in totals.state" in one
    assert "route" not in one[one.index("# plan"):] and "close" not in one[one.index("# plan"):]


def test_the_plan_has_one_stage_per_step_and_its_topics_once() -> None:
    for pipeline in _drawn().values():
        plan = plan_of(pipeline, 6)
        names = [topic.name for topic in plan.topics]
        assert len(names) == len(set(names))
        for stage in plan.stages:  # every topic a stage reads or writes is one of the plan's
            assert set(stage.inputs) | set(stage.outputs) | {stage.state_topic} <= set(names)
    teams = plan_of(parse_pipeline(REGROUPING), 6)
    assert [s.name for s in teams.stages] == ["route", "reduce"] and teams.stage2_shards == 4
    assert teams.first.transactional_ids == tuple(f"teams-0-{p}" for p in range(6))
    assert teams.view_writers == 4 and not teams.ranked_globally and teams.co_partitioned


@pytest.mark.parametrize("name", ["totals", "teams", "board", "regions"])
def test_the_architecture_page_draws_the_plan_explain_draws(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    drawing = explain(_drawn()[name], drawing="mermaid")
    assert drawing.startswith("flowchart LR\n")
    assert f"```mermaid\n{drawing}\n```" in (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    if name == "totals":
        assert main(["explain", "--mermaid", str(ROOT / "examples" / "totals.yaml")]) == 0
        assert capsys.readouterr().out == drawing + "\n"


def test_explain_names_the_cores_of_a_join_and_of_the_view_over_it() -> None:
    """The join and the grouped view over it reduce on the native cores unless
    `spark.core: python` (the native core is built by `make setup`), or, for the view, its
    outputs are not ones the core writes."""
    assert "# reduces in: the native join core, the native core for the grouped view over it" in explain(
        parse_pipeline(REGIONS))
    assert "# reduces in: Python (spark.core: python)" in explain(parse_pipeline({**REGIONS, "spark": {"core": "python"}}))
    avro = {**REGIONS, "outputs": {"view": {"topic": "regions.view", "format": "avro", "schema": "schemas/x.avsc"}}}
    assert "# reduces in: the native join core, Python for the grouped view over it (the native core writes the view " \
           "output as JSON" in explain(parse_pipeline(avro))
