"""The join input generator (`refold.dev.joinload`) the chaos harness's join pipeline and
`make bench-join` feed: what it promises about its input, and its two expected views
(the live rows' join and the reference join's grouped view) agreeing."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import yaml

from refold.config import JoinSpec, ViewSpec, parse_pipeline
from refold.dev.joinload import (
    CUSTOMERS,
    JOIN,
    JOIN_VIEW,
    ORDERS,
    JoinWorkload,
    expected_view,
    generate_join,
    join_chunks,
    live_rows,
    reference_view,
    sides,
)


def test_the_input_retracts_only_live_rows_and_pairs_every_correction() -> None:
    w = JoinWorkload(orders=3000, customers=60, regions=5, seed=4)
    records = list(generate_join(w))
    orders, customers = sides(records)
    assert len(orders) == w.orders
    assert [r["op"] for r in customers[: w.customers]] == ["+A"] * w.customers  # every customer first
    ops = Counter((side, r["op"]) for side, r in records)
    assert ops[(ORDERS, "-R")] and ops[(ORDERS, "-C")] and ops[(CUSTOMERS, "-R")] and ops[(CUSTOMERS, "-C")]
    times = [r["event_time"] for _side, r in records]
    assert times == sorted(times)
    for index, (side, record) in enumerate(records):
        if record["op"] == "-C":  # its +C next, same side, same message key
            nxt_side, nxt = records[index + 1]
            assert nxt_side == side and nxt["op"] == "+C" and nxt["id"] == record["id"]
            if side == CUSTOMERS:
                assert nxt["region"] != record["region"]
            else:
                assert nxt["customer_id"] == record["customer_id"]
    for side_records in (orders, customers):
        live_rows(side_records)  # raises when a retraction names a row that is not live
    # some orders belong to customers that have left: they join nothing
    gone = {r["id"] for r in customers if r["op"] == "-R"}
    assert any(r["customer_id"] in gone for r in orders[len(orders) // 2:])


def test_the_live_rows_join_is_the_reference_join_grouped() -> None:
    """`expected_view` (bench) and `reference_view` (chaos at small sizes) agree, and the
    spec the pipelines run is valid."""
    JoinSpec.model_validate(JOIN)
    ViewSpec.model_validate(JOIN_VIEW)
    for seed in (1, 2):
        records = list(generate_join(JoinWorkload(orders=1500, customers=40, regions=4, seed=seed)))
        want, refused = reference_view(records)
        assert refused == 0
        assert expected_view(records) == want
        assert sum(row["orders"] for row in want.values()) > 0


def test_the_expected_view_follows_moves_and_retractions() -> None:
    records = [
        (CUSTOMERS, {"op": "+A", "id": 1, "region": "north", "name": "a", "event_time": 0}),
        (CUSTOMERS, {"op": "+A", "id": 2, "region": "south", "name": "b", "event_time": 1}),
        (ORDERS, {"op": "+A", "id": 10, "customer_id": 1, "amount": 5, "event_time": 2}),
        (ORDERS, {"op": "+A", "id": 11, "customer_id": 2, "amount": 7, "event_time": 3}),
        (ORDERS, {"op": "+A", "id": 12, "customer_id": 3, "amount": 9, "event_time": 4}),  # no such customer
        (CUSTOMERS, {"op": "-C", "id": 1, "region": "north", "name": "a", "event_time": 5}),
        (CUSTOMERS, {"op": "+C", "id": 1, "region": "south", "name": "a", "event_time": 5}),
        (ORDERS, {"op": "-C", "id": 11, "customer_id": 2, "amount": 7, "event_time": 6}),
        (ORDERS, {"op": "+C", "id": 11, "customer_id": 2, "amount": 8, "event_time": 6}),
        (ORDERS, {"op": "+A", "id": 13, "customer_id": 2, "amount": 1, "event_time": 7}),
        (CUSTOMERS, {"op": "-R", "id": 2, "region": "south", "name": "b", "event_time": 8}),
        (CUSTOMERS, {"op": "+A", "id": 2, "region": "west", "name": "b", "event_time": 9}),
        (ORDERS, {"op": "-R", "id": 13, "customer_id": 2, "amount": 1, "event_time": 10}),
    ]
    want = {("south",): {"region": "south", "revenue": 5, "orders": 1},
            ("west",): {"region": "west", "revenue": 8, "orders": 1}}
    assert expected_view(records) == want
    assert reference_view(records) == (want, 0)


def test_chunks_keep_the_order_and_every_pair_whole() -> None:
    records = list(generate_join(JoinWorkload(orders=2000, customers=30, seed=7)))
    parts = list(join_chunks(records, 17))
    assert 15 <= len(parts) <= 19
    for side in (ORDERS, CUSTOMERS):
        lines = [orjson.loads(line) for part in parts for line in part[side]]
        assert lines == sides(records)[side]
        for part in parts:
            assert not part[side] or orjson.loads(part[side][-1])["op"] != "-C"


def test_the_chaos_and_bench_join_pipelines_are_runnable(tmp_path: Path) -> None:
    """The chaos harness's join pipeline file and the bench's join pipeline parse, read
    the feed's two topics, and the engine runs them (no refusal)."""
    from bench.join import join_pipeline
    from refold.dev.chaospipelines import JoinFeed, write_pipelines

    feed = JoinFeed(400, 100, 1)
    assert feed.workload.customers == 20 and feed.events == len(feed.records) > 400
    feed.cut(5)
    assert sum(len(o) + len(c) for o, c in feed.parts) == feed.events
    (path,) = write_pipelines(["join"], tmp_path, "unused", "127.0.0.1:1", batch=100, join=feed)
    pipeline = parse_pipeline(yaml.safe_load(path.read_text()))
    bench = join_pipeline("bench-join-x", feed.topics, "127.0.0.1:1", 1000)
    for p in (pipeline, bench):
        assert p.run_refusal() is None
        assert p.view.join == JoinSpec.model_validate(JOIN)
        assert [s.topic for s in p.sources.values()] == list(feed.topics)
    assert pipeline.outputs.delta is not None
