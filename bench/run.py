"""`make bench`: exactly-once Refold against Spark's at-least-once Kafka sink, one run.

Both contenders run the identical Spark pipeline (same source topic, same
reduction, same micro-batch size) in the same Spark session on the same broker;
only the commit differs. Machines here are noisy: read the ratio, not the seconds.

    python -m bench.run [--events 1000000] [--keys 100000] [--retract 0.2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from bench.baseline import SparkSinkProcessor
from refold.config import Pipeline, parse_pipeline
from refold.job import run_pipeline, spark_session
from refold.produce import produce
from refold.testing import Workload, generate

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "bench"


def pipeline(name: str, source: str, bootstrap: str, batch: int) -> Pipeline:
    return parse_pipeline(
        {
            "pipeline": name,
            "kafka": {"bootstrap.servers": bootstrap},
            "source": {"topic": source},
            "view": {
                "key": ["player_name"],
                "columns": {
                    "total": {"sum": "score"},
                    "games": {"count": "*"},
                    "best": {"max": "score"},
                    "latest": {"last": "score"},
                },
            },
            "outputs": {"view": {"topic": f"{name}.view"}, "delta": {"topic": f"{name}.delta"}},
            "trigger": "100ms",
            "max_batch_events": batch,
            "spark": {"checkpoint_dir": f"/tmp/refold-bench/{name}"},
        }
    )


def timed_run(p: Pipeline, bootstrap: str, spark: Any, events: int, factory: Any = None) -> dict[str, Any]:
    progress = run_pipeline(p, bootstrap, until_idle=5.0, spark=spark, quiet=True, processor_factory=factory)
    assert progress.last_commit is not None, "no batch committed"
    seconds = progress.last_commit - progress.started
    if progress.events != events:
        raise SystemExit(f"{p.pipeline}: reduced {progress.events} events, expected {events}")
    return {"seconds": seconds, "events_per_s": events / seconds, "batches": progress.batches}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--retract", type=float, default=0.2)
    parser.add_argument("--batch", type=int, default=100_000, help="max events per micro-batch")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    from refold.localkafka import ensure_broker

    bootstrap = ensure_broker(None, start_local=True)
    settings = {"bootstrap.servers": bootstrap}
    run_id = time.strftime("%Y%m%d%H%M%S")
    source = f"bench-{run_id}"

    print(f"generating {args.events:,} events over {args.keys:,} keys ({args.retract:.0%} retractions/corrections)…",
          file=sys.stderr)
    workload = Workload(events=args.events, keys=args.keys, retract_share=args.retract, seed=args.seed)
    lines = [orjson.dumps(r) for r in generate(workload)]
    events = len(lines)
    produced = produce(settings, source, lines, ["player_name"], partitions=args.partitions,
                       per_transaction=50_000, prevalidate=False)
    print(f"produced {events:,} events in {produced.seconds:.1f}s ({events / produced.seconds:,.0f}/s)",
          file=sys.stderr)

    spark = spark_session(name="refold-bench")
    try:
        print("running Spark + built-in Kafka sink (at least once)…", file=sys.stderr)
        baseline = timed_run(pipeline(f"bench-alo-{run_id}", source, bootstrap, args.batch), bootstrap, spark, events,
                             factory=lambda p, s, sp: SparkSinkProcessor(p, s, sp))
        print("running Refold (exactly once)…", file=sys.stderr)
        refold = timed_run(pipeline(f"bench-eos-{run_id}", source, bootstrap, args.batch), bootstrap, spark, events)
    finally:
        spark.stop()

    ratio = refold["events_per_s"] / baseline["events_per_s"]
    rows = [("Spark, built-in Kafka sink (at least once)", baseline), ("Refold (exactly once)", refold)]
    print(f"\n{'contender':<44} {'events/s':>12} {'seconds':>9} {'batches':>8}")
    for name, r in rows:
        print(f"{name:<44} {r['events_per_s']:>12,.0f} {r['seconds']:>9.1f} {r['batches']:>8}")
    print(f"\nexactly-once / at-least-once throughput ratio: {ratio:.2f} (target ≥ 0.80)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "run": run_id, "machine": platform.platform(), "cores": os.cpu_count(),
        "events": events, "keys": args.keys, "retract_share": args.retract, "batch": args.batch,
        "partitions": args.partitions, "spark_at_least_once": baseline, "refold_exactly_once": refold,
        "ratio": ratio,
    }
    (RESULTS / "eos_vs_spark.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
