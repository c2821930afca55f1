"""Join pipelines in the engine (docs/SEMANTICS.md, Joins): a join's shards against
`refold.reference_joins` record by record on the real broker (random changelogs of both
sides, random batch cuts, restarts), merged and co-partitioned; a grouped view over the
join against the reference grouped view over the reference join; the plan's `join` stage."""

from __future__ import annotations

import itertools
import os
import pickle
import random
import signal
import subprocess
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import duckdb
import orjson
import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_join import COLUMNS, Unit, changelogs
from test_join import as_units as numbered

from refold.cli.produce import produce
from refold.codecs.avro import AvroCodec
from refold.config import Pipeline, ViewSpec, load_pipeline, parse_pipeline
from refold.kafka.io import TopicSpec, ensure_topics, open_transactions, read_to_end
from refold.model.changelog import ChangelogEvent, Op
from refold.model.reasons import Reason
from refold.ops.status import print_status
from refold.ops.verify import verify
from refold.plan import RIGHT_PARTITIONS, plan_of
from refold.plan.draw import mermaid, tree
from refold.recovery.records import decode_dead_letter
from refold.recovery.restore import load_checkpoints
from refold.reference import reference_changelog
from refold.reference_joins import reference_join
from refold.runtime.batch import InputRecord
from refold.runtime.processor import BatchProcessor
from refold.spark.job import engine_topics, run_pipeline

GROUPED = {"key": ["region"], "columns": {"revenue": {"sum": "amount"}, "orders": {"count": "id"}}}


def join_pipeline(name: str, bootstrap: str, kind: str, *, key: list[str] | None = None, grouped: bool = False,
                  keyed: bool = False, **more: Any) -> Pipeline:
    """orders ⋈ customers on orders.cust = customers.cid; `keyed`: on orders.cust =
    customers.cust, each source keyed by its join column (co-partitioned, when the
    partition counts agree: equal values are equal message keys)."""
    right = "cust" if keyed else "cid"
    columns = {**COLUMNS, "cid": f"customers.{right}"}
    join: dict[str, Any] = {"left": "orders", "right": "customers", "on": [["cust", right]], "type": kind,
                            "columns": columns, **({"key": key} if key else {})}
    sources = {"orders": {"topic": f"{name}.orders", **({"key": ["cust"]} if keyed else {})},
               "customers": {"topic": f"{name}.customers", **({"key": ["cust"]} if keyed else {})}}
    return parse_pipeline({"pipeline": name, "kafka": {"bootstrap.servers": bootstrap}, "sources": sources,
                           "view": {"join": join, **(GROUPED if grouped else {})},
                           "outputs": {"view": {"topic": f"{name}.view"}}, **more})


def renamed(units: Sequence[Unit]) -> list[Unit]:
    """The units with the customers' join column named `cust` (as the orders' is)."""
    return [(side, [e._replace(row={("cust" if k == "cid" else k): v for k, v in e.row.items()}) for e in events]
             if side else events) for side, events in units]


def wire(units: Sequence[Unit], partitions: int, right: int | None = None) -> tuple[list[InputRecord],
                                                                                    list[tuple[int, int, int]]]:
    """The units as the two topics' records, in the order they were made (the timestamp
    counts it up, so the engine merges both sources back into this order); each unit's
    first record as (side, partition, offset). A row goes to partition `cust`/`cid` mod
    `partitions` (`right`: the right source's, when it has another count; 0 for a null),
    keyed as `refold produce --key` keys it."""
    counts = (partitions, right or partitions)
    offsets: dict[int, int] = {}
    records: list[InputRecord] = []
    firsts = []
    for side, events in units:
        column = ("cust", "cid" if "cid" in events[0].row or "cust" not in events[0].row else "cust")[side]
        first = events[0].row.get(column)  # (a -C and its +C in one partition: the first's)
        partition = (first % counts[side] if isinstance(first, int) else 0) + side * RIGHT_PARTITIONS
        for index, event in enumerate(events):
            offset = offsets.get(partition, 0)
            offsets[partition] = offset + 1
            if index == 0:
                firsts.append((side, partition % RIGHT_PARTITIONS, offset))
            key = orjson.dumps({column: first})  # (a pair's halves share their message key)
            records.append(InputRecord(partition, offset, key, orjson.dumps({"op": event.op.code, **event.row}),
                                       len(records)))
    return records, firsts


