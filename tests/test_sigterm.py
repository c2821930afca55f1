"""`refold run` stopped with SIGTERM on the host (as `docker stop` and service managers
stop it): the batch in flight ends whole and the run exits 0. The handler only asks the
run to stop; an exception raised into the driver could land inside a call to Spark's
JVM and break its connection (then the run ended with "Answer from Java side is empty")."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from engine_runs import load_source, write_pipeline

from refold.kafka.io import read_to_end


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.slow
def test_sigterm_while_running_stops_after_the_batch_with_status_0(
    bootstrap_servers: str, topic: Any, tmp_path: Path
) -> None:
    source, _events = load_source(bootstrap_servers, topic, partitions=2, events=600, keys=40, seed=71)
    path = write_pipeline(tmp_path, source, bootstrap_servers, trigger="200ms")
    engine = subprocess.Popen([sys.executable, "-m", "refold.cli", "run", str(path), "--log-format", "json"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    committed = threading.Event()

    def read() -> None:
        assert engine.stderr is not None
        for line in engine.stderr:
            lines.append(line)
            if '"batch committed"' in line:
                committed.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert committed.wait(180), "".join(lines[-30:])
        time.sleep(1.0)  # idle batches: the driver waits on the query, inside a call to the JVM
        engine.send_signal(signal.SIGTERM)
        code = engine.wait(120)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(30)
    reader.join(10)
    text = "".join(lines)
    assert code == 0, text[-4000:]
    messages = [orjson.loads(line).get("message", "") for line in lines if line.startswith("{")]
    assert any("SIGTERM" in m for m in messages), text[-2000:]
    assert any("stop requested" in m for m in messages), text[-2000:]
    assert "Answer from Java side is empty" not in text
    name = path.stem
    assert any(True for _ in read_to_end({"bootstrap.servers": bootstrap_servers}, f"{name}.view"))
