"""What the engine's fault tests share: a source loaded with a seeded changelog, and
the exactly-once check after a run (`refold verify` against the reference, and the
committed checkpoints counting every event once)."""

from __future__ import annotations

from collections.abc import Callable

import orjson

from refold.cli.produce import produce
from refold.config import Pipeline
from refold.dev.testing import Workload, generate
from refold.ops.verify import verify
from refold.recovery.restore import load_checkpoint


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
