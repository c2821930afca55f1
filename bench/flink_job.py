"""The Apache Flink contender of `make bench`: the bench's per-key reduction as Flink SQL.

Run by the Flink virtualenv's python (`.refold/flink-venv`, see `bench/flink.py`),
never by Refold's: PyFlink pins its own pyarrow, pandas and protobuf. It imports
nothing from Refold. One JSON object per line on stdout tells the parent what
happened when (wall clock, `time.time()`): `{"event": "submitted", "t": ...}` right
before the job starts, `{"event": "finished", "t": ...}` when it has ended.

The source is the bench's changelog topic read as plain JSON (`op` is a column: Flink
SQL cannot turn a column into a RowKind), bounded at the offsets that are the end
when the job starts, so the job ends by itself. A retraction (`-R`, `-C`) counts -1,
an addition (`+A`, `+C`) +1. Two reductions:

- `multiset` (the default, faithful): the live copies of each row are counted
  first (`GROUP BY` every row column, `SUM(sign)`), rows whose count is 0 drop out,
  then per key `total = SUM(score * n)`, `games = SUM(n)`, `best = MAX(score)` over
  that updating table (Flink's retracting MAX). A key with no live row is deleted
  (a tombstone), as in Refold's view.
- `signed`: one level, `SUM(sign * score)` and `SUM(sign)` per key; no `best`, and
  a key whose rows are all retracted stays with 0 / 0.

Refold's `latest` (last by offset) has no faithful Flink SQL form here and is left out.

The result goes to an `upsert-kafka` table (key `{"player_name": ...}`, JSON value)
with `sink.delivery-guarantee = exactly-once`: Flink commits its Kafka transactions
on checkpoints, so checkpointing is on (every `--checkpoint-ms`), and a bounded job
takes a final checkpoint when its input ends, which commits the rest.

    python bench/flink_job.py --bootstrap H:P --source T --output T2 --jar PATH
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--jar", required=True, action="append", help="connector jar (repeatable)")
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--checkpoint-ms", type=int, default=1000)
    parser.add_argument("--reduction", choices=("multiset", "signed"), default="multiset")
    parser.add_argument("--run-id", default=str(int(time.time())))
    args = parser.parse_args(argv)

    from pyflink.table import EnvironmentSettings, TableEnvironment

    env = TableEnvironment.create(EnvironmentSettings.in_streaming_mode())
    conf = env.get_config()
    for key, value in {
        "pipeline.jars": ";".join(f"file://{jar}" for jar in args.jar),
        "parallelism.default": str(args.parallelism),
        "execution.checkpointing.interval": f"{args.checkpoint_ms}ms",
        "execution.checkpointing.mode": "EXACTLY_ONCE",
        # Checkpoints to files: the default (the JobManager's memory) refuses a state over
        # 5 MB, which the multiset reduction passes at ~30k keys (then every checkpoint
        # fails and the job restarts for ever).
        "execution.checkpointing.storage": "filesystem",
        "execution.checkpointing.dir": f"file:///tmp/refold-bench/flink-checkpoints/{args.run_id}",
        # Group aggregation buffers input per key for a moment, like Refold's batches.
        "table.exec.mini-batch.enabled": "true",
        "table.exec.mini-batch.allow-latency": "200ms",
        "table.exec.mini-batch.size": "5000",
    }.items():
        conf.set(key, value)

    kafka = f"'properties.bootstrap.servers' = '{args.bootstrap}'"
    env.execute_sql(f"""
        CREATE TABLE changelog (
            op STRING,
            player_name STRING,
            score BIGINT,
            bonus DOUBLE,
            team STRING
        ) WITH (
            'connector' = 'kafka',
            'topic' = '{args.source}',
            {kafka},
            'properties.group.id' = 'bench-flink-{args.run_id}',
            'properties.isolation.level' = 'read_committed',
            'scan.startup.mode' = 'earliest-offset',
            'scan.bounded.mode' = 'latest-offset',
            'format' = 'json',
            'json.fail-on-missing-field' = 'false',
            'json.ignore-parse-errors' = 'false'
        )""")
    env.execute_sql("""
        CREATE TEMPORARY VIEW signed_changelog AS
        SELECT player_name, score, bonus, team,
               CAST(CASE WHEN op IN ('-R', '-C') THEN -1 ELSE 1 END AS BIGINT) AS sign
        FROM changelog""")
    best = "best BIGINT," if args.reduction == "multiset" else ""
    env.execute_sql(f"""
        CREATE TABLE view_out (
            player_name STRING,
            total BIGINT,
            games BIGINT,
            {best}
            PRIMARY KEY (player_name) NOT ENFORCED
        ) WITH (
            'connector' = 'upsert-kafka',
            'topic' = '{args.output}',
            {kafka},
            'key.format' = 'json',
            'value.format' = 'json',
            'sink.delivery-guarantee' = 'exactly-once',
            'sink.transactional-id-prefix' = 'bench-flink-{args.run_id}',
            'properties.transaction.timeout.ms' = '600000'
        )""")
    if args.reduction == "multiset":
        insert = """
            INSERT INTO view_out
            SELECT player_name, SUM(score * n), SUM(n), MAX(score)
            FROM (
                SELECT player_name, score, bonus, team, SUM(sign) AS n
                FROM signed_changelog
                GROUP BY player_name, score, bonus, team
            )
            WHERE n > 0
            GROUP BY player_name"""
    else:
        insert = """
            INSERT INTO view_out
            SELECT player_name, SUM(sign * score), SUM(sign)
            FROM signed_changelog
            GROUP BY player_name"""
    say("submitted", reduction=args.reduction)
    env.execute_sql(insert).wait()
    say("finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
