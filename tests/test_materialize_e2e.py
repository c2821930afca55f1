"""End to end: the real engine materializes into SQLite, PostgreSQL and Parquet, is
killed with kill -9 between StartCommit and the Kafka commit, restarts: every store
equals the reference view, and every delta row is there exactly once.

Marked slow (`make test-slow`, which CI runs after `make test`): it puts together
proofs that faster tests make in `make test`. Each driver crashed after StartCommit,
before Kafka committed, then opened again from Kafka's checkpoint and replayed, is
`test_conformance.test_restart_after_a_crash` (every driver, through the runtime the
batch processor runs); kill -9 of the engine inside the Kafka transaction is
`test_crash.test_kill_9_at_each_point_then_restart`; the engine writing a SQLite store
end to end is the demo's and the tutorial's run (`test_terminal`, `test_tutorial`)."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import orjson
import pytest
import yaml
from test_crash import COLUMNS, finish, start_engine

from refold.cli.produce import produce
from refold.config import load_pipeline
from refold.connectors.parquet import read_parquet_deltas, read_parquet_view
from refold.connectors.postgres import read_deltas as read_postgres_deltas
from refold.connectors.postgres import read_view as read_postgres_view
from refold.connectors.sqlite import read_sqlite_deltas, read_sqlite_view
from refold.dev.testing import Workload, generate
from refold.ops.verify import read_source, verify
from refold.recovery.restore import load_checkpoint
from refold.reference import fold_deltas, merge_partitions, reference_changelog

pytestmark = [pytest.mark.kafka, pytest.mark.spark, pytest.mark.postgres, pytest.mark.slow]


def test_kill_9_between_start_commit_and_kafka_commit(
    bootstrap_servers: str, topic, tmp_path: Path, postgres_dsn: str
) -> None:
    source = topic(partitions=3)
    rows = list(generate(Workload(events=1500, keys=100, seed=41)))
    produce({"bootstrap.servers": bootstrap_servers}, source, [orjson.dumps(r) for r in rows], ["player_name"],
            progress=False, per_transaction=300)
    name = f"m{uuid.uuid4().hex[:10]}"
    lake = tmp_path / "lake"
    lake.mkdir()
    database = tmp_path / "views.db"
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "pipeline": name,
        "kafka": {"bootstrap.servers": bootstrap_servers},
        "source": {"topic": source},
        "view": {"key": ["player_name"], "columns": COLUMNS},
        "outputs": {
            "view": {"topic": f"{name}.view"},
            "materialize": [
                {"driver": "sqlite", "path": str(database), "view": "scores", "delta": "scores_delta"},
                {"driver": "parquet", "path": str(lake), "view": "scores", "delta": "scores_delta"},
                {"driver": "postgres", "dsn": postgres_dsn, "view": "scores", "delta": "scores_delta"},
            ],
        },
        "trigger": "200ms",
        "max_batch_events": 250,
        "spark": {"master": "local[1]", "checkpoint_dir": str(tmp_path / "spark"),
                  "conf": {"spark.ui.enabled": "false"}},
    }))
    # in_txn:3 — every driver got StartCommit for batch 3 (SQLite and PostgreSQL committed
    # it; Parquet staged and referenced it), the Kafka transaction did not commit.
    code, err = finish(start_engine(path, crash="in_txn:3"))
    assert code == -9, err[-3000:]
    pipeline = load_pipeline(path)
    settings = {"bootstrap.servers": bootstrap_servers}
    held = sqlite3.connect(database).execute("SELECT checkpoint FROM _refold_checkpoints").fetchall()
    # the crashed shard's store is ahead of Kafka (batch 2 there); with local[1] the
    # shards' tasks run one at a time, so it is the only one that reached batch 3
    assert sum(b'"batch":3' in row[0] for row in held) == 1, held
    code, err = finish(start_engine(path))
    assert code == 0, err[-3000:]
    report = verify(pipeline, settings)
    assert report.anomalies == [], "\n".join(report.anomalies)
    checkpoint = load_checkpoint(pipeline, settings)
    assert checkpoint is not None and set(checkpoint.driver_checkpoints) == {"sqlite", "parquet", "postgres"}

    partitions, bad = read_source(pipeline, settings)
    assert bad == 0
    expected = reference_changelog(pipeline.view, merge_partitions(partitions)).view
    assert read_sqlite_view(database, "scores") == expected
    assert read_parquet_view(lake, "scores") == expected
    assert read_postgres_view(postgres_dsn, "scores") == expected
    sqlite_deltas = read_sqlite_deltas(database, "scores_delta")
    assert fold_deltas(pipeline.view, sqlite_deltas) == expected  # nothing twice, nothing missing
    assert fold_deltas(pipeline.view, read_parquet_deltas(lake, "scores_delta")) == expected
    assert fold_deltas(pipeline.view, read_postgres_deltas(postgres_dsn, "scores_delta")) == expected
    assert not list((lake / "_staging").rglob("*.parquet"))  # staged work applied or removed
