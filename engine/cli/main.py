"""The `refold` command line (DESIGN.md §5)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from refold import environment
from refold.errors import OperationalError, RefoldError, UserError


def _settings(args: argparse.Namespace) -> dict[str, object]:
    """librdkafka settings: --kafka-config FILE and -X on top of the bootstrap servers."""
    from refold.kafka.connection import KafkaConnection, client_settings, command_line_where

    where = command_line_where(args.kafka_config, args.kafka_setting)
    connection = KafkaConnection.of(client_settings(args.kafka_config, args.kafka_setting), where)
    bootstrap = args.bootstrap_servers or connection.bootstrap_servers
    if not bootstrap:  # the embedded default: the local broker (refold kafka start)
        from refold.dev.localkafka import ensure_broker

        bootstrap = ensure_broker(None)
    return {**connection.librdkafka(), "bootstrap.servers": bootstrap}


def _pipeline(args: argparse.Namespace) -> Any:
    """The pipeline file, its `kafka:` block updated by --kafka-config FILE and -X."""
    from refold.config import load_pipeline
    from refold.kafka.connection import client_settings, command_line_where

    pipeline = load_pipeline(args.pipeline)
    extra = client_settings(args.kafka_config, args.kafka_setting)
    if not extra:
        return pipeline
    where = f"kafka (with {command_line_where(args.kafka_config, args.kafka_setting)})"
    return pipeline.model_copy(update={"kafka": pipeline.kafka.merged(extra, where)})


def cmd_kafka(args: argparse.Namespace) -> int:
    from refold.dev import localkafka

    return localkafka.cli(args)


def cmd_pg(args: argparse.Namespace) -> int:
    from refold.dev import localpg

    return localpg.cli(args)


def cmd_spark(args: argparse.Namespace) -> int:
    from refold.dev import localspark

    return localspark.cli(args)


def cmd_registry(args: argparse.Namespace) -> int:
    from refold.dev import localregistry

    return localregistry.cli(args)


def cmd_jars(args: argparse.Namespace) -> int:
    from refold.spark import jars

    unknown = [name for name in args.sets if name not in jars.SETS]
    if unknown:
        print(f"refold jars: unknown set {', '.join(unknown)}; known: {', '.join(jars.SETS)}", file=sys.stderr)
        return 2
    for name in args.sets or ("kafka-broker", "spark-connectors"):
        paths = jars.resolve(name)
        print(f"{name}: {len(paths)} jars in {paths[0].parent if paths else '-'}")
    return 0


def cmd_produce(args: argparse.Namespace) -> int:
    from refold.cli.produce import produce, read_input

    lines, is_file = read_input(args.file)
    keys = [k.strip() for k in args.key.split(",") if k.strip()]
    if not keys:
        raise UserError("--key needs at least one column")
    result = produce(
        _settings(args),
        args.topic,
        lines,
        keys,
        fmt=args.format,
        schema=args.schema,
        per_transaction=args.per_transaction,
        prevalidate=is_file,
        partitions=args.partitions,
    )
    print(
        f"wrote {result.events} events to {args.topic} in {result.transactions} "
        f"transaction{'s' if result.transactions != 1 else ''} ({result.seconds:.2f}s)"
    )
    return 0


def cmd_consume(args: argparse.Namespace) -> int:
    from refold.cli.consume import consume

    count = consume(
        _settings(args),
        args.topic,
        from_beginning=args.from_beginning,
        until_idle=args.until_idle,
        fmt=args.format,
        schema=args.schema,
    )
    print(f"consumed {count} records from {args.topic}", file=sys.stderr)
    return 0


def _stop_on_sigterm() -> None:
    """SIGTERM (`docker stop`, a service manager) stops the run as Ctrl-C does: the batch
    in flight commits or aborts whole, then the run ends with status 0. A second SIGTERM
    while it stops is ignored (the sender's SIGKILL is the way to stop at once)."""
    import signal

    def on_term(_signum: int, _frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        logging.getLogger("refold").info("SIGTERM: stopping after the current batch")
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)


def cmd_run(args: argparse.Namespace) -> int:
    from refold.spark.job import run_pipeline

    if not sys.stderr.isatty():  # a container, a service manager, CI: structured log lines
        from refold.ops.monitor import json_logging

        json_logging()
    _stop_on_sigterm()
    pipeline = _pipeline(args)
    run_pipeline(
        pipeline, bootstrap=args.bootstrap_servers, until_idle=args.until_idle, metrics_port=args.metrics_port
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from refold.ops.status import print_status

    pipeline = _pipeline(args)
    print_status(pipeline, bootstrap=args.bootstrap_servers)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from refold.config import load_pipeline
    from refold.ops.explain import explain

    print(explain(load_pipeline(args.pipeline)))
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("refold")
    except PackageNotFoundError:  # run from the source tree without installing it
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refold", description="Exactly-once changelog engine on Kafka.")
    parser.add_argument("--version", action="version", version=f"refold {_version()}")
    parser.add_argument(
        "--bootstrap-servers",
        default=environment.bootstrap_servers(),
        help="Kafka cluster to use (default: REFOLD_BOOTSTRAP_SERVERS, else the local broker 127.0.0.1:9092)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--kafka-config", metavar="FILE", help="librdkafka settings, key=value lines (SASL, TLS: docs/SECURITY.md)"
    )
    parser.add_argument(
        "-X", dest="kafka_setting", action="append", metavar="KEY=VALUE", help="one librdkafka setting (repeatable)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    kafka = sub.add_parser("kafka", help="a local Apache Kafka broker (KRaft) under .refold/")
    kafka.add_argument("action", choices=["start", "stop", "status"])
    kafka.add_argument("--port", type=int, default=9092)
    kafka.set_defaults(func=cmd_kafka)

    pg = sub.add_parser("pg", help="a local PostgreSQL server (Debian's binaries) under .refold/")
    pg.add_argument("action", choices=["start", "stop", "status"])
    pg.add_argument("--port", type=int, help="default: the last start's port if free, else a free one")
    pg.set_defaults(func=cmd_pg)

    spark = sub.add_parser("spark", help="a local Spark standalone cluster (master + workers on 127.0.0.1) under .refold/")
    spark.add_argument("action", choices=["start", "stop", "status"])
    spark.add_argument("--workers", type=int, default=2, help="workers to start (default 2)")
    spark.add_argument("--cores", type=int, default=1, help="cores per worker (default 1)")
    spark.add_argument("--memory", default="2g", help="memory each worker offers executors, e.g. 2g (default 2g)")
    spark.add_argument("--port", type=int, help="master port (default 7077 when free, else a free one)")
    spark.add_argument("--ui-port", type=int, help="master UI port (default 8080 when free, else a free one)")
    spark.set_defaults(func=cmd_spark)

    registry = sub.add_parser("registry", help="a local Apicurio schema registry (Confluent-compatible API) on "
                                               "127.0.0.1, for trying schema_registry: (in-memory storage)")
    registry.add_argument("action", choices=["build", "start", "stop", "status"])
    registry.add_argument("--port", type=int, help="HTTP port (default: a free one)")
    registry.set_defaults(func=cmd_registry)

    jars = sub.add_parser("jars", help="resolve the JVM jars (Kafka broker, Spark Kafka connector) with Maven")
    jars.add_argument("sets", nargs="*", metavar="SET",
                      help="the sets to resolve (default: kafka-broker spark-connectors; also "
                           "flink-connectors, lakehouse-readers: Spark readers of Delta and Iceberg tables)")
    jars.set_defaults(func=cmd_jars)

    produce = sub.add_parser("produce", help="write JSON-lines changelog events to a topic, transactionally")
    produce.add_argument("topic")
    produce.add_argument("file", nargs="?", default="-", help="JSON lines, one event per line ('-' = stdin)")
    produce.add_argument("--key", required=True, help="message key column(s), comma-separated")
    produce.add_argument("--format", choices=["jsonl", "avro"], default="jsonl", help="wire format of the values")
    produce.add_argument("--schema", help="Avro schema (.avsc) for --format avro")
    produce.add_argument("--per-transaction", type=int, default=10_000, help="events per Kafka transaction")
    produce.add_argument("--partitions", type=int, default=3, help="partitions if the topic must be created")
    produce.set_defaults(func=cmd_produce)

    consume = sub.add_parser("consume", help="print a topic's committed records as JSON lines")
    consume.add_argument("topic")
    consume.add_argument("--from-beginning", action="store_true")
    consume.add_argument("--until-idle", type=float, metavar="SECONDS", help="stop after this long without records")
    consume.add_argument("--format", choices=["jsonl", "avro"], default="jsonl")
    consume.add_argument("--schema", help="Avro schema (.avsc) for --format avro")
    consume.set_defaults(func=cmd_consume)

    run = sub.add_parser("run", help="run the engine on a pipeline file")
    run.add_argument("pipeline")
    run.add_argument("--until-idle", type=float, metavar="SECONDS", help="stop after this long without input")
    run.add_argument(
        "--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on PORT (overrides metrics.port)"
    )
    run.set_defaults(func=cmd_run)

    status = sub.add_parser("status", help="committed offsets, lag, last batch of a pipeline")
    status.add_argument("pipeline")
    status.set_defaults(func=cmd_status)

    explain = sub.add_parser("explain", help="the view a pipeline runs (the spec a SQL view becomes), its shards "
                                             "and topics")
    explain.add_argument("pipeline")
    explain.set_defaults(func=cmd_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # py4j logs every command it sends to the JVM at DEBUG, Kafka options (passwords) too.
    logging.getLogger("py4j").setLevel(logging.INFO)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"refold: error: {exc}", file=sys.stderr)
        return 2
    except OperationalError as exc:  # nothing committed: a restart retries
        print(f"refold: failed: {exc}", file=sys.stderr)
        return 1
    except RefoldError as exc:
        print(f"refold: internal error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