def make_topics(pipeline: Pipeline, partitions: int) -> None:
    settings_ = {"bootstrap.servers": pipeline.kafka_settings()["bootstrap.servers"]}
    ensure_topics(settings_, [TopicSpec(s.topic, partitions) for s in pipeline.sources.values()]
                  + engine_topics(pipeline, partitions))


def run_batches(pipeline: Pipeline, records: list[InputRecord], cuts: list[int], restarts: list[bool]) -> None:
    settings_ = {"bootstrap.servers": pipeline.kafka_settings()["bootstrap.servers"]}
    processor = BatchProcessor(pipeline, settings_)
    try:
        bounds = [0, *sorted(set(cuts)), len(records)]
        for number, (start, end) in enumerate(itertools.pairwise(bounds)):
            processor.process(records[start:end])
            if restarts[number % len(restarts)]:
                processor.close()
                processor = BatchProcessor(pipeline, settings_)
        processor.process(records)  # a replay of everything: it writes nothing
    finally:
        processor.close()
    # a commit returns before its markers are written: a read_committed reader right after
    # it (the test's) may not see the last transaction yet
    outputs = [pipeline.dlq_topic, *([pipeline.outputs.view.topic] if pipeline.outputs.view is not None else [])]
    assert open_transactions(settings_, outputs, timeout=30) == []


def run_drawn(pipeline: Pipeline, units: Sequence[Unit], data: st.DataObject, cuts: int = 5,
              restarts: int = 4) -> list[tuple[int, int, int]]:
    """The units written to the pipeline's two sources (two partitions each, `wire`) and
    run in batches cut where `data` draws (at most `cuts` cuts), restarting after the
    batches it draws (a cycle of at most `restarts`); each unit's first record."""
    make_topics(pipeline, 2)
    records, firsts = wire(units, 2)
    drawn = data.draw(st.lists(st.integers(0, len(records)), max_size=cuts))
    run_batches(pipeline, records, drawn, data.draw(st.lists(st.booleans(), min_size=1, max_size=restarts)))
    return firsts


def produce_wired(pipeline: Pipeline, records: Sequence[InputRecord]) -> None:
    """The records into the pipeline's two source topics, at the offsets `wire` gave them."""
    producer = Producer({"bootstrap.servers": pipeline.kafka_settings()["bootstrap.servers"]})
    topics = [source.topic for source in pipeline.sources.values()]
    for record in records:
        producer.produce(topics[record.partition >= RIGHT_PARTITIONS], record.value, record.key,
                         partition=record.partition % RIGHT_PARTITIONS)
    assert producer.flush(30) == 0


def written(pipeline: Pipeline) -> list[bytes]:
    settings_ = {"bootstrap.servers": pipeline.kafka_settings()["bootstrap.servers"]}
    assert pipeline.outputs.view is not None
    return [m.value() for m in read_to_end(settings_, pipeline.outputs.view.topic)]


def by_partition(pipeline: Pipeline, topic: str) -> dict[int, list[Any]]:
    settings_ = {"bootstrap.servers": pipeline.kafka_settings()["bootstrap.servers"]}
    out: dict[int, list[Any]] = {}
    for message in read_to_end(settings_, topic):
        out.setdefault(message.partition(), []).append(message)
    return out


def changelog(changes: Sequence[Any]) -> list[bytes]:
    return [orjson.dumps({"op": c.op.code, **c.row}) for c in changes]


# the merged join, record by record -----------------------------------------------------------

@pytest.mark.kafka
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.data_too_large])
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]), data=st.data())
def test_a_merged_join_writes_what_the_reference_join_writes(bootstrap_servers: str, units: list[Unit], kind: str,
                                                             data: st.DataObject) -> None:
    check_merged_join(bootstrap_servers, units, kind, data, "python")  # (native: tests/test_join_engine_native.py)


