"""`refold trace` through a join (orders ⋈ customers): the join shard writes the trace
index `P.trace`, and `--key` on the join's view and `--input` on either source's
TOPIC:PARTITION:OFFSET answer through it exactly what a full scan of the view topic
answers, co-partitioned, merged and for a grouped view over the join; a joined row's
trace names the order and the customer record behind each of its records."""

from __future__ import annotations

import random
import uuid
from io import StringIO
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer
from test_trace_index import assert_index_answers_as_the_scan

from refold.cli import trace
from refold.config import Pipeline, parse_pipeline
from refold.kafka.io import TopicSpec, ensure_topics, read_to_end
from refold.plan import RIGHT_PARTITIONS, plan_of, trace_topic
from refold.runtime.batch import InputRecord
from refold.runtime.processor import BatchProcessor
from refold.spark.job import engine_topics

pytestmark = pytest.mark.kafka

PARTITIONS = 2
COLUMNS = {"id": "orders.id", "cust": "orders.cust", "amount": "orders.amount", "name": "customers.name"}
GROUPED = {"key": ["name"], "columns": {"total": {"sum": "amount"}, "orders": {"count": "*"}}}


def _pipeline(settings_: dict[str, Any], layout: str, grouped: bool = False) -> Pipeline:
    """orders ⋈ customers on cust; `co-partitioned`: both sources keyed by cust."""
    name = f"tj{uuid.uuid4().hex[:8]}"
    keyed = {"key": ["cust"]} if layout == "co-partitioned" else {}
    join = {"left": "orders", "right": "customers", "on": [["cust", "cust"]], "type": "inner", "columns": COLUMNS,
            **({} if grouped else {"key": ["id"]})}
    pipeline = parse_pipeline({
        "pipeline": name, "kafka": settings_,
        "sources": {"orders": {"topic": f"{name}.orders", **keyed}, "customers": {"topic": f"{name}.customers", **keyed}},
        "view": {"join": join, **(GROUPED if grouped else {})},
        "outputs": {"view": {"topic": f"{name}.view"}}})
    ensure_topics(settings_, [TopicSpec(s.topic, PARTITIONS) for s in pipeline.sources.values()]
                  + engine_topics(pipeline, PARTITIONS))
    return pipeline


def _produce(settings_: dict[str, Any], pipeline: Pipeline,
             events: list[tuple[str, dict[str, Any]]]) -> list[InputRecord]:
    """The events (`orders`/`customers`, row with `op`) written to their source topics,
    partition cust mod 2, and the same records as the join shard's input (the right
    source's partitions numbered `RIGHT_PARTITIONS + p`), in the order written."""
    producer = Producer({**settings_, "enable.idempotence": True})
    records: list[InputRecord] = []
    placed: list[Any] = []
    for number, (side, row) in enumerate(events):
        topic = pipeline.sources[side].topic
        partition = row["cust"] % PARTITIONS
        key, value = orjson.dumps({"cust": row["cust"]}), orjson.dumps(row)
        producer.produce(topic, value, key, partition=partition, on_delivery=lambda err, msg: placed.append(msg))
        producer.flush(30)
        assert len(placed) == number + 1 and placed[-1].error() is None
        shard_partition = partition + (RIGHT_PARTITIONS if side == "customers" else 0)
        records.append(InputRecord(shard_partition, placed[-1].offset(), key, value, 1_000 + number))
    return records


def _run(pipeline: Pipeline, settings_: dict[str, Any], records: list[InputRecord], cuts: list[int]) -> None:
    processor = BatchProcessor(pipeline, settings_)
    try:
        for start, end in zip([0, *cuts], [*cuts, len(records)], strict=True):
            if start < end:
                processor.process(records[start:end])
    finally:
        processor.close()


