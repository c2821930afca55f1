"""The `refold` command line (DESIGN.md §5)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from refold import environment
from refold.errors import OperationalError, RefoldError, UserError

NEVER_RAN = 3  # `refold status` of a pipeline that never ran (no P.checkpoints topic)


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
        f"wrote {result.events} event{'s' if result.events != 1 else ''} to {args.topic} in {result.transactions} "
        f"transaction{'s' if result.transactions != 1 else ''} ({result.seconds:.2f}s)"
    )
    return 0


def _columns(text: str | None, option: str) -> list[str]:
    columns = [c.strip() for c in (text or "").split(",") if c.strip()]
    if text is not None and not columns:
        raise UserError(f"{option} needs at least one column")
    return columns


def _json_object(text: str, option: str) -> dict[str, Any]:
    import orjson

    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise UserError(f"{option} must be a JSON object: {exc}") from exc
    if not isinstance(value, dict):
        raise UserError(f"{option} must be a JSON object, not {text!r}")
    return value


def cmd_ingest(args: argparse.Namespace) -> int:
    from refold.ingest import ingest

    result = ingest(
        _settings(args),
        args.topic,
        args.files or ["-"],
        merge_strategy=args.merge,
        primary_key=_columns(args.primary_key, "--primary-key"),
        compare_columns=_columns(args.compare_columns, "--compare-columns") or None,
        event_time_column=args.event_time,
        deleted_column=args.deleted_column,
        fmt=args.format,
        name=args.name,
        partitions=args.partitions,
        per_transaction=args.per_transaction,
    )
    if result.fold is not None and result.fold.refused:
        print(f"refold: warning: {result.fold.refused} records of {args.topic} change nothing, as the engine "
              f"refuses them (first: {result.fold.first_refused})", file=sys.stderr)
    for conflict in result.conflicts[:10]:
        print(f"refold: conflict: {conflict}", file=sys.stderr)
    if len(result.conflicts) > 10:
        print(f"refold: ... {len(result.conflicts) - 10} more conflicts", file=sys.stderr)
    counts = ", ".join(f"{result.changes.get(code, 0)} {code}" for code in ("+A", "-R", "-C", "+C"))
    if result.already:
        print(f"ingest {result.identity} was already committed to {args.topic} ({counts}); nothing written")
        return 0
    resumed = f", resumed after input row {result.resumed_at}" if result.resumed_at else ""
    print(f"ingest {result.identity}: wrote {counts} to {args.topic} in {result.transactions} "
          f"transaction{'s' if result.transactions != 1 else ''}{resumed} ({result.seconds:.2f}s)")
    return 0


def cmd_correct(args: argparse.Namespace) -> int:
    import orjson

    from refold.ingest import correct

    change = correct(_settings(args), args.topic, _columns(args.primary_key, "--primary-key"),
                     _json_object(args.key, "--key"), _json_object(args.set, "--set"), event_time=args.event_time)
    if change is None:
        print(f"the row of {args.key} already has those values; nothing written")
        return 0
    print(f"-C {orjson.dumps(change.old).decode()}")
    print(f"+C {orjson.dumps(change.new).decode()}")
    return 0


def cmd_retract(args: argparse.Namespace) -> int:
    import orjson

    from refold.ingest import retract

    change = retract(_settings(args), args.topic, _columns(args.primary_key, "--primary-key"),
                     _json_object(args.key, "--key"), event_time=args.event_time)
    print(f"-R {orjson.dumps(change.old).decode()}")
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


def _stop_on_sigterm(request_stop: Callable[[], None]) -> None:
    """SIGTERM (`docker stop`, a service manager) stops the run as Ctrl-C does: the batch
    in flight commits or aborts whole, then the run ends with status 0. A second SIGTERM
    while it stops is ignored (the sender's SIGKILL is the way to stop at once). The
    handler only asks (`request_stop`): an exception raised into whatever the driver is
    doing could land inside a call to Spark's JVM and break its connection."""
    import signal

    def on_term(_signum: int, _frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        logging.getLogger("refold").info("SIGTERM: stopping after the current batch")
        request_stop()

    signal.signal(signal.SIGTERM, on_term)


def cmd_run(args: argparse.Namespace) -> int:
    from refold.spark.job import request_stop, run_pipeline

    # a container, a service manager, CI: structured log lines; a person: a line per batch
    log_format = args.log_format or ("text" if sys.stderr.isatty() else "json")
    if log_format == "json":
        from refold.ops.monitor import json_logging

        json_logging()
    _stop_on_sigterm(request_stop)
    pipeline = _pipeline(args)
    run_pipeline(
        pipeline, bootstrap=args.bootstrap_servers, until_idle=args.until_idle, metrics_port=args.metrics_port,
        log_format=log_format,
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from refold.ops.status import print_status

    pipeline = _pipeline(args)
    return 0 if print_status(pipeline, bootstrap=args.bootstrap_servers) else NEVER_RAN


def cmd_trace(args: argparse.Namespace) -> int:
    from refold.cli import trace

    pipeline = _pipeline(args)
    return trace.run(pipeline, pipeline.kafka_settings(args.bootstrap_servers), key=args.key, input_=args.input,
                     since=args.since, until=args.until, as_json=args.json)


def cmd_explain(args: argparse.Namespace) -> int:
    from refold.config import load_pipeline
    from refold.ops.explain import explain

    print(explain(load_pipeline(args.pipeline), drawing="mermaid" if args.mermaid else "tree"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refold", description="Exactly-once changelog engine on Kafka.")
    parser.add_argument(
        "--bootstrap-servers",
        default=environment.bootstrap_servers(),
        help="Kafka cluster to use (default: REFOLD_BOOTSTRAP_SERVERS, else the local broker 127.0.0.1:9092)",
    )
    parser.add_argument("--version", action="version", version=f"refold {version()}")
    parser.add_argument(
        "-v", "--verbose", action="store_true",
        help="debug logging, librdkafka's own log lines, and Spark's log on the terminal instead of its file "
             "(<refold home>/logs/)",
    )
    parser.add_argument(
        "--kafka-config", metavar="FILE", help="librdkafka settings, key=value lines (SASL, TLS: docs/SECURITY.md)"
    )
    parser.add_argument(
        "-X", dest="kafka_setting", action="append", metavar="KEY=VALUE", help="one librdkafka setting (repeatable)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    kafka = sub.add_parser("kafka", help="a local Apache Kafka broker or cluster (KRaft) under .refold/")
    kafka.add_argument("action", choices=["start", "stop", "status"])
    kafka.add_argument("--port", type=int, default=9092,
                       help="the broker's port; a cluster's brokers take this one and the next ones")
    kafka.add_argument("--brokers", type=int, default=1,
                       help="start: a KRaft cluster of this many nodes (3: replication factor 3, "
                            "min.insync.replicas 2); default 1, the single broker")
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

    ingest = sub.add_parser("ingest", help="write the changelog a snapshot, ledger, upsert or append batch means "
                                           "against the topic's live rows, exactly once (docs/ingest.md)")
    ingest.add_argument("topic")
    ingest.add_argument("files", nargs="*", metavar="FILE",
                        help="CSV, JSON-lines or Parquet files, folders or globs ('-' or none: stdin)")
    ingest.add_argument("--merge", required=True, choices=["snapshot", "ledger", "upsert", "append"])
    ingest.add_argument("--primary-key", metavar="COL[,COL]", help="the primary-key columns (the message key)")
    ingest.add_argument("--compare-columns", metavar="COL,...",
                        help="snapshot: a row changed only when one of these columns did")
    ingest.add_argument("--event-time", metavar="COL", help="the column of each row's event time "
                                                            "(default: the ingest's time)")
    ingest.add_argument("--deleted-column", metavar="COL",
                        help="upsert: a row whose COL is true retracts its key's row (COL is not written)")
    ingest.add_argument("--format", choices=["csv", "jsonl", "parquet"], help="default: from the file names")
    ingest.add_argument("--name", help="the ingest's identity (default: the SHA-256 of its input and options)")
    ingest.add_argument("--partitions", type=int, default=3, help="partitions if the topic must be created")
    ingest.add_argument("--per-transaction", type=int, default=10_000, help="changes per Kafka transaction")
    ingest.set_defaults(func=cmd_ingest)

    for verb, text in (("correct", "set columns of one row by its primary key: the exact -C/+C pair"),
                       ("retract", "retract one row by its primary key: -R with the exact old row")):
        keyed = sub.add_parser(verb, help=text)
        keyed.add_argument("topic")
        keyed.add_argument("--primary-key", required=True, metavar="COL[,COL]")
        keyed.add_argument("--key", required=True, metavar="JSON", help="the key, e.g. '{\"id\": 7}'")
        if verb == "correct":
            keyed.add_argument("--set", required=True, metavar="JSON", help="the new values, e.g. '{\"score\": 90}'")
        keyed.add_argument("--event-time", type=int, metavar="MS", help="epoch ms (default: now)")
        keyed.set_defaults(func=cmd_correct if verb == "correct" else cmd_retract)

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
    run.add_argument(
        "--log-format", choices=["text", "json"],
        help="progress and log lines: text (a line per batch a person reads) or json (one object a line); "
             "default: text on a terminal, json otherwise",
    )
    run.set_defaults(func=cmd_run)

    status = sub.add_parser(
        "status", help="committed offsets, lag, last batch of a pipeline",
        description="Committed offsets, lag, last batch and shards of a pipeline, as its P.checkpoints topic "
                    "holds them.",
        epilog=f"exit status: 0 the status is printed (also before the first committed batch); "
               f"{NEVER_RAN} the pipeline never ran (no P.checkpoints topic on the cluster: `refold run` "
               f"starts it); 2 an error (the pipeline file, the cluster).",
    )
    status.add_argument("pipeline")
    status.set_defaults(func=cmd_status)

    trace = sub.add_parser(
        "trace", help="a view key's history with the input event behind each change, or what an input event caused",
        description="From the cause headers of the view, delta and dead-letter records (docs/provenance.md): "
                    "--key, a view key's records oldest first, each with the input event that caused it and "
                    "the one whose record it retracts; --input, every record that input event caused.",
        epilog="exit status: 0 records found; 1 none found; 2 an error.",
    )
    trace.add_argument("pipeline")
    trace.add_argument("--key", metavar="JSON", help="the view key as a JSON object of its key columns")
    trace.add_argument("--input", metavar="TOPIC:PARTITION:OFFSET", help="an input event of the source topic")
    trace.add_argument("--since", type=int, metavar="OFFSET", help="scan view records from this offset on")
    trace.add_argument("--until", type=int, metavar="OFFSET", help="scan view records before this offset")
    trace.add_argument("--json", action="store_true", help="one JSON object per record")
    trace.set_defaults(func=cmd_trace)

    explain = sub.add_parser("explain", help="the view a pipeline runs (the spec a SQL view becomes) and its plan: "
                                             "its stages, shards, transactional ids and topics, as a tree")
    explain.add_argument("pipeline")
    explain.add_argument("--mermaid", action="store_true",
                         help="print the plan as a Mermaid flowchart (for docs) instead")
    explain.set_defaults(func=cmd_explain)
    return parser


def version() -> str:
    """The installed package's version (its metadata)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("refold")
    except PackageNotFoundError:  # run from a checkout without `pip install`
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # py4j logs every command it sends to the JVM at DEBUG, Kafka options (passwords) too;
    # its INFO lines (callback server, connections) are for -v only.
    logging.getLogger("py4j").setLevel(logging.INFO if args.verbose else logging.WARNING)
    from refold.spark import logs

    logs.to_terminal(args.verbose)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"refold: error: {exc}{_trace(exc)}", file=sys.stderr)
        return 2
    except OperationalError as exc:  # nothing committed: a restart retries
        print(f"refold: failed: {exc}{_trace(exc)}", file=sys.stderr)
        return 1
    except RefoldError as exc:
        print(f"refold: internal error: {exc}{_trace(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not logs.from_spark(exc):
            raise
        # Spark's or the JVM's own error: one line here, the traces in Spark's log file
        print(f"refold: error: Spark failed: {logs.first_line(exc)}{_trace(exc)}; "
              "run again with -v for Spark's log on the terminal", file=sys.stderr)
        return 1


def _trace(exc: BaseException) -> str:
    """Where the trace of an error Spark or the JVM took part in went (its log file)."""
    from refold.spark import logs

    if not logs.from_spark(exc):
        return ""

    where = logs.record_failure(exc)
    return f" (the trace: {where})" if where is not None else ""


if __name__ == "__main__":
    sys.exit(main())
