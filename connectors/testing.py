"""Test doubles for materialization drivers, shipped so that a driver written outside
this repository can be driven the way Refold's own conformance suite
(tests/test_conformance.py) drives the built-in ones:

- `Harness`: the batch processor's calls around one driver, through the real
  runtime (`Materializations`) and a real reducer, with Kafka as two variables
  (the committed checkpoint and the state). `crash()` drops the runtime and the
  driver mid-protocol, never closing them, and starts a fresh instance from what
  "Kafka" committed, as a process killed with kill -9 would.
- `Recording`: wraps a driver and logs every message it sees and answers, in order
  (`RecordingExecutor` logs the Stores a Sink's writers get), to check against the
  protocol's ordering rules.
- `WebhookReceiver` (`serve_webhook()`): a real HTTP server on 127.0.0.1 that
  records every POST and can answer 503 to the first ones.
- `changelog()` and `batches_of()`: a seeded random changelog, cut into batches.

Nothing here is used by the engine at run time.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import random
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from refold.config import Pipeline
from refold.connectors import protocol as p
from refold.connectors.runtime import Materializations, ThreadExecutor
from refold.dev.testing import Workload, generate
from refold.model.changelog import Op
from refold.recovery.records import Checkpoint
from refold.reduce import Rejected, SourceEvent, make_reducer
from refold.reference import merge_partitions

Entry = tuple[Any, ...]  # one logged message: its name first ("Load", binding, key), …


# Recording ----------------------------------------------------------------------------------


class Recording(p.Driver[Any]):
    """Wraps a driver; records every message it sees and answers, in order.

    `ack_waits_for_load`: each Acknowledge after the first waits (up to 30 s) until a
    Load arrives, proving the runtime does not wait for Acknowledged before Load."""

    def __init__(self, inner: p.Driver[Any], log: list[Entry], *, ack_waits_for_load: bool = False) -> None:
        super().__init__(inner.settings, inner.where)
        self.inner = inner
        self.log = log
        self.pattern = inner.pattern
        self.store_errors = inner.store_errors
        self.ack_waits_for_load = ack_waits_for_load
        self.loaded = threading.Condition()  # notified on each Load, and at the end
        self.ending = False  # no batch follows: an Acknowledge waits for no Load

    def sink(self) -> p.Sink | None:
        return self.inner.sink()

    def open(self, request: p.Open) -> p.Opened:
        self.log.append(("Open", request.driver_checkpoint))
        opened = self.inner.open(request)
        self.log.append(("Opened", opened.runtime_checkpoint))
        return opened

    def acknowledge(self, request: p.Acknowledge) -> p.Acknowledged:
        self.log.append(("Acknowledge", request.batch))
        if self.ack_waits_for_load and request.batch > 0:
            with self.loaded:  # until the next batch has sent a Load (maybe before this Acknowledge)
                self.loaded.wait_for(lambda: self.ending or self._loaded_in(request.batch + 1), 30.0)
        answer = self.inner.acknowledge(request)
        self.log.append(("Acknowledged",))
        return answer

    def _loaded_in(self, batch: int) -> bool:
        """Whether a Load follows the ("-- batch", batch) marker in the log."""
        try:
            start = self.log.index(("-- batch", batch))
        except ValueError:
            return False
        return any(entry[0] == "Load" for entry in self.log[start:])

    def load(self, requests: Sequence[p.Load]) -> list[p.Loaded]:
        with self.loaded:
            self.log += [("Load", r.binding, r.key) for r in requests]
            self.loaded.notify_all()
        answers = self.inner.load(requests)
        self.log += [("Loaded", a.binding, a.key) for a in answers]
        return answers

    def flush(self, request: p.Flush) -> p.Flushed:
        self.log.append(("Flush",))
        answer = self.inner.flush(request)
        self.log.append(("Flushed",))
        return answer

    def store(self, requests: Sequence[p.Store]) -> None:
        self.log += [("Store", r.binding, r.key, r.exists, r.delete) for r in requests]
        self.inner.store(requests)

    def start_commit(self, request: p.StartCommit) -> p.StartedCommit:
        self.log.append(("StartCommit", request.runtime_checkpoint.batch, request.full_refresh))
        answer = self.inner.start_commit(request)
        self.log.append(("StartedCommit",))
        return answer

    def close(self) -> None:
        self.inner.close()

    def end(self) -> None:
        """No batch follows: the last Acknowledge stops waiting for its Load."""
        with self.loaded:
            self.ending = True
            self.loaded.notify_all()


class RecordingExecutor(ThreadExecutor):
    """Records the Stores a Sink's writers get (they bypass `Driver.store`)."""

    def __init__(self, log: list[Entry]) -> None:
        super().__init__(threads=3)
        self.log = log

    def prepare(self, writer: p.SinkWriter, txn: p.TxnInfo, parts: Any) -> list[p.CommitInfo]:
        for _part, stores in parts:
            self.log += [("Store", s.binding, s.key, s.exists, s.delete) for s in stores]
        return super().prepare(writer, txn, parts)


# The harness: the batch processor's calls, with Kafka as two variables --------------------------


