"""Join pipelines on the native join core (`spark.core: native`): the merged and the
co-partitioned join against `refold.reference_joins` as in tests/test_join_engine.py,
and a batch whose value the native core does not hold (a float that is not finite)
mid-batch: the shard joins it again in Python from its store, and the view is still the
reference join's with each dead letter exactly once."""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_join import Unit, changelogs
from test_join_engine import (
    changelog,
    check_co_partitioned_join,
    check_merged_join,
    join_pipeline,
    make_topics,
    run_batches,
    wire,
    written,
)

from refold.codecs.avro import AvroCodec
from refold.config import parse_pipeline
from refold.kafka.io import read_to_end
from refold.model.changelog import ChangelogEvent, Op
from refold.model.reasons import Reason
from refold.plan import RIGHT_PARTITIONS
from refold.recovery.records import decode_dead_letter
from refold.recovery.restore import load_checkpoints
from refold.reduce import SourceEvent
from refold.reference_joins import reference_join
from refold.runtime.batch import InputRecord
from refold.runtime.joins import JoinShardProcessor

SLOW = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]


@pytest.mark.kafka
@settings(max_examples=5, deadline=None, suppress_health_check=SLOW)
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]), data=st.data())
def test_a_merged_join_on_the_native_core_writes_what_the_reference_join_writes(
        bootstrap_servers: str, units: list[Unit], kind: str, data: st.DataObject) -> None:
    check_merged_join(bootstrap_servers, units, kind, data, "native")


@pytest.mark.kafka
@settings(max_examples=3, deadline=None, suppress_health_check=SLOW)
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]), data=st.data())
def test_a_co_partitioned_join_on_the_native_core_writes_the_reference_join_key_by_key(
        bootstrap_servers: str, units: list[Unit], kind: str, data: st.DataObject) -> None:
    check_co_partitioned_join(bootstrap_servers, units, kind, data, "native")


def _units_with_nan() -> list[Unit]:
    """Orders and customers (with a `score`); customer 2's score is NaN (the native join
    core does not hold it), between units the core joins; two retractions of rows that
    are not live (dead letters), one before the NaN and one after; customer 2 is never
    retracted (NaN equals nothing)."""
    def customer(cid: int, score: float) -> Unit:
        return 1, [SourceEvent(Op.APPEND, {"cid": cid, "region": ["eu", "us"][cid % 2], "score": score}, (0, 0, 0))]

    def order(op: Op, n: int, cust: int) -> Unit:
        return 0, [SourceEvent(op, {"id": n, "cust": cust, "amount": n + 1}, (0, 0, 0))]

    return [customer(1, 0.5), order(Op.APPEND, 1, 1), order(Op.RETRACT, 9, 1), order(Op.APPEND, 2, 2),
            customer(2, math.nan), order(Op.APPEND, 3, 2), order(Op.RETRACT, 8, 2), customer(3, 1.5),
            order(Op.APPEND, 4, 3), order(Op.RETRACT, 1, 1), customer(0, 2.5), order(Op.APPEND, 5, 0),
            order(Op.APPEND, 6, 2)]