def check_merged_join(bootstrap_servers: str, units: list[Unit], kind: str, data: st.DataObject, core: str) -> None:
    """Both sources over two partitions each, joined in one shard: the view topic is the
    reference join's changelog, record by record, whatever the batch cuts and restarts;
    each record names its unit's first event (`<topic>:<partition>:<offset>`); each
    refused unit is a dead letter naming its own topic, partition and offset."""
    key = data.draw(st.sampled_from([None, ["id"]]))
    pipeline = join_pipeline(f"je{uuid.uuid4().hex[:8]}", bootstrap_servers, kind, key=key, spark={"core": core})
    firsts = run_drawn(pipeline, units, data)
    spec = pipeline.view.join
    assert spec is not None
    expected = reference_join(spec, units)
    assert written(pipeline) == changelog(expected.changes)
    # provenance: each unit's records name its first event
    topics = (f"{pipeline.pipeline}.orders", f"{pipeline.pipeline}.customers")
    causes = []
    for index in range(len(units)):
        made = len(reference_join(spec, units[: index + 1]).changes) - len(reference_join(spec, units[:index]).changes)
        side, partition, offset = firsts[index]
        causes += [f"{topics[side]}:{partition}:{offset}".encode()] * made
    view = [m for part in by_partition(pipeline, f"{pipeline.pipeline}.view").values() for m in part]
    assert [dict(m.headers() or [])["refold.cause"] for m in view] == causes
    letters = sorted((d.topic, d.partition, d.offset, d.reason) for d in
                     (decode_dead_letter(m.value()) for m in read_to_end({"bootstrap.servers": bootstrap_servers},
                                                                         pipeline.dlq_topic)))
    assert letters == sorted((topics[firsts[i][0]], firsts[i][1], firsts[i][2], reason)
                             for i, reason in expected.rejected)
    assert all(reason == Reason.NOT_LIVE for _, reason in expected.rejected)
    checkpoint = load_checkpoints(pipeline, {"bootstrap.servers": bootstrap_servers})[0]
    assert checkpoint.records_in == sum(len(events) for _side, events in units)  # every record once, the replay none
    assert set(checkpoint.offsets) <= {0, 1, RIGHT_PARTITIONS, RIGHT_PARTITIONS + 1}


@pytest.mark.kafka
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.data_too_large])
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]), data=st.data())
def test_a_grouped_view_over_a_merged_join_is_the_reference_over_the_reference_join(
        bootstrap_servers: str, units: list[Unit], kind: str, data: st.DataObject) -> None:
    """Revenue per region over the join, in the join's shard: the view topic is the
    reference grouped view over the reference join's records; a joined row with a null
    region is a dead letter (`null key`) of the source record that made it."""
    pipeline = join_pipeline(f"jg{uuid.uuid4().hex[:8]}", bootstrap_servers, kind, key=["id"], grouped=True)
    run_drawn(pipeline, units, data)
    spec = pipeline.view.join
    assert spec is not None
    joined = reference_join(spec, units)
    view = ViewSpec.model_validate(GROUPED)
    expected = reference_changelog(view, numbered(joined.changes))
    assert written(pipeline) == changelog(expected.changes)
    letters = [decode_dead_letter(m.value()) for m in read_to_end({"bootstrap.servers": bootstrap_servers},
                                                                  pipeline.dlq_topic)]
    null_keys = [letter for letter in letters if letter.reason == Reason.NULL_KEY]
    assert len(null_keys) == len([r for r in expected.rejected if r[1] == Reason.NULL_KEY])


# co-partitioned: shard p joins partition p of both ----------------------------------------

@pytest.mark.kafka
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                                HealthCheck.data_too_large])
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]), data=st.data())
def test_a_co_partitioned_join_writes_the_reference_join_key_by_key(bootstrap_servers: str, units: list[Unit], kind: str,
                                                                    data: st.DataObject) -> None:
    check_co_partitioned_join(bootstrap_servers, units, kind, data, "python")  # (native: tests/test_join_engine_native.py)


def check_co_partitioned_join(bootstrap_servers: str, units: list[Unit], kind: str, data: st.DataObject, core: str) -> None:
    """Both sources keyed by their join column over three partitions each: three shards,
    each joining partition p of both; each shard's view partition is the reference
    join's changelog of that partition's join keys (nulls in partition 0), in order."""
    if any(len(events) == 2 and events[0].row.get(("cust", "cid")[side]) != events[1].row.get(("cust", "cid")[side])
           for side, events in units):
        return  # (a correction that moves a row to another join key is keyed by the new one: not co-partitioned)
    units = renamed(units)
    pipeline = join_pipeline(f"jc{uuid.uuid4().hex[:8]}", bootstrap_servers, kind, key=["id"], keyed=True,
                             spark={"core": core})
    assert plan_of(pipeline, 3).layout == "co-partitioned"
    make_topics(pipeline, 3)
    records, _ = wire(units, 3)
    cuts = data.draw(st.lists(st.integers(0, len(records)), max_size=4))
    run_batches(pipeline, records, cuts, [False, True])
    spec = pipeline.view.join
    assert spec is not None
    parts = by_partition(pipeline, f"{pipeline.pipeline}.view")
    for p in range(3):
        mine = [(side, events) for side, events in units if ((events[0].row.get("cust") or 0) % 3) == p]
        assert [m.value() for m in parts.get(p, [])] == changelog(reference_join(spec, mine).changes)


