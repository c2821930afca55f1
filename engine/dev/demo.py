"""`make demo`: the RFC-015 match scores through a top-2 leaderboard (RFC-015's own SQL) and
per-player totals; then hourly scores per team, a windowed view whose input has a late
correction and an event too late for its hour.

Starts the local broker (unless REFOLD_BOOTSTRAP_SERVERS names another), produces
the six match results and the hourly scores, runs the example pipelines until idle in
one Spark session, and prints each view changelog, the final views, the tables they are
materialized into (the leaderboard: SQLite and Delta Lake, under `<home>/demo/`) and the
windowed view's dead letters.
"""

from __future__ import annotations

import importlib.resources
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from refold.cli.produce import produce
from refold.config import Pipeline, parse_pipeline
from refold.connectors.settings import DeltaSettings, SQLiteSettings
from refold.environment import home as project_home
from refold.kafka.io import read_to_end
from refold.ops.verify import read_view_changes
from refold.reference import fold_changelog
from refold.spark import logs
from refold.spark.job import run_pipeline, spark_session

EXAMPLES = Path(str(importlib.resources.files("refold.examples")))  # examples/ in a checkout


def _pipeline(name: str, run_id: str, source: str, bootstrap: str, folder: Path) -> Pipeline:
    data: dict[str, Any] = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    data["pipeline"] = f"{data['pipeline']}-{run_id}"
    data["kafka"] = {"bootstrap.servers": bootstrap}
    if "sql" in data["view"]:  # the query names the example's topic; this run reads its own
        named = f"from {data['source']['topic']}\n"
        if named not in data["view"]["sql"]:
            raise AssertionError(f"examples/{name}.yaml: its query does not read {data['source']['topic']}")
        data["view"]["sql"] = data["view"]["sql"].replace(named, f"from `{source}`\n")
    data["source"]["topic"] = source
    for output in ("view", "delta"):
        if output in data["outputs"]:
            data["outputs"][output]["topic"] = data["outputs"][output]["topic"].replace(
                name, f"{name}-{run_id}", 1
            )
    for entry in data["outputs"].get("materialize", []):
        if entry.get("driver") == "sqlite":  # one database per run, under the Refold home
            entry["path"] = str(folder / f"{name}-{run_id}.db")
        elif entry.get("driver") == "delta":  # one folder of Delta tables per run, beside it
            lake = folder / f"{name}-{run_id}-delta"
            lake.mkdir(parents=True, exist_ok=True)  # the driver wants the folder to exist
            entry["path"] = str(lake)
    return parse_pipeline(data, where=f"examples/{name}.yaml")


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "  (empty)"
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(_cell(r.get(c))) for r in rows)) for c in columns}
    lines = ["  " + "  ".join(c.ljust(widths[c]) for c in columns)]
    lines.append("  " + "  ".join("-" * widths[c] for c in columns))
    lines += ["  " + "  ".join(_cell(r.get(c)).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)


def _sqlite_rows(path: str, table: str, columns: list[str]) -> list[dict[str, Any]]:
    """The view's own `columns` of the table's rows as stored, by key (the driver's
    bookkeeping columns, `_doc` and `_writer`, left out: `refold.connectors`)."""
    db = sqlite3.connect(path)
    try:
        listed = ", ".join('"' + c.replace('"', '""') + '"' for c in columns)
        cursor = db.execute(f'SELECT {listed} FROM "{table}" ORDER BY 1')
        return [dict(zip(columns, row, strict=True)) for row in cursor]
    finally:
        db.close()


def _delta_rows(path: str, table: str) -> list[dict[str, Any]]:
    """A Delta view table's rows (each row's `_doc`, as `read_delta_view` returns them), by key."""
    from refold.connectors.delta import read_delta_view

    view = read_delta_view(path, table)
    return [view[key] for key in sorted(view, key=repr)]


def _dead_letters(pipeline: Pipeline, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The pipeline's dead letters: reason, source offset, and a late event's window and
    watermark (their headers)."""
    shown = ("refold.reason", "refold.offset", "refold.window_start", "refold.window_end", "refold.watermark")
    rows = []
    for msg in read_to_end(settings, pipeline.dlq_topic):
        headers = {name: value.decode() for name, value in msg.headers() or []}
        rows.append({name.removeprefix("refold."): headers.get(name) for name in shown})
    return rows


def _cell(value: Any) -> str:
    return "null" if value is None else str(value)


def main() -> int:
    from refold.dev.localkafka import ensure_broker

    bootstrap = ensure_broker(None, start_local=True)
    settings = {"bootstrap.servers": bootstrap}
    run_id = time.strftime("%Y%m%d-%H%M%S")
    source = f"match_scores-{run_id}"
    lines = (EXAMPLES / "match_scores.jsonl").read_bytes().splitlines()
    result = produce(settings, source, lines, ["player_name"], partitions=1, progress=False)
    print(f"\n== produced {result.events} match results to {source}\n")

    folder = project_home() / "demo"
    folder.mkdir(parents=True, exist_ok=True)
    pipelines = [_pipeline(name, run_id, source, bootstrap, folder) for name in ("leaderboard", "totals")]
    hourly_source = f"hourly_scores-{run_id}"
    lines = (EXAMPLES / "hourly_scores.jsonl").read_bytes().splitlines()
    result = produce(settings, hourly_source, lines, ["team"], partitions=1, progress=False)
    print(f"== produced {result.events} hourly scores to {hourly_source} (a late correction, a late event)\n")
    pipelines.append(_pipeline("hourly", run_id, hourly_source, bootstrap, folder))
    spark = spark_session(name="refold-demo")
    if logs.current_log() is not None:
        print(f"== Spark's own log: {logs.current_log()}")
    try:
        for pipeline in pipelines:
            print(f"== running {pipeline.pipeline} until idle …", flush=True)
            run_pipeline(pipeline, bootstrap, until_idle=3.0, spark=spark, log_format="text")
    finally:
        spark.stop()

    columns: dict[str, list[str]] = {}  # each view's own columns, in its rows' order
    for pipeline in pipelines:
        if pipeline.view.sql is not None:
            print(f"\n== {pipeline.pipeline}: the view is this SQL (RFC-015's leaderboard query; "
                  "`refold explain examples/leaderboard.yaml` prints the view spec it becomes)")
            print("\n".join("  " + line for line in pipeline.view.sql.rstrip().splitlines()))
        changes = read_view_changes(pipeline, settings)
        assert pipeline.outputs.view is not None
        print(f"\n== {pipeline.outputs.view.topic}: the view changelog")
        print(_table([{"op": c.op.code, **c.row} for c in changes]))
        print(f"\n== {pipeline.pipeline}: the final view")
        view = fold_changelog(changes)
        rows = [view[key] for key in sorted(view, key=repr)]
        columns[pipeline.pipeline] = list(rows[0]) if rows else []
        print(_table(rows))
    for pipeline in pipelines:
        for entry in pipeline.outputs.materialize:
            if isinstance(entry, SQLiteSettings):
                table = entry.view or "view"
                print(f"\n== {pipeline.pipeline}: materialized into SQLite {entry.path}, table {table}")
                print(_table(_sqlite_rows(str(entry.path), table, columns[pipeline.pipeline])))
        for entry in pipeline.outputs.materialize:  # after SQLite's
            if isinstance(entry, DeltaSettings) and entry.view:
                print(f"\n== {pipeline.pipeline}: materialized into Delta Lake, table {entry.path}/{entry.view}")
                print(_table(_delta_rows(entry.path, entry.view)))
    for pipeline in pipelines:
        if pipeline.view.window is not None:
            print(f"\n== {pipeline.dlq_topic}: the dead letters (why each event was refused)")
            print(_table(_dead_letters(pipeline, settings)))
    print(
        "\nThe broker keeps running: `.venv/bin/refold consume <topic> --from-beginning --until-idle 2`"
        " to look around, `make kafka-stop` to stop it."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