@pytest.mark.kafka
@pytest.mark.parametrize("cut", [None, 7])
def test_a_value_the_native_join_core_does_not_hold_is_joined_in_python_once(
        bootstrap_servers: str, tmp_path: Any, caplog: pytest.LogCaptureFixture, cut: int | None) -> None:
    """Customers in Avro with a `double` score, one NaN mid-batch: the shard's native join
    core refuses it (`Unsupported`), the shard drops the batch's work and joins it in
    Python from the store. The view is the reference join's, every record once; the two
    refused retractions are dead letters exactly once; one warning names the reason. With
    a cut and a restart, the next start joins on the native core again, from the store
    the Python join wrote."""
    schema = tmp_path / "customer.avsc"
    schema.write_text(orjson.dumps({"type": "record", "name": "Customer", "fields": [
        {"name": "op", "type": "int"}, {"name": "cid", "type": ["null", "long"]},
        {"name": "region", "type": ["null", "string"]}, {"name": "score", "type": ["null", "double"]}]}).decode())
    name = f"jn{uuid.uuid4().hex[:8]}"
    base = join_pipeline(name, bootstrap_servers, "left", key=["id"], spark={"core": "native"})
    sources = {"orders": {"topic": f"{name}.orders"},
               "customers": {"topic": f"{name}.customers", "format": "avro", "schema": str(schema)}}
    pipeline = parse_pipeline({**base.model_dump(by_alias=True, exclude={"source"}, exclude_none=True),
                               "sources": sources})
    assert pipeline.spark.core == "native"
    make_topics(pipeline, 2)
    units = _units_with_nan()
    records, firsts = wire([(side, [e._replace(row={k: v for k, v in e.row.items() if k != "score"})
                                    for e in events]) for side, events in units], 2)
    codec = AvroCodec(str(schema))
    scores = iter(events[0].row["score"] for side, events in units if side == 1)
    avro: list[InputRecord] = []
    for record in records:
        if record.partition >= RIGHT_PARTITIONS:
            event = orjson.loads(record.value)
            op = Op.parse(event.pop("op"))
            record = record._replace(value=codec.encode(ChangelogEvent(op, {**event, "score": next(scores)}, None)))
        avro.append(record)
    with caplog.at_level(logging.WARNING, logger="refold.runtime.joins"):
        run_batches(pipeline, avro, [] if cut is None else [cut], [True])
    spec = pipeline.view.join
    assert spec is not None
    expected = reference_join(spec, units)
    assert written(pipeline) == changelog(expected.changes)  # (NaN is written as null, both ways)
    letters = sorted((d.topic, d.partition, d.offset, d.reason) for d in
                     (decode_dead_letter(m.value()) for m in read_to_end({"bootstrap.servers": bootstrap_servers},
                                                                         pipeline.dlq_topic)))
    topics = (f"{name}.orders", f"{name}.customers")
    assert letters == sorted((topics[firsts[i][0]], firsts[i][1], firsts[i][2], reason) for i, reason in expected.rejected)
    assert [reason for _, reason in expected.rejected] == [Reason.NOT_LIVE, Reason.NOT_LIVE]
    warnings = [r.getMessage() for r in caplog.records if "joins in Python" in r.getMessage()]
    assert warnings and all(w.endswith("a float that is not finite") for w in warnings)
    assert len(warnings) == 1  # (the store keeps the join's columns: the next start's native core takes it)
    assert all("score" not in w and "nan" not in w.lower() for w in warnings)  # (no payloads)
    checkpoint = load_checkpoints(pipeline, {"bootstrap.servers": bootstrap_servers})[0]
    assert checkpoint.records_in == len(records) and checkpoint.dlq == 2


def _grouped_with_delta(name: str, bootstrap: str, kind: str, core: str, cache: int | None = None) -> Any:
    """Revenue per region over the merged join, with a delta output, on `core` (holding at
    most `cache` keys: `spark.state_cache_keys`)."""
    spark: dict[str, Any] = {"core": core} | ({} if cache is None else {"state_cache_keys": cache})
    base = join_pipeline(name, bootstrap, kind, key=["id"], grouped=True, spark=spark)
    return parse_pipeline({**base.model_dump(by_alias=True, exclude={"source"}, exclude_none=True),
                           "outputs": {"view": {"topic": f"{name}.view"}, "delta": {"topic": f"{name}.delta"}}})


def _records_of(pipeline: Any) -> dict[str, list[tuple[Any, ...]]]:
    """The view, delta, dead-letter and state records the pipeline wrote, each partition's
    in its order: partition, key, value and headers, the pipeline's name in them as `P`
    (each pipeline's topics carry its own name)."""
    settings_ = {"bootstrap.servers": pipeline.kafka_settings()["bootstrap.servers"]}
    name = pipeline.pipeline.encode()

    def shown(message: Any) -> tuple[Any, ...]:
        headers = [(k, v.replace(name, b"P")) for k, v in message.headers() or []]
        return message.partition(), message.key(), (message.value() or b"").replace(name, b"P"), headers

    topics = {"view": pipeline.outputs.view.topic, "delta": pipeline.outputs.delta.topic,
              "dead letters": pipeline.dlq_topic, "state": pipeline.state_topic}
    # (partition by partition: a read interleaves partitions wherever a fetch ends)
    return {what: sorted((shown(m) for m in read_to_end(settings_, topic)), key=lambda r: r[0])
            for what, topic in topics.items()}


