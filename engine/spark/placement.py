"""Where a re-grouping view's later stages run: each shard's task on the same executor
batch after batch.

Stage 1's tasks read Kafka, and Spark's Kafka source prefers, for each topic
partition, one executor (`floorMod(tp.hashCode, executors)`) for as long as the set
of executors stays. Stage 2's and stage 3's tasks have no input of Spark's: a
`spark.range` of the shard numbers gave them no preferred location, so shard s ran
on whichever executor had a core free first. A shard that changed executor met a
stale store there (a catch-up from `P.state`) and a new shard host, and its old host
idled on the other executor with the keys it held.

Here each shard's task is a partition of an RDD made with `SparkContext.makeRDD`'s
location preferences: shard s prefers executor `s mod n` of the executors sorted by
(host, id), which is stable while the executor set is. It is a preference, not a
promise: after `spark.locality.wait` (3 s by default) Spark runs the task on another
executor, whose store catches up from `P.state` as before; correctness never rests on
where a task runs (a shard's store is stamped, its writer fenced).

Without executors of its own (`local[...]`: the driver runs every task) there is
nothing to prefer, and the tasks run in a `spark.range` as before.
"""

from __future__ import annotations

import functools
import logging
import pickle
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa

from refold.spark.tasks import SUMMARY, ShardTask

log = logging.getLogger(__name__)


def executors(spark: Any) -> list[str]:
    """Spark's names for the application's executors (`executor_<host>_<id>`, what
    `TaskLocation` parses), sorted by (host, id); [] when the driver runs the tasks."""
    manager = spark.sparkContext._jsc.sc().env().blockManager()
    peers = manager.master().getPeers(manager.blockManagerId())  # every executor but the driver
    found = [(peer.host(), peer.executorId()) for peer in (peers.apply(i) for i in range(peers.size()))]
    return [f"executor_{host}_{executor}" for host, executor in sorted(found, key=_order)]


def _order(found: tuple[str, str]) -> tuple[str, int, str]:
    host, executor = found
    return (host, int(executor), "") if executor.isdigit() else (host, -1, executor)


def run_shards(spark: Any, task: ShardTask, shards: int) -> list[dict[str, Any]]:
    """`task` run once for each shard 0 … shards-1, shard s preferring executor
    `s mod n`; the tasks' summary rows (`SUMMARY`'s columns, as dicts)."""
    places = executors(spark)
    if not places:
        return [row.asDict() for row in spark.range(0, shards, 1, shards).mapInArrow(task, SUMMARY).collect()]
    from pyspark import RDD
    from pyspark.serializers import CPickleSerializer

    context = spark.sparkContext
    jvm = context._jvm
    scala = jvm.scala.jdk.javaapi.CollectionConverters
    items = jvm.java.util.ArrayList()
    for shard in range(shards):
        where = jvm.java.util.ArrayList()
        where.add(places[shard % len(places)])
        items.add(jvm.scala.Tuple2(pickle.dumps(shard), scala.asScala(where).toSeq()))
    tag = jvm.scala.reflect.ClassTag.apply(jvm.java.lang.Class.forName("[B"))
    made = context._jsc.sc().makeRDD(scala.asScala(items).toSeq(), tag)  # one partition per item
    located: RDD[int] = RDD(made.toJavaRDD(), context, CPickleSerializer())
    rows: list[dict[str, Any]] = located.mapPartitions(functools.partial(_summaries, task)).collect()
    log.debug("%d shard task(s) placed on %d executor(s)", shards, len(places))
    return rows


def _summaries(task: ShardTask, shards: Iterable[int]) -> Iterator[dict[str, Any]]:
    """On the executor: the shards' numbers to `task` as `spark.range` would have given
    them (a column `id`), its summaries out as rows."""
    numbers = list(shards)
    for summary in task(iter([pa.record_batch({"id": pa.array(numbers, pa.int64())})])):
        yield from summary.to_pylist()
