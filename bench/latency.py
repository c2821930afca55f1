"""End-to-end latency of Refold at a fixed, sub-maximal input rate: p50/p90/p99.

One process holds everything, so every time below is read from one monotonic clock:

- the engine: `refold.spark.job.run_pipeline` in a background thread of this process (one
  Spark session, started before the clock matters), on `bench.run.pipeline`'s grouped
  view (view + delta outputs) with trigger `--trigger`, over a fresh source topic;
- a producer thread: first one probe event, and nothing more until its view record
  is seen (the engine is up end to end: Spark session, query, first commit); then
  plain (non-transactional) `+A` events at `--rate` events/s, paced in 20 ms slices.
  Event i has `score` i, and `player_name` i mod `--keys` (default 100,000: the key
  space of the contenders' run whose peak sets the rate), or, with `--keys 0`, a
  fresh `player_name` each (every event a new key: a workload of inserts only).
  Either way event i yields exactly one view record that shows
  the key's new row (`+A` or `+C`) with `latest` = i, since the view's `latest` is
  the key's last score and a key's events keep their order. The send time of an
  event is the moment it is handed to the Kafka client. It sends until the measured
  window (below) is over;
- a reader thread: a `read_committed` consumer of the view topic (all partitions,
  from the beginning, fetch.wait.max.ms 10); the receive time of event i is the
  moment the first `+A`/`+C` view record with `latest` = i is polled.

Latency of an event = its receive time - its send time. The events of the first
`--warmup` seconds of paced sending (default 10 s: Python workers still cold) are
left out of the figures, not out of the checks. The measured window is the
`--seconds` after the warm-up: about rate * seconds events. (The producer waits for
the probe's view record: started with the engine, the first batches would catch up
on the backlog of the query's start, 20-40 s of events, which at 4,300 events/s
outlasts the warm-up and becomes most of the p99.) When every event's view record has been seen (or `--drain`
seconds after the producer stopped), the engine is left to stop by itself once idle.

It prints one line of figures and writes a JSON file (default docs/bench/latency.json):
count, p50, p90, p99, max (seconds), the trigger, the rate, p99/trigger, and the
latency at every half percent (for `bench.plots`). The lead runs it at half the peak
rate that `make bench` measured: the default reads it from docs/bench/contenders.json.

    python -m bench.latency [--rate EVENTS_PER_S] [--keys 100000] [--seconds 60] [--trigger 1s]
                            [--warmup 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    Producer,
    TopicPartition,
)

from bench.run import RESULTS, pipeline
from refold.config import Pipeline, parse_duration
from refold.kafka.io import (
    TopicSpec,
    consumer_config,
    delivery_failures,
    ensure_topics,
    partitions_of,
    producer_config,
)
from refold.model import jsonbytes
from refold.model.changelog import message_key_bytes
from refold.spark.job import engine_topics, run_pipeline, spark_session

SLICE = 0.02  # the producer's pacing step, seconds
KEY = ["player_name"]
CDF_STEPS = 200  # the JSON's latency distribution: one value per half percent


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_info() -> dict[str, Any]:
    """The fields every bench JSON starts with: when, where, how busy the machine was."""
    return {
        "run": time.strftime("%Y%m%d%H%M%S"),
        "machine": platform.platform(),
        "cores": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    say(f"wrote {path}")


def append_event(key: str, score: int, event_time_ms: int) -> bytes:
    """One `+A` changelog event of the bench's row shape (`refold.dev.testing`'s columns)."""
    row = {"op": "+A", "event_time": event_time_ms, "player_name": key, "score": score,
           "bonus": None, "team": ("red", "blue", "green")[score % 3]}
    return jsonbytes.dumps(row)  # right-sized: 10M of them are kept


def prepare_topics(settings: dict[str, Any], p: Pipeline, partitions: int) -> None:
    """Create the pipeline's topics before the engine starts, so that a reader can assign
    its view topic at once. (A just-created topic may answer NOT_LEADER_FOR_PARTITION
    for a while; `refold.kafka.io` rides that out as the engine starts.)"""
    ensure_topics(settings, engine_topics(p, max(p.partitions, partitions)))


def duration(text: str) -> float:
    """argparse type for `--trigger`: '1s', '500ms' (refold's duration syntax)."""
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the trigger must be longer than 0")
    return seconds


PROBE = -1  # the probe event's id (its score)
NEW_ROW = frozenset(("+A", "+C"))  # the view ops that show a key's new row


@dataclass
class Timeline:
    """Send and receive times (time.monotonic) by event id (the event's score)."""

    sent: dict[int, float] = field(default_factory=dict)
    received: dict[int, float] = field(default_factory=dict)
    first_seen: float | None = None  # the first view record (the probe's)
    paced_from: float | None = None  # when paced sending began
    duplicates: int = 0  # new-row view records of an event already seen (there should be none)

    def window_over(self, warmup: float, seconds: float) -> bool:
        """Whether `seconds` have passed after the warm-up."""
        start = self.paced_from
        return start is not None and time.monotonic() >= start + warmup + seconds

    def all_seen(self) -> bool:
        return len(self.received) >= len(self.sent) and all(k in self.received for k in self.sent)


class Worker(threading.Thread):
    """A daemon thread that keeps its target's result or exception."""

    def __init__(self, name: str, target: Callable[[], Any]) -> None:
        super().__init__(name=name, daemon=True)
        self._target_fn = target
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._target_fn()
        except BaseException as exc:  # reported by the main thread
            self.error = exc


def send_paced(settings: dict[str, Any], topic: str, rate: float, keys: int, timeline: Timeline,
               done: Callable[[], bool], limit: float) -> int:
    """One probe event, and once its view record is seen, `rate` events/s until `done()`:
    event i with score i, over `keys` keys (0: each a fresh key); record each send time.
    Fails after `limit` seconds (the engine never showed a view record, or the window
    never ended)."""
    producer = Producer(producer_config(settings, **{"linger.ms": 1}))
    errors, on_delivery = delivery_failures()
    prefix = uuid.uuid4().hex[:8]
    started = time.monotonic()
    probe = f"lat-{prefix}-probe"
    timeline.sent[PROBE] = started
    producer.produce(topic, append_event(probe, PROBE, int(time.time() * 1000)), message_key_bytes(KEY, (probe,)),
                     on_delivery=on_delivery)
    producer.flush(30)
    while timeline.first_seen is None:
        if time.monotonic() - started >= limit:
            raise RuntimeError(f"the engine showed no view record in {limit:g}s")
        time.sleep(0.05)
    started = timeline.paced_from = time.monotonic()
    sent = 0
    while not done():
        elapsed = time.monotonic() - started
        if elapsed >= limit:
            raise RuntimeError(f"no end of the measured window after {limit:g}s of sending "
                               f"({len(timeline.received):,} view records seen)")
        while sent < int(rate * elapsed) + 1:
            key = f"lat-{prefix}-{sent % keys if keys else sent:09d}"
            value = append_event(key, sent, int(time.time() * 1000))
            sent_key = message_key_bytes(KEY, (key,))
            while True:
                timeline.sent[sent] = time.monotonic()  # when the client takes it
                try:
                    producer.produce(topic, value, sent_key, on_delivery=on_delivery)
                    break
                except BufferError:  # its queue is full (the broker acknowledges slower than the pace)
                    producer.poll(0.01)
            sent += 1
        producer.poll(0)
        next_slice = (int((time.monotonic() - started) / SLICE) + 1) * SLICE
        time.sleep(max(0.0, started + next_slice - time.monotonic()))
    remaining = producer.flush(60)
    if errors or remaining:
        raise RuntimeError(f"the producer failed: {errors[0].str() if errors else f'{remaining} records unsent'}")
    return sent


def watch_view(settings: dict[str, Any], topic: str, timeline: Timeline, stop: threading.Event) -> None:
    """Note when each event's new-row view record (`latest` = its id) is first seen by a
    read_committed reader, until `stop`."""
    conf = consumer_config(settings, **{"group.id": f"bench-latency-{uuid.uuid4()}", "fetch.wait.max.ms": 10,
                                        "enable.partition.eof": False})
    consumer = Consumer(conf)
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions_of(settings, topic)])
        while not stop.is_set():
            for msg in consumer.consume(num_messages=1000, timeout=0.05):
                now = time.monotonic()
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise RuntimeError(f"reading {topic}: {err.str()}")
                change = orjson.loads(msg.value() or b"null")
                if not isinstance(change, dict) or change.get("op") not in NEW_ROW:
                    continue
                event = change.get("latest")
                if event in timeline.received:
                    timeline.duplicates += 1
                elif isinstance(event, int):
                    timeline.received[event] = now
                    if timeline.first_seen is None:
                        timeline.first_seen = now
    finally:
        consumer.close()