def test_a_join_plan_has_a_join_stage() -> None:
    merged = join_pipeline("jp", "127.0.0.1:1", "left", grouped=True, key=["id"])
    plan = plan_of(merged, 4)
    assert plan.layout == "merged" and [s.name for s in plan.stages] == ["join"]
    assert plan.first.steps == ("decode", "validate", "join", "reduce")
    assert plan.first.inputs == ("jp.orders", "jp.customers") and plan.first.shards == 1
    assert [s.name for s in plan.sources] == ["orders", "customers"]
    drawn = tree(plan)
    assert "1. join: decode → validate → join → reduce (1 shard, merging every input partition)" in drawn
    assert "orders: jp.orders" in drawn and "customers: jp.customers" in drawn
    assert "jp.customers" in mermaid(plan) and "1. join" in mermaid(plan)
    paired = plan_of(join_pipeline("jq", "127.0.0.1:1", "inner", keyed=True), 4)
    assert paired.layout == "co-partitioned" and paired.first.shards == 4 and paired.first.by_partition
    # a grouped view whose key does not hold the left join column re-groups: merged
    assert plan_of(join_pipeline("jr", "127.0.0.1:1", "inner", keyed=True, grouped=True), 4).layout == "merged"
    assert plan_of(join_pipeline("js", "127.0.0.1:1", "inner", keyed=True, shards="merged"), 4).layout == "merged"


def test_a_join_without_a_grouped_view_is_not_netted_per_batch() -> None:
    """`emit: per_batch` over a join without a grouped view is refused in one line; a
    grouped view over a join in shards keyed off the join key is not (it runs through a
    second exchange: tests/test_join_exchange.py)."""
    assert join_pipeline("jx", "127.0.0.1:1", "inner", shards=3, grouped=True).run_refusal() is None
    plain = join_pipeline("jn", "127.0.0.1:1", "inner")
    netted = parse_pipeline({**plain.model_dump(by_alias=True, exclude={"source", "shards"}, exclude_none=True),
                             "outputs": {"view": {"topic": "v", "emit": "per_batch"}}})
    assert (netted.run_refusal() or "").startswith("outputs.view.emit: per_batch nets a batch's records per key")


# through Spark ---------------------------------------------------------------------------

