"""`make bench-windows`: a windowed view over out-of-order input, Refold against Flink
SQL and Spark, in one run, and the boundedness of Refold's windowed state.

One seeded input (`refold.dev.windowload`) is produced to one topic: `--events`
changelog events of `{player_name, score, ts}` over `--keys` players, spread over 100
horizons of event time (one horizon: the lateness plus the window size); `--late` of
the appends are late by up to `--late-by` windows, `--corrections` of the events are
`-C`/`+C` pairs (a new score, the same time; some of them late too) and a few are
retractions. A tumble of `--window-ms` per player; the lateness (every contender's
watermark delay) is `--lateness-ms`. Each contender reads that identical topic:

- refold: `refold run`, exactly once, the windowed view (total, games, best per player
  and window) with `lateness`, `emit: per_event`; then `refold verify`: its changelog
  record by record and its dead letters against the reference (one watermark per
  shard);
- refold-final: the same with `emit: final`: each window's row written once, when the
  watermark passes its end plus the lateness, as the TVF writes it (the late events
  within the lateness counted, the later ones dead letters); like for like with flink,
  where `refold` also writes every correction as it comes;
- flink: PyFlink SQL, the TUMBLE window table-valued function over a watermark of
  `rowtime - lateness`, signed sums (`op` is a column to Flink), Kafka sink exactly once
  (`bench/flink_windows_job.py`, in Flink's own virtualenv, `bench.flink`);
- spark-sql: Structured Streaming, `groupBy(window(ts, …), player_name)` after
  `withWatermark(ts, lateness)`, signed sums, update mode, Spark's Kafka sink (at least
  once).

Throughput is events over the time from the contender's start to its last output
(as `make bench-contenders` measures it); Refold's after an untimed run of its view over a
few events in the same Spark session (`warm_up`): it runs first. A late event is one whose window had
already ended when it came (its end at or before the largest time before it in the
input; `windowload.late_events`). For each contender: how many late events its output
counts and how many it lost. Flink and Spark keep no dead letters: per window
(player, start), their last output row is compared with the signed sums over all the
window's events (the late ones counted) and over its events without the late ones
(the late ones lost); a window that matches neither is `unexplained`. Refold: the
late events it dead-lettered (reason `late`, beyond the horizon) are read from its
dead-letter topic; the others were applied (its output equals the reference's, which
applies every event within the horizon), so lost = 0 — only when `refold verify` finds
no anomaly, else it is reported unknown.

State boundedness: each shard's `P.state` partition is replayed in offset order
(read_committed) and its live records (keys whose latest record is not a tombstone)
counted after every record (an upper bound of what its store held at any batch's end);
the largest count is set against one horizon's worth: the live records the same view
without a lateness holds over the shard's events whose times lie in one horizon in the
middle of the input. Target: every shard under 2x.

    python -m bench.windows [--events 1000000] [--keys 1000] [--window-ms 60000] [--lateness-ms 60000]
                            [--late 0.05] [--late-by 2] [--corrections 0.05] [--partitions 4]
                            [--contenders refold,flink,spark-sql] [--bootstrap H:P] [--json-dir docs/bench]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

import orjson

from bench import contest
from bench.contest import WARM_UP_EVENTS, Spark, add_common_arguments, run_contenders, start
from bench.procs import PeakRss
from refold.cli.produce import produce
from refold.config import Pipeline, parse_pipeline
from refold.dev.windowload import WindowWorkload, generate_windowed, late_events
from refold.kafka.io import TopicSpec, ensure_topics, read_to_end
from refold.model import jsonbytes
from refold.model.reasons import Reason
from refold.ops.verify import read_source, verify
from refold.recovery.records import decode_dead_letter
from refold.reduce import Rejected, make_reducer
from refold.reference import merge_partitions

CONTENDERS = ("refold", "refold-final", "flink", "spark-sql")
TITLES = {
    "refold": "Refold, exactly once, lateness, dead letters",
    "refold-final": "Refold, the same, emit: final",
    "flink": "Flink SQL TUMBLE TVF, watermark, exactly once",
    "spark-sql": "Spark window() + withWatermark, at least once",
}
TARGETS = {"flink": 1.5}  # Refold's throughput as a multiple of the contender's
STATE_BOUND = 2.0  # a shard's live state over one horizon's worth


def window_pipeline(name: str, source: str, bootstrap: str, w: WindowWorkload, batch: int,
                    emit: str = "per_event") -> Pipeline:
    return parse_pipeline({
        "pipeline": name,
        "kafka": {"bootstrap.servers": bootstrap},
        "source": {"topic": source},
        "view": w.view("tumble"),
        "outputs": {"view": {"topic": f"{name}.view", "emit": emit}},
        "trigger": "100ms",
        "max_batch_events": batch,
        "spark": {"checkpoint_dir": f"/tmp/refold-bench/{name}", "state_dir": "/tmp/refold-bench/state"},
    })


# what the contenders' last outputs are compared with --------------------------------------

Sums = dict[tuple[str, int], tuple[int, int]]  # (player, window start) -> (signed total, signed count)


def window_sums(records: Sequence[dict[str, Any]], late: Sequence[bool], window_ms: int) -> tuple[Sums, Sums, dict[tuple[str, int], int]]:
    """The signed sums per window over every event, over the events that are not late,
    and the late events per window."""
    every: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    on_time: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    lates: dict[tuple[str, int], int] = defaultdict(int)
    for record, is_late in zip(records, late, strict=True):
        sign = 1 if record["op"] in ("+A", "+C") else -1
        key = (record["player_name"], record["ts"] - record["ts"] % window_ms)
        for target in (every,) if is_late else (every, on_time):
            target[key][0] += sign * record["score"]
            target[key][1] += sign
        if is_late:
            lates[key] += 1
    return ({k: (v[0], v[1]) for k, v in every.items()}, {k: (v[0], v[1]) for k, v in on_time.items()}, dict(lates))


def late_accounting(output: Sums, every: Sums, on_time: Sums, lates: dict[tuple[str, int], int]) -> dict[str, int]:
    """Per window: the contender's last row against the sums with and without its late
    events; the late events counted, lost, and in windows that match neither."""
    counted = lost = unexplained = windows_off = 0
    for key in set(every) | set(output):
        got = output.get(key, (0, 0))
        n = lates.get(key, 0)
        if got == every.get(key, (0, 0)):
            counted += n
        elif got == on_time.get(key, (0, 0)):
            lost += n
        else:
            unexplained += n
            windows_off += 1
    return {"late_counted": counted, "late_lost": lost, "late_unexplained": unexplained,
            "windows_unexplained": windows_off}


def read_window_output(bootstrap: str, topic: str) -> Sums:
    """A contender's output topic (JSON rows `player_name, window_start, total, games`):
    the last row per window."""
    out: Sums = {}
    for message in read_to_end({"bootstrap.servers": bootstrap}, topic):
        if message.value() is None:
            continue
        row = orjson.loads(message.value())
        out[(row["player_name"], int(row["window_start"]))] = (int(row["total"] or 0), int(row["games"] or 0))
    return out


# Refold -----------------------------------------------------------------------------------

def input_positions(bootstrap: str, source: str, lines: Sequence[bytes]) -> dict[tuple[int, int], int]:
    """(partition, offset) -> the index of the input line the record holds (equal lines
    share a key, so a partition: each partition's records are taken in order)."""
    waiting: dict[bytes, deque[int]] = defaultdict(deque)
    for index, line in enumerate(lines):
        waiting[line].append(index)
    where = {}
    for message in read_to_end({"bootstrap.servers": bootstrap}, source):
        where[(message.partition() or 0, message.offset() or 0)] = waiting[message.value() or b""].popleft()
    return where


def run_refold(spark: Any, bootstrap: str, source: str, run_id: str, w: WindowWorkload, batch: int, events: int,
               late: Sequence[bool], where: dict[tuple[int, int], int], forget: list[Pipeline],
               emit: str = "per_event") -> dict[str, Any]:
    """Refold's run; its pipelines (and the warm-up's) into `forget`: their local stores
    go once the Spark session stopped (its Python workers keep the shards open until then)."""
    from bench.run import timed_run

    run_id += "-final" if emit == "final" else ""
    p = window_pipeline(f"bench-win-{run_id}", source, bootstrap, w, batch, emit)
    settings = {"bootstrap.servers": bootstrap}
    warm_up(spark, bootstrap, run_id, w, batch, forget, emit)
    forget.append(p)
    result = timed_run(p, bootstrap, spark, events)
    started = time.monotonic()
    report = verify(p, settings, dead_letters=True)
    result["verify_s"] = time.monotonic() - started
    result["anomalies"] = len(report.anomalies)
    letters = [decode_dead_letter(m.value()) for m in read_to_end(settings, p.dlq_topic)]
    late_letters = [d for d in letters if d.reason == Reason.LATE]
    dead = {where[(d.partition, d.offset)] for d in letters}
    total_late = sum(late)
    result |= {
        "late_events": total_late,
        "late_dead_lettered": len(late_letters),
        # late events dead-lettered for another reason: the other half of a pair whose late half
        # was, or a retraction or correction of a row its late append never made live
        "late_dead_lettered_other": sum(1 for index in dead if late[index]) - sum(
            1 for d in late_letters if late[where[(d.partition, d.offset)]]),
        "dead_letters": len(letters),
        "late_counted": sum(1 for index, is_late in enumerate(late) if is_late and index not in dead),
        "late_lost": 0 if not report.anomalies else None,  # None: unknown, verify found anomalies
    }
    if report.anomalies:
        print("  refold: verify found anomalies:\n    " + "\n    ".join(report.anomalies[:10]), file=sys.stderr)
    result["state"] = state_boundedness(p, settings, w)
    return result


def warm_up(spark: Any, bootstrap: str, run_id: str, w: WindowWorkload, batch: int, forget: list[Pipeline],
            emit: str) -> None:
    """The same view over `WARM_UP_EVENTS` events of its own topic, untimed (`contest.warm_up`)."""
    small = WindowWorkload(events=WARM_UP_EVENTS, keys=w.keys, window_ms=w.window_ms, lateness_ms=w.lateness_ms,
                           seed=w.seed + 1)
    topic = f"bench-windows-warm-{run_id}"
    p = window_pipeline(f"bench-win-warm-{run_id}", topic, bootstrap, small, batch, emit)
    forget.append(p)
    contest.warm_up(spark, bootstrap, p, [(topic, [jsonbytes.dumps(r) for r in generate_windowed(small)],
                                           ["player_name"])])


def state_boundedness(p: Pipeline, settings: dict[str, Any], w: WindowWorkload) -> dict[str, Any]:
    """Per shard: the most live `P.state` records at any point of the run, one horizon's
    worth (see the module's docstring), their ratio."""
    most: dict[int, int] = defaultdict(int)
    live: dict[int, set[bytes]] = defaultdict(set)
    for message in read_to_end(settings, p.state_topic):
        partition, key = message.partition() or 0, message.key() or b""
        if message.value() is None:
            live[partition].discard(key)
        else:
            live[partition].add(key)
        most[partition] = max(most[partition], len(live[partition]))
    unbounded = p.view.model_copy(update={"window": p.view.window.model_copy(update={"lateness": None})}) \
        if p.view.window is not None else p.view
    partitions, _bad = read_source(p, settings)
    shards = {}
    for partition, events in sorted(partitions.items()):
        units = merge_partitions({partition: events})
        times = [event.row["ts"] for unit in units for event in unit]
        low = min(times) + (max(times) - min(times)) // 2  # a horizon in the middle of the input
        reducer = make_reducer(unbounded)
        state: dict[bytes, bytes | None] = {}
        for unit in units:
            if all(low <= event.row["ts"] < low + w.horizon_ms for event in unit):
                with contextlib.suppress(Rejected):  # a retraction of a row from before that horizon
                    reducer.apply(unit)
        state.update(reducer.take_state_changes())
        horizon = sum(1 for v in state.values() if v is not None)
        shards[partition] = {"most_live_records": most.get(partition, 0), "one_horizon_records": horizon,
                             "ratio": most.get(partition, 0) / max(1, horizon)}
    return {"shards": shards, "max_ratio": max((s["ratio"] for s in shards.values()), default=0.0)}


# Spark ------------------------------------------------------------------------------------

def run_spark_windows(spark: Any, bootstrap: str, source: str, output: str, partitions: int, events: int,
                      batch: int, checkpoint: str, w: WindowWorkload) -> dict[str, Any]:
    """`window()` with a watermark of the lateness, signed sums, update mode, until it
    has read `events` events."""
    from pyspark.sql import functions as F

    ensure_topics({"bootstrap.servers": bootstrap}, [TopicSpec(output, partitions)])
    schema = "op STRING, player_name STRING, score BIGINT, ts BIGINT"
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
        .withColumn("t", F.timestamp_millis(F.col("ts")))
        .withWatermark("t", f"{w.lateness_ms} milliseconds")
    )
    windows = rows.groupBy(F.window("t", f"{w.window_ms} milliseconds"), "player_name").agg(
        F.sum(F.col("sign") * F.col("score")).alias("total"), F.sum("sign").alias("games"))
    out = windows.select(
        F.to_json(F.struct("player_name", F.unix_millis(F.col("window.start")).alias("window_start"))).alias("key"),
        F.to_json(F.struct("player_name", F.unix_millis(F.col("window.start")).alias("window_start"),
                           "total", "games")).alias("value"),
    )
    with PeakRss() as peak:
        started = time.monotonic()
        query = (out.writeStream.outputMode("update").format("kafka")
                 .option("kafka.bootstrap.servers", bootstrap).option("topic", output)
                 .option("checkpointLocation", checkpoint)
                 .trigger(processingTime="100 milliseconds")
                 .queryName(f"bench-spark-windows-{output}").start())
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
    seconds = ended - started
    return {"seconds": seconds, "events_per_s": events / seconds, "batches": len(seen), "peak_rss_bytes": peak.bytes}


