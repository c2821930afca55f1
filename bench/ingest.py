"""`make bench-ingest`: `refold ingest --merge snapshot` against what a user writes instead.

The bench writes two Parquet snapshots of one table (deterministic from `--seed`):
the first of `--rows` rows (`id`, `name`, `city`, `score`, `balance`), the second
the same with `--changed` of the rows' `score` changed and `--removed` of the rows
gone. Then, each in its own process (so that its wall time, CPU seconds and peak
RSS are its own):

- ingest 1: `refold ingest TOPIC first.parquet --merge snapshot --primary-key id`
  into a fresh topic: every row `+A`;
- limit: the limit pipe (`bench.limit`: consume → produce, transactional, no
  reduction) copying the topic ingest 1 wrote, the same number of records;
- ingest 2: the second snapshot against it (the topic's changelog folded, the
  snapshot diffed, `-C`/`+C` per changed row and `-R` per removed one written);
- duckdb: the same diff as a user writes it in DuckDB: a full outer join of the two
  Parquet files on the key, the changed, added and removed rows written to Parquet.

Peak RSS is the process tree's, sampled from /proc every 0.1 s (`bench.procs.PeakRss`;
not the kernel's `ru_maxrss`, which after fork and exec also holds this process's
own peak); CPU seconds are user + system from the process's rusage. Machines here
are noisy, and CPU seconds less so than wall time: read the ratios.

    python -m bench.ingest [--rows 10000000] [--changed 0.01] [--removed 0.001] [--seed 1]
                           [--bootstrap H:P] [--work-dir DIR] [--json-dir docs/bench]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench.procs import PeakRss

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "bench"
CHUNK = 1_000_000  # rows generated (and written as one row group) at a time
CITIES = pa.array([f"city-{i:02d}" for i in range(50)])
RSS_TARGET = 1 << 30  # the ingest's peak RSS at 10M rows must stay under 1 GB
TITLES = {
    "ingest-1": "refold ingest: first snapshot (all +A)",
    "limit": "limit: consume → produce the same records",
    "ingest-2": "refold ingest: second snapshot (the diff)",
    "duckdb": "DuckDB: full outer join of the two files",
}


def write_snapshots(first: Path, second: Path, rows: int, changed: float, removed: float,
                    seed: int) -> dict[str, int]:
    """The two snapshots, chunk by chunk (bounded memory); returns how many rows the
    second one changed and removed."""
    schema = pa.schema([("id", pa.int64()), ("name", pa.string()), ("city", pa.string()),
                        ("score", pa.int64()), ("balance", pa.float64())])
    counts = {"changed": 0, "removed": 0}
    with pq.ParquetWriter(first, schema) as one, pq.ParquetWriter(second, schema) as two:
        for start in range(0, rows, CHUNK):
            n = min(CHUNK, rows - start)
            rng = np.random.default_rng([seed, start])
            ids = pa.array(np.arange(start, start + n, dtype=np.int64))
            names = pc.binary_join_element_wise("player-", pc.cast(ids, pa.string()), "")
            cities = CITIES.take(pa.array(rng.integers(0, len(CITIES), n)))
            scores = rng.integers(0, 1_000_000, n)
            balances = rng.integers(0, 100_000_000, n) / 100
            one.write_table(pa.table([ids, names, cities, pa.array(scores), pa.array(balances)], schema=schema))
            draw = rng.random(n)
            gone = draw < removed
            change = (draw >= removed) & (draw < removed + changed)
            counts["removed"] += int(gone.sum())
            counts["changed"] += int(change.sum())
            keep = pa.array(~gone)
            table = pa.table([ids, names, cities, pa.array(np.where(change, scores + 1, scores)),
                              pa.array(balances)], schema=schema)
            two.write_table(table.filter(keep))
    return counts


def measured(command: Sequence[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `command` to its end: wall seconds, CPU seconds (user + system), peak RSS of its
    tree (sampled), its standard output."""
    with tempfile.TemporaryFile() as out:
        started = time.monotonic()
        process = subprocess.Popen(command, stdout=out, cwd=ROOT, env=env)
        with PeakRss(process.pid, interval=0.1) as peak:
            _pid, status, usage = os.wait4(process.pid, 0)
        seconds = time.monotonic() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode()
    if process.returncode != 0:
        raise SystemExit(f"{command[:4]}: exit {process.returncode}\n{text}")
    return {"seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "peak_rss_bytes": peak.bytes, "output": text.strip()}


def run_ingest(bootstrap: str, topic: str, snapshot: Path, name: str, env: dict[str, str]) -> dict[str, Any]:
    refold = str(Path(sys.executable).with_name("refold"))
    result = measured([refold, "--bootstrap-servers", bootstrap, "ingest", topic, str(snapshot), "--merge", "snapshot",
                       "--primary-key", "id", "--name", name], env)
    # "ingest NAME: wrote 3 +A, 0 -R, 0 -C, 0 +C to TOPIC in …"
    counts = result["output"].split(": wrote ", 1)[1].split(" to ", 1)[0]
    result["changes"] = {code: int(n) for n, code in (part.split() for part in counts.split(", "))}
    result["records"] = sum(result["changes"].values())
    return result


DUCKDB_DIFF = """
COPY (
    SELECT CASE WHEN n.id IS NULL THEN 'removed' WHEN o.id IS NULL THEN 'added' ELSE 'changed' END AS change,
           o.id AS old_id, o.name AS old_name, o.city AS old_city, o.score AS old_score, o.balance AS old_balance,
           n.id AS new_id, n.name AS new_name, n.city AS new_city, n.score AS new_score, n.balance AS new_balance
    FROM read_parquet($old) AS o FULL OUTER JOIN read_parquet($new) AS n ON o.id = n.id
    WHERE o.id IS NULL OR n.id IS NULL
       OR o.name IS DISTINCT FROM n.name OR o.city IS DISTINCT FROM n.city
       OR o.score IS DISTINCT FROM n.score OR o.balance IS DISTINCT FROM n.balance
) TO '{out}' (FORMAT parquet)
"""


def duckdb_diff(old: Path, new: Path, out: Path) -> int:
    """The diff a DuckDB user writes (in this process: run it through `measured`); the
    number of changed, added and removed rows written."""
    import duckdb

    connection = duckdb.connect()
    connection.execute(DUCKDB_DIFF.format(out=str(out).replace("'", "''")), {"old": str(old), "new": str(new)})
    written = connection.execute("SELECT count(*) FROM read_parquet($out)", {"out": str(out)}).fetchone()
    connection.close()
    assert written is not None
    return int(written[0])


def run_limit(bootstrap: str, source: str, env: dict[str, str]) -> dict[str, Any]:
    from refold.kafka.io import TopicSpec, ensure_topics, partitions_of

    settings = {"bootstrap.servers": bootstrap}
    output = f"{source}.limit"
    ensure_topics(settings, [TopicSpec(output, len(partitions_of(settings, source)))])
    result = measured([sys.executable, "-m", "bench.limit", "--bootstrap", bootstrap, "--source", source,
                       "--output", output, "--per-transaction", "10000"], env)
    result["records"] = json.loads(result["output"].splitlines()[-1])["events"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--changed", type=float, default=0.01, help="share of rows whose score changes")
    parser.add_argument("--removed", type=float, default=0.001, help="share of rows the second snapshot drops")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--bootstrap", help="the broker (default: the local one, started when none runs)")
    parser.add_argument("--work-dir", type=Path, help="where the snapshots go (default: a temporary folder)")
    parser.add_argument("--json-dir", type=Path, default=RESULTS, help="where ingest.json goes (default docs/bench)")
    parser.add_argument("--duckdb-diff", nargs=3, type=Path, metavar=("OLD", "NEW", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.duckdb_diff:  # the DuckDB contender, in its own process
        print(json.dumps({"records": duckdb_diff(*args.duckdb_diff)}), flush=True)
        return 0

    from refold.dev.localkafka import ensure_broker

    bootstrap = ensure_broker(args.bootstrap, start_local=True)
    run_id = time.strftime("%Y%m%d%H%M%S")
    topic = f"bench-ingest-{run_id}"
    work = Path(tempfile.mkdtemp(prefix="refold-bench-ingest-", dir=args.work_dir))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(ROOT))))}
    results: dict[str, dict[str, Any]] = {}
    try:
        first, second = work / "first.parquet", work / "second.parquet"
        started = time.monotonic()
        counts = write_snapshots(first, second, args.rows, args.changed, args.removed, args.seed)
        print(f"wrote two snapshots of {args.rows:,} rows ({counts['changed']:,} changed, {counts['removed']:,} "
              f"removed; {first.stat().st_size / 2**20:,.0f} MiB each) in {time.monotonic() - started:.1f}s",
              file=sys.stderr)
        expected = {"ingest-1": args.rows, "limit": args.rows,
                    "ingest-2": 2 * counts["changed"] + counts["removed"],
                    "duckdb": counts["changed"] + counts["removed"]}
        steps = {
            "ingest-1": lambda: run_ingest(bootstrap, topic, first, f"bench-{run_id}-1", env),
            "limit": lambda: run_limit(bootstrap, topic, env),
            "ingest-2": lambda: run_ingest(bootstrap, topic, second, f"bench-{run_id}-2", env),
            "duckdb": lambda: {**(r := measured([sys.executable, "-m", "bench.ingest", "--duckdb-diff", str(first),
                                                 str(second), str(work / "changes.parquet")], env)),
                               "records": json.loads(r["output"])["records"]},
        }
        for name, step in steps.items():
            print(f"running {TITLES[name]}…", file=sys.stderr, flush=True)
            results[name] = step()
            results[name].pop("output", None)
            if results[name]["records"] != expected[name]:
                raise SystemExit(f"{name}: wrote {results[name]['records']:,} records, expected {expected[name]:,}")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ingest2 = results["ingest-2"]
    for name, other in (("ingest-1", "limit"), ("ingest-2", "duckdb")):
        results[name]["vs"] = (other, results[name]["seconds"] / results[other]["seconds"],
                               results[name]["cpu_seconds"] / results[other]["cpu_seconds"])
    print(f"\n{args.rows:,} rows; second snapshot: {counts['changed']:,} changed, {counts['removed']:,} removed")
    print(f"{'step':<44} {'records':>10} {'seconds':>8} {'CPU s':>7} {'CPU µs/row':>10} {'peak RSS':>10} "
          f"{'wall ratio':>17} {'CPU ratio':>9}")
    for name, r in results.items():
        wall, cpu = (f"{r['vs'][1]:.2f}x {r['vs'][0]}", f"{r['vs'][2]:.2f}x") if "vs" in r else ("-", "-")
        print(f"{TITLES[name]:<44} {r['records']:>10,} {r['seconds']:>8.1f} {r['cpu_seconds']:>7.1f} "
              f"{r['cpu_seconds'] / args.rows * 1e6:>10.1f} {r['peak_rss_bytes'] / 2**20:>6,.0f} MiB {wall:>17} {cpu:>9}")
    print("(CPU µs/row: CPU time per row of the snapshot; ratios: the ingest's wall or CPU time as a multiple of "
          "the contender's)")
    peak = max(results["ingest-1"]["peak_rss_bytes"], ingest2["peak_rss_bytes"])
    print(f"the ingest's peak RSS: {peak / 2**20:,.0f} MiB (target at 10M rows: under 1 GB: "
          f"{'ok' if peak < RSS_TARGET else 'MISSED'})")

    args.json_dir.mkdir(parents=True, exist_ok=True)
    report = {"run": run_id, "machine": platform.platform(), "cores": os.cpu_count(), "rows": args.rows,
              "changed": counts["changed"], "removed": counts["removed"], "seed": args.seed,
              "steps": {name: {k: v for k, v in r.items() if k != "vs"} | (
                  {"wall_ratio": {r["vs"][0]: r["vs"][1]}, "cpu_ratio": {r["vs"][0]: r["vs"][2]}} if "vs" in r else {})
                  for name, r in results.items()}}
    (args.json_dir / "ingest.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
