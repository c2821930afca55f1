"""Watching a running pipeline: Prometheus metrics and the progress output of `refold run`.

The `Monitor` is fed by the job after each committed batch (`committed`) and
keeps a ticker thread that measures the consumer lag every second. It serves,
when a port is given (`metrics: {port: 9464}` or `refold run --metrics-port`),
these metrics on `http://HOST:PORT/metrics`, each labelled with `pipeline`:

| metric | type | what |
|---|---|---|
| `refold_events_in_total{topic}` | counter | input records reduced (committed) |
| `refold_events_out_total{topic}` | counter | records committed to each output topic and the dead-letter topic |
| `refold_dead_letters_total` | counter | bad input records sent to `P.dlq` |
| `refold_tombstones_total` | counter | input records without a change (Debezium tombstones), skipped |
| `refold_batches_total` | counter | committed batches |
| `refold_batch_duration_seconds` | histogram | decode + reduce + commit of one batch |
| `refold_commit_latency_seconds` | histogram | `begin_transaction` to `commit_transaction` |
| `refold_transaction_aborts_total` | counter | batch transactions that failed and were run again |
| `refold_consumer_lag{topic,partition}` | gauge | end offset minus committed offset (transaction markers count) |
| `refold_last_commit_timestamp_seconds` | gauge | wall clock of the last commit |

Progress goes to stderr, one line per committed batch: its events, outputs, dead
letters, the lag after it (the source records still to read once the batch committed;
transaction markers are not records) and the rate. On a terminal (or with `refold run
--log-format text`) the line is for a person:

    [scores] batch 3: 1,000 events → 1,212 outputs, 0 dead letters · lag 0 · 2,410 events/s

otherwise (or with `--log-format json`) it is one JSON object, `"message": "batch
committed"`, and the engine's log records are JSON lines too (`json_logging`). The
line is written by the monitor's thread right after the commit (measuring the lag
takes a read of the source's end), never by the batch. Payloads never appear.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
import threading
import time
from datetime import UTC, datetime
from typing import Any, Protocol, TextIO

import orjson
from confluent_kafka import Consumer, KafkaException, TopicPartition
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from refold.config import Pipeline
from refold.kafka.io import consumer_config, partitions_of
from refold.plan import RIGHT_PARTITIONS
from refold.runtime.processor import BatchStats

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Offsets(Protocol):
    @property
    def offsets(self) -> dict[int, int]: ...


class Metrics:
    """The pipeline's Prometheus metrics, in their own registry."""

    def __init__(self, pipeline: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.events_in = Counter("refold_events_in", "Input records reduced (committed).", ["pipeline", "topic"], registry=r)
        self.events_out = Counter("refold_events_out", "Records committed per output topic.", ["pipeline", "topic"], registry=r)
        self.dead_letters = Counter("refold_dead_letters", "Bad input records sent to the dead-letter topic.", ["pipeline"], registry=r)
        self.tombstones = Counter("refold_tombstones", "Input records without a change, skipped.", ["pipeline"], registry=r)
        self.batches = Counter("refold_batches", "Committed batches.", ["pipeline"], registry=r)
        self.batch_seconds = Histogram("refold_batch_duration_seconds", "Decode, reduce and commit of one batch.",
                                       ["pipeline"], buckets=_LATENCY_BUCKETS, registry=r)
        self.commit_seconds = Histogram("refold_commit_latency_seconds", "begin_transaction to commit_transaction.",
                                        ["pipeline"], buckets=_LATENCY_BUCKETS, registry=r)
        self.aborts = Counter("refold_transaction_aborts", "Batch transactions that failed and were run again.",
                              ["pipeline"], registry=r)
        self.lag = Gauge("refold_consumer_lag", "End offset minus committed offset of each input partition.",
                         ["pipeline", "topic", "partition"], registry=r)
        self.last_commit = Gauge("refold_last_commit_timestamp_seconds", "Wall clock of the last commit.",
                                 ["pipeline"], registry=r)
        self.pipeline = pipeline
        for metric in (self.dead_letters, self.tombstones, self.batches, self.aborts):
            metric.labels(pipeline)  # present (at 0) before the first batch

    def batch(self, stats: BatchStats, source_topic: str, new_aborts: int) -> None:
        p = self.pipeline
        self.events_in.labels(p, source_topic).inc(stats.records_in)
        for topic, count in stats.out_by_topic.items():
            self.events_out.labels(p, topic).inc(count)
        self.dead_letters.labels(p).inc(stats.dead_letters)
        self.tombstones.labels(p).inc(stats.tombstones)
        self.batches.labels(p).inc()
        self.batch_seconds.labels(p).observe(stats.seconds)
        self.commit_seconds.labels(p).observe(stats.commit_seconds)
        if new_aborts:
            self.aborts.labels(p).inc(new_aborts)
        self.last_commit.labels(p).set(stats.committed_at)


class Monitor:
    """Metrics endpoint (optional), lag ticker and progress output of one run."""

    def __init__(
        self,
        pipeline: Pipeline,
        settings: dict[str, Any],
        *,
        metrics_port: int | None = None,
        quiet: bool = False,
        stream: TextIO | None = None,
        interval: float = 1.0,
        log_format: str | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.topic = pipeline.source.topic
        # the topics the lag counts, each with what its partitions are numbered from in the
        # offsets (a join's right source's partition p is RIGHT_PARTITIONS + p)
        self.sources = [(self.topic, 0)] + ([(pipeline.sources[pipeline.view.join.right].topic, RIGHT_PARTITIONS)]
                                            if pipeline.view.join is not None else [])
        self.metrics = Metrics(pipeline.pipeline)
        self.port = metrics_port if metrics_port is not None else (pipeline.metrics.port if pipeline.metrics else None)
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        # "text" (a line a person reads) or "json"; by default text on a terminal
        self.format = log_format or ("text" if self.stream.isatty() else "json")
        self.interval = interval
        self.lag: int | None = None
        self.last_commit: float | None = None
        self.batches = 0
        self.events = 0
        self._aborts_seen = 0
        self._rates: collections.deque[tuple[float, int]] = collections.deque(maxlen=10)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lines: collections.deque[tuple[BatchStats, dict[int, int], float]] = collections.deque()
        self._processor: _Offsets | None = None
        self._threads: list[threading.Thread] = []
        self._server: Any = None

    def start(self, processor: _Offsets) -> None:
        """Serve the metrics (if a port is set) and start measuring the lag."""
        self._processor = processor
        if self.port is not None:
            host = self.pipeline.metrics.host if self.pipeline.metrics else "0.0.0.0"
            self._server, thread = start_http_server(self.port, host, registry=self.metrics.registry)
            self._threads.append(thread)
            log.info("metrics on http://%s:%d/metrics", host, self.port)
        ticker = threading.Thread(target=self._tick, args=(processor,), name="refold-monitor", daemon=True)
        ticker.start()
        self._threads.append(ticker)

    def committed(self, stats: BatchStats, aborts: int) -> None:
        """After each committed batch (aborts: the processor's count so far)."""
        self.metrics.batch(stats, self.topic, aborts - self._aborts_seen)
        self._aborts_seen = aborts
        self.batches += 1
        self.events += stats.records_in
        self.last_commit = time.monotonic()
        self._rates.append((self.last_commit, self.events))
        if self.quiet:
            return
        offsets = dict(self._processor.offsets) if self._processor is not None else {}
        rate = self.rate() if len(self._rates) > 1 else stats.records_in / stats.seconds if stats.seconds > 0 else 0.0
        self._lines.append((stats, offsets, rate))
        self._wake.set()  # the monitor's thread measures the lag after the batch and writes the line

    def rate(self) -> float:
        """Events per second over the last few batches."""
        if len(self._rates) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._rates[0], self._rates[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def close(self) -> None:
        """Stop the metrics server and the thread, once the batches' lines are written."""
        self._stop.set()
        self._wake.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for thread in self._threads:
            thread.join(30)
        self._write_lines(None)  # any the thread left (it never started, or it stopped)

    # The ticker --------------------------------------------------------------------------

    def _tick(self, processor: _Offsets) -> None:
        consumer = Consumer(consumer_config(self.settings))
        try:
            partitions = {topic: partitions_of(self.settings, topic) for topic, _ in self.sources}
            measured = 0.0
            while True:
                stopping = self._stop.is_set()
                self._wake.clear()  # before the lines are taken: a batch's line after it wakes the wait below
                self._write_lines(consumer, partitions)
                if stopping:
                    return
                if time.monotonic() - measured >= self.interval:
                    self._measure_lag(consumer, partitions, processor.offsets)
                    measured = time.monotonic()
                self._wake.wait(self.interval)
        except Exception as exc:  # the monitor must never stop the engine
            log.warning("lag measurement stopped: %s", exc)
        finally:
            consumer.close()

    def _measure_lag(self, consumer: Consumer, partitions: dict[str, list[int]], committed: dict[int, int]) -> None:
        total = 0
        for topic, shift in self.sources:
            for partition in partitions[topic]:
                try:
                    _low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=5)
                except KafkaException:
                    return
                lag = max(high - committed.get(shift + partition, 0), 0)
                self.metrics.lag.labels(self.pipeline.pipeline, topic, str(partition)).set(lag)
                total += lag
        self.lag = total

    def _lag_after(self, consumer: Consumer | None, partitions: dict[str, list[int]], committed: dict[int, int],
                   exact_limit: int = 0) -> int | None:
        """The source records still to read past `committed`, counted while within
        `exact_limit` offsets, else the offset distance (None when the broker does not say)."""
        from refold.ops.status import records_lag

        if consumer is None:
            return None
        total = 0
        try:
            for topic, shift in self.sources:
                ends = {}
                for partition in partitions.get(topic, []):
                    _low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=5)
                    ends[partition] = high
                mine = {p - shift: o for p, o in committed.items() if (p >= RIGHT_PARTITIONS) == bool(shift)}
                rows = records_lag(self.settings, topic, mine, ends, exact_limit=exact_limit, timeout=2.0)
                total += sum(row.lag for row in rows)
        except Exception as exc:  # a lag the broker could not tell: the line says "?"
            log.debug("lag after the batch: %s", exc)
            return None
        return total

    def _write_lines(self, consumer: Consumer | None, partitions: dict[str, list[int]] | None = None) -> None:
        while self._lines:
            stats, offsets, rate = self._lines.popleft()
            # the newest batch's lag counted; older lines still waiting (batches faster than
            # the count) get the offset distance, so the lines keep up with the batches
            exact_limit = _EXACT_LAG_LIMIT if not self._lines else 0
            lag = self._lag_after(consumer, partitions or {}, offsets, exact_limit)
            with contextlib.suppress(OSError, ValueError):  # a closed stream
                print(self._line(stats, lag, rate), file=self.stream, flush=True)

    def _line(self, stats: BatchStats, lag: int | None, rate: float) -> str:
        if self.format == "text":
            return (
                f"[{self.pipeline.pipeline}] batch {stats.batch}: {_count(stats.records_in, 'event')} → "
                f"{_count(stats.records_out, 'output')}, {_count(stats.dead_letters, 'dead letter')} · "
                f"lag {'?' if lag is None else f'{lag:,}'} · {_rate(rate)} events/s"
            )
        return orjson.dumps({
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "level": "INFO",
            "message": "batch committed",
            "pipeline": self.pipeline.pipeline,
            "batch": stats.batch,
            "in": stats.records_in,
            "out": stats.records_out,
            "dead_letters": stats.dead_letters,
            "tombstones": stats.tombstones,
            "seconds": round(stats.seconds, 4),
            "commit_seconds": round(stats.commit_seconds, 4),
            "lag": lag,
            "events_per_second": round(rate, 1),
        }).decode()


def _count(number: int, noun: str) -> str:
    """`1 event`, `1,000 events`."""
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def _rate(rate: float) -> str:
    return f"{rate:,.1f}" if rate < 10 else f"{rate:,.0f}"


# The batch line counts the records still to read while the offsets past the commit stay
# within this many (a short read of the source), else it gives the offset distance.
_EXACT_LAG_LIMIT = 10_000


class JsonFormatter(logging.Formatter):
    """One JSON object per log record: time, level, logger, message."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def json_logging() -> None:
    """Switch the root logger's handlers to JSON lines (for non-terminal stderr)."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(JsonFormatter())
