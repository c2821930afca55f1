"""Rows/s of each materialization driver on a 100k-row view: `python -m bench.drivers`.

Drives the runtime directly (no Kafka, no Spark; writers on threads): one
transaction stores 100k new view rows (Load finds nothing, then Store +
StartCommit + Acknowledge), a second one updates all of them (every Load hits).
The webhook takes the same number of delta rows, POSTed to a local
`http.server`. PostgreSQL is measured when `REFOLD_POSTGRES_DSN` names a server.
"""

from __future__ import annotations

import argparse
import http.server
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from refold.config import parse_pipeline
from refold.connectors.runtime import Materializations, ThreadExecutor
from refold.model.changelog import Op
from refold.recovery.records import Checkpoint
from refold.reduce import ViewChange

KEY = ("player_name",)


def _receiver() -> tuple[http.server.ThreadingHTTPServer, str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/hook"


def _rows(count: int, version: int) -> list[dict[str, Any]]:
    return [
        {"player_name": f"p{i:07d}", "total": i * version, "best": i % 1000, "n": version, "latest": i % 97}
        for i in range(count)
    ]


def measure(settings: dict[str, Any], rows: int) -> tuple[float, float]:
    """(rows/s of the insert transaction, rows/s of the update transaction)."""
    columns = {"total": {"sum": "score"}, "best": {"max": "score"}, "n": {"count": "*"}, "latest": {"last": "score"}}
    pipeline = parse_pipeline(
        {"pipeline": "bench", "source": {"topic": "t"}, "view": {"key": list(KEY), "columns": columns},
         "outputs": {"materialize": [settings]}}
    )
    runtime = Materializations.from_pipeline(pipeline, ThreadExecutor(4))
    assert runtime is not None
    checkpoint = Checkpoint("bench", "0", 0, "t", {}, {}, 0, 0, 0, 0, {})
    runtime.open(checkpoint)
    runtime.settle()
    delta = settings.get("view") is None
    rates = []
    for version in (1, 2):
        data = _rows(rows, version)
        changes = [] if delta else [ViewChange(Op.APPEND, (r["player_name"],), r, KEY) for r in data]
        deltas = [{**r, "_count": 1} for r in data] if delta else []
        checkpoint = Checkpoint("bench", "0", version, "t", {0: version * rows}, {}, 0, 0, 0, 0, {})
        started = time.perf_counter()
        driver_checkpoints = runtime.commit(checkpoint, changes, deltas, dict)
        checkpoint = Checkpoint("bench", "0", version, "t", {0: version * rows}, {}, 0, 0, 0, 0, driver_checkpoints)
        runtime.acknowledge(version)
        runtime.settle()
        rates.append(rows / (time.perf_counter() - started))
    runtime.close()
    return rates[0], rates[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args()
    server, url = _receiver()
    results = []
    with tempfile.TemporaryDirectory(prefix="refold-bench-") as folder:
        lake = Path(folder) / "lake"
        lake.mkdir()
        cases: list[tuple[str, dict[str, Any]]] = [
            ("sqlite", {"driver": "sqlite", "path": str(Path(folder) / "bench.db"), "view": "scores"}),
            ("parquet", {"driver": "parquet", "path": str(lake), "view": "scores", "parallelism": 4}),
            ("webhook (deltas)", {"driver": "webhook", "url": url, "delta": "scores", "parallelism": 4}),
        ]
        dsn = os.environ.get("REFOLD_POSTGRES_DSN")
        if dsn:
            cases.append(("postgres", {"driver": "postgres", "dsn": dsn, "view": "bench_scores"}))
        for name, settings in cases:
            insert, update = measure(settings, args.rows)
            results.append((name, insert, update))
            print(f"  {name}: done", flush=True)
    server.shutdown()
    print(f"\n{'driver':<18} {'insert rows/s':>14} {'update rows/s':>14}   ({args.rows:,} rows, one transaction each)")
    for name, insert, update in results:
        print(f"{name:<18} {insert:>14,.0f} {update:>14,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
