"""A pipeline on a real Spark standalone cluster (master + 2 workers on 127.0.0.1,
started by the same code as `refold spark start`), run through `refold run` with
`spark: {master: spark://…}`, equals the reference."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import yaml

from refold.cli.produce import produce
from refold.config import load_pipeline
from refold.dev import localspark
from refold.dev.sparkstate import master_state
from refold.dev.testing import Workload, generate
from refold.ops.verify import verify

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[localspark.ClusterInfo]:
    home = tmp_path_factory.mktemp("spark-home")
    info = localspark.start(2, 1, "1g", home=home, quiet=True, die_with_parent=True)
    try:
        yield info
    finally:
        localspark.stop(home)


def test_a_pipeline_runs_on_the_standalone_cluster(
    cluster: localspark.ClusterInfo, bootstrap_servers: str, topic, tmp_path: Path
) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=4)
    rows = list(generate(Workload(events=3000, keys=200, seed=23)))
    produce(settings, source, [orjson.dumps(r) for r in rows], ["player_name"], progress=False, per_transaction=500)
    name = f"cluster{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "pipeline": name,
        "kafka": {"bootstrap.servers": bootstrap_servers},
        "source": {"topic": source, "format": "jsonl"},
        "view": {"key": ["player_name"], "columns": {"total": {"sum": "score"}, "best": {"max": "score"},
                                                     "latest": {"last": "score"}}},
        "outputs": {"view": {"topic": f"{name}.view"}, "delta": {"topic": f"{name}.delta"}},
        "trigger": "200ms",
        "max_batch_events": 1000,
        "spark": {
            "master": cluster.url,
            "checkpoint_dir": str(tmp_path / "spark"),
            "conf": {"spark.executor.cores": "1", "spark.executor.memory": "512m", "spark.cores.max": "2"},
        },
    }))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFOLD_TEST_")}
    done = subprocess.run(
        [sys.executable, "-m", "refold.cli", "run", str(path), "--until-idle", "4"],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    report = verify(load_pipeline(path), settings)
    assert report.anomalies == [] and report.events == len(rows)
    # the query ran as an application of the cluster, with executors on its workers
    apps = master_state(cluster.ui_port) or {}
    ran = [a for a in apps.get("completedapps", []) + apps.get("activeapps", []) if a.get("name") == f"refold-{name}"]
    assert ran, apps
