"""What the benchmarks that set Refold against other engines on one input share
(`bench.windows`, `bench.join`): their common arguments, the contenders chosen, and
running each in turn in one Spark session made on first need, one failing keeping the
others' figures."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "bench"


def add_common_arguments(parser: argparse.ArgumentParser, contenders: Sequence[str], json_name: str) -> None:
    """--batch, --partitions, --seed, --contenders, Flink's parallelism and checkpoint
    interval, --bootstrap, --json-dir."""
    parser.add_argument("--batch", type=int, default=100_000, help="max events per micro-batch")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--contenders", default=",".join(contenders),
                        help=f"comma-separated, run in this order: {','.join(contenders)}")
    parser.add_argument("--flink-parallelism", type=int, default=2)
    parser.add_argument("--flink-checkpoint-ms", type=int, default=1000)
    parser.add_argument("--bootstrap", help="the broker (default: the local one, started when none runs)")
    parser.add_argument("--json-dir", type=Path, default=RESULTS,
                        help=f"where {json_name} goes (default docs/bench)")


def start(parser: argparse.ArgumentParser, argv: list[str] | None,
          known: Sequence[str]) -> tuple[argparse.Namespace, list[str], str, str]:
    """The arguments parsed; the contenders `--contenders` names, in its order (a parser
    error for an unknown one); the broker (the local one, started when none runs); the
    run's id (a timestamp: its topics' names)."""
    from refold.dev.localkafka import ensure_broker

    args = parser.parse_args(argv)
    chosen = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in known]
    if unknown or not chosen:
        parser.error(f"--contenders: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}")
    return args, chosen, ensure_broker(args.bootstrap, start_local=True), time.strftime("%Y%m%d%H%M%S")


class Spark:
    """The bench's Spark session, made on first `get()`, stopped by `stop()` if made."""

    def __init__(self) -> None:
        self.session: Any = None

    def get(self) -> Any:
        if self.session is None:
            from refold.spark.job import spark_session

            self.session = spark_session(name="refold-bench")
        return self.session

    def stop(self) -> None:
        if self.session is not None:
            self.session.stop()


def run_contenders(chosen: Sequence[str], titles: dict[str, str], run: Callable[[str, Spark], dict[str, Any]],
                   forget: Sequence[Any] = ()) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """`run(name, spark)` for each chosen contender in turn: (their results, the failed
    ones' reasons). `forget`: Refold's pipelines (`run` may add to it), whose local
    stores are deleted once the Spark session stopped: its shard hosts hold them open
    until then."""
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    spark = Spark()
    try:
        for name in chosen:
            print(f"running {titles[name]}…", file=sys.stderr, flush=True)
            try:
                results[name] = run(name, spark)
            except (SystemExit, Exception) as exc:  # one contender failing keeps the others' figures
                failed[name] = str(exc) or type(exc).__name__
                print(f"  {name} failed: {failed[name]}", file=sys.stderr)
    finally:
        spark.stop()
        from bench.run import forget_state

        for p in forget:
            forget_state(p)
    return results, failed


WARM_UP_EVENTS = 2_000  # events of a bench's untimed warm-up run (`warm_up`)


def warm_up(spark: Any, bootstrap: str, p: Any, inputs: Sequence[tuple[str, Sequence[bytes], Sequence[str]]],
            partitions: int = 4) -> None:
    """Run pipeline `p`, untimed, over a small input of its own topics, each of `inputs`
    a (topic, lines, key fields): Refold runs first in the bench's Spark session, whose
    first streaming query pays for its JVM's Kafka source, its Python workers and their
    imports (5-11 s measured at 100k windowed events); `make bench-contenders` runs
    Refold after two Spark contenders, in a warm session. `p` is the same view as the
    timed run's, under its own pipeline name."""
    from refold.cli.produce import produce
    from refold.spark.job import run_pipeline

    for topic, lines, keys in inputs:
        produce({"bootstrap.servers": bootstrap}, topic, list(lines), list(keys), partitions=partitions,
                per_transaction=50_000, prevalidate=False, progress=False)
    run_pipeline(p, bootstrap, until_idle=1.0, spark=spark, quiet=True)
