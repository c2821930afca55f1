"""`make bench-join`: revenue per region over orders joined with customers, Refold against
Flink SQL's regular join and GROUP BY, on the same two topics in one run.

One seeded input (`refold.dev.joinload`) is produced once to two topics on the local
broker, each keyed by `id`: customers (`id, region, name`: an `+A` of each, then moves
between regions as `-C`/`+C` and some retractions, spread over the run) and orders
(`id, customer_id, amount`: appends, retractions and corrections of an amount);
`--events` order events over `--customers` customers. Each contender reads those
identical topics:

- refold: `refold run`, exactly once, the join view of `joinload.JOIN_VIEW`
  (`SELECT c.region, SUM(o.amount), COUNT(*) FROM orders o JOIN customers c ON
  o.customer_id = c.id GROUP BY c.region`, a grouped view over `view.join`), run to
  the end of the input as `make bench-contenders` runs it (`bench.run.timed_run`), after an
  untimed warm-up of the same view over 2,000 order events of its own topics
  (`bench.contest.warm_up`: the Spark session's first streaming query pays seconds);
- flink: PyFlink SQL, each side's live rows counted from `op` (a column to Flink),
  a regular join of the two updating tables and a GROUP BY region, `upsert-kafka`
  exactly once (`bench/flink_join_job.py`, in Flink's own virtualenv, `bench.flink`);
  `--flink-reduction signed` joins the signed events instead.

Both are checked against the expected view: the join of both sides' live rows at the
end, summed per region (`joinload.expected_view`; with 20,000 order events or fewer
also the reference join and grouped view, `joinload.reference_view`, which it must
equal). Refold: its view changelog folds (each `-C`/`-R` retracts its key's current
row) to it, and it wrote no dead letter (`joinload.check_join`); Flink: its last row
per region equals it. Throughput is events of both topics over the time from the
contender's start to its last committed output (as `make bench-contenders` measures
it); peak RSS is of each contender's process tree (Refold: this process, its JVM and
the JVM's Python workers). Target: Refold at 1.5x Flink's events/s or more.

    python -m bench.join [--events 1000000] [--customers 50000] [--regions 20] [--partitions 4]
                         [--shards merged|M] [--contenders refold,flink] [--bootstrap H:P] [--json-dir docs/bench]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

from bench.contest import (
    WARM_UP_EVENTS,
    Spark,
    add_common_arguments,
    run_contenders,
    start,
    warm_up,
)
from refold.cli.produce import produce
from refold.config import Pipeline, parse_pipeline
from refold.dev.joinload import (
    JOIN_VIEW,
    SIDE_NAMES,
    JoinWorkload,
    expected_view,
    generate_join,
    reference_view,
    sides,
)
from refold.model import jsonbytes

CONTENDERS = ("refold", "flink")
TITLES = {
    "refold": "Refold join + grouped view, exactly once",
    "flink": "Flink SQL regular join + GROUP BY, exactly once",
}
TARGET = 1.5  # Refold's events/s as a multiple of Flink's
REFERENCE_UP_TO = 20_000  # order events up to which the reference join checks the expected view too


def join_pipeline(name: str, topics: tuple[str, str], bootstrap: str, batch: int,
                  shards: str | None = None) -> Pipeline:
    """`shards`: the pipeline's (None: unset, which merges a join's partitions in one task)."""
    return parse_pipeline({
        "pipeline": name,
        "kafka": {"bootstrap.servers": bootstrap},
        "sources": {side: {"topic": topic} for side, topic in zip(SIDE_NAMES, topics, strict=True)},
        "view": JOIN_VIEW,
        "outputs": {"view": {"topic": f"{name}.view"}},
        "trigger": "100ms",
        "max_batch_events": batch,
        **({} if shards is None else {"shards": shards if shards == "merged" else int(shards)}),
        "spark": {"checkpoint_dir": f"/tmp/refold-bench/{name}", "state_dir": "/tmp/refold-bench/state"},
    })


def run_refold(spark: Any, bootstrap: str, topics: tuple[str, str], run_id: str, args: argparse.Namespace,
               events: int, expected: dict[tuple[Any, ...], dict[str, Any]], forget: list[Pipeline]) -> dict[str, Any]:
    """Refold's run, after an untimed warm-up of the same view over `WARM_UP_EVENTS`
    order events of its own topics and pipeline (`contest.warm_up`); both pipelines into
    `forget`: their local stores go once the Spark session stopped (its shard hosts hold
    them open until then)."""
    from bench.run import timed_run
    from refold.dev.joinload import check_join

    small = JoinWorkload(orders=WARM_UP_EVENTS, customers=max(1, min(args.customers, WARM_UP_EVENTS // 10)),
                         regions=args.regions, seed=args.seed + 1)
    warm_topics = (f"bench-join-warm-{run_id}.orders", f"bench-join-warm-{run_id}.customers")
    warm = join_pipeline(f"bench-join-warm-{run_id}", warm_topics, bootstrap, args.batch, args.shards)
    p = join_pipeline(f"bench-join-{run_id}", topics, bootstrap, args.batch, args.shards)
    forget += [warm, p]
    warm_up(spark, bootstrap, warm, [(topic, [jsonbytes.dumps(r) for r in side], ["id"]) for topic, side
                                     in zip(warm_topics, sides(list(generate_join(small))), strict=True)],
            partitions=args.partitions)
    result = timed_run(p, bootstrap, spark, events)
    report = check_join(p, {"bootstrap.servers": bootstrap}, expected, events)
    if report.anomalies:
        print("  refold: " + "\n    ".join(report.anomalies[:10]), file=sys.stderr)
    return result | {"view_records": report.view_records, "anomalies": len(report.anomalies),
                     "dead_letters": report.dead_letters}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = JoinWorkload()
    parser.add_argument("--events", type=int, default=defaults.orders, help="order events")
    parser.add_argument("--customers", type=int, default=defaults.customers)
    parser.add_argument("--regions", type=int, default=defaults.regions)
    parser.add_argument("--flink-reduction", choices=("multiset", "signed"), default="multiset")
    parser.add_argument("--shards", default=None, help="Refold's `shards`: merged (what unset means for a "
                        "join) or M, the join and the sum by region in M shards each, through two exchanges")
    add_common_arguments(parser, CONTENDERS, "join.json")
    args, chosen, bootstrap, run_id = start(parser, argv, CONTENDERS)
    settings = {"bootstrap.servers": bootstrap}
    topics = (f"bench-join-{run_id}.orders", f"bench-join-{run_id}.customers")
    w = JoinWorkload(orders=args.events, customers=args.customers, regions=args.regions, seed=args.seed)
    records = list(generate_join(w))
    expected = expected_view(records)
    if args.events <= REFERENCE_UP_TO:
        reference, refused = reference_view(records)
        if reference != expected or refused:
            raise SystemExit(f"the live rows' join and the reference join disagree ({refused} units refused)")
    seconds = 0.0
    for topic, side in zip(topics, sides(records), strict=True):
        lines = [jsonbytes.dumps(r) for r in side]
        seconds += produce(settings, topic, lines, ["id"], partitions=args.partitions, per_transaction=50_000,
                           prevalidate=False, progress=False).seconds
    events = len(records)
    orders, customers = sides(records)
    print(f"produced {len(orders):,} order and {len(customers):,} customer events ({args.customers:,} customers, "
          f"{args.regions} regions) in {seconds:.1f}s", file=sys.stderr)
    del records, orders, customers
    forget: list[Pipeline] = []  # Refold's pipelines, whose local stores go after the shards closed

    def run(name: str, spark: Spark) -> dict[str, Any]:
        if name == "refold":
            result = run_refold(spark.get(), bootstrap, topics, run_id, args, events, expected, forget)
            return result | {"right": result["anomalies"] == 0}
        from bench.flink import run_flink_join

        result = run_flink_join(bootstrap, *topics, f"bench-flink-join-{run_id}.view", args.partitions, events,
                                {region: row for (region,), row in expected.items()}, reduction=args.flink_reduction,
                                parallelism=args.flink_parallelism, checkpoint_ms=args.flink_checkpoint_ms)
        return result | {"right": result["mismatches"] == 0}

    results, failed = run_contenders(chosen, TITLES, run, forget)

    refold = results.get("refold")
    print(f"\n{events:,} events ({args.events:,} orders, {args.customers:,} customers, {args.regions} regions), "
          f"{args.partitions} partitions, batch {args.batch:,}")
    print(f"{'contender':<48} {'events/s':>10} {'seconds':>8} {'peak RSS':>10} {'Refold /':>8}  result")
    for name, r in results.items():
        r["ratio_refold_to"] = refold["events_per_s"] / r["events_per_s"] if refold else None
        wrong = (f"{r['anomalies']} anomalies" if name == "refold" else f"{r['mismatches']} regions differ")
        print(f"{TITLES[name]:<48} {r['events_per_s']:>10,.0f} {r['seconds']:>8.1f} "
              f"{r['peak_rss_bytes'] / 2**20:>7,.0f} MiB {r['ratio_refold_to'] or 0:>8.2f}  "
              f"{'right' if r['right'] else 'WRONG: ' + wrong}")
    if refold and "flink" in results:
        ratio = results["flink"]["ratio_refold_to"]
        print(f"Refold / flink: {ratio:.2f} (target ≥ {TARGET}: {'ok' if ratio >= TARGET else 'MISSED'})")
    for name, reason in failed.items():
        print(f"{TITLES[name]}: FAILED ({reason})")

    args.json_dir.mkdir(parents=True, exist_ok=True)
    report = {"run": run_id, "machine": platform.platform(), "cores": os.cpu_count(), "events": events,
              "orders": args.events, "customers": args.customers, "regions": args.regions,
              "partitions": args.partitions, "batch": args.batch, "shards": args.shards, "seed": args.seed,
              "flink_reduction": args.flink_reduction, "contenders": results, "failed": failed}
    (args.json_dir / "join.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 1 if failed or any(not r["right"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
