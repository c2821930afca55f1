"""Bad-input fuzzing: malformed records among valid ones, through the real batch processor.

Hypothesis mixes valid units (appends, retractions of live rows, correction pairs)
with bad records of every kind (random bytes, truncated JSON, wrong types, bad
`op`, unpaired `-C` and `+C`, retraction of a row that is not live, null,
non-scalar and oversize keys) in a real source topic, then runs the engine's
`BatchProcessor` (the part of `refold run` that reduces and commits; Spark only
hands it the records) over them in a few batches, on the real broker. Every bad
record must reach `P.dlq` with a reason, the engine must not stop, and the
committed view must equal the reference over the valid records.
"""

from __future__ import annotations

import itertools
import random
import uuid
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refold.config import Pipeline, parse_pipeline
from refold.kafka.io import ensure_topics, open_transactions, read_to_end
from refold.ops.verify import verify
from refold.recovery.records import decode_dead_letter
from refold.runtime.processor import BatchProcessor, InputRecord
from refold.spark.job import engine_topics

pytestmark = pytest.mark.kafka

GROUPED = {
    "key": ["player_name"],
    "columns": {
        "total": {"sum": "score"},
        "n": {"count": "*"},
        "mean": {"avg": "score"},
        "best": {"max": "score"},
        "worst": {"min": "score"},
        "opening": {"first": "score"},
        "latest": {"last": "score"},
        "teams": {"set": "team"},
    },
}
TOP_N = {"top_n": {"n": 2, "order_by": {"score": "desc"}, "partition_by": ["team"]}}
BAD_KINDS = (
    "random_bytes",
    "truncated",
    "score_not_number",
    "key_not_scalar",
    "op_out_of_range",
    "op_unknown",
    "unpaired_minus_c",
    "lone_plus_c",
    "not_live",
    "null_key",
    "missing_key",
    "oversize_key",
    "not_an_object",
)


def build(seed: int, plan: list[str | None], key: str) -> tuple[list[bytes], int]:
    """The source records for `plan` (None: a valid unit; a kind: one bad record), and
    how many bad ones. `key` is the column that keys the view (its bad values are bad
    records). The last record is always a valid append, so that an unpaired
    `-C` is followed by something (a `-C` at the very end still waits for its `+C`)."""
    rng = random.Random(seed)
    live: list[dict[str, Any]] = []
    out: list[bytes] = []
    bad = 0

    def row() -> dict[str, Any]:
        return {"player_name": f"p{rng.randrange(6)}", "score": rng.randrange(100), "team": rng.choice("ab")}

    for step in [*plan, None]:
        if step is None:
            choice = rng.random()
            if live and choice < 0.25:
                out.append(orjson.dumps({"op": "-R", **live.pop(rng.randrange(len(live)))}))
            elif live and choice < 0.5:
                old = live.pop(rng.randrange(len(live)))
                new = {**row(), "player_name": old["player_name"]}
                live.append(new)
                out += [orjson.dumps({"op": "-C", **old}), orjson.dumps({"op": "+C", **new})]
            else:
                live.append(row())
                out.append(orjson.dumps({"op": "+A", **live[-1]}))
            continue
        bad += 1
        good = orjson.dumps({"op": "+A", **row()})
        out.append(
            {
                "random_bytes": lambda: rng.randbytes(rng.randrange(1, 40)).replace(b"{", b"(") or b"\x00",
                "truncated": lambda good=good: good[: rng.randrange(1, len(good) - 1)],
                "score_not_number": lambda: orjson.dumps({"op": "+A", **row(), "score": ["ten"]}),
                "key_not_scalar": lambda: orjson.dumps({"op": "+A", **row(), key: [1, {"a": 2}]}),
                "op_out_of_range": lambda: orjson.dumps({"op": 9, **row()}),
                "op_unknown": lambda: orjson.dumps({"op": "+X", **row()}),
                "unpaired_minus_c": lambda: orjson.dumps({"op": "-C", **row(), "score": -1}),
                "lone_plus_c": lambda: orjson.dumps({"op": "+C", **row(), "score": -1}),
                "not_live": lambda: orjson.dumps({"op": "-R", **row(), "score": -1}),
                "null_key": lambda: orjson.dumps({"op": "+A", **row(), key: None}),
                "missing_key": lambda: orjson.dumps({"op": "+A", **{c: v for c, v in row().items() if c != key}}),
                "oversize_key": lambda: orjson.dumps({"op": "+A", **row(), key: "x" * 300_000}),
                "not_an_object": lambda: orjson.dumps([1, 2, 3]),
            }[step]()
        )
    return out, bad


