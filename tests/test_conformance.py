"""One protocol conformance suite, run against every materialization driver.

The same test functions, parametrized by driver (`driver_case`), drive each driver
through the real runtime (`refold.connectors.runtime`) the way the batch processor
does: a real reducer makes each batch's view changes and deltas, a small stand-in
for Kafka keeps the last committed checkpoint and state, and a crash is the
runtime and driver objects dropped at a chosen step, then a fresh instance opened
from the last committed checkpoint. Every message a driver sees is recorded and
checked against the protocol's ordering rules; the final store contents are
checked against the reference reducer (`refold.reference`).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import random
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from refold.config import Pipeline, parse_pipeline
from refold.connectors import protocol as p
from refold.connectors.parquet import STAGING, read_parquet_deltas, read_parquet_view
from refold.connectors.runtime import Materializations, ThreadExecutor
from refold.connectors.sqlite import read_sqlite_view
from refold.dev.testing import Workload, generate
from refold.errors import ConfigError
from refold.model.changelog import Op
from refold.recovery.records import Checkpoint
from refold.reduce import Rejected, SourceEvent, make_reducer
from refold.reference import fold_deltas, merge_partitions, reference_changelog

HAS_POSTGRES = (Path(__file__).resolve().parent.parent / "connectors" / "postgres.py").exists()
VIEW_DRIVERS = ["sqlite", "parquet", *(["postgres"] if HAS_POSTGRES else [])]
DELTA_DRIVERS = ["sqlite", "parquet", "webhook", *(["postgres"] if HAS_POSTGRES else [])]
ALL_DRIVERS = DELTA_DRIVERS
COLUMNS = {"total": {"sum": "score"}, "best": {"max": "score"}, "n": {"count": "*"}, "latest": {"last": "score"}}
CRASH_STEPS = ["after_stores", "after_start_commit", "after_kafka_commit", "after_acknowledge"]


# The webhook receiver ---------------------------------------------------------------------


@dataclass
class Receiver:
    """A real HTTP server on 127.0.0.1 that records every POST."""

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


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    state = Receiver()

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


# Driver cases -------------------------------------------------------------------------------


@dataclass
class DriverCase:
    """How to configure one driver and read back what it stored."""

    name: str
    settings: dict[str, Any]
    read_view: Callable[[], dict[tuple[Any, ...], dict[str, Any]]] | None
    read_deltas: Callable[[], list[dict[str, Any]]]

    @property
    def has_view(self) -> bool:
        return self.read_view is not None


def _sqlite_deltas(path: Path, table: str) -> list[dict[str, Any]]:
    db = sqlite3.connect(path)
    try:
        return [orjson.loads(doc) for (doc,) in db.execute(f'SELECT _doc FROM "{table}" ORDER BY rowid')]
    finally:
        db.close()


@pytest.fixture(params=ALL_DRIVERS)
def driver_case(request: pytest.FixtureRequest, tmp_path: Path) -> DriverCase:
    return _case(request.param, request, tmp_path)


@pytest.fixture(params=VIEW_DRIVERS)
def view_case(request: pytest.FixtureRequest, tmp_path: Path) -> DriverCase:
    return _case(request.param, request, tmp_path)


def _case(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> DriverCase:
    if name == "sqlite":
        db = tmp_path / "view.db"
        return DriverCase(
            name,
            {"driver": "sqlite", "path": str(db), "view": "scores", "delta": "scores_delta"},
            lambda: read_sqlite_view(db, "scores"),
            lambda: _sqlite_deltas(db, "scores_delta"),
        )
    if name == "parquet":
        root = tmp_path / "lake"
        root.mkdir()
        return DriverCase(
            name,
            {"driver": "parquet", "path": str(root), "view": "scores", "delta": "scores_delta", "parallelism": 3},
            lambda: read_parquet_view(root, "scores"),
            lambda: read_parquet_deltas(root, "scores_delta"),
        )
    if name == "webhook":
        hook: Receiver = request.getfixturevalue("receiver")
        return DriverCase(
            name,
            {"driver": "webhook", "url": hook.url, "delta": "scores_delta", "backoff": 0.01},
            None,
            hook.rows,
        )
    if name == "postgres":
        dsn: str = request.getfixturevalue("postgres_dsn")
        from refold.connectors import postgres

        return DriverCase(
            name,
            {"driver": "postgres", "dsn": dsn, "view": "scores", "delta": "scores_delta"},
            lambda: postgres.read_view(dsn, "scores"),
            lambda: postgres.read_deltas(dsn, "scores_delta"),
        )
    raise AssertionError(name)


# Recording --------------------------------------------------------------------------------------


class Recording(p.Driver):
    """Wraps a driver; records every message it sees and answers, in order."""

    def __init__(self, inner: p.Driver, log: list[tuple[Any, ...]], *, ack_waits_for_load: bool = False) -> None:
        super().__init__(inner.settings, inner.where)
        self.inner = inner
        self.log = log
        self.pattern = inner.pattern  # type: ignore[misc]
        self.ack_waits_for_load = ack_waits_for_load
        self.loading = threading.Event()

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
            # Flow's runtime does not wait for Acknowledged before Load: prove it.
            self.loading.wait(5.0)
            self.loading.clear()
        answer = self.inner.acknowledge(request)
        self.log.append(("Acknowledged",))
        return answer

    def load(self, requests: Sequence[p.Load]) -> list[p.Loaded]:
        self.log += [("Load", r.binding, r.key) for r in requests]
        self.loading.set()
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


class RecordingExecutor(ThreadExecutor):
    """Records the Stores a Sink's writers get (they bypass `Driver.store`)."""

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        super().__init__(threads=3)
        self.log = log

    def prepare(self, writer: p.SinkWriter, txn: p.TxnInfo, parts: Any) -> list[p.CommitInfo]:
        for _part, stores in parts:
            self.log += [("Store", s.binding, s.key, s.exists, s.delete) for s in stores]
        return super().prepare(writer, txn, parts)


