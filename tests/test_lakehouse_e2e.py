"""End to end: one engine run materializes a grouped view into Delta Lake and Iceberg
tables (view and delta tables of each) beside the Kafka view; Spark itself (delta-spark,
Iceberg's Spark runtime) and a second reader (delta-rs, pyiceberg) read every table back,
and each equals the folded view changelog key by key.

Spark reads in a subprocess (`lakehouse_spark_read.py`) with the `lakehouse-readers`
jars: the session the engine runs in (the conftest's) has none of them and stays as it is.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
from deltalake import DeltaTable

from refold.cli.produce import produce
from refold.config import parse_pipeline
from refold.connectors.delta import key_json, read_delta_deltas, read_delta_view
from refold.connectors.iceberg import read_iceberg_deltas, read_iceberg_view
from refold.dev.testing import Workload, generate
from refold.ops.verify import read_view_changes, same, verify
from refold.reference import fold_changelog, fold_deltas
from refold.spark.job import run_pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

READER = Path(__file__).resolve().parent / "lakehouse_spark_read.py"
COLUMNS = {"total": {"sum": "score"}, "n": {"count": "*"}, "best": {"max": "score"}, "latest": {"last": "score"}}
CATALOG, NAMESPACE = "lakehouse", "games"  # not the defaults: Spark's catalog is named like the setting

Key = tuple[Any, ...]


def assert_same_view(got: Mapping[Key, Mapping[str, Any]], want: Mapping[Key, Mapping[str, Any]], what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: keys differ: {sorted(got.keys() ^ want.keys())[:10]}"
    wrong = [key for key in want if not same(dict(got[key]), dict(want[key]))]
    assert not wrong, f"{what}: {len(wrong)} rows differ, e.g. {wrong[0]}: {got[wrong[0]]} != {want[wrong[0]]}"


def spark_read(lake: Path, warehouse: Path) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Every table's rows as Spark reads them, from a Spark session of its own."""
    request = {
        "delta": {"path": str(lake), "tables": ["scores", "scores_delta"]},
        "iceberg": {"warehouse": str(warehouse), "catalog": CATALOG, "namespace": NAMESPACE,
                    "tables": ["scores", "scores_delta"]},
    }
    done = subprocess.run([sys.executable, str(READER), json.dumps(request)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    tables: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for line in done.stdout.splitlines():
        if line.startswith('{"format": '):  # the JVM may log to stdout too
            record = json.loads(line)
            tables.setdefault((record["format"], record["table"]), []).append(record["row"])
    return tables


def test_spark_and_a_second_reader_see_the_view_in_delta_and_iceberg(
    bootstrap_servers: str, topic, tmp_path: Path, spark
) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    events = list(generate(Workload(events=3000, keys=300, retract_share=0.25, seed=19)))
    assert {e["op"] for e in events} == {"+A", "-R", "-C", "+C"}  # retractions and corrections
    produce(settings, source, [orjson.dumps(e) for e in events], ["player_name"], progress=False, per_transaction=500)
    lake, warehouse = tmp_path / "delta", tmp_path / "iceberg"
    lake.mkdir()
    warehouse.mkdir()
    name = f"l{uuid.uuid4().hex[:10]}"
    pipeline = parse_pipeline({
        "pipeline": name,
        "source": {"topic": source, "format": "jsonl"},
        "view": {"key": ["player_name"], "columns": COLUMNS},
        "outputs": {
            "view": {"topic": f"{name}.view"},
            "delta": {"topic": f"{name}.delta"},
            "materialize": [
                {"driver": "delta", "path": str(lake), "view": "scores", "delta": "scores_delta"},
                {"driver": "iceberg", "warehouse": str(warehouse), "catalog": CATALOG, "namespace": NAMESPACE,
                 "view": "scores", "delta": "scores_delta"},
            ],
        },
        "trigger": "200ms",
        "max_batch_events": 800,
        "spark": {"checkpoint_dir": str(tmp_path / "spark")},
    })
    progress = run_pipeline(pipeline, bootstrap_servers, until_idle=1.0, spark=spark, quiet=True)
    assert progress.batches >= 3
    report = verify(pipeline, settings)
    assert report.anomalies == [], "\n".join(report.anomalies)
    assert report.events == len(events)

    view = fold_changelog(read_view_changes(pipeline, settings))
    assert 100 < len(view) <= 300
    # verify read all four tables back: two view tables, two delta tables
    assert report.table_rows > 2 * len(view), report.table_rows
    spec = pipeline.view

    # the second reader: delta-rs and pyiceberg, the rows' `_doc`
    assert_same_view(read_delta_view(lake, "scores"), view, "delta-rs: scores")
    assert_same_view(fold_deltas(spec, read_delta_deltas(lake, "scores_delta")), view, "delta-rs: scores_delta")
    where = {"namespace": NAMESPACE, "catalog": CATALOG}
    assert_same_view(read_iceberg_view(warehouse, "scores", **where), view, "pyiceberg: scores")
    assert_same_view(fold_deltas(spec, read_iceberg_deltas(warehouse, "scores_delta", **where)), view,
                     "pyiceberg: scores_delta")

    # Spark: the typed columns of the view tables, and `_doc` of every table
    tables = spark_read(lake, warehouse)
    columns = [*spec.key, *COLUMNS]
    for fmt in ("delta", "iceberg"):
        rows = tables.get((fmt, "scores"), [])
        assert len(rows) == len(view), f"Spark {fmt}: {len(rows)} view rows, not {len(view)}"
        typed = {tuple(json.loads(r["_key"])): {c: r[c] for c in columns} for r in rows}
        assert_same_view(typed, view, f"Spark {fmt}: scores, typed columns")
        assert_same_view({tuple(json.loads(r["_key"])): json.loads(r["_doc"]) for r in rows}, view,
                         f"Spark {fmt}: scores, _doc")
        deltas = [json.loads(r["_doc"]) for r in tables.get((fmt, "scores_delta"), [])]
        assert deltas, f"Spark {fmt}: no delta rows"
        assert_same_view(fold_deltas(spec, deltas), view, f"Spark {fmt}: scores_delta")

    # verify sees a table that lost a row (as `make chaos` relies on)
    lost = sorted(view)[0]
    DeltaTable(str(lake / "scores")).delete(f"_key = '{key_json(lost)}'")
    broken = verify(pipeline, settings)
    assert any(a.startswith("delta table scores: key") and "missing" in a for a in broken.anomalies), broken.anomalies
