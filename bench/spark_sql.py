"""What a Spark user writes today instead of Refold: a native Structured Streaming
aggregation over the same topic (`make bench` contender "spark-sql").

    source = spark.readStream.format("kafka")…            # read_committed, maxOffsetsPerTrigger
    events = from_json(value) with sign = +1 for +A/+C, -1 for -R/-C
    events.groupBy("player_name").agg(sum(sign * score) AS total, sum(sign) AS games)
          .writeStream.outputMode("update").format("kafka")  # Spark's own sink: at least once

Spark keeps the per-key sums in its own state store (its checkpoint folder) and writes
the updated rows of each micro-batch with its built-in Kafka sink. What it cannot do,
beside its figure: exact `max`/`min`/`last` under retraction (a retracted maximum
cannot be taken back from a running `max`; the bench view's `best` and `latest` are
left out), a per-event view changelog (update mode writes one row per changed key per
micro-batch, no `-C`/`+C`), dead letters (a malformed record is a null row), and
exactly once (a crash between the sink's write and the offset commit writes the batch
again). Its throughput is the events of the run over the time from the query's start
to the end of the batch that took the last of them; its output is checked key by key
against the signed sums of the same events.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import orjson

from bench.procs import PeakRss
from refold.kafka.io import TopicSpec, ensure_topics, read_to_end


def expected_sums(records: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """(total, games) per key: the signed sum of score and of 1 over every event."""
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for record in records:
        sign = 1 if record["op"] in ("+A", "+C") else -1
        entry = sums[record["player_name"]]
        entry[0] += sign * record["score"]
        entry[1] += sign
    return {key: (total, games) for key, (total, games) in sums.items()}


def run_spark_sql(spark: Any, bootstrap: str, source: str, output: str, partitions: int, events: int,
                  batch: int, checkpoint: str, expected: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """Run the aggregation over `source` from the beginning until it has read `events`
    events; its throughput, peak RSS and the keys whose last output differs."""
    from pyspark.sql import functions as F

    ensure_topics({"bootstrap.servers": bootstrap}, [TopicSpec(output, partitions)])
    schema = "op STRING, event_time BIGINT, player_name STRING, score BIGINT"
    rows = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", source)
        .option("startingOffsets", "earliest")
        .option("kafka.isolation.level", "read_committed")
        .option("maxOffsetsPerTrigger", str(batch))
        .load()
        .select(F.from_json(F.col("value").cast("string"), schema).alias("e"))
        .select("e.*")
        .withColumn("sign", F.when(F.col("op").isin("+A", "+C"), F.lit(1)).otherwise(F.lit(-1)))
    )
    totals = rows.groupBy("player_name").agg(
        F.sum(F.col("sign") * F.col("score")).alias("total"), F.sum("sign").alias("games")
    )
    out = totals.select(
        F.to_json(F.struct("player_name")).alias("key"),
        F.to_json(F.struct("player_name", "total", "games")).alias("value"),
    )
    with PeakRss() as peak:
        started = time.monotonic()
        query = (
            out.writeStream.outputMode("update").format("kafka")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("topic", output)
            .option("checkpointLocation", checkpoint)
            .trigger(processingTime="100 milliseconds")
            .queryName(f"bench-spark-sql-{output}")
            .start()
        )
        read, ended, seen = 0, started, set()
        try:
            while read < events:
                if not query.isActive:
                    raise SystemExit(f"spark-sql: the query stopped: {query.exception()}")
                for progress in query.recentProgress:
                    if progress["batchId"] not in seen:
                        seen.add(progress["batchId"])
                        read += int(progress["numInputRows"])
                        ended = time.monotonic()
                time.sleep(0.05)
        finally:
            query.stop()
    if read != events:
        raise SystemExit(f"spark-sql: read {read} events, expected {events}")
    latest: dict[str, dict[str, Any]] = {}
    for message in read_to_end({"bootstrap.servers": bootstrap}, output):
        row = orjson.loads(message.value())
        latest[row["player_name"]] = row
    mismatches = sum(1 for key, (total, games) in expected.items()
                     if (latest.get(key, {}).get("total"), latest.get(key, {}).get("games")) != (total, games))
    seconds = ended - started
    return {"seconds": seconds, "events_per_s": events / seconds, "batches": len(seen),
            "peak_rss_bytes": peak.bytes, "mismatches": mismatches, "columns": ["total", "games"]}
