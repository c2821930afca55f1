"""Exactly once per ingest through kill -9 at random points of its transactions
(inside one, between two), on the real broker: the same ingest run again until it finishes leaves
the topic's changelog exactly as one run without a kill does."""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition

from refold.ingest import ingest
from refold.kafka.io import read_to_end

pytestmark = [pytest.mark.kafka, pytest.mark.slow]  # make test-slow: kill -9 at random points of whole ingests

REFOLD = [sys.executable, "-m", "refold.cli.main"]


def _by_partition(settings: dict[str, Any], topic: str) -> dict[int, list[tuple[bytes | None, dict[str, Any]]]]:
    """Per partition, (message key, record without event_time) of every committed record."""
    out: dict[int, list[tuple[bytes | None, dict[str, Any]]]] = {}
    for msg in read_to_end(settings, topic):
        record = orjson.loads(msg.value() or b"null")
        record.pop("event_time", None)
        out.setdefault(int(msg.partition() or 0), []).append((msg.key(), record))
    return out


def _produced(consumer: Consumer, topic: str) -> int:
    """The topic's high watermarks summed: every record produced, committed or not."""
    return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)[1]
               for p in range(2))


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


@pytest.mark.parametrize("strategy", ["append", "upsert", "snapshot"])
def test_kill_9_then_the_same_ingest_writes_each_change_once(bootstrap_servers: str, topic, tmp_path: Path,
                                                              strategy: str) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    rng = random.Random(f"kill-{strategy}")
    base = [{"id": i, "v": i, "ts": 1_000 + i} for i in range(300)]
    if strategy == "snapshot":  # 100 changed, 100 removed, 100 new
        batch = ([{"id": i, "v": i + (1 if i < 100 else 0), "ts": 2_000 + i} for i in range(200) if i < 100 or i >= 200]
                 + [{"id": i, "v": i, "ts": 1_000 + i} for i in range(200, 300)]
                 + [{"id": i, "v": -i, "ts": 3_000 + i} for i in range(300, 400)])
    else:  # every key twice: an upsert corrects each one
        batch = [{"id": i % 300, "v": i, "ts": 2_000 + i} for i in range(600)]
    base_path, batch_path = tmp_path / "base.jsonl", tmp_path / "batch.jsonl"
    base_path.write_bytes(_jsonl(base))
    batch_path.write_bytes(_jsonl(batch))
    key = [] if strategy == "append" else ["id"]
    killed, clean = topic(partitions=2), topic(partitions=2)
    for name in (killed, clean):
        ingest(settings, name, [str(base_path)], merge_strategy="snapshot", primary_key=["id"], event_time_column="ts")
    ingest(settings, clean, [str(batch_path)], merge_strategy=strategy, primary_key=key, event_time_column="ts",
           per_transaction=10)

    command = [*REFOLD, "--bootstrap-servers", bootstrap_servers, "ingest", killed, str(batch_path),
               "--merge", strategy, "--event-time", "ts", "--per-transaction", "4",
               *(["--primary-key", "id"] if key else [])]
    kills = 0
    watermarks = Consumer({**settings, "group.id": "refold-test-watermarks"})
    for _attempt in range(14):
        # killed once the topic has grown by a random number of records since this run
        # started (produced, not yet committed: inside a transaction or between two), so
        # each kill lands in the ingest's transactions whatever the machine's speed
        start, target = _produced(watermarks, killed), rng.randint(1, 120)
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            while proc.poll() is None and _produced(watermarks, killed) - start < target:
                assert time.monotonic() < deadline, "the ingest neither wrote nor finished in 120 s"
                time.sleep(0.005)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
                kills += 1
                continue
        finally:
            assert proc.stdout is not None and proc.stderr is not None
            out, err = proc.stdout.read(), proc.stderr.read()
            proc.stdout.close()
            proc.stderr.close()
        assert proc.returncode == 0, err.decode()
        break
    else:
        final = subprocess.run(command, capture_output=True, timeout=120, check=False)
        assert final.returncode == 0, final.stderr.decode()
        out = final.stdout
    watermarks.close()
    again = subprocess.run(command, capture_output=True, timeout=120, check=False)
    assert again.returncode == 0 and b"already committed" in again.stdout, again.stdout + again.stderr
    assert kills >= 1, "no run was killed: the test proved nothing"
    assert _by_partition(settings, killed) == _by_partition(settings, clean)
    # the run that finished wrote the rest, or found it committed by a run killed after its commit
    assert b"wrote" in out or b"already committed" in out


def test_a_second_writer_fences_a_running_ingest(bootstrap_servers: str, topic, tmp_path: Path) -> None:
    """A correction into the topic while an ingest runs fences the ingest (one
    transactional id per topic); the ingest run again finishes, each row once."""
    from refold.ingest import correct
    from refold.ingest.run import ingests_topic

    settings = {"bootstrap.servers": bootstrap_servers}
    name = topic(partitions=2)
    rows = [{"id": i, "v": i} for i in range(3000)]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(_jsonl(rows))
    command = [*REFOLD, "--bootstrap-servers", bootstrap_servers, "ingest", name, str(path), "--merge", "append",
               "--primary-key", "id", "--per-transaction", "2"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until its first transactions are committed
            with contextlib.suppress(Exception):
                if any(True for _ in read_to_end(settings, ingests_topic(name))):
                    break
            time.sleep(0.2)
        change = correct(settings, name, ["id"], {"id": 0}, {"v": -1})
        assert change is not None
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, out + err
    assert b"fenced" in err, err
    finished = subprocess.run(command, capture_output=True, timeout=300, check=False)
    assert finished.returncode == 0, finished.stderr.decode()
    records = [r for rs in _by_partition(settings, name).values() for _k, r in rs]
    assert sorted(r["id"] for r in records if r["op"] == "+A") == list(range(3000))
    assert [(r["op"], r["v"]) for r in records if r["op"] != "+A"] == [("-C", 0), ("+C", -1)]