@pytest.mark.kafka
@settings(max_examples=5, deadline=None, suppress_health_check=SLOW)
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]), data=st.data())
def test_the_grouped_view_over_a_join_writes_the_same_records_on_either_core(
        bootstrap_servers: str, monkeypatch: pytest.MonkeyPatch, units: list[Unit], kind: str,
        data: st.DataObject) -> None:
    """Revenue per region over the merged join, in Python and on the native cores (the
    view's `GroupedCore` naming causes `<topic>:<partition>:<offset>`), with the same batch
    cuts and restarts: the same view, delta, dead-letter and state records, byte for byte,
    headers (causes, what each record retracts) included; with a cache of 3 keys too, which
    each batch passes (the shard starts its cores empty and loads from its store). The
    native cores read each batch's records themselves (`read_join`), every batch of this
    clean input."""
    read_natively = JoinShardProcessor._read_natively
    batches = {"native": 0, "Python": 0}

    def counted(shard: JoinShardProcessor, fresh: Any, out: Any) -> Any:
        pending = read_natively(shard, fresh, out)
        batches["Python" if pending is None else "native"] += 1
        return pending

    monkeypatch.setattr(JoinShardProcessor, "_read_natively", counted)
    records, _ = wire(units, 2)
    cuts = data.draw(st.lists(st.integers(0, len(records)), max_size=5))
    restarts = data.draw(st.lists(st.booleans(), min_size=1, max_size=4))
    cache = data.draw(st.sampled_from([None, 3]))
    written_by = {}
    for core in ("python", "native"):
        pipeline = _grouped_with_delta(f"jv{uuid.uuid4().hex[:8]}", bootstrap_servers, kind, core, cache)
        make_topics(pipeline, 2)
        batches.update(native=0, Python=0)
        run_batches(pipeline, records, cuts, restarts)
        written_by[core] = _records_of(pipeline)
    assert written_by["native"] == written_by["python"]
    assert batches["Python"] == 0 and (batches["native"] > 0 or not records), batches
    assert any(h for _, _, _, h in written_by["native"]["view"]) or not written_by["native"]["view"]


@pytest.mark.kafka
def test_a_sum_past_64_bits_reduces_the_view_over_the_join_in_python(
        bootstrap_servers: str, caplog: pytest.LogCaptureFixture) -> None:
    """Two orders of 2^62 in one region: their sum passes 64 bits, which the view's native
    core does not hold. The shard drops the batch's work and reduces the view in Python
    from its store until its next start (one warning each, no payload in it): every record
    as the Python core writes it. After the cut and a restart, the next start's native core
    meets the sum again in the store, and falls back again."""
    def order(n: int, cust: int, amount: int) -> Unit:
        return 0, [SourceEvent(Op.APPEND, {"id": n, "cust": cust, "amount": amount}, (0, 0, 0))]

    customers: list[Unit] = [(1, [SourceEvent(Op.APPEND, {"cid": c, "region": "eu"}, (0, 0, 0))]) for c in (1, 2)]
    units = [*customers, order(1, 1, 5), order(2, 2, 2 ** 62), order(3, 1, 2 ** 62), order(4, 2, 7)]
    records, _ = wire(units, 2)
    written_by = {}
    for core in ("python", "auto"):
        pipeline = _grouped_with_delta(f"jw{uuid.uuid4().hex[:8]}", bootstrap_servers, "inner", core)
        make_topics(pipeline, 2)
        with caplog.at_level(logging.WARNING, logger="refold.runtime.joins"):
            run_batches(pipeline, records, [len(records) - 1], [True])
        written_by[core] = _records_of(pipeline)
    assert written_by["auto"] == written_by["python"]
    assert b'"revenue":9223372036854775820' in written_by["auto"]["view"][-1][2]  # (2^63 + 12)
    warnings = [r.getMessage() for r in caplog.records if "over the join in Python" in r.getMessage()]
    assert len(warnings) == 2 and all(w.endswith("a sum past 64 bits") for w in warnings)
    assert all(str(2 ** 62) not in w and "922337" not in w for w in warnings)
