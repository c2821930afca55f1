"""What a person sees on the terminal: `make demo` and `refold run` print Refold's own
lines only (Spark's and the JVM's logging in `<home>/logs/`, librdkafka's at DEBUG), a
line per batch with the lag after it, one `refold: error:` line for what Spark or the
JVM could not do, `refold status` of a pipeline that never ran, `refold --version`."""

from __future__ import annotations

import io
import logging
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any

import orjson
import pytest
from engine_runs import write_pipeline

from refold.cli.main import NEVER_RAN, main
from refold.cli.produce import produce
from refold.config import parse_pipeline
from refold.kafka.io import producer_config
from refold.ops.monitor import Monitor
from refold.runtime.batch import BatchStats

REFOLD = [sys.executable, "-m", "refold.cli"]

# Lines that are not Refold's: log4j's and Spark's JVM, librdkafka (`%4|1795…|GETPID|`),
# setuptools, py4j's traces.
FOREIGN = re.compile(
    r"\bWARN\b|log4j|SLF4J|%[0-9]\||rdkafka|Package would be ignored|py4j|Traceback|"
    r"org\.apache\.|java\.|WARNING: |NativeCodeLoader|Exception in thread"
)


def foreign_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if FOREIGN.search(line)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pipeline_file(tmp_path: Path, source: str, bootstrap: str, **extra: Any) -> Path:
    return write_pipeline(tmp_path, source, bootstrap, columns={"total": {"sum": "score"}}, delta=False, **extra)


def _events(count: int) -> list[bytes]:
    return [orjson.dumps({"op": "+A", "player_name": f"p{i % 3}", "score": i}) for i in range(count)]


# The demo ------------------------------------------------------------------------------


@pytest.mark.kafka
@pytest.mark.spark
def test_the_demo_prints_refold_lines_only(bootstrap_servers: str, refold_home: Path) -> None:
    env = {**os.environ, "REFOLD_BOOTSTRAP_SERVERS": bootstrap_servers, "REFOLD_HOME": str(refold_home)}
    done = subprocess.run([sys.executable, "-m", "refold.dev.demo"], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert foreign_lines(out) == [], out
    # the batch lines a person reads, each with the lag after its batch: all events read
    batches = [line for line in done.stderr.splitlines() if "] batch " in line]
    assert len(batches) == 3 and all("lag 0 ·" in line for line in batches), done.stderr
    assert [": 6 events →" in line for line in batches] == [True, True, False], done.stderr  # not "26 events/s"
    assert "10 events → 12 outputs, 1 dead letter ·" in batches[2], done.stderr
    # the windowed view: the late event is a dead letter naming its closed window
    dead = done.stdout.split("the dead letters (why each event was refused)", 1)[1].splitlines()
    assert dead[3].split() == ["late", "8", "2024-05-01T09:00:00Z", "2024-05-01T10:00:00Z",
                               "2024-05-01T10:05:00Z"], done.stdout
    # Spark's own log is a file, named once
    named = [line for line in done.stdout.splitlines() if line.startswith("== Spark's own log: ")]
    assert len(named) == 1, done.stdout
    log = Path(named[0].removeprefix("== Spark's own log: "))
    assert log.parent == refold_home / "logs" and "WARN" in log.read_text()
    # the SQLite table shows the leaderboard's own columns, no bookkeeping column
    table = done.stdout.split("materialized into SQLite", 1)[1].splitlines()[1].split()
    assert table == ["place", "match_time", "player_name", "score"], done.stdout


# The batch line ------------------------------------------------------------------------


class _Offsets:
    def __init__(self, offsets: dict[int, int]) -> None:
        self.offsets = offsets


@pytest.mark.kafka
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_the_batch_line_gives_the_records_still_to_read_after_the_batch(
    bootstrap_servers: str, topic, log_format: str
) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=1)
    produce(settings, source, _events(6), ["player_name"], partitions=1, progress=False)  # offsets 0-5, a marker at 6
    pipeline = parse_pipeline({
        "pipeline": f"lag{uuid.uuid4().hex[:8]}", "source": {"topic": source},
        "view": {"key": ["player_name"], "columns": {"total": {"sum": "score"}}},
        "outputs": {"view": {"topic": "unused"}},
    }, where="test")
    stream = io.StringIO()
    processor = _Offsets({})
    monitor = Monitor(pipeline, settings, stream=stream, log_format=log_format, interval=60)
    monitor.start(processor)
    try:
        processor.offsets = {0: 6}  # the first batch read all 6 events
        monitor.committed(BatchStats(batch=1, records_in=6, records_out=8, seconds=0.5), 0)
        deadline = time.monotonic() + 30
        while not stream.getvalue() and time.monotonic() < deadline:  # written by the monitor's thread
            time.sleep(0.05)
        processor.offsets = {0: 2}  # as if a batch had read 2 of them
        monitor.committed(BatchStats(batch=2, records_in=2, records_out=2, dead_letters=1, seconds=0.5), 0)
    finally:
        monitor.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    if log_format == "json":
        first, second = (orjson.loads(line) for line in lines)
        assert (first["lag"], first["in"], first["out"]) == (0, 6, 8)
        assert second["lag"] == 4 and second["dead_letters"] == 1
    else:
        assert lines[0].startswith(f"[{pipeline.pipeline}] batch 1: 6 events → 8 outputs, 0 dead letters · lag 0 · ")
        assert " · lag 4 · " in lines[1] and "1 dead letter ·" in lines[1] and lines[1].endswith("events/s")


