"""Table sources in a join (`refold.runtime.jointables`): an upsert topic of customers
joined with a changelog of orders, against `refold.reference_joins` fed the table's
changelog (a new key `+A`, a changed row `-C`/`+C`, an unchanged one nothing, a
tombstone `-R`), whatever the batch cuts and restarts."""

from __future__ import annotations

import random
import uuid
from typing import Any

import orjson
import pytest
from test_join import Unit
from test_join import as_units as numbered
from test_join_engine import (
    GROUPED,
    by_partition,
    changelog,
    join_pipeline,
    make_topics,
    run_batches,
    written,
)
from test_join_exchange import SHARDS, folded, shard_of_unit

from refold.config import Pipeline, ViewSpec, parse_pipeline
from refold.kafka.io import read_to_end
from refold.model.changelog import Op
from refold.model.reasons import Reason
from refold.plan import RIGHT_PARTITIONS, plan_of
from refold.recovery.records import decode_dead_letter
from refold.reduce import SourceEvent
from refold.reference import reference_changelog
from refold.reference_joins import reference_join
from refold.runtime.batch import InputRecord


def upsert_join(bootstrap: str, kind: str, debezium: bool = False, **more: Any) -> Pipeline:
    """orders (a changelog) ⋈ customers (an upsert topic keyed by cid, or Debezium's)."""
    base = join_pipeline(f"ju{uuid.uuid4().hex[:8]}", bootstrap, kind, key=["id"], **more)
    dumped = base.model_dump(by_alias=True, exclude={"source"}, exclude_none=True)
    topic = base.sources["customers"].topic
    dumped["sources"]["customers"] = ({"topic": topic, "format": "debezium-json"} if debezium else
                                      {"topic": topic, "form": "upsert", "key": ["cid"]})
    return parse_pipeline(dumped)


def histories(seed: int, debezium: bool = False) -> tuple[list[InputRecord], list[Unit]]:
    """Seeded orders (appends, retractions) and customer upserts (new, overwritten,
    unchanged, deleted by a tombstone, back again; `debezium`: as Debezium's create,
    update and delete events, an unchanged row not written, and one update whose
    `before` is not the customer's row, refused) as the topics' records in the order
    they were made, and the units of both changelogs (the customers' the table's)."""
    rng = random.Random(seed)
    records: list[InputRecord] = []
    units: list[Unit] = []
    offsets: dict[int, int] = {}
    live: list[dict[str, Any]] = []
    table: dict[int, dict[str, Any]] = {}
    tag = (0, 0, 0)

    def record(partition: int, key: dict[str, Any], value: bytes | None) -> None:
        offset = offsets.get(partition, 0)
        offsets[partition] = offset + 1
        records.append(InputRecord(partition, offset, orjson.dumps(key), value, len(records)))

    for step in range(60):
        if rng.random() < 0.5:
            if live and rng.random() < 0.3:
                row = live.pop(rng.randrange(len(live)))
                op = Op.RETRACT
            else:
                row = {"id": step, "cust": rng.choice([0, 1, 2, 3, None]), "amount": rng.randrange(1, 9)}
                live.append(row)
                op = Op.APPEND
            record(step % 2, {"id": row["id"]}, orjson.dumps({"op": op.code, **row}))
            units.append((0, [SourceEvent(op, row, tag)]))
            continue
        cid = rng.randrange(4)
        old = table.get(cid)
        if old is not None and rng.random() < 0.2:  # a tombstone deletes the customer
            record(RIGHT_PARTITIONS + cid % 2, {"cid": cid},
                   orjson.dumps({"op": "d", "before": old}) if debezium else None)
            del table[cid]
            units.append((1, [SourceEvent(Op.RETRACT, old, tag)]))
            continue
        new = {"cid": cid, "region": rng.choice(["eu", "us"]) if old is None or rng.random() < 0.7 else old["region"]}
        if debezium and old == new:
            continue
        if debezium and old is not None and step == 59:  # (refused: not the customer's row)
            record(RIGHT_PARTITIONS + cid % 2, {"cid": cid},
                   orjson.dumps({"op": "u", "before": {**old, "region": "mars"}, "after": new}))
            continue
        value = new if not debezium else {"op": "c", "after": new} if old is None else \
            {"op": "u", "before": old, "after": new}
        record(RIGHT_PARTITIONS + cid % 2, {"cid": cid}, orjson.dumps(value))
        table[cid] = new
        if old is None:
            units.append((1, [SourceEvent(Op.APPEND, new, tag)]))
        elif old != new:
            units.append((1, [SourceEvent(Op.CORRECT_FROM, old, tag), SourceEvent(Op.CORRECT_TO, new, tag)]))
    return records, units


@pytest.mark.kafka
@pytest.mark.parametrize(("seed", "kind"), [(1, "inner"), (2, "left"), (3, "full")])
def test_an_upsert_source_in_a_join_writes_the_reference_join_of_its_table(bootstrap_servers: str, seed: int,
                                                                           kind: str) -> None:
    """A customer overwritten in its upsert topic moves its orders' joined rows to the
    new row; deleted by a tombstone, its orders lose it: the view topic is the reference
    join's changelog of the orders and the customers' table changelog, record by record,
    with batch cuts and restarts (the last rows come back from `P.state`)."""
    pipeline, units = run_history(upsert_join(bootstrap_servers, kind), seed)
    spec = pipeline.view.join
    assert spec is not None
    assert written(pipeline) == changelog(reference_join(spec, units).changes)


