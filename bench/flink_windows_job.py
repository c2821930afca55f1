"""The Apache Flink contender of `make bench-windows`: a tumble per player as Flink SQL's
TUMBLE window table-valued function over an event-time watermark.

Run by the Flink virtualenv's python (`.refold/flink-venv`, see `bench/flink.py`); it
imports nothing from Refold (its shared parts: `flink_sql.py`). One JSON object per
line on stdout, as `flink_job.py` writes them (`submitted`, `finished`).

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

import sys

from flink_sql import SIGN, changelog_table, execute, job_parser, kafka_sink, table_environment


def seconds(ms: int) -> str:
    """Milliseconds as an interval literal's seconds: `60`, `1.500`."""
    return f"{ms // 1000}" if ms % 1000 == 0 else f"{ms // 1000}.{ms % 1000:03d}"


def main(argv: list[str] | None = None) -> int:
    parser = job_parser()
    parser.add_argument("--source", required=True)
    parser.add_argument("--window-ms", type=int, required=True)
    parser.add_argument("--lateness-ms", type=int, required=True)
    args = parser.parse_args(argv)

    env = table_environment(args, **{"table.local-time-zone": "UTC"})
    group = f"bench-flink-windows-{args.run_id}"
    env.execute_sql(changelog_table("changelog", args.source, f"""player_name STRING,
            score BIGINT,
            ts BIGINT,
            rowtime AS TO_TIMESTAMP_LTZ(ts, 3),
            WATERMARK FOR rowtime AS rowtime - INTERVAL '{seconds(args.lateness_ms)}' SECOND""",
                                    args.bootstrap, group))
    env.execute_sql(f"""
        CREATE TABLE windows_out (
            player_name STRING,
            window_start BIGINT,
            total BIGINT,
            games BIGINT
        ) {kafka_sink(args.output, args.bootstrap, group, upsert=False)}""")
    insert = f"""
        INSERT INTO windows_out
        SELECT player_name, MIN(ts) - MOD(MIN(ts), CAST({args.window_ms} AS BIGINT)),
               SUM({SIGN} * score), SUM({SIGN})
        FROM TABLE(TUMBLE(TABLE changelog, DESCRIPTOR(rowtime), INTERVAL '{seconds(args.window_ms)}' SECOND))
        GROUP BY player_name, window_start, window_end"""
    return execute(env, insert)


if __name__ == "__main__":
    sys.exit(main())
