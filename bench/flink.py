"""The Apache Flink contender of `make bench`: its virtualenv, its jar, its run, its check.

PyFlink conflicts with PySpark (pyarrow, pandas, protobuf pins), so it lives in its
own virtualenv, `<home>/flink-venv` (`.refold/flink-venv` in a checkout), made on
first use with the pinned `apache-flink` below; a stamp file records the version.
Flink's Kafka SQL connector is the `flink-connectors` jar set (`refold.spark.jars`,
`engine/jvm/flink-connectors.pom.xml`): connector 5.0.0-2.2 is the release for
Flink 2.2.

`run_flink` starts `bench/flink_job.py` with that venv's python (`run_flink_windows`
`bench/flink_windows_job.py` for `make bench-windows`, `run_flink_join`
`bench/flink_join_job.py` for `make bench-join`; all through `run_job`), samples the peak
RSS of its process tree (the Python driver and Flink's JVM), and reads the output
topic `read_committed` while the job runs: the time of the last committed output
record it sees, minus the time the job was submitted, is Flink's time (the JVM's
start is reported apart, as Refold's Spark session start is not counted either;
`first_output_s`, when the first committed record appeared, shows how much of
Flink's time is planning, mini-cluster start and deployment).
After the job has ended it drains the topic and compares the final per-key rows
with the expected view (from `refold.reference`; the join's from
`refold.dev.joinload`): the number of keys that differ is the mismatch count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, KafkaError, TopicPartition

from bench.procs import PeakRss
from refold.environment import home as project_home
from refold.kafka.io import TopicSpec, consumer_config, ensure_topics, partitions_of
from refold.spark.jars import resolve

FLINK_VERSION = "2.2.1"  # apache-flink on PyPI; the connector jar set must match it
JOB = Path(__file__).resolve().parent / "flink_job.py"
WINDOWS_JOB = Path(__file__).resolve().parent / "flink_windows_job.py"  # `make bench-windows`
JOIN_JOB = Path(__file__).resolve().parent / "flink_join_job.py"  # `make bench-join`
_STAMP = ".refold-flink"


def flink_python() -> Path:
    """The Flink virtualenv's python, making the venv (a few minutes, once) when needed."""
    venv = project_home() / "flink-venv"
    python = venv / "bin" / "python"
    stamp = venv / _STAMP
    if python.is_file() and stamp.is_file() and stamp.read_text().strip() == FLINK_VERSION:
        return python
    print(f"installing apache-flink {FLINK_VERSION} into {venv} (once; a large download)…", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"apache-flink=={FLINK_VERSION}"], check=True)
    stamp.write_text(FLINK_VERSION + "\n")
    return python


def flink_jars() -> list[Path]:
    return resolve("flink-connectors")


class OutputReader(threading.Thread):
    """Reads an upsert topic read_committed into a dict (key → value, tombstones delete)
    and notes the wall-clock time each record arrived."""

    def __init__(self, settings: dict[str, Any], topic: str) -> None:
        super().__init__(name="bench-flink-reader", daemon=True)
        self.consumer = Consumer(consumer_config(settings, **{"group.id": f"bench-flink-reader-{uuid.uuid4()}"}))
        self.partitions = partitions_of(settings, topic)
        self.consumer.assign([TopicPartition(topic, p, 0) for p in self.partitions])
        self.rows: dict[bytes, bytes] = {}
        self.records = 0
        self.first_record: float | None = None
        self.last_record: float | None = None
        self.draining = threading.Event()  # set when the producer is done: stop at the end
        self.failure: str | None = None

    def run(self) -> None:
        at_end: set[int] = set()
        while not (self.draining.is_set() and at_end >= set(self.partitions)):
            messages = self.consumer.consume(10_000, 0.2)
            if self.draining.is_set() and not messages:
                break  # the job has ended and nothing more comes
            for message in messages:
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        at_end.add(message.partition() or 0)
                        continue
                    self.failure = error.str()
                    return
                at_end.discard(message.partition() or 0)
                self.records += 1
                self.last_record = time.time()
                if self.first_record is None:
                    self.first_record = self.last_record
                key = message.key() or b""
                value = message.value()
                if value is None:
                    self.rows.pop(key, None)
                else:
                    self.rows[key] = value
        self.consumer.close()


def mismatches(rows: dict[bytes, bytes], expected: dict[str, dict[str, Any]], columns: list[str],
               key: str = "player_name", count: str = "games") -> int:
    """Keys whose final output row differs from the expected one, or is missing, or is
    extra (a row whose `count` column is 0 counts as none)."""
    seen = {}
    for raw, value in rows.items():
        seen[orjson.loads(raw)[key]] = orjson.loads(value)
    bad = 0
    for name in set(seen) | set(expected):
        got, want = seen.get(name), expected.get(name)
        if got is not None and got.get(count) == 0:
            got = None  # the signed reduction keeps a key whose rows are all gone, at 0
        if got is None and want is None:
            continue
        if got is None or want is None or any(got.get(c) != want.get(c) for c in columns):
            bad += 1
    return bad