def _orders_and_customers(seed: int, move: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]],
                                               list[dict[str, Any]]]:
    """Seeded changelogs of orders and customers (appends, retractions, corrections that
    move an order to another customer unless not `move`, and a customer to another region)
    and their live rows."""
    rng = random.Random(seed)
    orders: list[dict[str, Any]] = []
    customers: list[dict[str, Any]] = []
    live_orders: dict[int, dict[str, Any]] = {}
    live_customers: dict[int, dict[str, Any]] = {}
    for cid in range(8):
        row = {"cid": cid, "region": rng.choice(["eu", "us", "asia"])}
        customers.append({"op": "+A", **row})
        live_customers[cid] = row
    for oid in range(300):
        row = {"id": oid, "cust": rng.randrange(10), "amount": rng.randrange(1, 50)}
        orders.append({"op": "+A", **row})
        live_orders[oid] = row
        if rng.random() < 0.2:
            old = live_orders.pop(rng.choice(sorted(live_orders)))
            if rng.random() < 0.5:
                orders.append({"op": "-R", **old})
            else:
                new = {**old, "cust": rng.randrange(10) if move else old["cust"], "amount": rng.randrange(1, 50)}
                orders += [{"op": "-C", **old}, {"op": "+C", **new}]
                live_orders[new["id"]] = new
        if rng.random() < 0.05:
            cid = rng.randrange(8)
            old = live_customers[cid]
            new = {**old, "region": rng.choice(["eu", "us", "asia"])}
            customers += [{"op": "-C", **old}, {"op": "+C", **new}]
            live_customers[cid] = new
    return orders, customers, list(live_orders.values()), list(live_customers.values())


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.parametrize("layout", ["merged", "co-partitioned", "exchanged", "regrouped"])
def test_a_join_runs_in_spark_and_ends_with_duckdbs_table(bootstrap_servers: str, spark: Any, topic: Any,
                                                          tmp_path: Any, layout: str) -> None:
    """Revenue per region (per customer and region: co-partitioned, and through the
    exchange in `shards: 2`; per region through both exchanges, the customers in three
    partitions) of orders joined with customers, in SQL, run by `refold run` (local[2])
    to its end: the view topic's final table is DuckDB's for the same query over both
    sides' live rows."""
    keyed = layout == "co-partitioned"
    orders, customers, live_orders, live_customers = _orders_and_customers(7, move=not keyed)
    settings_ = {"bootstrap.servers": bootstrap_servers}
    order_topic, customer_topic = topic(partitions=2), topic(partitions=3 if layout == "regrouped" else 2)
    # messages keyed by the join column (`refold produce --key`), a pair's halves alike
    produce(settings_, order_topic, [orjson.dumps(r) for r in orders], ["id"] if not keyed else ["cust"],
            progress=False, per_transaction=50)
    if keyed:  # the customers' join column named as the orders' (equal values, equal message keys)
        customers = [{("cust" if k == "cid" else k): v for k, v in r.items()} for r in customers]
        live_customers = [{"cid": r["cid"], "region": r["region"]} for r in live_customers]
    right = "cust" if keyed else "cid"
    produce(settings_, customer_topic, [orjson.dumps(r) for r in customers], [right], progress=False)
    name = f"js{uuid.uuid4().hex[:8]}"
    sql = ("SELECT c.region, SUM(o.amount) AS revenue, COUNT(o.id) AS orders FROM orders o "
           "JOIN customers c ON o.cust = c.cid GROUP BY c.region")
    pipeline = parse_pipeline({
        "pipeline": name, "kafka": settings_,
        "sources": {"orders": {"topic": order_topic, "key": ["id"] if not keyed else ["cust"]},
                    "customers": {"topic": customer_topic, "key": [right]}},
        "view": {"sql": sql} if layout in ("merged", "regrouped") else {
            "sql": sql.replace("c.region", "o.cust, c.region").replace("c.cid", "c.cust" if keyed else "c.cid")},
        **({"shards": 2} if layout in ("exchanged", "regrouped") else {}),
        "outputs": {"view": {"topic": f"{name}.view"}},
        "trigger": "200ms", "max_batch_events": 120,
        "spark": {"master": "local[2]", "checkpoint_dir": str(tmp_path / "spark")},
    })
    plan = plan_of(pipeline, 2)
    assert plan.layout == layout.replace("regrouped", "exchanged") and plan.regrouped == (layout == "regrouped")
    run_pipeline(pipeline, bootstrap_servers, until_idle=3.0, spark=spark, quiet=True)
    table: dict[bytes, dict[str, Any]] = {}
    for message in read_to_end(settings_, f"{name}.view"):
        record = orjson.loads(message.value())
        op = record.pop("op")
        if op in ("+A", "+C"):
            table[message.key()] = record
        elif op == "-R":
            table.pop(message.key(), None)
    db = duckdb.connect()
    db.execute("CREATE TABLE orders (id INTEGER, cust INTEGER, amount INTEGER)")
    db.execute("CREATE TABLE customers (cid INTEGER, region VARCHAR)")
    db.executemany("INSERT INTO orders VALUES (?, ?, ?)", [(r["id"], r["cust"], r["amount"]) for r in live_orders])
    db.executemany("INSERT INTO customers VALUES (?, ?)", [(r["cid"], r["region"]) for r in live_customers])
    query = pipeline.view.sql
    assert query is not None
    cursor = db.execute(query.replace("c.cust", "c.cid"))
    names = [d[0] for d in cursor.description]
    expected = sorted(orjson.dumps(dict(zip(names, row, strict=True)), option=orjson.OPT_SORT_KEYS)
                      for row in cursor.fetchall())
    assert sorted(orjson.dumps(row, option=orjson.OPT_SORT_KEYS) for row in table.values()) == expected
    checkpoints = load_checkpoints(pipeline, settings_)
    assert sum(c.records_in for c in checkpoints.values()) == len(orders) + len(customers)
    report = verify(pipeline, settings_)  # `refold verify`: the folded view is the reference's
    assert report.anomalies == [] and report.events == len(orders) + len(customers)


