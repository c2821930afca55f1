"""The Apache Flink contender of `make bench-windows`: a tumble per player as Flink SQL's
TUMBLE window table-valued function over an event-time watermark.

Run by the Flink virtualenv's python (`.refold/flink-venv`, see `bench/flink.py`); it
imports nothing from Refold. One JSON object per line on stdout, as `flink_job.py`
writes them (`submitted`, `finished`).

The source is the windowed bench's topic read as plain JSON (`op` is a column), bounded
at the offsets that are the end when the job starts. The event time is `ts` (epoch
ms) as a `TIMESTAMP_LTZ(3)` with `WATERMARK FOR rowtime AS rowtime - lateness`. Per
player and window: `SUM(sign * score)` and `SUM(sign)` (a retraction counts -1). The
window's start goes out as epoch ms (the smallest `ts` of the window, floored to the
window: no time zone involved). Flink writes each window once, when the watermark
passes its end, to a plain `kafka` table with `sink.delivery-guarantee = exactly-once`;
a row later than the watermark is dropped (Flink counts it in a metric, no more).

    python bench/flink_windows_job.py --bootstrap H:P --source T --output T2 --jar PATH --window-ms 60000 --lateness-ms 60000
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def seconds(ms: int) -> str:
    """Milliseconds as an interval literal's seconds: `60`, `1.500`."""
    return f"{ms // 1000}" if ms % 1000 == 0 else f"{ms // 1000}.{ms % 1000:03d}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--jar", required=True, action="append", help="connector jar (repeatable)")
    parser.add_argument("--window-ms", type=int, required=True)
    parser.add_argument("--lateness-ms", type=int, required=True)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--checkpoint-ms", type=int, default=1000)
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
        "execution.checkpointing.storage": "filesystem",
        "execution.checkpointing.dir": f"file:///tmp/refold-bench/flink-checkpoints/{args.run_id}",
        "table.local-time-zone": "UTC",
    }.items():
        conf.set(key, value)

    kafka = f"'properties.bootstrap.servers' = '{args.bootstrap}'"
    env.execute_sql(f"""
        CREATE TABLE changelog (
            op STRING,
            player_name STRING,
            score BIGINT,
            ts BIGINT,
            rowtime AS TO_TIMESTAMP_LTZ(ts, 3),
            WATERMARK FOR rowtime AS rowtime - INTERVAL '{seconds(args.lateness_ms)}' SECOND
        ) WITH (
            'connector' = 'kafka',
            'topic' = '{args.source}',
            {kafka},
            'properties.group.id' = 'bench-flink-windows-{args.run_id}',
            'properties.isolation.level' = 'read_committed',
            'scan.startup.mode' = 'earliest-offset',
            'scan.bounded.mode' = 'latest-offset',
            'format' = 'json',
            'json.fail-on-missing-field' = 'false',
            'json.ignore-parse-errors' = 'false'
        )""")
    env.execute_sql(f"""
        CREATE TABLE windows_out (
            player_name STRING,
            window_start BIGINT,
            total BIGINT,
            games BIGINT
        ) WITH (
            'connector' = 'kafka',
            'topic' = '{args.output}',
            {kafka},
            'format' = 'json',
            'sink.delivery-guarantee' = 'exactly-once',
            'sink.transactional-id-prefix' = 'bench-flink-windows-{args.run_id}',
            'properties.transaction.timeout.ms' = '600000'
        )""")
    insert = f"""
        INSERT INTO windows_out
        SELECT player_name, MIN(ts) - MOD(MIN(ts), CAST({args.window_ms} AS BIGINT)),
               SUM(CASE WHEN op IN ('-R', '-C') THEN -score ELSE score END),
               SUM(CAST(CASE WHEN op IN ('-R', '-C') THEN -1 ELSE 1 END AS BIGINT))
        FROM TABLE(TUMBLE(TABLE changelog, DESCRIPTOR(rowtime), INTERVAL '{seconds(args.window_ms)}' SECOND))
        GROUP BY player_name, window_start, window_end"""
    say("submitted")
    env.execute_sql(insert).wait()
    say("finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
