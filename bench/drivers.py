"""Rows/s of each materialization driver: `python -m bench.drivers [--rows 10000,100000]`.

Drives the runtime directly (no Kafka, no Spark; writers on threads): per view size,
one transaction stores that many new view rows (Load finds nothing, then Store +
StartCommit + Acknowledge), a second one updates all of them (every Load hits). The
webhook takes the same number of delta rows, POSTed to a local `http.server`. Every
driver runs in the same process, one after the other, at each size: SQLite,
Parquet, the webhook, PostgreSQL (`REFOLD_POSTGRES_DSN`, else a local server from
Debian's binaries started for the run with `durable=False`, as the tests run it),
Delta Lake and Iceberg (local folders; Iceberg's SQL catalog in SQLite).
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import os
import tempfile
import threading
import time
from collections.abc import Iterator
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
    parser.add_argument("--rows", default="10000,100000", help="view sizes, comma-separated")
    args = parser.parse_args()
    sizes = [int(size) for size in args.rows.split(",") if size.strip()]
    server, url = _receiver()
    results = []
    with tempfile.TemporaryDirectory(prefix="refold-bench-") as folder, _postgres(Path(folder)) as dsn:
        for size in sizes:
            run = Path(folder) / f"run-{size}"
            for name in ("lake", "delta", "iceberg"):
                (run / name).mkdir(parents=True)
            cases: list[tuple[str, dict[str, Any]]] = [
                ("sqlite", {"driver": "sqlite", "path": str(run / "bench.db"), "view": "scores"}),
                ("parquet", {"driver": "parquet", "path": str(run / "lake"), "view": "scores", "parallelism": 4}),
                ("webhook (deltas)", {"driver": "webhook", "url": url, "delta": "scores", "parallelism": 4}),
                ("postgres", {"driver": "postgres", "dsn": dsn, "view": f"bench_scores_{size}"}),
                ("delta", {"driver": "delta", "path": str(run / "delta"), "view": "scores"}),
                ("iceberg", {"driver": "iceberg", "warehouse": str(run / "iceberg"), "view": "scores"}),
            ]
            for name, settings in cases:
                insert, update = measure(settings, size)
                results.append((name, size, insert, update))
                print(f"  {name}, {size:,} rows: done", flush=True)
    server.shutdown()
    print(f"\n{'driver':<18} {'rows':>8} {'insert rows/s':>14} {'update rows/s':>14}   (one transaction each)")
    for name, size, insert, update in results:
        print(f"{name:<18} {size:>8,} {insert:>14,.0f} {update:>14,.0f}")
    return 0


@contextlib.contextmanager
def _postgres(folder: Path) -> Iterator[str]:
    """`REFOLD_POSTGRES_DSN`, else a local server in `folder` for the run."""
    dsn = os.environ.get("REFOLD_POSTGRES_DSN")
    if dsn:
        yield dsn
        return
    from refold.dev import localpg

    folder.chmod(0o755)  # PostgreSQL runs as its own user: it must enter the folder
    home = folder / "pg"
    home.mkdir()
    home.chmod(0o755)
    info = localpg.start(home=home, quiet=True, durable=False, die_with_parent=True)
    try:
        yield info.dsn()
    finally:
        localpg.stop(home=home)


if __name__ == "__main__":
    raise SystemExit(main())