# kill -9 mid-commit, then a new run: every record once ---------------------------------------

@pytest.mark.kafka
@pytest.mark.parametrize("grouped", [False, True], ids=["join", "join-and-view"])
@pytest.mark.parametrize("where", ["in_txn", "after_commit"])
def test_a_join_killed_mid_commit_writes_each_record_once(bootstrap_servers: str, tmp_path: Any, where: str,
                                                          grouped: bool) -> None:
    """A join shard killed (SIGKILL) with batch 2's records sent and not committed, or
    committed and not in its store: the next run writes the reference join's changelog
    (or the grouped view over it, whose batches the native cores read themselves where
    built), record by record, nothing twice and nothing lost."""
    pipeline = join_pipeline(f"jk{uuid.uuid4().hex[:8]}", bootstrap_servers, "left", key=["id"], grouped=grouped)
    units, records = killed_in_a_subprocess(pipeline, bootstrap_servers, tmp_path, where, (
        "processor = BatchProcessor(pipeline, settings, hooks=Hooks(crash_at=f'{where}:2'))\n"))
    run_batches(pipeline, records, [7, 14], [False])
    spec = pipeline.view.join
    assert spec is not None
    joined = reference_join(spec, units).changes
    expected = reference_changelog(ViewSpec.model_validate(GROUPED), numbered(joined)).changes if grouped else joined
    assert written(pipeline) == changelog(expected)


@pytest.mark.kafka
def test_verify_finds_a_join_view_that_is_not_the_reference(bootstrap_servers: str) -> None:
    """`verify` of a join folds its view and compares it with the reference join's table:
    a record too many is an anomaly."""
    pipeline = join_pipeline(f"jv{uuid.uuid4().hex[:8]}", bootstrap_servers, "full")
    make_topics(pipeline, 2)
    records, _ = wire(crash_units(), 2)
    settings_ = {"bootstrap.servers": bootstrap_servers}
    producer = Producer(settings_)
    topics = [source.topic for source in pipeline.sources.values()]
    for record in records:
        producer.produce(topics[record.partition >= RIGHT_PARTITIONS], record.value, record.key,
                         partition=record.partition % RIGHT_PARTITIONS)
    assert producer.flush(30) == 0
    run_batches(pipeline, records, [5], [False])
    report = verify(pipeline, settings_)
    assert report.anomalies == [] and report.events == len(records)
    producer.produce(f"{pipeline.pipeline}.view", b'{"op":"+A","id":99}', b"{}")
    assert producer.flush(30) == 0
    del producer
    assert verify(pipeline, settings_).anomalies == ['view: extra {"id":99} (1 copies)']



def killed_in_a_subprocess(pipeline: Pipeline, bootstrap_servers: str, tmp_path: Any, where: str,
                           make_processor: str) -> tuple[list[Unit], list[Any]]:
    """`crash_units()` written to the pipeline's two sources, then processed in batches of
    7 records by a `BatchProcessor` in a child process that `make_processor` (Python lines
    with `pipeline`, `settings`, `where` in scope) sets up to die by SIGKILL; the units and
    the records, for the run after it."""
    units = crash_units()
    make_topics(pipeline, 2)
    records, _ = wire(units, 2)
    batches = [records[i:i + 7] for i in range(0, len(records), 7)]
    script = tmp_path / "crash.py"
    script.write_text(
        "import pickle, sys\n"
        "from refold.runtime.hooks import Hooks\n"
        "from refold.runtime.processor import BatchProcessor\n"
        "pipeline, settings, batches, where = pickle.load(open(sys.argv[1], 'rb'))\n"
        + make_processor +
        "for batch in batches:\n"
        "    processor.process(batch)\n")
    data = tmp_path / "input.pickle"
    data.write_bytes(pickle.dumps((pipeline, {"bootstrap.servers": bootstrap_servers}, batches, where)))
    done = subprocess.run([sys.executable, str(script), str(data)], env={**os.environ}, timeout=300, check=False)
    assert done.returncode == -signal.SIGKILL
    return units, records

