"""Starting Spark for Refold: the session with the Kafka connector on its classpath,
the driver's logging to a file, a standalone master checked before Spark tries it, the
JVM options of a cluster, local mode's task retries."""

from __future__ import annotations

import ctypes
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

from refold.errors import PrerequisiteError
from refold.spark import logs


def spark_session(master: str = "local[2]", conf: dict[str, str] | None = None, name: str = "refold") -> Any:
    """A local-friendly Spark session with Spark's Kafka connector on the classpath. The
    driver's JVM logs to `<home>/logs/<name>.log` (`refold.spark.logs`), not the terminal."""
    limit_malloc_arenas()  # before py4j's threads exist
    from pyspark import SparkConf
    from pyspark.sql import SparkSession

    from refold.spark.jars import spark_jars

    # Python workers (materialization writers on executors) need this interpreter's packages
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    check_master(master)
    log = None if logs.on_terminal() else logs.log_file(name)
    options = {
        "spark.master": local_with_retries(master),
        "spark.app.name": name,
        "spark.jars": ",".join(str(p) for p in spark_jars()),
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.driver.host": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.python.worker.reuse": "true",
        "spark.python.daemon.module": "refold.spark.daemon",  # pyspark without its zip: see there
        "spark.sql.streaming.kafka.useDeprecatedOffsetFetching": "false",
        **java_options(master, log),
        **(conf or {}),
    }
    if log is not None:  # the driver's JVM, its output to the log file
        logs.launch_jvm(SparkConf(loadDefaults=False).setAll(list(options.items())), log)
    builder = SparkSession.builder
    for key, value in options.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def check_master(master: str, timeout: float = 3.0) -> None:
    """A standalone master (`spark://host:port`, several for a standby pair) must answer
    before Spark starts: Spark itself would retry for a minute and end in pages of
    stack traces. Raises PrerequisiteError naming the master and what to do."""
    found = re.fullmatch(r"spark://(.+)", master.strip())
    if found is None:
        return  # local[N], or a resource manager Spark reaches its own way
    refused = []
    for address in found.group(1).split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
            return
        except ValueError:
            raise PrerequisiteError(f"spark.master {master!r}: {address!r} is not host:port") from None
        except OSError as exc:
            refused.append(f"{address.strip()}: {exc.strerror or exc}")
    raise PrerequisiteError(
        f"the Spark master {master} does not answer ({'; '.join(refused)}): start one with "
        "`refold spark start` (a local standalone cluster), or set spark.master to local[2] "
        "to run Spark inside refold"
    )


# On a cluster the JVMs' own work is small: the executors fetch Kafka and hand Arrow
# batches to the Python workers, the driver plans each batch. Their C2 compiler threads
# kept compiling batch after batch and cost more than they saved there; C1 alone cut
# the executors' and the driver's JVM CPU and raised a 2-executor run's throughput
# (bench.tasks workers: docs/PERFORMANCE.md). Local mode keeps HotSpot's default: its
# one JVM is the whole of Spark, and C1 alone measured no faster there. A `spark.conf`
# entry for either key replaces Refold's.
_CLUSTER_JIT = "-XX:TieredStopAtLevel=1"


def java_options(master: str, log: Path | None = None) -> dict[str, str]:
    """The driver's (and, on a cluster, the executors') JVM options Refold starts Spark with:
    the driver's logging to `log` through Refold's log4j2 configuration (`refold.spark.logs`),
    or WARN and above on the terminal when `log` is None."""
    logging_options = " ".join(logs.driver_options(log)) if log is not None else "-Dlog4j2.level=WARN"
    if master.strip().startswith("local"):
        return {"spark.driver.extraJavaOptions": logging_options}
    return {"spark.driver.extraJavaOptions": f"{logging_options} {_CLUSTER_JIT}",
            "spark.executor.extraJavaOptions": _CLUSTER_JIT}


def local_with_retries(master: str, attempts: int = 4) -> str:
    """`local[N]` as `local[N,attempts]`: in local mode Spark runs a failed task once
    unless the master says otherwise (`spark.task.maxFailures` is for clusters), and a
    shard's task that lost its Python worker should run again, as on a cluster."""
    found = re.fullmatch(r"local(?:\[(\d+|\*)\])?", master.strip())
    if found is None:
        return master
    return f"local[{found.group(1) or 1},{attempts}]"


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Two glibc malloc arenas instead of 8 per core (what `MALLOC_ARENA_MAX=2` does).

    Batches arrive on py4j's callback threads, and glibc gives threads arenas of their
    own: state freed in one arena was not reused by the next batch's thread, so the
    heap kept growing (measured, four 60k-key pipelines in one process: RSS 775 → 1,872
    MiB with the default, 781 → 802 MiB with two arenas set before Spark starts). Called
    before py4j's threads exist: an arena a thread already has stays. No effect off glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_ARENA_MAX, arenas)
    except (OSError, AttributeError):
        pass


_M_ARENA_MAX = -8  # glibc's malloc.h