def wait_for_views(timeline: Timeline, reader: Worker, engine: Worker, deadline: float) -> None:
    """Until every sent event was seen, the reader ended or a thread failed, or the
    deadline passed. (An engine that stopped, idle, is no reason to stop: the reader may
    still be behind it.)"""
    last_report = time.monotonic()
    while time.monotonic() < deadline and not timeline.all_seen():
        if reader.error is not None or engine.error is not None or not reader.is_alive():
            return
        if time.monotonic() - last_report >= 10:
            last_report = time.monotonic()
            say(f"  {len(timeline.received):,} of {len(timeline.sent):,} events seen in the view")
        time.sleep(0.2)


def percentile_table(latencies: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else latencies * 99
    return {"p50_s": cuts[49], "p90_s": cuts[89], "p99_s": cuts[98], "max_s": max(latencies),
            "mean_s": statistics.fmean(latencies)}


def cdf(latencies: list[float]) -> list[float]:
    """The latency at quantiles 0, 0.5 %, …, 100 % (nearest rank)."""
    ordered = sorted(latencies)
    last = len(ordered) - 1
    return [ordered[round(last * i / CDF_STEPS)] for i in range(CDF_STEPS + 1)]


def figures(timeline: Timeline, warmup: float) -> dict[str, Any]:
    """The latency figures of the events sent after the warm-up."""
    if not timeline.received:
        raise SystemExit("latency: no view record was seen at all; nothing to measure")
    assert timeline.paced_from is not None
    cut = timeline.paced_from + warmup
    measured = [timeline.received[k] - t for k, t in timeline.sent.items() if t >= cut and k in timeline.received]
    missing = sum(1 for k in timeline.sent if k not in timeline.received)
    skipped = sum(1 for t in timeline.sent.values() if t < cut)
    if not measured:
        raise SystemExit(f"latency: no event was sent after the warm-up (paced sending + {warmup:g}s; "
                         f"{skipped:,} events before it)")
    return {"count": len(measured), "warmup_skipped": skipped, "missing": missing,
            "duplicates": timeline.duplicates, **percentile_table(measured), "cdf_s": cdf(measured)}


def latency_pipeline(run_id: str, source: str, bootstrap: str, trigger: str, batch: int) -> Pipeline:
    """`make bench`'s grouped pipeline, with this run's trigger."""
    return pipeline(f"bench-latency-{run_id}", source, bootstrap, batch).model_copy(update={"trigger": trigger})


def measure(args: argparse.Namespace, bootstrap: str, spark: Any, run_id: str) -> dict[str, Any]:
    settings = {"bootstrap.servers": bootstrap}
    source = f"bench-latency-{run_id}"
    ensure_topics(settings, [TopicSpec(source, args.partitions)])
    p = latency_pipeline(run_id, source, bootstrap, args.trigger, args.batch)
    prepare_topics(settings, p, args.partitions)  # and the reader can assign the view topic
    assert p.outputs.view is not None
    view_topic = p.outputs.view.topic
    timeline = Timeline()
    stop = threading.Event()
    idle = max(5.0, 3 * p.trigger_seconds)
    reader = Worker("bench-view-reader", lambda: watch_view(settings, view_topic, timeline, stop))
    engine = Worker("bench-engine", lambda: run_pipeline(p, bootstrap, until_idle=idle, spark=spark, quiet=True))
    limit = args.start_timeout + args.warmup + args.seconds
    producer = Worker("bench-producer", lambda: send_paced(
        settings, source, args.rate, args.keys, timeline, lambda: timeline.window_over(args.warmup, args.seconds),
        limit))
    reader.start()
    engine.start()
    producer.start()  # from now on data is always available: the engine cannot go idle early
    over = f"over {args.keys:,} keys" if args.keys else "each a new key"
    say(f"a probe event to {source}, then {args.rate:,.0f} events/s ({over}) once its view record is seen, until "
        f"{args.seconds:g}s after the warm-up (the first {args.warmup:g}s of paced sending); trigger {args.trigger}")
    producer.join()
    if producer.error is not None:
        stop.set()
        raise SystemExit(f"latency: {producer.error}")
    say(f"sent {producer.result:,} events; waiting for their view records (at most {args.drain:g}s)")
    wait_for_views(timeline, reader, engine, time.monotonic() + args.drain)
    stop.set()
    reader.join(30)
    engine.join(idle + 120)
    for worker in (reader, engine):
        if worker.error is not None:
            raise SystemExit(f"latency: the {worker.name} failed: {worker.error}")
    if engine.is_alive():
        raise SystemExit("latency: the engine did not stop after going idle")
    result = figures(timeline, args.warmup)
    result["engine_events"] = engine.result.events
    result["engine_batches"] = engine.result.batches
    result["sent"] = producer.result
    return result


def half_peak(contenders: Path, fallback: float = 1000.0) -> float:
    """Half of Refold's throughput in the last `make bench` run (bench.run's JSON)."""
    try:
        peak = float(json.loads(contenders.read_text())["contenders"]["refold"]["events_per_s"])
    except (OSError, ValueError, KeyError, TypeError):
        print(f"no Refold figure in {contenders}; sending {fallback:,.0f} events/s", file=sys.stderr)
        return fallback
    print(f"Refold's peak in {contenders.name}: {peak:,.0f} events/s; sending half", file=sys.stderr)
    return round(peak / 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=None,
                        help="events/s sent (default: half of Refold's events/s in docs/bench/contenders.json, "
                             "the peak `make bench` measured; 1000 when there is none)")
    parser.add_argument("--keys", type=int, default=100_000,
                        help="the events' key space (default 100000, the contenders' run's); 0: each a new key")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="the measured window after the warm-up, seconds (default 60)")
    parser.add_argument("--trigger", default="1s", help="the pipeline's trigger interval (default 1s)")
    parser.add_argument("--warmup", type=float, default=10.0,
                        help="the first seconds of paced sending whose events are not counted (default 10)")
    parser.add_argument("--drain", type=float, default=120.0,
                        help="seconds to wait for the last view records after sending ends (default 120)")
    parser.add_argument("--start-timeout", type=float, default=300.0,
                        help="seconds the engine may take to show its first view record (default 300)")
    parser.add_argument("--partitions", type=int, default=4, help="source partitions (default 4)")
    parser.add_argument("--batch", type=int, default=100_000, help="max events per micro-batch (default 100000)")
    parser.add_argument("--json", type=Path, default=RESULTS / "latency.json", help="where to write the figures")
    args = parser.parse_args(argv)
    try:
        trigger_s = duration(args.trigger)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--trigger: {exc}")
    if args.rate is None:
        args.rate = half_peak(RESULTS / "contenders.json")
    if args.rate <= 0 or args.seconds <= 0 or args.keys < 0:
        parser.error("--rate and --seconds must be positive, --keys at least 0")

    from refold.dev.localkafka import ensure_broker

    bootstrap = ensure_broker(None, start_local=True)
    info = run_info()
    spark = spark_session(name="refold-latency")
    try:
        result = measure(args, bootstrap, spark, info["run"])
    finally:
        spark.stop()
    result.update(rate=args.rate, seconds=args.seconds, trigger=args.trigger, trigger_s=trigger_s,
                  p99_over_trigger=result["p99_s"] / trigger_s, warmup_s=args.warmup,
                  partitions=args.partitions, batch=args.batch, keys=args.keys or None)
    write_json(args.json, {**info, **result})
    print(f"latency: rate={args.rate:,.0f}/s over {f'{args.keys:,} keys' if args.keys else 'new keys'} "
          f"for {args.seconds:g}s trigger={args.trigger} "
          f"count={result['count']:,} p50={result['p50_s']:.3f}s p90={result['p90_s']:.3f}s "
          f"p99={result['p99_s']:.3f}s max={result['max_s']:.3f}s p99/trigger={result['p99_over_trigger']:.2f} "
          f"(warm-up skipped {result['warmup_skipped']:,}; missing {result['missing']}; "
          f"duplicates {result['duplicates']})")
    return 1 if result["missing"] or result["duplicates"] else 0


if __name__ == "__main__":
    sys.exit(main())
