"""PySpark's Python worker daemon, with pyspark imported from its installation rather
than from Spark's zip (`spark.python.daemon.module`, set by `refold.spark.job`).

Spark starts each executor's daemon (`python -m <module> pyspark.worker`, which forks
a Python worker per task) with `$SPARK_HOME/python/lib/pyspark.zip`, py4j's zip and
the spark-core jar first on PYTHONPATH. When SPARK_HOME is the pip-installed pyspark
(local mode and `refold spark start`), the zips hold the very files of that
installation and the jar holds no Python, but as archives on the path they cost
twice: a new worker compiles pyspark's modules from source (a zip has no bytecode
cache), and every task calls `importlib.invalidate_caches()`
(`pyspark.worker_util.setup_spark_files`), which makes each archive's importer read
its whole directory again (pyspark.zip 1,300 entries, spark-core 5,400): a tenth to a
fifth of a worker's time in `make bench` (measured; docs/PERFORMANCE.md).

So this drops from `sys.path` the archives inside the pyspark installation that the
rest of the path has unpacked (pyspark and py4j both importable without them), and
their importers, imports the shard tasks' modules (so every forked worker has them)
and freezes them out of the garbage collector's sight (`gc.freeze()`: the collection
PySpark runs in a worker after every task scans only the worker's own objects), then
runs `pyspark.daemon` as Spark would. The archives of another installation (a
SPARK_HOME that is not this interpreter's pyspark, perhaps another version) stay
first, as Spark put them. Nothing here imports pyspark before the path is settled.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys
from importlib.machinery import PathFinder


def unzipped_path(path: list[str]) -> list[str]:
    """`path` without the archives (zips, jars) inside the pyspark installation that
    `path` also has unpacked, with py4j: the installation's own files, or jars that
    hold no Python at all."""
    unpacked = [entry for entry in path if not os.path.isfile(entry)]
    spec = PathFinder.find_spec("pyspark", unpacked)
    if spec is None or spec.origin is None or PathFinder.find_spec("py4j", unpacked) is None:
        return path  # (an origin: a regular package, not a folder that only holds Spark's archives)
    home = os.path.dirname(os.path.realpath(spec.origin))
    return [entry for entry in path
            if not (os.path.isfile(entry) and os.path.realpath(entry).startswith(home + os.sep))]


def main() -> None:
    kept = unzipped_path(sys.path)
    for entry in set(sys.path) - set(kept):  # its zip importer, made while `refold` was looked up
        sys.path_importer_cache.pop(entry, None)  # would still be asked to invalidate its caches
    sys.path[:] = kept
    _subreaper()
    _preload()
    _relay_logging()
    runpy.run_module("pyspark.daemon", run_name="__main__", alter_sys=True)


def _subreaper() -> None:
    """Make the daemon its descendants' reaper (prctl PR_SET_CHILD_SUBREAPER): a shard
    host (`refold.spark.hosts`) whose worker exited stays under the executor's process
    tree instead of init's. Without it (not Linux) hosts still work, only outside the tree."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _preload() -> None:
    """Import the shard tasks' modules in the daemon, once: every worker it forks starts
    with them (each worker imported them itself, ~0.5 s of CPU, while its first task
    waited). A failure here is only printed: the task's own import reports it."""
    try:
        import refold.spark.tasks  # noqa: F401
    except Exception as exc:
        print(f"refold.spark.daemon: importing refold.spark.tasks failed: {exc!r}", file=sys.stderr)
    # PySpark's daemon makes each worker run `gc.collect()` after every task. Over the
    # ~100k objects of these imports that took ~55 ms a task, 4 tasks a batch at a 1 s
    # trigger: 0.2 of a core (bench.latency, docs/PERFORMANCE.md). Frozen here, before
    # the forks, the workers' collections only scan what they made themselves (and their
    # pages of these objects stay shared with the daemon's).
    gc.freeze()


def _relay_logging() -> None:
    """The workers' warnings to the driver when it asks (`refold.spark.logs`): set up
    here, before the forks, every worker has it."""
    try:
        from refold.spark.logs import relay_worker_logging

        relay_worker_logging()
    except Exception as exc:
        print(f"refold.spark.daemon: relaying the workers' logging failed: {exc!r}", file=sys.stderr)


if __name__ == "__main__":
    main()
