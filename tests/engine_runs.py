"""What the engine's tests share: a pipeline file, a source loaded with a seeded
changelog, and the exactly-once check after a run (`refold verify` against the
reference, and the committed checkpoints counting every event once)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import yaml

from refold.cli.produce import produce
from refold.config import Pipeline
from refold.dev.testing import Workload, generate
from refold.ops.verify import verify
from refold.recovery.records import Checkpoint
from refold.recovery.restore import load_checkpoint
from refold.runtime.batch import Outgoing
from refold.runtime.processor import BatchProcessor
from refold.runtime.shard import ShardProcessor

COLUMNS = {"total": {"sum": "score"}, "best": {"max": "score"}, "n": {"count": "*"}, "latest": {"last": "score"}}


def write_pipeline(tmp: Path, source: str, bootstrap: str, *, columns: dict[str, Any] | None = None,
                   delta: bool = True, spark: dict[str, Any] | None = None, **settings: Any) -> Path:
    """A uniquely named pipeline file in `tmp`: over `source` (keyed by player_name), a
    view per player_name of `columns` (default `COLUMNS`) into NAME.view, and its deltas
    into NAME.delta unless `delta` is False; Spark `local[2]` with its checkpoints in
    tmp/spark/NAME, `spark` over that; `settings` (trigger, max_batch_events, …) at the
    top level."""
    name = f"p{uuid.uuid4().hex[:10]}"
    path = tmp / f"{name}.yaml"
    outputs = {"view": {"topic": f"{name}.view"}} | ({"delta": {"topic": f"{name}.delta"}} if delta else {})
    path.write_text(yaml.safe_dump({
        "pipeline": name,
        "kafka": {"bootstrap.servers": bootstrap},
        "source": {"topic": source},
        "view": {"key": ["player_name"], "columns": COLUMNS if columns is None else columns},
        "outputs": outputs,
        "spark": {"master": "local[2]", "checkpoint_dir": str(tmp / "spark" / name)} | (spark or {}),
        **settings,
    }))  # fmt: skip
    return path


def load_source(bootstrap: str, topic: Callable[..., str], *, partitions: int, events: int, keys: int, seed: int,
                per_transaction: int = 300) -> tuple[str, int]:
    """A fresh source topic with a seeded changelog keyed by player_name: (topic, events)."""
    source = topic(partitions=partitions)
    rows = [orjson.dumps(r) for r in generate(Workload(events=events, keys=keys, seed=seed))]
    produce({"bootstrap.servers": bootstrap}, source, rows, ["player_name"], progress=False,
            per_transaction=per_transaction)
    return source, len(rows)


def assert_exact(pipeline: Pipeline, bootstrap: str, events: int) -> None:
    """The outputs equal the reference record by record, and the committed checkpoints
    count `events` read, once each."""
    settings = {"bootstrap.servers": bootstrap}
    report = verify(pipeline, settings)
    assert report.anomalies == [], "\n".join(report.anomalies)
    assert report.events == events
    checkpoint = load_checkpoint(pipeline, settings)
    assert checkpoint is not None and checkpoint.records_in == events


class Recording(ShardProcessor):
    """Commits as the engine does, and keeps what each batch sent."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[tuple[int, Outgoing]] = []
        super().__init__(*args, **kwargs)

    def _commit(self, out: Outgoing, checkpoint: Checkpoint) -> None:
        super()._commit(out, checkpoint)
        self.sent.append((checkpoint.batch, out))


class RecordingProcessor(BatchProcessor):
    shard_type = Recording