@pytest.mark.parametrize("layout", ["co-partitioned", "merged"])
def test_a_joined_rows_trace_names_the_order_and_the_customer(bootstrap_servers: str, layout: str) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    pipeline = _pipeline(settings_, layout)
    assert trace_topic(pipeline) in {t.name for t in plan_of(pipeline, PARTITIONS).topics}
    assert pipeline.view.join is not None
    events = [("customers", {"op": "+A", "cust": 1, "name": "Ann"}),
              ("customers", {"op": "+A", "cust": 2, "name": "Bo"}),
              ("orders", {"op": "+A", "id": 1, "cust": 1, "amount": 10}),
              ("orders", {"op": "+A", "id": 2, "cust": 2, "amount": 5}),
              ("orders", {"op": "+A", "id": 3, "cust": 1, "amount": 7}),
              ("customers", {"op": "-C", "cust": 1, "name": "Ann"}),
              ("customers", {"op": "+C", "cust": 1, "name": "Anne"}),
              ("orders", {"op": "-R", "id": 2, "cust": 2, "amount": 5})]
    records = _produce(settings_, pipeline, events)
    _run(pipeline, settings_, records, [3, 6])  # (the customer's -C held over to the next batch)
    orders, customers = pipeline.sources["orders"].topic, pipeline.sources["customers"].topic

    def at(number: int) -> tuple[str, int, int]:
        side, row = events[number]
        return pipeline.sources[side].topic, row["cust"] % PARTITIONS, records[number].offset

    notes: list[str] = []
    got = trace.trace_key(pipeline, settings_, {"id": 1}, note=notes.append)
    assert notes == []
    assert [(r["op"], r["row"]["name"]) for r in got] == [("+A", "Ann"), ("-C", "Ann"), ("+C", "Anne")]
    causes = [(r["cause"]["topic"], r["cause"]["partition"], r["cause"]["offset"], r["cause"]["op"], r["cause"]["row"])
              for r in got]
    order, correction = events[2][1], events[5][1]
    assert causes[0] == (*at(2), "+A", {k: v for k, v in order.items() if k != "op"})  # the order
    assert causes[1] == causes[2] == (*at(5), "-C", {k: v for k, v in correction.items() if k != "op"})  # the customer
    assert causes[0][0] == orders and causes[1][0] == customers
    if layout == "co-partitioned":  # the command's lines, as docs/provenance.md shows them
        out = StringIO()
        assert trace.run(pipeline, settings_, key='{"id": 1}', input_=None, since=None, until=None, as_json=False,
                         out=out) == 0
        view = f"{pipeline.pipeline}.view"
        assert out.getvalue().splitlines() == [
            f'view {view}[1]@0 +A {{"id":1,"cust":1,"amount":10,"name":"Ann"}}',
            f'    cause: {orders}[1]@0 +A {{"id":1,"cust":1,"amount":10}}',
            f'view {view}[1]@4 -C {{"id":1,"cust":1,"amount":10,"name":"Ann"}}',
            f'    cause: {customers}[1]@1 -C {{"cust":1,"name":"Ann"}}',
            f'view {view}[1]@5 +C {{"id":1,"cust":1,"amount":10,"name":"Anne"}}',
            f'    cause: {customers}[1]@1 -C {{"cust":1,"name":"Ann"}}']
    # what the customer's correction changed: both of its orders' joined rows
    got = trace.trace_input(pipeline, settings_, *at(5), note=notes.append)
    assert sorted((r["key"]["id"], r["op"]) for r in got) == [(1, "+C"), (1, "-C"), (3, "+C"), (3, "-C")]
    got = trace.trace_input(pipeline, settings_, *at(7), note=notes.append)
    assert [(r["key"], r["op"]) for r in got] == [({"id": 2}, "-R")]
    assert notes == []
    assert assert_index_answers_as_the_scan(pipeline, settings_, inputs=None, fetched=True) == 8


def _random_events(rng: random.Random, count: int) -> list[tuple[str, dict[str, Any]]]:
    """Appends, retractions and corrections of live orders and customers over 6 customers."""
    live: dict[str, list[dict[str, Any]]] = {"orders": [], "customers": []}
    events: list[tuple[str, dict[str, Any]]] = []
    for number in range(count):
        side = rng.choice(["orders", "orders", "customers"])
        rows = live[side]
        cust = rng.randrange(6)
        fresh = {"id": number, "cust": cust, "amount": rng.randrange(100)} if side == "orders" else {
            "cust": cust, "name": f"c{cust}-{number}"}
        what = rng.choice(["+A", "+A", "-R", "-C"]) if rows else "+A"
        if what == "+A":
            rows.append(fresh)
            events.append((side, {"op": "+A", **fresh}))
        elif what == "-R":
            events.append((side, {"op": "-R", **rows.pop(rng.randrange(len(rows)))}))
        else:
            at = rng.randrange(len(rows))
            old = rows[at]
            new = {**old, "amount": rng.randrange(100)} if side == "orders" else {**old, "name": f"c{old['cust']}-{number}"}
            rows[at] = new
            events += [(side, {"op": "-C", **old}), (side, {"op": "+C", **new})]
    return events


@pytest.mark.parametrize("layout,grouped", [("co-partitioned", False), ("merged", False), ("co-partitioned", True)])
def test_join_trace_through_the_index_equals_the_scan(bootstrap_servers: str, layout: str, grouped: bool) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    pipeline = _pipeline(settings_, layout, grouped)
    rng = random.Random(f"{layout}-{grouped}")
    records = _produce(settings_, pipeline, _random_events(rng, 60))
    cuts = sorted(rng.sample(range(1, len(records)), 4))
    _run(pipeline, settings_, records, cuts)
    written = assert_index_answers_as_the_scan(pipeline, settings_, inputs=None, fetched=True)
    assert written > 20
    # a replay writes nothing again, no index record either
    entries = len(list(read_to_end(settings_, trace_topic(pipeline))))
    _run(pipeline, settings_, records, cuts)
    assert len(list(read_to_end(settings_, trace_topic(pipeline)))) == entries