def crash_units() -> list[Unit]:
    """Orders and customers that join, move and leave, over a few batches."""
    from refold.reduce import SourceEvent

    units: list[Unit] = []
    for n in range(12):
        units.append((1, [SourceEvent(Op.APPEND, {"cid": n % 4, "region": ["eu", "us"][n % 2]}, (0, 0, 0))]))
        units.append((0, [SourceEvent(Op.APPEND, {"id": n, "cust": n % 5, "amount": n + 1}, (0, 0, 0))]))
    units.append((0, [SourceEvent(Op.RETRACT, {"id": 3, "cust": 3, "amount": 4}, (0, 0, 0))]))
    units.append((1, [SourceEvent(Op.CORRECT_FROM, {"cid": 1, "region": "us"}, (0, 0, 0)),
                      SourceEvent(Op.CORRECT_TO, {"cid": 1, "region": "asia"}, (0, 0, 0))]))
    return units


@pytest.mark.kafka
def test_refold_status_shows_both_sources_of_a_join(bootstrap_servers: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`refold status` of a join: the shard's offsets of both sources (the right's as
    `R<p>`) and a lag table per source."""
    pipeline = join_pipeline(f"jt{uuid.uuid4().hex[:8]}", bootstrap_servers, "inner")
    make_topics(pipeline, 2)
    records, _ = wire(crash_units(), 2)
    produce_wired(pipeline, records)  # (for the lag)
    run_batches(pipeline, records, [9], [False])
    assert print_status(pipeline)
    shown = capsys.readouterr().out
    assert f"source {pipeline.pipeline}.orders (L) joined with {pipeline.pipeline}.customers (R)" in shown
    assert "R0:" in shown and "R1:" in shown
    assert f"  {pipeline.pipeline}.customers (R)" in shown and shown.count("total lag 0") == 2


@pytest.mark.kafka
def test_each_side_is_read_with_its_own_source_settings(bootstrap_servers: str, tmp_path: Any) -> None:
    """Orders in JSON, customers in Avro (their own `schema`): the view is the reference
    join's; a customers record that does not decode is a dead letter naming the customers
    topic, its partition and offset, and so does its `refold.cause`."""
    schema = tmp_path / "customer.avsc"
    schema.write_text(orjson.dumps({"type": "record", "name": "Customer", "fields": [
        {"name": "op", "type": "int"}, {"name": "cid", "type": ["null", "long"]},
        {"name": "region", "type": ["null", "string"]}]}).decode())
    name = f"ja{uuid.uuid4().hex[:8]}"
    base = join_pipeline(name, bootstrap_servers, "left", key=["id"])
    sources = {"orders": {"topic": f"{name}.orders"},
               "customers": {"topic": f"{name}.customers", "format": "avro", "schema": str(schema)}}
    pipeline = parse_pipeline({**base.model_dump(by_alias=True, exclude={"source"}, exclude_none=True),
                               "sources": sources})
    make_topics(pipeline, 2)
    units = crash_units()
    records, _ = wire(units, 2)
    codec = AvroCodec(str(schema))
    avro = []
    for record in records:
        if record.partition >= RIGHT_PARTITIONS:
            event = orjson.loads(record.value)
            op = Op.parse(event.pop("op"))
            record = record._replace(value=codec.encode(ChangelogEvent(op, event, None)))
        avro.append(record)
    bad = InputRecord(RIGHT_PARTITIONS + 1, max(r.offset for r in avro if r.partition == RIGHT_PARTITIONS + 1) + 1,
                      b"{}", b"\x07not avro", len(avro))
    run_batches(pipeline, [*avro, bad], [6], [True])
    spec = pipeline.view.join
    assert spec is not None
    assert written(pipeline) == changelog(reference_join(spec, units).changes)
    (letter,) = read_to_end({"bootstrap.servers": bootstrap_servers}, pipeline.dlq_topic)
    dead = decode_dead_letter(letter.value())
    assert (dead.topic, dead.partition, dead.offset) == (f"{name}.customers", 1, bad.offset)
    assert dict(letter.headers() or [])["refold.cause"] == f"{name}.customers:1:{bad.offset}".encode()


def test_the_example_join_pipeline_runs_as_a_join() -> None:
    """examples/revenue.yaml: orders joined with customers, revenue summed by region."""
    pipeline = load_pipeline("examples/revenue.yaml")
    assert pipeline.run_refusal() is None
    plan = plan_of(pipeline, 3)
    assert plan.layout == "merged" and plan.first.name == "join" and plan.first.inputs == ("orders", "customers")
    assert pipeline.view.key == ["region"]