# the run ----------------------------------------------------------------------------------

def report_refold(mine: str, r: dict[str, Any], results: dict[str, dict[str, Any]]) -> None:
    """A Refold run's lines: `refold verify`, its ratios against the targets, its state."""
    print(f"{mine} verify: {r['anomalies']} anomalies (changelog record by record, dead letters exactly "
          "the reference's)")
    for name, target in TARGETS.items():
        if name in results:
            ratio = r["events_per_s"] / results[name]["events_per_s"]
            r[f"ratio_to_{name}"] = ratio
            print(f"{TITLES[mine]} / {name}: {ratio:.2f} (target ≥ {target}: {'ok' if ratio >= target else 'MISSED'})")
    state = r["state"]
    print(f"{mine} state: the most live P.state records of a shard over one horizon's worth: "
          + ", ".join(f"shard {p} {s['most_live_records']:,}/{s['one_horizon_records']:,} = {s['ratio']:.2f}"
                      for p, s in state["shards"].items())
          + f" (target < {STATE_BOUND}: {'ok' if state['max_ratio'] < STATE_BOUND else 'MISSED'})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = WindowWorkload()
    parser.add_argument("--events", type=int, default=defaults.events)
    parser.add_argument("--keys", type=int, default=defaults.keys)
    parser.add_argument("--window-ms", type=int, default=defaults.window_ms)
    parser.add_argument("--lateness-ms", type=int, default=defaults.lateness_ms)
    parser.add_argument("--late", type=float, default=defaults.late_share, help="share of appends that are late")
    parser.add_argument("--late-by", type=float, default=defaults.late_by, help="how late, at most, in windows")
    parser.add_argument("--corrections", type=float, default=defaults.correct_share, help="share of -C/+C pairs")
    parser.add_argument("--horizons", type=float, default=defaults.horizons, help="the input's span in horizons")
    add_common_arguments(parser, CONTENDERS, "windows.json")
    args, chosen, bootstrap, run_id = start(parser, argv, CONTENDERS)
    settings = {"bootstrap.servers": bootstrap}
    source = f"bench-windows-{run_id}"
    w = WindowWorkload(events=args.events, keys=args.keys, window_ms=args.window_ms, lateness_ms=args.lateness_ms,
                       late_share=args.late, late_by=args.late_by, correct_share=args.corrections,
                       horizons=args.horizons, seed=args.seed)
    records = list(generate_windowed(w))
    late = late_events(records, w.window_ms)
    lines = [jsonbytes.dumps(r) for r in records]
    events = len(lines)
    produced = produce(settings, source, lines, ["player_name"], partitions=args.partitions,
                       per_transaction=50_000, prevalidate=False, progress=False)
    print(f"produced {events:,} events ({sum(late):,} late, {sum(1 for r in records if r['op'] == '-C'):,} "
          f"corrections) over {args.keys:,} players in {produced.seconds:.1f}s", file=sys.stderr)
    every, on_time, lates = window_sums(records, late, w.window_ms)
    where = input_positions(bootstrap, source, lines) if {"refold", "refold-final"} & set(chosen) else {}
    del records

    forget: list[Pipeline] = []  # Refold's pipelines, whose local stores go after the shards closed

    def run(name: str, spark: Spark) -> dict[str, Any]:
        if name.startswith("refold"):
            return run_refold(spark.get(), bootstrap, source, run_id, w, args.batch, events, late, where, forget,
                              "final" if name == "refold-final" else "per_event")
        if name == "spark-sql":
            checkpoint = f"/tmp/refold-bench/spark-windows-{run_id}"
            output = f"bench-spark-windows-{run_id}.view"
            try:
                result = run_spark_windows(spark.get(), bootstrap, source, output, args.partitions, events,
                                           args.batch, checkpoint, w)
            finally:
                shutil.rmtree(checkpoint, ignore_errors=True)
        else:
            from bench.flink import run_flink_windows

            output = f"bench-flink-windows-{run_id}.view"
            result = run_flink_windows(bootstrap, source, output, args.partitions, events, w,
                                       parallelism=args.flink_parallelism, checkpoint_ms=args.flink_checkpoint_ms)
        return result | late_accounting(read_window_output(bootstrap, output), every, on_time, lates)

    results, failed = run_contenders(chosen, TITLES, run, forget)

    refolds = {name: results[name] for name in ("refold", "refold-final") if name in results}
    refold = next(iter(refolds.values()), None)  # the ratios' numerator: per_event when it ran
    total_late = sum(late)
    print(f"\n{events:,} events, {args.keys:,} players, tumble {w.window_ms:,} ms, lateness {w.lateness_ms:,} ms, "
          f"{total_late:,} late events, {args.partitions} partitions, batch {args.batch:,}")
    print(f"{'contender':<48} {'events/s':>10} {'seconds':>8} {'peak RSS':>10} {'Refold /':>8} "
          f"{'late counted':>12} {'late lost':>9} {'late dead letters':>17}")
    for name, r in results.items():
        r["ratio_refold_to"] = refold["events_per_s"] / r["events_per_s"] if refold else None
        lost = r.get("late_lost")
        lost_text = "?" if lost is None else f"{lost:,}"
        if r.get("late_unexplained"):
            lost_text += f" (+{r['late_unexplained']:,} in {r['windows_unexplained']:,} windows matching neither)"
        print(f"{TITLES[name]:<48} {r['events_per_s']:>10,.0f} {r['seconds']:>8.1f} "
              f"{r['peak_rss_bytes'] / 2**20:>7,.0f} MiB {r['ratio_refold_to'] or 0:>8.2f} "
              f"{r.get('late_counted', 0):>12,} {lost_text:>9} {r.get('late_dead_lettered', 0):>17,}")
    if refold:
        print(f"(late dead letters: reason `late`, beyond the horizon; {refold['late_dead_lettered_other']:,} more "
              "late events were dead letters for another reason: the other half of a late pair, or a retraction "
              "of a row whose late append was refused)")
    for mine, r in refolds.items():
        report_refold(mine, r, results)
    for name, reason in failed.items():
        print(f"{TITLES[name]}: FAILED ({reason})")

    args.json_dir.mkdir(parents=True, exist_ok=True)
    report = {"run": run_id, "machine": platform.platform(), "cores": os.cpu_count(), "events": events,
              "keys": args.keys, "window_ms": w.window_ms, "lateness_ms": w.lateness_ms, "late_share": w.late_share,
              "late_by": w.late_by, "correct_share": w.correct_share, "horizons": w.horizons,
              "partitions": args.partitions, "batch": args.batch, "seed": args.seed, "late_events": total_late,
              "contenders": results, "failed": failed}
    (args.json_dir / "windows.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    bad = bool(failed) or any(r["anomalies"] or r["late_lost"] != 0 for r in refolds.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
