"""kill -9 of the engine running a windowed view with a lateness, then restarts: still
exactly once, the closed windows' tombstones included.

The input (`refold.dev.windowload`) is out of order: events a little behind the clock,
some late by up to two windows (within the horizon: they correct a written window;
beyond it: a `late` dead letter), late corrections and retractions. After the kills
and a final run, the checks are the reference's (`refold verify`): every key's
committed view records equal the reference's record by record (one watermark per
shard: per source partition), the committed dead letters are exactly the reference's
(each once, `late` ones included), the checkpoints count every event once; and each
shard's `P.state`, folded, holds the open windows only: a reducer restored from it
holds exactly the reference's open windows and watermark (a closed window whose
records were not tombstoned would show up there)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from test_crash import finish, start_engine

from refold.cli.produce import produce
from refold.config import Pipeline, load_pipeline
from refold.dev.windowload import WindowWorkload, generate_windowed
from refold.kafka.io import read_to_end
from refold.model.reasons import Reason
from refold.ops.verify import read_source, verify
from refold.recovery.records import decode_dead_letter
from refold.recovery.restore import load_checkpoint, load_checkpoints
from refold.reduce import make_reducer
from refold.reduce.windowed import WATERMARK_KEY
from refold.reference import ReferenceResult, merge_partitions
from refold.reference_windows import WindowModel
from refold.state.store import VIEW_RECORD_FIRST

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

# 1500 events over 30 horizons of a 1 s tumble with 1 s lateness, a dozen players: each
# player's windows hold a few rows, and dozens of windows close in every shard
WORKLOAD = WindowWorkload(events=1500, keys=12, window_ms=1000, lateness_ms=1000, horizons=30, late_share=0.1,
                          correct_share=0.08, retract_share=0.04, seed=37)


@pytest.fixture
def windowed_source(bootstrap_servers: str, topic: Callable[..., str]) -> tuple[str, int]:
    source = topic(partitions=3)
    rows = [orjson.dumps(r) for r in generate_windowed(WORKLOAD)]
    produce({"bootstrap.servers": bootstrap_servers}, source, rows, ["player_name"], progress=False,
            per_transaction=300)
    return source, len(rows)


def write_windowed_pipeline(tmp: Path, source: str, bootstrap: str, kind: str) -> Path:
    name = f"cw{uuid.uuid4().hex[:10]}"
    path = tmp / f"{name}.yaml"
    outputs: dict[str, Any] = {"view": {"topic": f"{name}.view"}}
    if kind == "tumble":
        outputs["delta"] = {"topic": f"{name}.delta"}
    path.write_text(yaml.safe_dump({
        "pipeline": name,
        "kafka": {"bootstrap.servers": bootstrap},
        "source": {"topic": source},
        "view": WORKLOAD.view(kind),
        "outputs": outputs,
        "trigger": "200ms",
        "max_batch_events": 250,
        "spark": {"master": "local[1]", "checkpoint_dir": str(tmp / "spark" / name),
                  "state_dir": str(tmp / "state"), "conf": {"spark.ui.enabled": "false"}},
    }))
    return path


def open_windows(pipeline: Pipeline, settings: dict[str, Any]) -> dict[int, tuple[dict[Any, Any], int | None]]:
    """Per source partition: the reference's open windows at the end (rows by output key)
    and its watermark's largest time (the watermark plus the lateness)."""
    partitions, _bad = read_source(pipeline, settings)
    emit = pipeline.outputs.view.emit if pipeline.outputs.view is not None else "per_event"
    lateness = pipeline.view.window.lateness_ms if pipeline.view.window is not None else None
    assert lateness is not None
    out = {}
    for partition, events in partitions.items():
        model = WindowModel(pipeline.view, emit)
        scratch = ReferenceResult()
        for index, unit in enumerate(merge_partitions({partition: events})):
            model.step(unit, index, scratch, list(range(len(unit))))
        wm = model.watermark()
        out[partition] = (model.outputs_of(model.live), None if wm is None else wm + lateness)
    return out


def folded_state(pipeline: Pipeline, settings: dict[str, Any]) -> dict[int, dict[bytes, bytes | None]]:
    """Each `P.state` partition's committed records folded: the latest value per key
    (None: a tombstone)."""
    state: dict[int, dict[bytes, bytes | None]] = {}
    for message in read_to_end(settings, pipeline.state_topic):
        state.setdefault(message.partition() or 0, {})[message.key() or b""] = message.value()
    return state


def assert_exactly_once(pipeline: Pipeline, bootstrap: str, events: int) -> None:
    settings = {"bootstrap.servers": bootstrap}
    report = verify(pipeline, settings, dead_letters=True)
    assert report.anomalies == [], "\n".join(report.anomalies)
    assert report.events == events
    checkpoint = load_checkpoint(pipeline, settings)
    assert checkpoint is not None and checkpoint.records_in == events
    assert sorted(load_checkpoints(pipeline, settings)) == [0, 1, 2]  # one shard per source partition
    reasons = [decode_dead_letter(m.value()).reason for m in read_to_end(settings, pipeline.dlq_topic)]
    assert Reason.LATE in reasons, "the input has events beyond the horizon: some must be late dead letters"
    emit = pipeline.outputs.view.emit if pipeline.outputs.view is not None else "per_event"
    state = folded_state(pipeline, settings)
    for partition, (rows, max_time) in open_windows(pipeline, settings).items():
        records = state.get(partition, {})
        live = sorted((k, v) for k, v in records.items()
                      if v is not None and (k == WATERMARK_KEY or k >= VIEW_RECORD_FIRST))
        reducer = make_reducer(pipeline.view, emit)
        reducer.restore(live)
        assert getattr(reducer, "max_time", None) == max_time, partition
        assert reducer.view() == rows, f"P.state of shard {partition} holds other windows than the open ones"
        # the closed windows' records are there as tombstones (the latest record of their keys)
        assert any(v is None for v in records.values()), f"P.state of shard {partition}: no window closed"


def test_a_tumble_view_with_lateness_killed_inside_its_transaction_then_restarted(
        bootstrap_servers: str, windowed_source: tuple[str, int], tmp_path: Path) -> None:
    # the short one, in `make test`: records of batch 2 sent (late dead letters, closed
    # windows' tombstones among them), not committed; the restart writes them once
    source, events = windowed_source
    path = write_windowed_pipeline(tmp_path, source, bootstrap_servers, "tumble")
    code, err = finish(start_engine(path, crash="in_txn:2"))
    assert code == -9, err[-2000:]
    code, err = finish(start_engine(path))
    assert code == 0, err[-3000:]
    assert_exactly_once(load_pipeline(path), bootstrap_servers, events)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tumble", "session"])
def test_a_windowed_view_with_lateness_killed_at_each_point_then_restarted(
        bootstrap_servers: str, windowed_source: tuple[str, int], tmp_path: Path, kind: str) -> None:
    # killed inside a batch (nothing sent), inside the transaction (records sent, not
    # committed) and right after a commit (before the local store and Spark's checkpoint
    # saw it); each run goes on from what the one before committed, windows closing and
    # late events arriving through it all
    source, events = windowed_source
    path = write_windowed_pipeline(tmp_path, source, bootstrap_servers, kind)
    pipeline = load_pipeline(path)
    for crash in ("mid_batch:2", "in_txn:3", "after_commit:4"):
        code, err = finish(start_engine(path, crash=crash))
        assert code == -9, f"{crash}: {err[-2000:]}"
    code, err = finish(start_engine(path))
    assert code == 0, err[-3000:]
    assert_exactly_once(pipeline, bootstrap_servers, events)
