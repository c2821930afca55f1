"""What the Flink jobs of the benches share (`flink_job.py`, `flink_windows_job.py`,
`flink_join_job.py`): their arguments, the table environment's settings, a changelog
topic as a Flink table, the sign of an event, the lines they tell the parent.

Run in Flink's virtualenv with the jobs, never by Refold's python: it imports nothing
from Refold, and the jobs import it as a sibling (`from flink_sql import …`: a script's
own folder is first on its module path).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

# a retraction (-R, -C) counts -1, an addition (+A, +C) +1: `op` is a column to Flink SQL
SIGN = "CAST(CASE WHEN op IN ('-R', '-C') THEN -1 ELSE 1 END AS BIGINT)"


def say(event: str, **fields: object) -> None:
    """One JSON line for the parent (`bench.flink.run_job`): what happened, when."""
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def job_parser(*, reduction: bool = False) -> argparse.ArgumentParser:
    """The arguments every job takes (the broker, its output, the connector jars, its
    parallelism, checkpoint interval and run id; with `reduction`, `--reduction multiset`
    or `signed`); a job adds its own."""
    parser = argparse.ArgumentParser()
    if reduction:
        parser.add_argument("--reduction", choices=("multiset", "signed"), default="multiset")
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--jar", required=True, action="append", help="connector jar (repeatable)")
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--checkpoint-ms", type=int, default=1000)
    parser.add_argument("--run-id", default=str(int(time.time())))
    return parser


def table_environment(args: argparse.Namespace, **more: str) -> Any:
    """A streaming TableEnvironment with the connector jars, the parallelism, exactly-once
    checkpoints to files (the default, the JobManager's memory, refuses a state over 5 MB:
    then every checkpoint fails and the job restarts for ever), and `more` settings."""
    from pyflink.table import EnvironmentSettings, TableEnvironment

    env = TableEnvironment.create(EnvironmentSettings.in_streaming_mode())
    conf = env.get_config()
    for key, value in {
        "pipeline.jars": ";".join(f"file://{jar}" for jar in args.jar),
        "parallelism.default": str(args.parallelism),
        "execution.checkpointing.interval": f"{args.checkpoint_ms}ms",
        "execution.checkpointing.mode": "EXACTLY_ONCE",
        "execution.checkpointing.storage": "filesystem",
        "execution.checkpointing.dir": f"file:///tmp/refold-bench/flink-checkpoints/{args.run_id}",
        **more,
    }.items():
        conf.set(key, value)
    return env


# group aggregation buffers input per key for a moment, like Refold's batches
MINI_BATCH = {"table.exec.mini-batch.enabled": "true", "table.exec.mini-batch.allow-latency": "200ms",
              "table.exec.mini-batch.size": "5000"}


def changelog_table(name: str, topic: str, columns: str, bootstrap: str, group: str) -> str:
    """DDL of a changelog topic read as plain JSON (`op STRING` then `columns`),
    read_committed from the earliest offsets, bounded at the offsets that are the end
    when the job starts (so the job ends by itself)."""
    return f"""
        CREATE TABLE {name} (
            op STRING,
            {columns}
        ) WITH (
            'connector' = 'kafka',
            'topic' = '{topic}',
            'properties.bootstrap.servers' = '{bootstrap}',
            'properties.group.id' = '{group}',
            'properties.isolation.level' = 'read_committed',
            'scan.startup.mode' = 'earliest-offset',
            'scan.bounded.mode' = 'latest-offset',
            'format' = 'json',
            'json.fail-on-missing-field' = 'false',
            'json.ignore-parse-errors' = 'false'
        )"""


def kafka_sink(topic: str, bootstrap: str, prefix: str, upsert: bool) -> str:
    """The WITH clause of an exactly-once Kafka sink table (`upsert-kafka`, JSON key and
    value, when `upsert`; else `kafka`, JSON)."""
    formats = ("'connector' = 'upsert-kafka', 'key.format' = 'json', 'value.format' = 'json'" if upsert
               else "'connector' = 'kafka', 'format' = 'json'")
    return f"""WITH (
            {formats},
            'topic' = '{topic}',
            'properties.bootstrap.servers' = '{bootstrap}',
            'sink.delivery-guarantee' = 'exactly-once',
            'sink.transactional-id-prefix' = '{prefix}',
            'properties.transaction.timeout.ms' = '600000'
        )"""


def execute(env: Any, insert: str, **fields: object) -> int:
    """Run the job's INSERT to its end, telling the parent when it was submitted and
    when it finished; the script's exit status."""
    say("submitted", **fields)
    env.execute_sql(insert).wait()
    say("finished")
    return 0
