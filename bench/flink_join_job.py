"""The Apache Flink contender of `make bench-join`: revenue per region over orders joined
with customers, as Flink SQL's regular join and GROUP BY over the two changelog topics.

Run by the Flink virtualenv's python (`.refold/flink-venv`, see `bench/flink.py`); it
imports nothing from Refold. One JSON object per line on stdout, as `flink_job.py`
writes them (`submitted`, `finished`).

Both topics are read as plain JSON (`op` is a column: Flink SQL cannot turn a column
into a RowKind), bounded at the offsets that are the end when the job starts, so the
job ends by itself. A retraction (`-R`, `-C`) counts -1, an addition (`+A`, `+C`) +1.
Two reductions, as `flink_job.py` has:

- `multiset` (the default, faithful): each side's live copies of each row are counted
  first (`GROUP BY` every column, `SUM(sign)`, rows whose count is 0 drop out), then
  the two updating tables are joined (a regular join: Flink keeps both sides' rows in
  state and retracts joined rows when a side's row goes) and grouped by region:
  `revenue = SUM(amount * n_order * n_customer)`, `orders = SUM(n_order * n_customer)`.
  A region left with no joined row is deleted (a tombstone), as in Refold's view.
- `signed`: the two sides' events joined as they come (insert-only inputs, all of
  them kept in the join's state), `SUM(sign_o * sign_c * amount)` and `SUM(sign_o *
  sign_c)` per region: the join is bilinear, so the signed sums are the live rows'
  sums; a region whose rows are all gone stays with 0 / 0.

The result goes to an `upsert-kafka` table (key `{"region": ...}`, JSON value) with
`sink.delivery-guarantee = exactly-once`; checkpointing is on (every `--checkpoint-ms`)
and a bounded job takes a final checkpoint when its input ends, which commits the rest.

    python bench/flink_join_job.py --bootstrap H:P --orders T1 --customers T2 --output T3 --jar PATH
"""

from __future__ import annotations

import argparse
import json
import sys
import time

SIGN = "CAST(CASE WHEN op IN ('-R', '-C') THEN -1 ELSE 1 END AS BIGINT)"


def say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def source(name: str, topic: str, columns: str, bootstrap: str, run_id: str) -> str:
    return f"""
        CREATE TABLE {name} (
            op STRING,
            {columns}
        ) WITH (
            'connector' = 'kafka',
            'topic' = '{topic}',
            'properties.bootstrap.servers' = '{bootstrap}',
            'properties.group.id' = 'bench-flink-join-{run_id}-{name}',
            'properties.isolation.level' = 'read_committed',
            'scan.startup.mode' = 'earliest-offset',
            'scan.bounded.mode' = 'latest-offset',
            'format' = 'json',
            'json.fail-on-missing-field' = 'false',
            'json.ignore-parse-errors' = 'false'
        )"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--orders", required=True)
    parser.add_argument("--customers", required=True)
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
        # to files: the join's and the groups' state passes the JobManager memory's 5 MB
        "execution.checkpointing.storage": "filesystem",
        "execution.checkpointing.dir": f"file:///tmp/refold-bench/flink-checkpoints/{args.run_id}",
        # group aggregation buffers input per key for a moment, like Refold's batches
        "table.exec.mini-batch.enabled": "true",
        "table.exec.mini-batch.allow-latency": "200ms",
        "table.exec.mini-batch.size": "5000",
    }.items():
        conf.set(key, value)

    env.execute_sql(source("orders", args.orders, "id BIGINT, customer_id BIGINT, amount BIGINT",
                           args.bootstrap, args.run_id))
    env.execute_sql(source("customers", args.customers, "id BIGINT, region STRING, name STRING",
                           args.bootstrap, args.run_id))
    env.execute_sql(f"""
        CREATE TABLE region_out (
            region STRING,
            revenue BIGINT,
            orders BIGINT,
            PRIMARY KEY (region) NOT ENFORCED
        ) WITH (
            'connector' = 'upsert-kafka',
            'topic' = '{args.output}',
            'properties.bootstrap.servers' = '{args.bootstrap}',
            'key.format' = 'json',
            'value.format' = 'json',
            'sink.delivery-guarantee' = 'exactly-once',
            'sink.transactional-id-prefix' = 'bench-flink-join-{args.run_id}',
            'properties.transaction.timeout.ms' = '600000'
        )""")
    if args.reduction == "multiset":
        env.execute_sql(f"""
            CREATE TEMPORARY VIEW live_orders AS
            SELECT id, customer_id, amount, n FROM (
                SELECT id, customer_id, amount, SUM({SIGN}) AS n FROM orders GROUP BY id, customer_id, amount)
            WHERE n > 0""")
        env.execute_sql(f"""
            CREATE TEMPORARY VIEW live_customers AS
            SELECT id, region, n FROM (
                SELECT id, region, name, SUM({SIGN}) AS n FROM customers GROUP BY id, region, name)
            WHERE n > 0""")
        insert = """
            INSERT INTO region_out
            SELECT c.region, SUM(o.amount * o.n * c.n), SUM(o.n * c.n)
            FROM live_orders AS o JOIN live_customers AS c ON o.customer_id = c.id
            GROUP BY c.region"""
    else:
        insert = f"""
            INSERT INTO region_out
            SELECT c.region, SUM(o.sign * c.sign * o.amount), SUM(o.sign * c.sign)
            FROM (SELECT customer_id, amount, {SIGN} AS sign FROM orders) AS o
            JOIN (SELECT id, region, {SIGN} AS sign FROM customers) AS c ON o.customer_id = c.id
            GROUP BY c.region"""
    say("submitted", reduction=args.reduction)
    env.execute_sql(insert).wait()
    say("finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