# The harness: the batch processor's calls, with Kafka as two variables ----------------------------


def make_pipeline(settings: dict[str, Any], view: dict[str, Any] | None = None) -> Pipeline:
    return parse_pipeline(
        {
            "pipeline": "conf",
            "source": {"topic": "scores"},
            "view": view or {"key": ["player_name"], "columns": COLUMNS},
            "outputs": {"materialize": [settings]},
        }
    )


class Harness:
    def __init__(self, pipeline: Pipeline, *, ack_waits_for_load: bool = False, kafka: Harness | None = None) -> None:
        """`kafka`: start from another instance's committed checkpoint and state."""
        self.pipeline = pipeline
        self.ack_waits_for_load = ack_waits_for_load
        self.log: list[tuple[Any, ...]] = []
        self.committed = Checkpoint(pipeline.pipeline, pipeline.writer, 0, "scores", {}, {}, 0, 0, 0, 0, {})
        self.state: dict[bytes, bytes] = {}  # P.state, compacted
        self.events = 0
        if kafka is not None:
            self.committed, self.state, self.events = kafka.committed, dict(kafka.state), kafka.events
        self.start()

    def start(self) -> None:
        """A fresh instance: state from 'Kafka', every driver opened at the committed checkpoint."""
        self.reducer = make_reducer(self.pipeline.view)
        self.reducer.restore(self.state.items())
        drivers = p.build_drivers(self.pipeline.outputs.materialize)
        self.driver = Recording(drivers[0], self.log, ack_waits_for_load=self.ack_waits_for_load)
        self.runtime = Materializations(self.pipeline, [self.driver], RecordingExecutor(self.log), retry_seconds=0.01)
        self.runtime.open(self.committed)

    def batch(self, units: Sequence[Sequence[SourceEvent]], crash: str | None = None) -> None:
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
        self.runtime.close()

    def transactions(self) -> list[list[tuple[Any, ...]]]:
        """The log cut at each batch marker (the first part: Open and the recovery Acknowledge)."""
        out: list[list[tuple[Any, ...]]] = [[]]
        for entry in self.log:
            if entry[0] == "-- batch":
                out.append([])
            out[-1].append(entry)
        return out


def changelog(events: int = 2000, keys: int = 150, seed: int = 11) -> list[list[SourceEvent]]:
    rows = list(generate(Workload(events=events, keys=keys, seed=seed)))
    source = [
        SourceEvent(Op.parse(r["op"]), {k: v for k, v in r.items() if k not in ("op", "event_time")},
                    (r["event_time"], 0, offset))
        for offset, r in enumerate(rows)
    ]
    return merge_partitions({0: source})


def batches_of(units: list[list[SourceEvent]], seed: int = 5) -> list[list[list[SourceEvent]]]:
    rng = random.Random(seed)
    out, at = [], 0
    while at < len(units):
        size = rng.choice([1, 7, 40, 150, 400])
        out.append(units[at : at + size])
        at += size
    return out


