"""One real engine run (Spark + the real broker) for the operations features:
a Debezium CDC topic feeds a view whose output is Avro in the Confluent wire
format (confluent-kafka's mock registry, read back with its own
`AvroDeserializer`), with the Prometheus endpoint on and scraped over HTTP while
the engine runs. The view equals the reference reducer over the mapped events.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext
from prometheus_client.parser import text_string_to_metric_families

from refold.codecs import registry_client
from refold.codecs.pipeline import output_encoders
from refold.config import parse_pipeline
from refold.dev.localkafka import free_port
from refold.dev.testing import Workload, generate
from refold.kafka.io import read_to_end
from refold.model.changelog import Op, canonical_row
from refold.ops.verify import Report, fold_delta_topic, read_table_source, same
from refold.recovery.records import decode_dead_letter
from refold.reduce import ViewChange
from refold.reference import fold_changelog, reference_table
from refold.spark.job import run_pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

VIEW_ROW = {
    "type": "record",
    "name": "PlayerTotals",
    "namespace": "test",
    "fields": [
        {"name": "player_name", "type": "string"},
        {"name": "total", "type": "long"},
        {"name": "games", "type": "long"},
        {"name": "best", "type": ["null", "long"]},
    ],
}


def debezium_records(rows: list[dict[str, Any]]) -> tuple[list[tuple[bytes, bytes | None]], int, int]:
    """The generated changelog as the Debezium events of a table with a primary key
    `id` (each appended row a new id; a retraction deletes, a correction updates, the
    latest live row equal to it), keyed by `{"id": …}`, half of them with the JSON
    converter's payload wrapper, a tombstone after every 5th delete and a few bad
    envelopes; with the counts of tombstones and bad records."""
    out: list[tuple[bytes, bytes | None]] = []
    tombstones = bad = deletes = 0
    ids: dict[bytes, list[int]] = {}  # a live row (without its id) -> the ids holding it
    i = 0
    while i < len(rows):
        event = rows[i]
        op, row = event.pop("op"), event
        ts = row.pop("event_time")
        if op == "-C":
            after = dict(rows[i + 1])
            after.pop("op"), after.pop("event_time")
            id_ = ids[canonical_row(row)].pop()
            ids.setdefault(canonical_row(after), []).append(id_)
            body = {"op": "u", "before": {**row, "id": id_}, "after": {**after, "id": id_}, "ts_ms": ts}
            i += 2
        elif op == "-R":
            id_ = ids[canonical_row(row)].pop()
            body = {"op": "d", "before": {**row, "id": id_}, "after": None, "ts_ms": ts, "source": {"table": "scores"}}
            i += 1
        else:
            id_ = len(out)
            ids.setdefault(canonical_row(row), []).append(id_)
            body = {"op": "c", "before": None, "after": {**row, "id": id_}, "ts_ms": ts, "source": {"table": "scores"}}
            i += 1
        key = orjson.dumps({"id": id_})
        wrapped = {"schema": {"type": "struct"}, "payload": body} if len(out) % 2 else body
        out.append((key, orjson.dumps(wrapped)))
        if body["op"] == "d":
            deletes += 1
            if deletes % 5 == 0:
                out.append((key, None))
                tombstones += 1
        if len(out) % 97 == 0:
            out.append((key, orjson.dumps({"op": "t", "ts_ms": ts})))  # truncate: not a row change
            # an update without a before image of a key that has no row: not live
            out.append((orjson.dumps({"id": -1}), orjson.dumps({"op": "u", "after": {**row, "id": -1}, "ts_ms": ts})))
            bad += 2
    return out, tombstones, bad


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_debezium_topic_to_avro_view_with_metrics(bootstrap_servers, topic, tmp_path: Path, spark: Any) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=2)
    records, tombstones, bad = debezium_records(list(generate(Workload(events=1200, keys=80, seed=17))))
    producer = Producer(settings)
    for key, value in records:
        producer.produce(source, value, key)
    producer.flush(30)

    name = f"ops{uuid.uuid4().hex[:8]}"
    row_schema = tmp_path / "view.avsc"
    row_schema.write_text(json.dumps(VIEW_ROW))
    port = free_port()
    pipeline = parse_pipeline({
        "pipeline": name,
        "source": {"topic": source, "format": "debezium-json", "key": ["id"]},
        "view": {"key": ["player_name"],
                 "columns": {"total": {"sum": "score"}, "games": {"count": "*"}, "best": {"max": "score"}}},
        "outputs": {"view": {"topic": f"{name}.view", "format": "avro", "schema": str(row_schema)},
                    "delta": {"topic": f"{name}.delta"}},
        "schema_registry": {"url": f"mock://{name}"},
        "metrics": {"port": port, "host": "127.0.0.1"},
        "trigger": "200ms",
        "max_batch_events": 400,
        "spark": {"checkpoint_dir": str(tmp_path / "spark")},
    })
    failure: list[BaseException] = []

    def engine() -> None:
        try:
            run_pipeline(pipeline, bootstrap_servers, until_idle=4.0, spark=spark, quiet=True)
        except BaseException as exc:
            failure.append(exc)

    runner = threading.Thread(target=engine)
    started = time.monotonic()
    runner.start()
    try:
        # Scrape while the engine runs: until every record is counted in.
        labels = (("pipeline", name), ("topic", source))
        metrics: dict[Any, float] = {}
        while time.monotonic() - started < 240 and runner.is_alive():
            try:
                metrics = scrape(f"http://127.0.0.1:{port}/metrics")
            except OSError:
                metrics = {}
            if metrics.get(("refold_events_in_total", labels)) == len(records):
                break
            time.sleep(0.5)
        assert metrics.get(("refold_events_in_total", labels)) == len(records), failure
        lag_deadline = time.monotonic() + 10
        while sum(v for (n, _l), v in metrics.items() if n == "refold_consumer_lag") and time.monotonic() < lag_deadline:
            time.sleep(1)  # the lag gauge is measured every second
            metrics = scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        runner.join(300)
    assert not failure, failure
    seconds = time.monotonic() - started

    own = (("pipeline", name),)
    assert metrics[("refold_tombstones_total", own)] == tombstones > 0
    assert metrics[("refold_dead_letters_total", own)] == bad > 0
    assert metrics[("refold_transaction_aborts_total", own)] == 0
    batches = metrics[("refold_batches_total", own)]
    assert batches >= 3  # max_batch_events 400
    assert metrics[("refold_batch_duration_seconds_count", own)] == batches
    assert metrics[("refold_commit_latency_seconds_count", own)] == batches
    assert 0 < metrics[("refold_commit_latency_seconds_sum", own)] <= metrics[("refold_batch_duration_seconds_sum", own)]
    lags = {dict(labels)["partition"]: v for (n, labels), v in metrics.items() if n == "refold_consumer_lag"}
    assert set(lags) == {"0", "1"} and sum(lags.values()) == 0

    # The view: Avro in the wire format, read by confluent-kafka's own deserializer. A
    # `mock://` registry lives in one process and the engine registered its schemas in
    # a Spark worker's: registering the same schemas here, in the same order, gives
    # them the same ids in this process's mock.
    output_encoders(pipeline)
    deserialize = AvroDeserializer(registry_client(pipeline.schema_registry))  # type: ignore[arg-type]
    view_topic = f"{name}.view"
    actual = []
    for msg in read_to_end(settings, view_topic):
        record = deserialize(msg.value(), SerializationContext(view_topic, MessageField.VALUE))
        op = Op(record.pop("op"))
        assert record.pop("event_time") is None
        actual.append(ViewChange(op, (record["player_name"],), record))
    out = {("pipeline", name), ("topic", view_topic)}
    assert metrics[("refold_events_out_total", tuple(sorted(out)))] == len(actual)

    # ... folds to the reference's view of the table (the view re-groups the table's
    # rows, so its record order depends on the batches: the folded view is compared)
    partitions, undecodable = read_table_source(pipeline, settings)
    assert undecodable == bad // 2  # the truncates
    expected = reference_table(pipeline.view, partitions)
    assert [reason for _, reason in expected.rejected] == ["not live"] * (bad // 2)  # updates of no row
    folded_view = fold_changelog(actual)
    assert folded_view.keys() == expected.view.keys()
    assert all(same(folded_view[k], expected.view[k]) for k in folded_view)
    folded = fold_delta_topic(pipeline, settings, Report())
    assert folded.keys() == expected.view.keys()
    assert all(same(folded[k], expected.view[k]) for k in folded)

    letters = [decode_dead_letter(m.value()) for m in read_to_end(settings, pipeline.dlq_topic)]
    assert sorted(letter.reason for letter in letters) == sorted(["schema mismatch", "not live"] * (bad // 2))
    assert seconds < 240
