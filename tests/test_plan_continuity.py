"""A pipeline that committed before the plan (`refold.plan`) existed restarts on the
plan and continues exactly: same topics, transactional ids and checkpoints.

The code from before the plan runs from the repository's history (`git archive` of
`BEFORE`, the last commit without it), in a process of its own: it makes the
pipeline's topics and commits one batch through every stage (`BatchProcessor`). Then
this code's engine (`run_pipeline`, Spark `local[2]`) starts on that committed state,
reads the rest of the source, and the outputs must equal the reference record by
record, with every event counted once (`assert_exact`)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from engine_runs import assert_exact

from refold.cli.produce import produce
from refold.config import parse_pipeline
from refold.dev.testing import Workload, generate
from refold.plan import stage_writers
from refold.recovery.restore import load_writers
from refold.spark.job import run_pipeline

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "c8e66c0440538886dc001bae6f2e592d3814fb7f"  # the last commit whose start-up had no plan

VIEWS = {
    "regrouping": {"key": ["team"], "columns": {"total": {"sum": "score"}, "n": {"count": "*"},
                                                 "best": {"max": "score"}}},
    "global_top_n": {"top_n": {"n": 3, "order_by": {"score": "desc"}}},
}

# Runs in the code from before the plan: one batch of what the source holds, every stage.
OLD_RUN = """
import json, sys
import refold
assert refold.__file__.startswith(sys.argv[2]), refold.__file__
from refold.config import parse_pipeline
from refold.kafka.io import ensure_topics, read_to_end
from refold.runtime.batch import InputRecord
from refold.runtime.processor import BatchProcessor
from refold.spark.job import engine_topics
data = json.loads(sys.argv[1])
data["spark"]["core"] = "python"  # the installed native core is the new code's
pipeline = parse_pipeline(data)
settings = pipeline.kafka_settings()
ensure_topics(settings, engine_topics(pipeline, 3))
records = [InputRecord(m.partition(), m.offset(), m.key(), m.value(), m.timestamp()[1])
           for m in read_to_end(settings, pipeline.source.topic)]
processor = BatchProcessor(pipeline, settings)
try:
    stats = processor.process(records)
finally:
    processor.close()
print(stats.records_in)
"""


@pytest.fixture(scope="module")
def code_before_the_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory to put on PYTHONPATH whose `refold` is the code of `BEFORE`."""
    root = tmp_path_factory.mktemp("before-the-plan")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE, "engine", "connectors", "schemas", "examples"],
                             capture_output=True, check=True, timeout=120).stdout
    tree = root / "tree"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    engine = tree / "engine"  # laid out as pyproject.toml's package-dir installs it
    (engine / "connectors").symlink_to(tree / "connectors")
    (engine / "schemas").symlink_to(tree / "schemas" / "avro")
    (engine / "examples").symlink_to(tree / "examples")
    path = root / "path"
    path.mkdir()
    (path / "refold").symlink_to(engine)
    return path


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_a_pipeline_committed_before_the_plan_continues_exactly_on_it(
    view: str, code_before_the_plan: Path, bootstrap_servers: str, topic: Any, tmp_path: Path, spark: Any
) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    rows = [orjson.dumps(r) for r in generate(Workload(events=1500, keys=60, seed=38))]
    name = f"pl{uuid.uuid4().hex[:8]}"
    outputs: dict[str, Any] = {"view": {"topic": f"{name}.view"}}
    if "key" in VIEWS[view]:
        outputs["delta"] = {"topic": f"{name}.delta"}
    data = {"pipeline": name, "kafka": settings, "shards": 2, "view": VIEWS[view], "outputs": outputs,
            "trigger": "200ms", "max_batch_events": 400, "spark": {"checkpoint_dir": str(tmp_path / "spark")},
            "source": {"topic": source, "format": "jsonl", "key": ["player_name"]}}
    produce(settings, source, rows[:900], ["player_name"], progress=False, per_transaction=300)

    env = {**os.environ, "PYTHONPATH": str(code_before_the_plan)}
    done = subprocess.run([sys.executable, "-c", OLD_RUN, json.dumps(data), str(code_before_the_plan)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) == 900  # the old code committed the first 900 events
    pipeline = parse_pipeline(data)
    before = load_writers(pipeline, settings, stage_writers(pipeline))
    stages = 3 if view == "global_top_n" else 2
    assert [sorted(before[writer]) for writer in stage_writers(pipeline)][:stages] == [[0, 1, 2], [0, 1], [0]][:stages]

    produce(settings, source, rows[900:], ["player_name"], progress=False, per_transaction=300)
    run_pipeline(pipeline, bootstrap_servers, until_idle=1.0, spark=spark, quiet=True)

    assert_exact(pipeline, bootstrap_servers, len(rows))  # no event lost or applied twice, in every output
    after = load_writers(pipeline, settings, stage_writers(pipeline))
    for writer in stage_writers(pipeline)[:stages]:  # the same shards went on from the old code's checkpoints
        assert sorted(after[writer]) == sorted(before[writer])
        assert any(after[writer][shard].batch > before[writer][shard].batch for shard in before[writer])