def run_job(script: Path, bootstrap: str, job_args: list[str], output: str, partitions: int, events: int,
            log_name: str) -> tuple[dict[str, Any], OutputReader]:
    """Run one Flink job (`script` with `job_args`, the broker, output and connector jars
    added) in the Flink
    virtualenv while reading `output` read_committed; its time (submission to the last
    committed output record), its JVM start, its peak RSS; and the reader (the output's
    final rows). SystemExit when the job fails or writes nothing."""
    python = flink_python()
    jars = flink_jars()
    settings = {"bootstrap.servers": bootstrap}
    ensure_topics(settings, [TopicSpec(output, partitions)])
    reader = OutputReader(settings, output)
    reader.start()
    command = [str(python), str(script), "--bootstrap", bootstrap, *job_args, "--output", output, "--run-id", output.replace(".", "-"),
               *(arg for jar in jars for arg in ("--jar", str(jar)))]
    launched = time.time()
    logs = project_home() / "flink-log"  # Flink's own log (else it writes into the venv)
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{log_name}.stderr"
    with log.open("w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", "FLINK_LOG_DIR": str(logs)})
        with PeakRss(process.pid) as peak:
            assert process.stdout is not None
            said = {}
            for line in process.stdout:
                if line.startswith("{"):
                    record = json.loads(line)
                    said[record["event"]] = record["t"]
            code = process.wait()
    ended = time.time()
    reader.draining.set()
    reader.join(120)
    if code != 0 or "finished" not in said:
        raise SystemExit(f"flink: the job {script.name} failed (exit {code}); see {log} and {logs}")
    if reader.failure or reader.last_record is None:
        raise SystemExit(f"flink: could not read {output}: {reader.failure or 'no output at all'}")
    submitted = said["submitted"]
    seconds = reader.last_record - submitted
    return {"seconds": seconds, "events_per_s": events / seconds, "startup_s": submitted - launched,
            "first_output_s": (reader.first_record or submitted) - submitted, "wall_s": ended - launched,
            "peak_rss_bytes": peak.bytes, "output_records": reader.records, "keys": len(reader.rows),
            "flink": FLINK_VERSION, "connector": [jar.name for jar in jars]}, reader


def run_flink(
    bootstrap: str, source: str, output: str, partitions: int, events: int,
    expected: dict[str, dict[str, Any]], *, reduction: str = "multiset", parallelism: int = 2,
    checkpoint_ms: int = 1000,
) -> dict[str, Any]:
    """Run the Flink job once; its time, peak RSS and the mismatch count against `expected`."""
    result, reader = run_job(JOB, bootstrap, ["--source", source, "--parallelism", str(parallelism),
                                   "--checkpoint-ms", str(checkpoint_ms), "--reduction", reduction],
                             output, partitions, events, "bench-flink-job")
    columns = ["total", "games", "best"] if reduction == "multiset" else ["total", "games"]
    return result | {"mismatches": mismatches(reader.rows, expected, columns), "reduction": reduction,
                     "columns": columns}


def run_flink_windows(bootstrap: str, source: str, output: str, partitions: int, events: int, window: Any, *,
                      parallelism: int = 2, checkpoint_ms: int = 1000) -> dict[str, Any]:
    """Run the windowed job (`flink_windows_job.py`: TUMBLE over a watermark of the
    lateness) once over `source`; its time (submission to the last committed output
    record) and peak RSS. `window`: the bench's `WindowWorkload` (window size, lateness).
    The output is compared by the caller (`bench.windows`)."""
    return run_job(WINDOWS_JOB, bootstrap, ["--source", source, "--window-ms", str(window.window_ms),
                                 "--lateness-ms", str(window.lateness_ms), "--parallelism", str(parallelism),
                                 "--checkpoint-ms", str(checkpoint_ms)],
                   output, partitions, events, "bench-flink-windows-job")[0]


def run_flink_join(bootstrap: str, orders: str, customers: str, output: str, partitions: int, events: int,
                   expected: dict[str, dict[str, Any]], *, reduction: str = "multiset", parallelism: int = 2,
                   checkpoint_ms: int = 1000) -> dict[str, Any]:
    """Run the join job (`flink_join_job.py`: a regular join and GROUP BY region) once
    over the two topics; its time, peak RSS, and the regions whose final row differs
    from `expected` (region → `{region, revenue, orders}`)."""
    result, reader = run_job(JOIN_JOB, bootstrap, ["--orders", orders, "--customers", customers,
                                        "--parallelism", str(parallelism), "--checkpoint-ms", str(checkpoint_ms),
                                        "--reduction", reduction],
                             output, partitions, events, "bench-flink-join-job")
    columns = ["revenue", "orders"]
    return result | {"mismatches": mismatches(reader.rows, expected, columns, key="region", count="orders"),
                     "reduction": reduction, "columns": columns}