def expected(pipeline: Pipeline, units: list[list[SourceEvent]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    return reference_changelog(pipeline.view, units).view


def assert_store_equals_reference(case: DriverCase, pipeline: Pipeline, units: list[list[SourceEvent]]) -> None:
    view = expected(pipeline, units)
    if case.read_view is not None:
        stored = case.read_view()
        assert stored.keys() == view.keys()
        assert stored == view
    deltas = case.read_deltas()
    assert fold_deltas(pipeline.view, deltas) == view  # every delta exactly once


# The suite ----------------------------------------------------------------------------------------


def test_ordering_rules(driver_case: DriverCase) -> None:
    pipeline = make_pipeline(driver_case.settings)
    harness = Harness(pipeline, ack_waits_for_load=driver_case.has_view)
    units = changelog(600, 60)
    batches = batches_of(units)
    live: set[tuple[Any, ...]] = set()
    for batch in batches:
        harness.batch(batch)
    harness.close()
    view_index = 0 if driver_case.has_view else None
    delta_index = 1 if driver_case.has_view else 0
    txns = harness.transactions()
    assert txns[0][0][0] == "Open" and ("Acknowledge", 0) in txns[0]
    assert len(txns) == len(batches) + 1
    log = harness.log
    unanswered = 0
    for entry in log:  # Flush never before every Acknowledge sent so far is Acknowledged
        unanswered += {"Acknowledge": 1, "Acknowledged": -1}.get(entry[0], 0)
        assert entry[0] != "Flush" or unanswered == 0
    assert [e for e in log if e[0] == "Acknowledge"] == [("Acknowledge", n) for n in range(len(batches) + 1)]
    if view_index is not None:  # the runtime did not wait for Acknowledged before Load
        for number in range(2, len(batches) + 1):
            sent = log.index(("Acknowledge", number - 1))
            answered = next(i for i in range(sent, len(log)) if log[i][0] == "Acknowledged")
            first_load = next(i for i in range(log.index(("-- batch", number)), len(log)) if log[i][0] == "Load")
            assert first_load < answered
    for txn, batch in zip(txns[1:], batches, strict=True):
        names = [entry[0] for entry in txn]
        flush = names.index("Flush")
        assert names.count("Flush") == 1 and names.count("StartCommit") == 1
        assert names.index("StartCommit") > max(i for i, n in enumerate(names) if n in ("Flush", "Store", "Load"))
        loads = [entry[2] for entry in txn if entry[0] == "Load"]
        loaded = {entry[2] for entry in txn if entry[0] == "Loaded"}
        assert all(entry[1] == view_index for entry in txn if entry[0] in ("Load", "Loaded"))  # never a delta binding
        assert len(loads) == len(set(loads))  # each key at most once
        stores = [entry for entry in txn if entry[0] == "Store"]
        if view_index is None:
            assert loads == []
        else:
            touched = {change for unit in batch for change in _keys(unit)}
            assert set(loads) <= touched
            assert loaded == set(loads) & live  # Loaded only for keys the store holds
            assert all(names.index("Load") < flush for _ in loads[:1])
            view_stores = {entry[2]: entry for entry in stores if entry[1] == view_index}
            assert set(view_stores) == set(loads)  # every loaded key stored once
            assert all(entry[3] == (entry[2] in loaded) for entry in view_stores.values())  # exists
            for key, entry in view_stores.items():
                if entry[4]:
                    live.discard(key)
                else:
                    live.add(key)
        assert any(entry[1] == delta_index for entry in stores)  # deltas are stored too
    assert_store_equals_reference(driver_case, pipeline, units)


def _keys(unit: Sequence[SourceEvent]) -> list[tuple[Any, ...]]:
    return [(event.row["player_name"],) for event in unit]


def test_missing_keys_are_not_loaded(view_case: DriverCase) -> None:
    pipeline = make_pipeline(view_case.settings)
    harness = Harness(pipeline)
    alice = SourceEvent(Op.APPEND, {"player_name": "alice", "score": 5}, (1, 0, 0))
    bob = SourceEvent(Op.APPEND, {"player_name": "bob", "score": 7}, (2, 0, 1))
    harness.batch([[alice]])
    harness.batch([[SourceEvent(Op.RETRACT, alice.row, (3, 0, 2))], [bob]])
    harness.close()
    first, second = harness.transactions()[1:]
    assert [e for e in first if e[0] == "Load"] == [("Load", 0, ("alice",))]
    assert [e for e in first if e[0] == "Loaded"] == []
    assert [e for e in second if e[0] == "Loaded"] == [("Loaded", 0, ("alice",))]
    stores = {e[2]: e for e in second if e[0] == "Store" and e[1] == 0}
    assert stores[("alice",)][3:] == (True, True)  # existed, deleted
    assert stores[("bob",)][3:] == (False, False)
    assert view_case.read_view is not None
    assert view_case.read_view() == {("bob",): {"player_name": "bob", "total": 7, "best": 7, "n": 1, "latest": 7}}


def test_empty_transactions(driver_case: DriverCase) -> None:
    pipeline = make_pipeline(driver_case.settings)
    harness = Harness(pipeline)
    units = changelog(200, 20)
    harness.batch(units)
    harness.runtime.settle()  # applied (parquet applies at Acknowledge)
    before = driver_case.read_view() if driver_case.read_view else None
    harness.batch([])
    harness.batch([])
    harness.close()
    for txn in harness.transactions()[2:]:
        names = [e[0] for e in txn]
        assert "Load" not in names and "Store" not in names
        assert names.count("Flush") == 1 and names.count("StartCommit") == 1
    assert harness.committed.batch == 3 and harness.driver.settings.materialization in harness.committed.driver_checkpoints
    if driver_case.read_view:
        assert driver_case.read_view() == before
    assert_store_equals_reference(driver_case, pipeline, units)


@pytest.mark.parametrize("step", CRASH_STEPS)
def test_restart_after_a_crash(driver_case: DriverCase, step: str) -> None:
    pipeline = make_pipeline(driver_case.settings)
    harness = Harness(pipeline)
    units = changelog(1200, 80, seed=3)
    batches = batches_of(units, seed=9)
    crash_at = 4
    for number, batch in enumerate(batches, start=1):
        if number == crash_at:
            crash = "after_start_commit" if step == "after_stores" else step
            if step == "after_stores":  # stores sent, StartCommit never answered: drop before it
                harness.driver.start_commit = _dies  # type: ignore[method-assign]
                with pytest.raises(_Crash):
                    harness.batch(batch)
                harness.crash()
            else:
                harness.batch(batch, crash=crash)
            if step in ("after_stores", "after_start_commit"):  # Kafka never committed: replay it
                harness.batch(batch)
        else:
            harness.batch(batch)
    harness.close()
    assert harness.log.count(("-- crash",)) == 1
    assert_store_equals_reference(driver_case, pipeline, units)


class _Crash(Exception):
    pass


def _dies(request: p.StartCommit) -> p.StartedCommit:
    raise _Crash


def test_a_zombie_cannot_commit(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    for name in [n for n in VIEW_DRIVERS if n != "parquet"]:  # remote-authoritative drivers
        case = _case(name, request, tmp_path)
        pipeline = make_pipeline(case.settings)
        old = Harness(pipeline)
        units = changelog(300, 30)
        old.batch(units[:100])
        new = Harness(pipeline, kafka=old)  # a second instance opens: the nonce moves
        with pytest.raises(p.DriverFencedError):
            old.batch(units[100:200])
        new.batch(units[100:])
        new.close()
        assert case.read_view is not None
        assert case.read_view() == expected(pipeline, units), name


def test_parquet_staging_is_never_applied_twice(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    case = _case("parquet", request, tmp_path)
    root = Path(case.settings["path"])
    pipeline = make_pipeline(case.settings)
    units = changelog(400, 40)
    harness = Harness(pipeline)
    harness.batch(units[:150])
    harness.runtime.settle()
    applied = sorted(f.name for f in (root / "scores").iterdir())
    # A zombie stages a batch that Kafka never commits; a new instance opens meanwhile.
    zombie = Harness(pipeline, kafka=harness)
    zombie.runtime.commit(  # stages and references a batch that Kafka never commits
        replace(harness.committed, batch=2), [], [{"player_name": "z", "_count": 1}], zombie.reducer.view
    )
    staged_before = list((root / STAGING).rglob("*.parquet"))
    assert staged_before
    harness.start()  # the live instance re-opens: the zombie's staging is removed, not applied
    assert not any(f.exists() for f in staged_before)
    assert sorted(f.name for f in (root / "scores").iterdir()) == applied
    harness.runtime.acknowledge(harness.committed.batch)  # applying the committed batch again: a no-op
    harness.runtime.acknowledge(harness.committed.batch)
    harness.runtime.settle()
    assert sorted(f.name for f in (root / "scores").iterdir()) == applied
    harness.batch(units[150:])
    harness.close()
    assert_store_equals_reference(case, pipeline, units)


def test_matches_the_reference_on_a_random_changelog(driver_case: DriverCase) -> None:
    pipeline = make_pipeline(driver_case.settings)
    harness = Harness(pipeline)
    units = changelog(3000, 200, seed=23)
    for batch in batches_of(units, seed=2):
        harness.batch(batch)
    harness.close()
    assert_store_equals_reference(driver_case, pipeline, units)


def test_a_top_n_view(view_case: DriverCase) -> None:
    settings = {k: v for k, v in view_case.settings.items() if k != "delta"}
    pipeline = make_pipeline(settings, {"top_n": {"n": 3, "order_by": {"score": "desc"}}})
    harness = Harness(pipeline)
    units = changelog(500, 40, seed=4)
    for batch in batches_of(units, seed=4):
        harness.batch(batch)
    harness.close()
    assert view_case.read_view is not None
    assert view_case.read_view() == expected(pipeline, units)


def test_a_store_behind_kafka_is_backfilled(view_case: DriverCase, tmp_path: Path) -> None:
    """A materialization added to a running pipeline: the next batch stores the whole view."""
    pipeline_without = parse_pipeline(
        {"pipeline": "conf", "source": {"topic": "scores"}, "view": {"key": ["player_name"], "columns": COLUMNS},
         "outputs": {"view": {"topic": "conf.view"}}}
    )
    units = changelog(600, 50, seed=8)
    reducer = make_reducer(pipeline_without.view)
    for unit in units[:400]:
        reducer.apply(unit)
    reducer.take_deltas()
    pipeline = make_pipeline({k: v for k, v in view_case.settings.items() if k != "delta"})
    harness = Harness(pipeline)
    harness.committed = replace(harness.committed, batch=7)  # Kafka has 7 batches; the store none
    harness.state = dict((k, v) for k, v in reducer.take_state_changes() if v is not None)
    harness.start()
    harness.batch(units[400:])
    harness.close()
    assert ("StartCommit", 8, True) in harness.log  # a full refresh
    assert view_case.read_view is not None
    assert view_case.read_view() == expected(pipeline, units)


def test_bad_settings_fail_at_open(tmp_path: Path) -> None:
    cases = {
        "path": {"driver": "sqlite", "path": str(tmp_path / "missing" / "x.db")},
        "path ": {"driver": "parquet", "path": str(tmp_path / "missing")},
        "url": {"driver": "webhook", "url": "http://127.0.0.1:9/hook", "timeout": 2},
    }
    for setting, settings in cases.items():
        harness_pipeline = make_pipeline(settings)
        with pytest.raises(ConfigError, match=rf"outputs\.materialize\[0\]\.{setting.strip()}: "):
            Harness(harness_pipeline)
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]\.pathh: unknown setting"):
        Harness(make_pipeline({"driver": "sqlite", "pathh": "x.db"}))
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]\.driver: unknown driver 'oracle'"):
        Harness(make_pipeline({"driver": "oracle"}))
    with pytest.raises(ConfigError, match=r"outputs\.materialize\[0\]: .*view.*webhook takes delta updates only"):
        Harness(make_pipeline({"driver": "webhook", "url": "http://127.0.0.1:9/", "view": "v"}))


def test_webhook_retries_and_the_idempotency_key(receiver: Receiver) -> None:
    case_settings = {"driver": "webhook", "url": receiver.url, "delta": "d", "backoff": 0.01, "parallelism": 2}
    pipeline = make_pipeline(case_settings)
    harness = Harness(pipeline)
    receiver.fail_next = 3  # the first three POSTs get 503: retried with backoff
    units = changelog(200, 30)
    harness.batch(units[:100])
    harness.batch(units[100:])
    harness.close()
    keys = [key for key, _ in receiver.posts]
    assert sorted(keys) == ["conf-0-1-0", "conf-0-1-1", "conf-0-2-0", "conf-0-2-1"]
    assert fold_deltas(pipeline.view, receiver.rows()) == expected(pipeline, units)
    receiver.fail_next = 10_000  # a part that never goes through fails the transaction
    harness = Harness(make_pipeline({**case_settings, "attempts": 2}))
    with pytest.raises(p.DriverError, match="failed to commit"):
        harness.batch(units[:10])
    harness.close()
