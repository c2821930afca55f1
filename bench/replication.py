"""`make bench-replication`: the price of replication, one broker against a cluster of three.

The same seeded changelog (`refold.dev.testing.generate`) is produced to a single broker
and to a local KRaft cluster of three brokers (`refold.dev.kafkacluster`: replication
factor 3, `min.insync.replicas` 2, `acks=all`), both started here, each in a temporary
home on free ports (not the shared broker on 9092). Then, on each in turn and in one Spark session (`local[2]`):

- limit: the limit pipe (`bench.limit`: consume → produce, transactional, no reduction);
- refold: `refold run` of the contenders' grouped view, exactly once, view and delta (after
  one short run that is not measured: the Spark session's warm-up).

Every topic on the cluster has three replicas, so each committed write waits for a
follower's fetch: the ratio cluster / single broker is what that costs on this machine,
where the three brokers share its two cores with Spark. Read the ratios, not the seconds.

    python -m bench.replication [--events 300000] [--keys 100000] [--retract 0.2]
                                [--batch 100000] [--partitions 4] [--json-dir docs/bench]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.run import RESULTS, forget_state, pipeline, run_limit, timed_run
from refold.cli.produce import produce
from refold.dev import kafkacluster, localkafka
from refold.dev.testing import Workload, generate
from refold.model import jsonbytes
from refold.spark.job import spark_session

BROKERS = 3


def measure(where: str, bootstrap: str, lines: list[bytes], args: argparse.Namespace, run_id: str,
            spark: Any) -> dict[str, dict[str, Any]]:
    """Produce `lines` to a fresh topic at `bootstrap`, then run the limit pipe and Refold over it."""
    settings = {"bootstrap.servers": bootstrap}
    source = f"bench-repl-{where}-{run_id}"
    produced = produce(settings, source, lines, ["player_name"], partitions=args.partitions,
                       per_transaction=50_000, prevalidate=False)
    print(f"  {where}: produced {len(lines):,} events in {produced.seconds:.1f}s", file=sys.stderr)
    results: dict[str, dict[str, Any]] = {"produce": {"seconds": produced.seconds,
                                                      "events_per_s": len(lines) / produced.seconds}}
    results["limit"] = run_limit(bootstrap, source, f"{source}.limit", args.partitions, len(lines), args.batch)
    print(f"  {where}: limit {results['limit']['events_per_s']:,.0f} events/s", file=sys.stderr)
    p = pipeline(f"bench-repl-{where}-eos-{run_id}", source, bootstrap, args.batch)
    try:
        results["refold"] = timed_run(p, bootstrap, spark, len(lines))
    finally:
        forget_state(p)
    print(f"  {where}: refold {results['refold']['events_per_s']:,.0f} events/s", file=sys.stderr)
    return results


def warm_up(bootstrap: str, lines: list[bytes], args: argparse.Namespace, run_id: str, spark: Any) -> None:
    """One short run first, not measured: the first pipeline of a Spark session pays for its
    Python workers' start and the JVM's warm-up, which would be charged to the single broker."""
    source = f"bench-repl-warm-{run_id}"
    produce({"bootstrap.servers": bootstrap}, source, lines, ["player_name"], partitions=args.partitions,
            per_transaction=50_000, prevalidate=False)
    p = pipeline(f"bench-repl-warm-eos-{run_id}", source, bootstrap, args.batch)
    try:
        timed_run(p, bootstrap, spark, len(lines))
    finally:
        forget_state(p)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--retract", type=float, default=0.2)
    parser.add_argument("--batch", type=int, default=100_000, help="max events per micro-batch and limit transaction")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    # Both on free ports in homes of their own: not the shared broker on 9092, whose other
    # topics and clients would be measured too.
    single_home = Path(tempfile.mkdtemp(prefix="refold-bench-single-"))
    home = Path(tempfile.mkdtemp(prefix="refold-bench-cluster-"))
    print(f"starting a local broker in {single_home} and a cluster of {BROKERS} brokers in {home}…", file=sys.stderr)
    single = localkafka.start(localkafka.free_port(), timeout=180.0, home=single_home, quiet=True,
                              die_with_parent=True).bootstrap
    port = kafkacluster.free_port_range(2 * BROKERS)
    try:
        cluster = kafkacluster.start(port, BROKERS, timeout=180.0, home=home, quiet=True, die_with_parent=True)
    except BaseException:
        localkafka.stop(home=single_home)
        raise
    run_id = time.strftime("%Y%m%d%H%M%S")
    workload = Workload(events=args.events, keys=args.keys, retract_share=args.retract, seed=args.seed)
    lines = [jsonbytes.dumps(r) for r in generate(workload)]
    spark = spark_session(name="refold-bench-replication")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        warm_up(single, lines[:20_000], args, run_id, spark)
        for where, bootstrap in (("single", single), ("cluster", cluster.bootstrap)):
            print(f"on the {where} ({bootstrap})…", file=sys.stderr, flush=True)
            results[where] = measure(where, bootstrap, lines, args, run_id, spark)
    finally:
        spark.stop()
        kafkacluster.stop(home=home)
        localkafka.stop(home=single_home)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(single_home, ignore_errors=True)

    print(f"\n{len(lines):,} events, {args.keys:,} keys, {args.retract:.0%} retractions/corrections, "
          f"{args.partitions} partitions, batch {args.batch:,}")
    print(f"{'':<10} {'1 broker':>12} {f'{BROKERS} brokers, RF 3':>16} {'cluster / 1':>12}")
    ratios: dict[str, float] = {}
    for part in ("produce", "limit", "refold"):
        one, three = results["single"][part]["events_per_s"], results["cluster"][part]["events_per_s"]
        ratios[part] = three / one
        print(f"{part:<10} {one:>12,.0f} {three:>16,.0f} {ratios[part]:>12.2f}")
    print("(events/s; produce: `refold produce`, transactional; limit: consume → produce; refold: exactly once)")
    args.json_dir.mkdir(parents=True, exist_ok=True)
    summary = {"run": run_id, "machine": platform.platform(), "cores": os.cpu_count(), "events": len(lines),
               "keys": args.keys, "retract_share": args.retract, "batch": args.batch,
               "partitions": args.partitions, "brokers": BROKERS, "results": results, "cluster_over_single": ratios}
    (args.json_dir / "replication.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
