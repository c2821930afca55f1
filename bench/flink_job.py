"""The Apache Flink contender of `make bench`: the bench's per-key reduction as Flink SQL.

Run by the Flink virtualenv's python (`.refold/flink-venv`, see `bench/flink.py`),
never by Refold's: PyFlink pins its own pyarrow, pandas and protobuf. It imports
nothing from Refold (its shared parts: `flink_sql.py`). One JSON object per line on
stdout tells the parent what happened when (wall clock, `time.time()`): `{"event": "submitted", "t": ...}` right
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

import sys

import flink_sql as sql


def main(argv: list[str] | None = None) -> int:
    parser = sql.job_parser(reduction=True)
    parser.add_argument("--source", required=True)
    args = parser.parse_args(argv)

    env = sql.table_environment(args, **sql.MINI_BATCH)
    group = f"bench-flink-{args.run_id}"
    env.execute_sql(sql.changelog_table("changelog", args.source, """player_name STRING,
            score BIGINT,
            bonus DOUBLE,
            team STRING""", args.bootstrap, group))
    env.execute_sql(f"""
        CREATE TEMPORARY VIEW signed_changelog AS
        SELECT player_name, score, bonus, team, {sql.SIGN} AS sign
        FROM changelog""")
    best = "best BIGINT," if args.reduction == "multiset" else ""
    env.execute_sql(f"""
        CREATE TABLE view_out (
            player_name STRING,
            total BIGINT,
            games BIGINT,
            {best}
            PRIMARY KEY (player_name) NOT ENFORCED
        ) {sql.kafka_sink(args.output, args.bootstrap, group, upsert=True)}""")
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
    return sql.execute(env, insert, reduction=args.reduction)


if __name__ == "__main__":
    sys.exit(main())
