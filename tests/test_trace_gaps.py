"""`refold trace` over a view whose trace index has a hole: provenance turned off and on
again between engine runs writes view records no index record names; the reader notices
the gap between two index records and scans it (and after the last), so `--key` still
gives every record of the key, as a full scan does."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import pytest
from test_trace_outputs import _run

from refold.cli import trace
from refold.config import Pipeline, parse_pipeline
from refold.kafka.io import ensure_topics, read_to_end
from refold.runtime.batch import InputRecord
from refold.spark.job import engine_topics

pytestmark = pytest.mark.kafka

PARTITIONS = 2


def _pipeline(settings_: dict[str, Any], name: str, source: str, provenance: bool) -> Pipeline:
    return parse_pipeline({
        "pipeline": name, "kafka": settings_, "source": {"topic": source, "key": ["g"]},
        "view": {"key": ["g"], "columns": {"total": {"sum": "score"}}},
        "outputs": {"view": {"topic": f"{name}.view"}, "provenance": provenance}})


def test_records_written_with_provenance_off_are_scanned(bootstrap_servers: str, topic: Any) -> None:
    settings_ = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=PARTITIONS)
    name = f"tg{uuid.uuid4().hex[:8]}"
    on = _pipeline(settings_, name, source, True)
    ensure_topics(settings_, engine_topics(on, PARTITIONS))
    offsets = [0] * PARTITIONS

    def events(scores: list[int]) -> list[InputRecord]:
        out = []
        for score in scores:
            g = score % 4
            p = g % PARTITIONS
            out.append(InputRecord(p, offsets[p], orjson.dumps({"g": g}),
                                   orjson.dumps({"op": "+A", "g": g, "score": score}), 1_000 + offsets[p]))
            offsets[p] += 1
        return out

    _run(on, settings_, events([0, 1, 2, 3, 4]))
    _run(_pipeline(settings_, name, source, False), settings_, events([8, 9, 10, 11]))
    _run(on, settings_, events([12, 13, 14, 15]))
    _run(_pipeline(settings_, name, source, False), settings_, events([16, 17]))  # (after the last index record)
    assert on.outputs.view is not None
    scanned: dict[bytes, list[tuple[int, int]]] = {}
    for msg in read_to_end(settings_, on.outputs.view.topic):
        scanned.setdefault(msg.key(), []).append((msg.partition(), msg.offset()))
    for key, where in scanned.items():
        notes: list[str] = []
        got = trace.trace_key(on, settings_, orjson.loads(key), note=notes.append)
        assert [(r["partition"], r["offset"]) for r in got] == sorted(where), key
        assert any("not in the trace index: scanning them" in note for note in notes), notes
    # what provenance off wrote has no cause: the trace says so
    got = trace.trace_key(on, settings_, {"g": 0})
    assert [r["row"]["total"] for r in got if r["op"] in ("+A", "+C")] == [0, 4, 12, 24, 40]
    assert [r["cause"] is None for r in got if r["op"] in ("+A", "+C")] == [False, False, True, False, True]
