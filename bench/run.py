"""`make bench`: Refold against the limit pipe, Spark and Apache Flink, in one run.

One seeded changelog is produced to one topic on the local broker; then each chosen
contender reads that identical topic and ends when its output is committed:

- limit:  consume → produce with a transactional producer, no reduction (`bench.limit`);
- spark-sql: what a Spark user writes instead of Refold: a native Structured Streaming
          aggregation (signed sum and count per key from `op`, update mode) with Spark's own
          Kafka sink, at least once; no exact max/last, no per-event changelog
          (`bench.spark_sql`);
- spark-sink: Refold's own reducer on the driver in a `foreachBatch`, writing with Spark's
          built-in Kafka sink, at least once (`bench.baseline`): the price of exactly once;
- refold: `refold run`, exactly once, view + delta outputs, each shard reduced in a Spark
          task on an executor's Python worker;
- refold-off: the same `refold run` with `outputs.provenance: off` (no cause headers, no
          trace index): what provenance costs, measured in the same run;
- flink:  PyFlink SQL, the same per-key reduction, `upsert-kafka` exactly once (`bench.flink`).

Spark and Refold run in this process, in one Spark session (`local[2]`); the limit and
Flink run as their own processes. Peak RSS is of each contender's process tree (for
Spark and Refold: this process, its JVM and the JVM's Python workers). Machines here
are noisy: read the ratios, not the seconds.

    python -m bench.run [--events 1000000] [--keys 100000] [--retract 0.2]
                        [--contenders limit,spark-sql,spark-sink,refold,refold-off,flink]
                        [--pairs 1] [--json-dir docs/bench]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.baseline import run_baseline
from bench.procs import PeakRss
from bench.spark_sql import expected_sums
from refold.cli.produce import produce
from refold.config import Pipeline, ViewSpec, parse_pipeline
from refold.dev.testing import Workload, generate
from refold.kafka.io import TopicSpec, ensure_topics
from refold.model import jsonbytes
from refold.model.changelog import Op
from refold.reduce import SourceEvent
from refold.reference import merge_partitions, reference_changelog
from refold.spark.job import run_pipeline, spark_session

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "bench"
CONTENDERS = ("limit", "spark-sql", "spark-sink", "refold", "refold-off", "flink")
TITLES = {
    "limit": "limit: consume → produce, transactional",
    "spark-sql": "Spark SQL aggregation, Spark's sink (at least once)",
    "spark-sink": "Refold's reducer, Spark's sink (at least once)",
    "refold": "Refold (exactly once)",
    "refold-off": "Refold (exactly once), provenance off",
    "flink": "Apache Flink SQL, upsert-kafka exactly once",
}


# Refold's throughput as a multiple of each contender's: (target, the ratio it asks for).
# The floor is what Refold must not fall below; the goal is where it aims.
TARGETS = {
    "limit": [("floor", 0.104), ("goal", 0.5)],
    "spark-sql": [("goal", 1.0)],
    "refold-off": [("floor", 0.95)],  # cause headers and the trace index cost at most 5 %
    "flink": [("floor", 0.82), ("goal", 1.5)],
}

STATE_ROOT = Path("/tmp/refold-bench/state")  # the bench pipelines' local state stores (spark.state_dir)


def pipeline(name: str, source: str, bootstrap: str, batch: int, state_dir: Path | str | None = None,
             spark: dict[str, Any] | None = None, key: str = "player_name", shards: int | str | None = None,
             provenance: bool = True) -> Pipeline:
    """The bench's grouped view over `source`; its Spark checkpoint in /tmp/refold-bench/<name>
    and its shards' local stores under `state_dir` (default `STATE_ROOT`); `spark`: more
    settings of its `spark:` block (`state_cache_keys`, `master`, `conf`). `key`: the view
    key; another column than `player_name` (the messages' key) re-groups, in `shards`."""
    return parse_pipeline(
        {
            "pipeline": name,
            "kafka": {"bootstrap.servers": bootstrap},
            "source": {"topic": source, **({"key": ["player_name"]} if key != "player_name" else {})},
            **({"shards": shards} if shards is not None else {}),
            "view": {
                "key": [key],
                "columns": {
                    "total": {"sum": "score"},
                    "games": {"count": "*"},
                    "best": {"max": "score"},
                    "latest": {"last": "score"},
                },
            },
            "outputs": {"view": {"topic": f"{name}.view"}, "delta": {"topic": f"{name}.delta"},
                        "provenance": provenance},
            "trigger": "100ms",
            "max_batch_events": batch,
            "spark": {"checkpoint_dir": f"/tmp/refold-bench/{name}", "state_dir": str(state_dir or STATE_ROOT),
                      **(spark or {})},
        }
    )


def forget_state(p: Pipeline) -> None:
    """Delete a finished bench pipeline's local stores and Spark checkpoint (they only fill /tmp)."""
    if p.spark.state_dir:
        shutil.rmtree(Path(p.spark.state_dir) / p.pipeline, ignore_errors=True)
    if p.spark.checkpoint_dir:
        shutil.rmtree(p.spark.checkpoint_dir, ignore_errors=True)


def timed_run(p: Pipeline, bootstrap: str, spark: Any, events: int, baseline: bool = False) -> dict[str, Any]:
    """Refold (`run_pipeline`), or with `baseline` the at-least-once baseline
    (`bench.baseline.run_baseline`), over `p` until idle: its throughput from its
    start to its last committed (baseline: written) batch, and the peak RSS of this
    process's tree (this process, its JVM, the JVM's Python workers)."""
    with PeakRss() as peak:
        if baseline:
            progress = run_baseline(p, bootstrap, spark, until_idle=5.0)
        else:
            progress = run_pipeline(p, bootstrap, until_idle=5.0, spark=spark, quiet=True)
    assert progress.last_commit is not None, "no batch committed"
    seconds = progress.last_commit - progress.started
    if progress.events != events:
        raise SystemExit(f"{p.pipeline}: reduced {progress.events} events, expected {events}")
    return {"seconds": seconds, "events_per_s": events / seconds, "batches": progress.batches,
            "peak_rss_bytes": peak.bytes}


def run_limit(bootstrap: str, source: str, output: str, partitions: int, events: int, batch: int) -> dict[str, Any]:
    """The limit pipe in its own process (bench.limit), with its peak RSS."""
    ensure_topics({"bootstrap.servers": bootstrap}, [TopicSpec(output, partitions)])
    command = [sys.executable, "-m", "bench.limit", "--bootstrap", bootstrap, "--source", source,
               "--output", output, "--per-transaction", str(batch)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    with PeakRss(process.pid) as peak:
        out, _ = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"limit: exit {process.returncode}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    if result["events"] != events:
        raise SystemExit(f"limit: copied {result['events']} events, expected {events}")
    result["peak_rss_bytes"] = peak.bytes
    return result


def expected_view(records: list[dict[str, Any]], spec: ViewSpec) -> dict[str, dict[str, Any]]:
    """The final view by `refold.reference`, key by key (the reduction is per key, and
    per key the reference's cost stays small)."""
    by_key: dict[str, list[SourceEvent]] = defaultdict(list)
    for index, record in enumerate(records):
        row = {k: v for k, v in record.items() if k not in ("op", "event_time")}
        by_key[row["player_name"]].append(SourceEvent(Op.parse(record["op"]), row, (record["event_time"], 0, index)))
    view: dict[str, dict[str, Any]] = {}
    for key, events in by_key.items():
        result = reference_changelog(spec, merge_partitions({0: events}))
        if result.rejected:
            raise SystemExit(f"the reference rejected input at key {key}: {result.rejected[:3]}")
        for (name,), row in result.view.items():
            view[name] = row
    return view


WARM_UP_SHARE = 5  # the untimed run before the first Refold contender: a fifth of the timed runs' events


def warm_up(spark: Any, bootstrap: str, run_id: str, partitions: int, batch: int, events: int) -> None:
    """The bench's view over a fifth of `events` (a topic of its own), untimed, before the
    session's first Refold contender: the first Refold query pays for its Python workers
    and their imports, the shard hosts they fork and the JVM's compilation of its path
    (Kafka source to Arrow, seconds of C2 compiler threads), which the contenders after it
    do not. Spark SQL running first warms part of the JVM only, and 2,000 events too
    little: the first of three provenance pairs took 17.7-18.8 s against 12.0-14.5 for
    the five after it (`--pairs 3`, an idle machine)."""
    topic = f"bench-warm-{run_id}"
    records = generate(Workload(events=max(events // WARM_UP_SHARE, 2_000), keys=max(events // 50, 200),
                                retract_share=0.2, seed=2))
    produce({"bootstrap.servers": bootstrap}, topic, [jsonbytes.dumps(r) for r in records], ["player_name"],
            partitions=partitions, per_transaction=50_000, prevalidate=False, progress=False)
    p = pipeline(f"bench-warm-{run_id}", topic, bootstrap, batch)
    try:
        run_pipeline(p, bootstrap, until_idle=1.0, spark=spark, quiet=True)
    finally:
        forget_state(p)


def paired(chosen: list[str], pairs: int) -> list[str]:
    """`chosen` with `refold` and `refold-off` each run `pairs` times where the first of
    them stands, in the order refold, refold-off, refold-off, refold, … (ABBA): each
    is first in its pair as often as the other."""
    both = [name for name in ("refold", "refold-off") if name in chosen]
    if pairs <= 1 or len(both) < 2:
        return chosen
    at = min(chosen.index(name) for name in both)
    rest = [name for name in chosen if name not in both]
    order = [name for i in range(pairs) for name in (both if i % 2 == 0 else both[::-1])]
    return rest[:at] + order + rest[at:]


def run_contender(name: str, args: argparse.Namespace, bootstrap: str, source: str, run_id: str, events: int,
                   expected: dict[str, dict[str, Any]], sums: dict[str, tuple[int, int]], spark: Any,
                   results: dict[str, dict[str, Any]]) -> Any:
    """Run one contender into `results`; returns the Spark session (made on first need)."""
    if name == "limit":
        results[name] = run_limit(bootstrap, source, f"{source}.limit", args.partitions, events, args.batch)
    elif name == "spark-sql":
        from bench.spark_sql import run_spark_sql

        if spark is None:
            spark = spark_session(name="refold-bench")
        checkpoint = f"/tmp/refold-bench/spark-sql-{run_id}"
        try:
            results[name] = run_spark_sql(spark, bootstrap, source, f"bench-spark-sql-{run_id}.view", args.partitions,
                                          events, args.batch, checkpoint, sums)
        finally:
            shutil.rmtree(checkpoint, ignore_errors=True)
        print(f"  spark-sql: {results[name]['mismatches']} mismatching keys of {len(sums):,} (total, games only: "
              "no exact max/last under retraction, no per-event changelog, at least once)", file=sys.stderr)
    elif name == "flink":
        from bench.flink import run_flink

        results[name] = run_flink(
            bootstrap, source, f"bench-flink-{run_id}.view", args.partitions, events, expected,
            reduction=args.flink_reduction, parallelism=args.flink_parallelism,
            checkpoint_ms=args.flink_checkpoint_ms,
        )
        print(f"  flink: {results[name]['mismatches']} mismatching keys of {len(expected):,} "
              f"(columns {', '.join(results[name]['columns'])}); JVM start "
              f"{results[name]['startup_s']:.1f}s not counted; first committed output after "
              f"{results[name]['first_output_s']:.1f}s", file=sys.stderr)
    else:
        if spark is None:
            spark = spark_session(name="refold-bench")
        if not any(other in results for other in ("spark-sink", "refold", "refold-off")):  # the first
            warm_up(spark, bootstrap, run_id, args.partitions, args.batch, events)
        kind = {"spark-sink": "alo", "refold": "eos", "refold-off": "eos-off"}[name]
        again = len(results.get(name, {}).get("runs", []))  # (`--pairs`: each run a pipeline of its own)
        p = pipeline(f"bench-{kind}-{run_id}{f'-{again}' if again else ''}", source, bootstrap, args.batch,
                     provenance=name != "refold-off")
        try:
            run = timed_run(p, bootstrap, spark, events, baseline=name == "spark-sink")
            runs = [*results.get(name, {}).get("runs", []), run]
            results[name] = {**sorted(runs, key=lambda r: r["events_per_s"])[(len(runs) - 1) // 2], "runs": runs}
        finally:
            forget_state(p)
    return spark


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--retract", type=float, default=0.2)
    parser.add_argument("--batch", type=int, default=100_000,
                        help="max events per micro-batch (and per transaction of the limit pipe)")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"comma-separated, run in this order: {','.join(CONTENDERS)}")
    parser.add_argument("--flink-reduction", choices=("multiset", "signed"), default="multiset",
                        help="multiset: total, games, best (faithful); signed: total, games in one level")
    parser.add_argument("--flink-parallelism", type=int, default=2)
    parser.add_argument("--flink-checkpoint-ms", type=int, default=1000)
    parser.add_argument("--pairs", type=int, default=1,
                        help="run refold and refold-off this many times each, alternating (ABBA...), "
                             "and report each one's median run (of an even count, the lower middle one): the second Refold run of a Spark "
                             "session is faster than the first, whichever it is")
    parser.add_argument("--json-dir", type=Path, default=RESULTS,
                        help="where contenders.json and eos_vs_spark.json go (default docs/bench)")
    args = parser.parse_args(argv)
    chosen = paired([c.strip() for c in args.contenders.split(",") if c.strip()], args.pairs)
    unknown = [c for c in chosen if c not in CONTENDERS]
    if unknown or not chosen:
        parser.error(f"--contenders: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(CONTENDERS)}")

    from refold.dev.localkafka import ensure_broker

    bootstrap = ensure_broker(None, start_local=True)
    settings = {"bootstrap.servers": bootstrap}
    run_id = time.strftime("%Y%m%d%H%M%S")
    source = f"bench-{run_id}"

    print(f"generating {args.events:,} events over {args.keys:,} keys ({args.retract:.0%} retractions/corrections)…",
          file=sys.stderr)
    workload = Workload(events=args.events, keys=args.keys, retract_share=args.retract, seed=args.seed)
    records = list(generate(workload))
    lines = [jsonbytes.dumps(r) for r in records]
    events = len(lines)
    produced = produce(settings, source, lines, ["player_name"], partitions=args.partitions,
                       per_transaction=50_000, prevalidate=False)
    print(f"produced {events:,} events in {produced.seconds:.1f}s ({events / produced.seconds:,.0f}/s)",
          file=sys.stderr)
    expected: dict[str, dict[str, Any]] = {}
    sums = expected_sums(records) if "spark-sql" in chosen else {}
    if "flink" in chosen:
        started = time.monotonic()
        expected = expected_view(records, pipeline("reference", source, bootstrap, args.batch).view)
        print(f"reference view: {len(expected):,} keys ({time.monotonic() - started:.1f}s)", file=sys.stderr)
    del records, lines
    gc.collect()

    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    spark = None
    try:
        for name in chosen:
            print(f"running {TITLES[name]}…", file=sys.stderr, flush=True)
            try:
                spark = run_contender(name, args, bootstrap, source, run_id, events, expected, sums, spark, results)
            except (SystemExit, Exception) as exc:  # one contender failing keeps the others' figures
                failed[name] = str(exc) or type(exc).__name__
                print(f"  {name} failed: {failed[name]}", file=sys.stderr)
    finally:
        if spark is not None:
            spark.stop()

    refold = results.get("refold")
    for r in results.values():
        r["ratio_to_refold"] = r["events_per_s"] / refold["events_per_s"] if refold else None
    print(f"\n{events:,} events, {args.keys:,} keys, {args.retract:.0%} retractions/corrections, "
          f"{args.partitions} partitions, batch {args.batch:,}")
    print(f"{'contender':<52} {'events/s':>10} {'seconds':>8} {'peak RSS':>10} {'vs Refold':>9}")
    for name, r in results.items():
        ratio = f"{r['ratio_to_refold']:.2f}" if r["ratio_to_refold"] else "-"
        title = TITLES[name] + (f", median of {len(r['runs'])}" if len(r.get("runs", [])) > 1 else "")
        print(f"{title:<52} {r['events_per_s']:>10,.0f} {r['seconds']:>8.1f} "
              f"{r['peak_rss_bytes'] / 2**20:>7,.0f} MiB {ratio:>9}")
    if refold:
        print("(vs Refold: the contender's throughput as a multiple of Refold's)")
        for name, goals in TARGETS.items():
            if name in results:
                mine = 1 / results[name]["ratio_to_refold"]
                said = "; ".join(f"{label} ≥ {target:.3g}: {'ok' if mine >= target else 'MISSED'}" for label, target in goals)
                print(f"Refold / {name}: {mine:.2f} ({said})")
    for name, reason in failed.items():
        print(f"{TITLES[name]}: FAILED ({reason})")
    if "spark-sql" in results and results["spark-sql"]["mismatches"]:
        print(f"Spark SQL's output differs from the signed sums at {results['spark-sql']['mismatches']} keys")
    if "flink" in results and results["flink"]["mismatches"]:
        print(f"Flink's output differs from the reference at {results['flink']['mismatches']} keys")

    args.json_dir.mkdir(parents=True, exist_ok=True)
    common = {
        "run": run_id, "machine": platform.platform(), "cores": os.cpu_count(),
        "events": events, "keys": args.keys, "retract_share": args.retract, "batch": args.batch,
        "partitions": args.partitions, "seed": args.seed,
    }
    (args.json_dir / "contenders.json").write_text(json.dumps({**common, "contenders": results, "failed": failed}, indent=2) + "\n")
    if "spark-sink" in results and refold:
        legacy = {**common, "spark_at_least_once": results["spark-sink"], "refold_exactly_once": refold,
                  "ratio": refold["events_per_s"] / results["spark-sink"]["events_per_s"]}
        (args.json_dir / "eos_vs_spark.json").write_text(json.dumps(legacy, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
