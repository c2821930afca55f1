"""A running pipeline's view changes by exactly the correction `refold correct` writes
(the real engine on Spark, the real broker)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from refold.config import parse_pipeline
from refold.ingest import correct, ingest, retract
from refold.model.changelog import Op
from refold.ops.verify import read_view_changes
from refold.reference import fold_changelog
from refold.spark.job import run_pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


def test_a_view_changes_by_exactly_the_correction(bootstrap_servers: str, topic, tmp_path: Path, spark: Any) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=2)
    rows = [{"id": i, "team": "red" if i % 2 else "blue", "score": 10 * i} for i in range(1, 9)]
    path = tmp_path / "scores.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    ingest(settings, source, [str(path)], merge_strategy="snapshot", primary_key=["id"], now=1_000)
    name = f"p{uuid.uuid4().hex[:10]}"
    pipeline = parse_pipeline({
        "pipeline": name,
        "source": {"topic": source, "format": "jsonl", "key": ["id"]},
        "view": {"key": ["team"], "columns": {"total": {"sum": "score"}, "players": {"count": "*"},
                                              "best": {"max": "score"}}},
        "outputs": {"view": {"topic": f"{name}.view", "form": "changelog"}},
        "trigger": "200ms",
        "spark": {"checkpoint_dir": str(tmp_path / name)},
    })

    def view_changes() -> list[Any]:
        run_pipeline(pipeline, bootstrap_servers, until_idle=1.0, spark=spark, quiet=True)
        return list(read_view_changes(pipeline, settings))

    before = view_changes()
    assert fold_changelog(before) == {
        ("blue",): {"team": "blue", "total": 200, "players": 4, "best": 80},
        ("red",): {"team": "red", "total": 160, "players": 4, "best": 70},
    }
    # id 8 (blue, the best) from 80 to 5: blue's total and best change, nothing else
    change = correct(settings, source, ["id"], {"id": 8}, {"score": 5}, event_time=2_000)
    assert change is not None and change.old == {"id": 8, "team": "blue", "score": 80}
    after = view_changes()
    assert after[: len(before)] == before
    assert [(c.op, c.row) for c in after[len(before):]] == [
        (Op.CORRECT_FROM, {"team": "blue", "total": 200, "players": 4, "best": 80}),
        (Op.CORRECT_TO, {"team": "blue", "total": 125, "players": 4, "best": 60}),
    ]
    retract(settings, source, ["id"], {"id": 1}, event_time=3_000)
    last = view_changes()
    assert [(c.op, c.row) for c in last[len(after):]] == [
        (Op.CORRECT_FROM, {"team": "red", "total": 160, "players": 4, "best": 70}),
        (Op.CORRECT_TO, {"team": "red", "total": 150, "players": 3, "best": 70}),
    ]