def run_history(pipeline: Any, seed: int) -> tuple[Any, Any]:
    """`pipeline` run over the upsert history of `seed` (`histories`) in batches cut at
    random, with a restart; the pipeline and the history's units."""
    assert pipeline.run_refusal() is None
    make_topics(pipeline, 2)
    records, units = histories(seed)
    rng = random.Random(seed)
    run_batches(pipeline, records, [rng.randrange(len(records)) for _ in range(4)], [False, True])
    return pipeline, units


def refused_update_history() -> tuple[Any, Any]:
    """The first Debezium history (`histories`, from seed 4) whose last step is an update
    the join refuses (its `before` is not the customer's row)."""
    for seed in range(4, 40):
        records, units = histories(seed, debezium=True)
        if b"mars" in (records[-1].value or b""):
            return records, units
    raise AssertionError("no history of seeds 4-39 ends with a refused update")


@pytest.mark.kafka
def test_a_debezium_source_in_a_join_writes_the_reference_join_of_its_table(bootstrap_servers: str) -> None:
    """Customers as Debezium's events (create, update, delete) in a left join: the view
    is the reference join of the table's changelog; an update whose `before` is not the
    customer's row is a dead letter of the customers topic (`before differs`)."""
    pipeline = upsert_join(bootstrap_servers, "left", debezium=True)
    assert pipeline.run_refusal() is None
    make_topics(pipeline, 2)
    records, units = refused_update_history()
    run_batches(pipeline, records, [len(records) // 3, len(records) // 2], [True])
    spec = pipeline.view.join
    assert spec is not None
    assert written(pipeline) == changelog(reference_join(spec, units).changes)
    letters = [decode_dead_letter(m.value()) for m in read_to_end({"bootstrap.servers": bootstrap_servers},
                                                                  pipeline.dlq_topic)]
    assert [(d.topic, d.partition, d.offset, d.reason) for d in letters] == [
        (pipeline.sources["customers"].topic, records[-1].partition - RIGHT_PARTITIONS, records[-1].offset,
         Reason.BEFORE_DIFFERS)]


@pytest.mark.kafka
@pytest.mark.parametrize(("seed", "kind"), [(5, "inner"), (6, "left"), (7, "full")])
def test_an_upsert_source_in_a_join_through_the_exchange_writes_the_reference_join(bootstrap_servers: str,
                                                                                   seed: int, kind: str) -> None:
    """The upsert topic of customers in a join in three shards: stage 1 keeps each
    customer's last row (in `P.rows`) and routes what its record changes; each join
    shard's view partition is the reference join's changelog of its join keys, record by
    record, with batch cuts and restarts."""
    pipeline, units = run_history(upsert_join(bootstrap_servers, kind, shards=SHARDS), seed)
    spec = pipeline.view.join
    assert spec is not None
    parts = by_partition(pipeline, f"{pipeline.pipeline}.view")
    assert sum(len(part) for part in parts.values()) > 0
    for m in range(SHARDS):
        mine = [(side, events) for side, events in units if shard_of_unit(side, events) == m]
        assert [r.value() for r in parts.get(m, [])] == changelog(reference_join(spec, mine).changes)


@pytest.mark.kafka
def test_a_debezium_source_in_a_regrouping_join_is_the_grouped_reference(bootstrap_servers: str) -> None:
    """Customers as Debezium's events, revenue per region over a left join in three
    shards (through both exchanges): the view is the reference grouped view over the
    reference join of the table's changelog; an update whose `before` is not the
    customer's row is a dead letter of the customers topic, written by stage 1."""
    pipeline = upsert_join(bootstrap_servers, "left", debezium=True, shards=SHARDS, grouped=True)
    assert pipeline.run_refusal() is None and plan_of(pipeline, 2).regrouped
    make_topics(pipeline, 2)
    records, units = refused_update_history()
    run_batches(pipeline, records, [len(records) // 3, len(records) // 2], [True])
    spec = pipeline.view.join
    assert spec is not None
    joined = reference_join(spec, units)
    expected = reference_changelog(ViewSpec.model_validate(GROUPED), numbered(joined.changes))
    view = [m.value() for part in by_partition(pipeline, f"{pipeline.pipeline}.view").values() for m in part]
    assert folded(view) == folded(changelog(expected.changes)) != {}
    letters = [decode_dead_letter(m.value()) for m in read_to_end({"bootstrap.servers": bootstrap_servers},
                                                                  pipeline.dlq_topic)]
    customers = pipeline.sources["customers"].topic
    assert [(d.topic, d.partition, d.offset, d.reason) for d in letters if d.reason == Reason.BEFORE_DIFFERS] == [
        (customers, records[-1].partition - RIGHT_PARTITIONS, records[-1].offset, Reason.BEFORE_DIFFERS)]
