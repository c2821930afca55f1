"""The Apache Flink contender of `make bench-join`: revenue per region over orders joined
with customers, as Flink SQL's regular join and GROUP BY over the two changelog topics.

Run by the Flink virtualenv's python (`.refold/flink-venv`, see `bench/flink.py`); it
imports nothing from Refold (its shared parts: `flink_sql.py`). One JSON object per line
on stdout, as `flink_job.py` writes them (`submitted`, `finished`).

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

import sys

import flink_sql as sql


def main(argv: list[str] | None = None) -> int:
    parser = sql.job_parser(reduction=True)
    parser.add_argument("--orders", required=True)
    parser.add_argument("--customers", required=True)
    args = parser.parse_args(argv)

    env = sql.table_environment(args, **sql.MINI_BATCH)
    group = f"bench-flink-join-{args.run_id}"
    env.execute_sql(sql.changelog_table("orders", args.orders, "id BIGINT, customer_id BIGINT, amount BIGINT",
                                    args.bootstrap, f"{group}-orders"))
    env.execute_sql(sql.changelog_table("customers", args.customers, "id BIGINT, region STRING, name STRING",
                                    args.bootstrap, f"{group}-customers"))
    env.execute_sql(f"""
        CREATE TABLE region_out (
            region STRING,
            revenue BIGINT,
            orders BIGINT,
            PRIMARY KEY (region) NOT ENFORCED
        ) {sql.kafka_sink(args.output, args.bootstrap, group, upsert=True)}""")
    if args.reduction == "multiset":
        env.execute_sql(f"""
            CREATE TEMPORARY VIEW live_orders AS
            SELECT id, customer_id, amount, n FROM (
                SELECT id, customer_id, amount, SUM({sql.SIGN}) AS n FROM orders GROUP BY id, customer_id, amount)
            WHERE n > 0""")
        env.execute_sql(f"""
            CREATE TEMPORARY VIEW live_customers AS
            SELECT id, region, n FROM (
                SELECT id, region, name, SUM({sql.SIGN}) AS n FROM customers GROUP BY id, region, name)
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
            FROM (SELECT customer_id, amount, {sql.SIGN} AS sign FROM orders) AS o
            JOIN (SELECT id, region, {sql.SIGN} AS sign FROM customers) AS c ON o.customer_id = c.id
            GROUP BY c.region"""
    return sql.execute(env, insert, reduction=args.reduction)


if __name__ == "__main__":
    sys.exit(main())
