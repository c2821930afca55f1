"""Spark's and the JVM's output: a file under `<refold home>/logs/`, not the terminal.

A driver JVM Refold starts (`refold.spark.job.spark_session`) logs through the log4j2
configuration Refold ships (`jvm/log4j2.properties`: WARN and above) into
`<home>/logs/<application>.log` (`refold-<pipeline>.log` for `refold run`), and what the
JVM prints outside log4j (the launcher's lines, "WARNING: Using incubator modules", a
JVM that cannot start) goes to the same file: pyspark's `launch_gateway` starts it with
its stdout and stderr there. The path is logged once, at INFO, when the JVM starts; an
error from Spark that ends a command leaves its trace there too (`record_failure`).

The Python workers that JVM starts (local mode: the shards' tasks) write to its
stderr too, and their warnings are Refold's own: a worker logs each WARNING and above
as a relay line (`relay_worker_logging`, set up by `refold.spark.daemon` when the
driver asks for it through `$REFOLD_LOG_RELAY`), and the driver, which reads the
JVM's stderr through a pipe, logs those records again under their own logger names
(on the terminal, as JSON lines under `refold run --log-format json`) and writes every
other line to the file.

`to_terminal(True)` (`refold -v`) starts the JVM as Refold did before: Spark's WARN
lines, the JVM's own output and the workers' on the terminal.

In local mode the driver's JVM runs the executors too. On a cluster each executor logs
as the cluster says (its stderr in its worker's folder), which never reaches the
terminal of `refold run`; a cluster's executors need not have Refold's files at the paths
this machine has, so their logging is left to the cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import orjson

from refold import environment
from refold.errors import PrerequisiteError

_logger = logging.getLogger(__name__)

LOG4J = Path(__file__).resolve().parent / "jvm" / "log4j2.properties"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")

_lock = threading.Lock()
_terminal = False
_current: Path | None = None  # the log file of the JVM this process started


def to_terminal(on: bool) -> None:
    """Spark's and the JVM's output on the terminal (`refold -v`), or in the log file (default)."""
    global _terminal
    _terminal = on


def on_terminal() -> bool:
    return _terminal


def log_file(app: str) -> Path:
    """Where the driver JVM of Spark application `app` logs: `<home>/logs/<app>.log`."""
    return environment.home() / "logs" / f"{_UNSAFE.sub('-', app).strip('-.') or 'spark'}.log"


def current_log() -> Path | None:
    """The log file of the driver JVM this process started (None: none, or on the terminal)."""
    return _current


def driver_options(log: Path) -> list[str]:
    """The driver JVM's system properties that send its log4j2 logging to `log`."""
    return [f"-Dlog4j2.configurationFile={LOG4J.as_uri()}", f"-Drefold.log.file={log}"]


def launch_jvm(conf: Any, log: Path) -> None:
    """Start Spark's driver JVM (pyspark's gateway) for `conf` with its stdout and stderr
    appended to `log`, unless this process runs one already (a JVM outlives a stopped
    Spark session; the next Spark session reuses it). Raises PrerequisiteError with the JVM's
    last lines when it does not start (no Java, a bad option)."""
    global _current
    from pyspark import SparkContext
    from pyspark.errors import PySparkRuntimeError
    from pyspark.java_gateway import launch_gateway

    with _lock:
        if SparkContext._gateway is not None:
            return
        log.parent.mkdir(parents=True, exist_ok=True)
        os.environ[environment.LOG_RELAY] = "1"  # for the Python workers the JVM starts (its environment)
        read, write = os.pipe()
        pump = threading.Thread(target=_pump, args=(read, log), name="refold-jvm-stderr", daemon=True)
        with open(log, "ab") as out:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            out.write(f"==== {stamp} Spark's driver JVM starts (refold, pid {os.getpid()})\n".encode())
            out.flush()
            pump.start()
            try:
                gateway = launch_gateway(conf, popen_kwargs={"stdout": out, "stderr": write})
            except PySparkRuntimeError as exc:
                os.close(write)
                write = -1
                pump.join(10)  # the JVM is gone: its last lines are in the file once the pipe ends
                raise PrerequisiteError(
                    f"Spark's JVM did not start: {_tail(log) or exc} (its output: {log}; Spark needs "
                    "Java 17 or newer on PATH or in JAVA_HOME, and its options in spark.conf must be valid)"
                ) from exc
            finally:
                if write >= 0:
                    os.close(write)  # the JVM has its own copy
        SparkContext._ensure_initialized(gateway=gateway, conf=conf)
        _current = log
    _logger.info("Spark's log: %s", log)


RELAY_MARK = b"\x1frefold-log "  # starts a worker's relayed log record on the JVM's stderr


def _pump(read: int, log: Path) -> None:
    """The JVM's stderr until it closes: relayed worker log records logged here, every
    other line appended to `log`."""
    with os.fdopen(read, "rb") as pipe, open(log, "ab") as out:
        for line in pipe:
            if line.startswith(RELAY_MARK):
                try:
                    entry = orjson.loads(line[len(RELAY_MARK):])
                    logging.getLogger(str(entry["name"])).log(int(entry["level"]), "%s", entry["message"])
                    continue
                except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                    pass
            with contextlib.suppress(OSError):
                out.write(line)
                out.flush()


class _Relay(logging.Handler):
    """A Python worker's log records as relay lines on its stderr (`RELAY_MARK` + JSON)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            entry = {"name": record.name, "level": record.levelno, "message": message}
            sys.stderr.buffer.write(RELAY_MARK + orjson.dumps(entry) + b"\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def relay_worker_logging() -> None:
    """In a Python worker whose driver relays (`$REFOLD_LOG_RELAY`): its WARNING and
    above records to the driver as relay lines. Elsewhere nothing changes."""
    if not environment.log_relay():
        return
    root = logging.getLogger()
    if not any(isinstance(handler, _Relay) for handler in root.handlers):
        handler = _Relay(logging.WARNING)
        root.addHandler(handler)


def record_failure(exc: BaseException) -> Path | None:
    """Append `exc`'s trace (Python's and, for a JVM error, Java's) to the JVM's log file;
    returns the file (None when this process started no JVM)."""
    if _current is None:
        return None
    with contextlib.suppress(OSError), open(_current, "a") as out:
        out.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} refold stopped on this error:\n")
        out.write("".join(traceback.format_exception(exc)))
    return _current


def from_spark(exc: BaseException) -> bool:
    """An exception of pyspark or py4j (a JVM error), or one caused by it."""
    seen: BaseException | None = exc
    while seen is not None:
        if type(seen).__module__.split(".")[0] in ("pyspark", "py4j"):
            return True
        seen = seen.__cause__
    return False


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an error's message (a JVM error's message carries its stack)."""
    text = str(exc).strip().splitlines()
    line = text[0].strip() if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _tail(path: Path, lines: int = 3) -> str:
    """The last lines of `path`, joined (for a one-line error)."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:] if line.strip() and not line.startswith("===="))