class Harness:
    """The first `outputs.materialize` entry of `pipeline`, driven batch by batch.

    `log` holds every message (`Recording`), with a ("-- batch", n) marker before
    each batch and ("-- crash",) at each crash; `driver` is the current instance's
    recording wrapper, `committed` what "Kafka" holds."""

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        ack_waits_for_load: bool = False,
        kafka: Harness | None = None,
        writer: str | None = None,
    ) -> None:
        """`kafka`: start from another instance's committed checkpoint and state;
        `writer`: the shard's writer (`<writer>-<shard>`) the sessions run as."""
        self.pipeline = pipeline
        self.writer = writer
        self.ack_waits_for_load = ack_waits_for_load
        self.log: list[Entry] = []
        self.committed = Checkpoint(
            pipeline.pipeline, pipeline.writer, 0, pipeline.source.topic, {}, {}, 0, 0, 0, 0, {}
        )
        self.state: dict[bytes, bytes] = {}  # P.state, compacted
        self.events = 0
        if kafka is not None:
            self.committed, self.state, self.events = kafka.committed, dict(kafka.state), kafka.events
        self.start()

    def start(self) -> None:
        """A fresh instance: state from 'Kafka', the driver opened at the committed checkpoint."""
        self.reducer = make_reducer(self.pipeline.view)
        self.reducer.restore(self.state.items())
        drivers = p.build_drivers(self.pipeline.outputs.materialize)
        self.driver = Recording(drivers[0], self.log, ack_waits_for_load=self.ack_waits_for_load)
        self.runtime = Materializations(
            self.pipeline, [self.driver], RecordingExecutor(self.log), self.writer, retry_seconds=0.01
        )
        self.runtime.open(self.committed)

    def batch(self, units: Sequence[Sequence[SourceEvent]], crash: str | None = None) -> None:
        """Reduce `units` and run their transaction; `crash` ("after_start_commit",
        "after_kafka_commit", "after_acknowledge") kills the instance at that step."""
        changes = []
        for unit in units:
            with contextlib.suppress(Rejected):  # a refused unit changes nothing
                changes += self.reducer.apply(unit)
        deltas = self.reducer.take_deltas()
        state = self.reducer.take_state_changes()
        events = self.events + sum(len(u) for u in units)
        checkpoint = replace(self.committed, batch=self.committed.batch + 1, offsets={0: events})
        self.log.append(("-- batch", checkpoint.batch))
        driver_checkpoints = self.runtime.commit(checkpoint, changes, deltas, self.reducer.view)
        if crash == "after_start_commit":
            return self.crash()
        checkpoint = replace(checkpoint, driver_checkpoints=driver_checkpoints)
        self.committed, self.events = checkpoint, events  # the Kafka transaction
        for key, value in state:
            if value is None:
                self.state.pop(key, None)
            else:
                self.state[key] = value
        if crash == "after_kafka_commit":
            return self.crash()
        self.runtime.acknowledge(checkpoint.batch)
        if crash == "after_acknowledge":
            self.runtime.close()  # lets Acknowledged land, then the process is gone
            return self.crash()
        return None

    def crash(self) -> None:
        """The process dies: the objects are dropped (never closed); a new instance starts."""
        self.log.append(("-- crash",))
        self.start()

    def close(self) -> None:
        self.driver.end()
        self.runtime.close()

    def transactions(self) -> list[list[Entry]]:
        """The log cut at each batch marker (the first part: Open and the recovery Acknowledge)."""
        out: list[list[Entry]] = [[]]
        for entry in self.log:
            if entry[0] == "-- batch":
                out.append([])
            out[-1].append(entry)
        return out


# Workloads -------------------------------------------------------------------------------------


def changelog(events: int = 2000, keys: int = 150, seed: int = 11) -> list[list[SourceEvent]]:
    """A seeded random changelog of one partition, as units (a correction pair is one unit)."""
    rows = list(generate(Workload(events=events, keys=keys, seed=seed)))
    source = [
        SourceEvent(Op.parse(r["op"]), {k: v for k, v in r.items() if k not in ("op", "event_time")},
                    (r["event_time"], 0, offset))
        for offset, r in enumerate(rows)
    ]
    return merge_partitions({0: source})


def batches_of(units: list[list[SourceEvent]], seed: int = 5) -> list[list[list[SourceEvent]]]:
    """`units` cut into batches of seeded random sizes (1 to 400 units)."""
    rng = random.Random(seed)
    out, at = [], 0
    while at < len(units):
        size = rng.choice([1, 7, 40, 150, 400])
        out.append(units[at : at + size])
        at += size
    return out


# The webhook receiver --------------------------------------------------------------------------


@dataclass
class WebhookReceiver:
    """What a real HTTP server on 127.0.0.1 received (`serve_webhook`)."""

    url: str = ""
    posts: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (Idempotency-Key, body)
    fail_next: int = 0  # answer 503 to this many requests first
    lock: threading.Lock = field(default_factory=threading.Lock)

    def rows(self) -> list[dict[str, Any]]:
        """Delta rows, each idempotency key once (as a receiver that remembers keys)."""
        seen: dict[str, dict[str, Any]] = {}
        for key, body in self.posts:
            seen.setdefault(key, body)
        return [row for body in seen.values() for row in body["rows"]]


@contextlib.contextmanager
def serve_webhook() -> Iterator[WebhookReceiver]:
    """A receiver on a free port for the block; it records every POST it answers 200."""
    state = WebhookReceiver()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with state.lock:
                fail = state.fail_next > 0
                if fail:
                    state.fail_next -= 1
                else:
                    state.posts.append((self.headers["Idempotency-Key"], json.loads(body)))
            self.send_response(503 if fail else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