def pipeline_for(source: str, bootstrap: str, view: dict[str, Any]) -> Pipeline:
    name = f"fz{uuid.uuid4().hex[:10]}"
    outputs: dict[str, Any] = {"view": {"topic": f"{name}.view"}}
    if "key" in view:
        outputs["delta"] = {"topic": f"{name}.delta"}
    return parse_pipeline(
        # messages keyed by player (a correction may move a player to another team):
        # the Top-N by team re-groups them, as one shard
        {"pipeline": name, "kafka": {"bootstrap.servers": bootstrap}, "source": {"topic": source, "key": ["player_name"]},
         "view": view, "outputs": outputs}
    )


@pytest.mark.parametrize("view", [GROUPED, TOP_N], ids=["grouped", "top_n"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    plan=st.lists(st.one_of(st.none(), st.sampled_from(BAD_KINDS)), min_size=1, max_size=40),
    seed=st.integers(0, 2**16),
    cuts=st.lists(st.integers(0, 60), max_size=3),
)
def test_bad_records_reach_the_dlq_and_the_view_stays_exact(
    bootstrap_servers: str, topic: Any, view: dict[str, Any], plan: list[str | None], seed: int, cuts: list[int]
) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=1)
    key = view["key"][0] if "key" in view else view["top_n"]["partition_by"][0]
    values, bad = build(seed, plan, key)
    producer = Producer({"bootstrap.servers": bootstrap_servers, "message.max.bytes": 2_000_000})
    for value in values:
        producer.produce(source, value, message_key(value, "player_name"))
    producer.flush(30)

    pipeline = pipeline_for(source, bootstrap_servers, view)
    ensure_topics(settings_, engine_topics(pipeline, 1))
    records = [
        InputRecord(m.partition() or 0, m.offset() or 0, m.key(), m.value(), m.timestamp()[1])
        for m in read_to_end(settings_, source)
    ]
    assert len(records) == len(values)
    processor = BatchProcessor(pipeline, settings_)
    try:
        bounds = sorted({0, len(records), *(c for c in cuts if c < len(records))})
        for start, end in itertools.pairwise(bounds):
            processor.process(records[start:end])  # never raises in default mode
    finally:
        processor.close()

    # the last commit's markers may still be on their way: read once they are written
    assert not open_transactions(settings_, [t.name for t in engine_topics(pipeline, 1)], timeout=30)
    letters = [decode_dead_letter(m.value()) for m in read_to_end(settings_, pipeline.dlq_topic)]
    assert len(letters) == bad, [letter.reason for letter in letters]
    assert all(letter.reason and letter.topic == source for letter in letters)
    assert len({letter.offset for letter in letters}) == bad  # each bad record once
    report = verify(pipeline, settings_)
    assert report.anomalies == [], "\n".join(report.anomalies)


def message_key(value: bytes, column: str) -> bytes:
    """Refold's message key of a record (the JSON object of its key column), or b"k" for
    one that has none (undecodable, no key): those are dead letters before any key check."""
    try:
        row = orjson.loads(value)
    except orjson.JSONDecodeError:
        return b"k"
    if not isinstance(row, dict) or row.get(column) is None:
        return b"k"
    return orjson.dumps({column: row[column]})