# librdkafka's own lines ------------------------------------------------------------------


def test_librdkafka_retries_are_debug_records_not_lines_on_stderr(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    from confluent_kafka import Producer

    closed = f"127.0.0.1:{_free_port()}"  # nobody listens: librdkafka retries and says so
    caplog.set_level(logging.DEBUG, logger="refold.kafka.librdkafka")
    producer = Producer(producer_config({"bootstrap.servers": closed}))
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any("Connect to" in r.getMessage() for r in caplog.records):
            producer.poll(0.2)
    finally:
        producer.close()
    said = [r for r in caplog.records if r.name == "refold.kafka.librdkafka"]
    assert said and all(r.levelno == logging.DEBUG for r in said)
    assert any(f"Connect to ipv4#{closed}" in r.getMessage() for r in said)
    captured = capfd.readouterr()
    assert "rdkafka" not in captured.err and "Connect to" not in captured.err, captured.err


# One line for what Spark or the JVM could not do -------------------------------------


@pytest.mark.kafka
def test_a_master_that_does_not_answer_is_one_error_line(bootstrap_servers: str, topic, tmp_path: Path) -> None:
    master = f"spark://127.0.0.1:{_free_port()}"
    path = _pipeline_file(tmp_path, topic(partitions=1), bootstrap_servers, spark={"master": master})
    started = time.monotonic()
    done = subprocess.run([*REFOLD, "run", str(path), "--until-idle", "1"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refold: error: the Spark master "), done.stderr
    assert master in lines[0] and "`refold spark start`" in lines[0]
    assert time.monotonic() - started < 60  # not Spark's minute of retries


@pytest.mark.kafka
def test_a_jvm_that_cannot_start_is_one_error_line_its_output_in_the_log(
    bootstrap_servers: str, topic, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    path = _pipeline_file(tmp_path, topic(partitions=1), bootstrap_servers,
                          spark={"conf": {"spark.driver.memory": "lots"}, "checkpoint_dir": str(tmp_path / "cp")})
    env = {**os.environ, "REFOLD_HOME": str(home)}
    done = subprocess.run([*REFOLD, "run", str(path), "--until-idle", "1"], capture_output=True, text=True,
                          timeout=300, env=env, check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    # with -v the JVM's own output is on the terminal, and no log file is made
    verbose = subprocess.run([*REFOLD, "-v", "run", str(path), "--until-idle", "1"], capture_output=True, text=True,
                             timeout=300, env={**env, "REFOLD_HOME": str(tmp_path / "home-v")}, check=False)
    assert verbose.returncode != 0 and "lots" in verbose.stderr, verbose.stderr
    assert not (tmp_path / "home-v" / "logs").exists()
    errors = [line for line in lines if line.startswith("refold: error: ")]
    assert len(errors) == 1 and "Spark's JVM did not start" in errors[0], done.stderr
    others = "\n".join(line for line in lines if line not in errors)  # the error quotes the JVM's last words
    assert foreign_lines(others) == [], done.stderr
    logs = list((home / "logs").glob("*.log"))
    assert len(logs) == 1 and str(logs[0]) in errors[0]
    assert "lots" in logs[0].read_text()  # the JVM's own words about the option


# status and --version ------------------------------------------------------------------


@pytest.mark.kafka
def test_status_of_a_pipeline_that_never_ran_says_so(
    bootstrap_servers: str, topic, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _pipeline_file(tmp_path, topic(partitions=1), bootstrap_servers)
    assert main(["status", str(path)]) == NEVER_RAN == 3
    out, err = capsys.readouterr()
    assert "never ran" in out and "does not exist" not in out + err, out + err


def test_status_help_documents_its_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0" in out and f"{NEVER_RAN} the pipeline never ran" in out


def test_version_comes_from_the_installed_package(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        main(["--version"])
    assert ended.value.code == 0
    assert capsys.readouterr().out.strip() == f"refold {version('refold')}"


def test_errors_from_spark_are_told_by_their_first_line_their_trace_in_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pyspark.errors import PySparkRuntimeError

    from refold.errors import RefoldError
    from refold.spark import logs

    try:
        raise PySparkRuntimeError(errorClass="JAVA_GATEWAY_EXITED", messageParameters={})
    except PySparkRuntimeError as exc:
        jvm_error = exc
    wrapped = RefoldError("the streaming query failed")
    wrapped.__cause__ = jvm_error
    assert logs.from_spark(jvm_error) and logs.from_spark(wrapped)
    assert not logs.from_spark(RefoldError("ours")) and not logs.from_spark(ValueError("x"))
    assert logs.first_line(ValueError("first\n\tat org.apache.spark.Some(Trace.java:1)")) == "first"
    assert len(logs.first_line(ValueError("x" * 1000))) == 300

    log = tmp_path / "spark.log"
    monkeypatch.setattr(logs, "_current", log)
    assert logs.record_failure(wrapped) == log
    text = log.read_text()
    assert "refold stopped on this error" in text and "PySparkRuntimeError" in text and "Traceback" in text
