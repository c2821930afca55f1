"""What the chaos harness runs: the pipelines it writes (a grouped view, a Top-N view
that re-groups in shards, a grouped view of an upsert topic, the upsert one also into
lakehouse tables, a windowed view with a lateness over an out-of-order topic of its
own, and revenue per region over a join of two topics of its own, orders and customers)
and the input it feeds them in chunks."""

from __future__ import annotations

import resource
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import yaml
from confluent_kafka import KafkaException

from refold.cli.produce import produce
from refold.dev import joinload
from refold.dev.windowload import WindowWorkload
from refold.errors import RefoldError, UserError
from refold.kafka.io import TopicSpec, ensure_topics
from refold.kafka.transactions import TransactionalWriter
from refold.model import jsonbytes
from refold.ops.verify import verify

GROUPED = {
    "total": {"sum": "score"},
    "games": {"count": "*"},
    "mean": {"avg": "score"},
    "best": {"max": "score"},
    "worst": {"min": "score"},
    "opening": {"first": "score"},
    "latest": {"last": "score"},
    "teams": {"set": "team"},
}
# each team's best 3 over the topic keyed by player: it re-groups in shards (refold.runtime.exchange), as
# many as the source has partitions (`shards` left at its default)
TOP_N = {"n": 3, "order_by": {"score": "desc"}, "partition_by": ["team"]}
UPSERT = {"rows": {"count": "*"}, "total": {"sum": "score"}, "best": {"max": "score"}, "teams": {"set": "team"},
          "latest": {"last": "score"}}  # per player, over the upsert topic (one row a player)
# the windowed pipeline's input (`refold.dev.windowload`): a 1 min tumble per player with 1 min of lateness,
# 5 % of the appends late by up to 2 min (within the horizon or beyond it), late corrections and retractions
WINDOW_MS = 60_000


def window_workload(events: int, keys: int, seed: int) -> WindowWorkload:
    """The windowed pipeline's input: `events` over 100 horizons, at most 1,000 players
    (a window then holds a few rows of a player)."""
    return WindowWorkload(events=events, keys=max(1, min(keys, 1_000)), window_ms=WINDOW_MS, lateness_ms=WINDOW_MS,
                          seed=seed)


def chunks(rows: Sequence[bytes], parts: int) -> Iterator[Sequence[bytes]]:
    """`rows` in about `parts` slices, never cut between a `-C` and its `+C`."""
    size = max(1, len(rows) // max(1, parts))
    start = 0
    while start < len(rows):
        end = min(len(rows), start + size)
        while end < len(rows) and orjson.loads(rows[end - 1]).get("op") == "-C":
            end += 1
        yield rows[start:end]
        start = end


def upsert_records(rows: Sequence[bytes]) -> list[tuple[bytes, bytes | None]]:
    """A changelog chunk as upsert records keyed by player: `+A`/`+C` put the row (the
    player's latest), `-R` a tombstone, `-C` nothing."""
    out: list[tuple[bytes, bytes | None]] = []
    for raw in rows:
        event = orjson.loads(raw)
        op = event.pop("op")
        event.pop("event_time", None)
        key = jsonbytes.dumps({"player_name": event["player_name"]})
        if op in ("+A", "+C"):
            out.append((key, jsonbytes.dumps(event)))
        elif op == "-R":
            out.append((key, None))
    return out


CACHE_KEYS = 2_000  # the grouped pipeline's `spark.state_cache_keys` (its shards hold several times that)


def write_pipelines(kinds: Sequence[str], directory: Path, source: str, bootstrap: str, *, batch: int,
                    master: str | None = None, upsert_source: str = "", lakehouse: Sequence[str] = (),
                    window_source: str = "", window: WindowWorkload | None = None,
                    join: JoinFeed | None = None) -> list[Path]:
    """One pipeline file per kind (`grouped`, `top_n`, `upsert`, `window`: a tumble
    view with a lateness over `window_source`, per player, with its deltas; `join`:
    `joinload.JOIN_VIEW` over the topics of `join`, with its deltas) in `directory`; the
    upsert pipeline (else the grouped one) also materializes into a table of each
    `lakehouse` driver (`delta`, `iceberg`) under `directory/lake`, its view and its
    deltas. (A materialization reads view changes in Python: the changelog's grouped
    view stays on the native core, `refold.runtime.native`, where the upsert view, a
    table source, reduces in Python anyway.) The grouped pipeline keeps `CACHE_KEYS`
    keys a shard in memory, far fewer than it has: a shard starts empty and reloads from
    its store every few batches, through the faults too (a batch read natively past that
    point once committed nothing)."""
    paths = []
    lake = directory / "lake"
    lake_kind = "upsert" if "upsert" in kinds else "grouped"  # (a windowed view is not materialized)
    for kind in kinds:
        name = f"chaos-{kind}-{uuid.uuid4().hex[:6]}"
        views: dict[str, dict[str, Any]] = {
            "grouped": {"key": ["player_name"], "columns": GROUPED},
            "top_n": {"top_n": TOP_N},
            "upsert": {"key": ["player_name"], "columns": UPSERT},
            "window": (window or window_workload(1, 1, 1)).view("tumble"),
            "join": joinload.JOIN_VIEW,
        }
        view = views[kind]
        sources = {"upsert": {"topic": upsert_source, "form": "upsert"}, "window": {"topic": window_source},
                   "top_n": {"topic": source, "key": ["player_name"]}}
        spec: dict[str, Any] = {
            "pipeline": name,
            "kafka": {"bootstrap.servers": bootstrap},
            **({"sources": {"orders": {"topic": join.topics[0]}, "customers": {"topic": join.topics[1]}}}
               if kind == "join" and join is not None else {"source": sources.get(kind, {"topic": source})}),
            "view": view,
            "outputs": {"view": {"topic": f"{name}.view"}},
            "trigger": "200ms",
            "max_batch_events": batch,
            "spark": {"checkpoint_dir": str(directory / "spark" / name), "state_dir": str(directory / "state")},
        }
        if kind == "grouped":  # past its key cache every few batches: the shards start empty and reload
            spec["spark"]["state_cache_keys"] = CACHE_KEYS
        if master is not None:
            spec["spark"]["master"] = master
            spec["spark"]["conf"] = {"spark.executor.cores": "1", "spark.executor.memory": "512m",
                                     "spark.cores.max": "2"}
        if kind != "top_n":  # delta updates are defined for grouped views only
            spec["outputs"]["delta"] = {"topic": f"{name}.delta"}
        if kind == lake_kind and lakehouse:
            spec["outputs"]["materialize"] = [_table(driver, lake, kind) for driver in lakehouse]
        path = directory / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        paths.append(path)
    return paths


def _table(driver: str, lake: Path, kind: str) -> dict[str, Any]:
    """A materialization entry: the view and the deltas in tables `<kind>_view`,
    `<kind>_deltas` of a Delta Lake folder or a local Iceberg catalog."""
    folder = lake / driver
    folder.mkdir(parents=True, exist_ok=True)
    where = {"path": str(folder)} if driver == "delta" else {"warehouse": str(folder)}
    return {"driver": driver, **where, "view": f"{kind}_view", "delta": f"{kind}_deltas"}


def half_of(rows: Sequence[bytes]) -> int:
    """Where a chunk splits in two: its middle, moved on past a `+C` so that no correction
    pair is cut."""
    cut = len(rows) // 2
    while cut < len(rows) and orjson.loads(rows[cut]).get("op") == "+C":
        cut += 1
    return cut


def halved(rows: Sequence[bytes], half: int | None) -> Sequence[bytes]:
    """`rows` whole (`half` None), or their first (0) or second (1) half (`half_of`)."""
    if half is None:
        return rows
    cut = half_of(rows)
    return rows[cut:] if half == 1 else rows[:cut]


def produce_chunk(settings: dict[str, Any], topic: str, rows: Sequence[bytes], partitions: int, say: Any,
                  key: Sequence[str] = ("player_name",)) -> None:
    """Produce one chunk, retrying while the broker is still coming back from a restart
    (its transaction coordinator loading): a failed init_transactions wrote nothing."""
    for attempt in range(1, 6):
        try:
            produce(settings, topic, rows, list(key), partitions=partitions,
                    per_transaction=10_000, prevalidate=False, progress=False)
            return
        except UserError as exc:
            # a transaction that could not start, or that the cluster did not take (aborted)
            retry = ("cannot start a Kafka transaction" in str(exc) or "cannot initialise transactions" in str(exc)
                     or "nothing of it is visible" in str(exc))
            if attempt == 5 or not retry:
                raise
            say(f"  producing a chunk failed ({exc}); again in 5s")
            time.sleep(5)


def produce_upserts(settings: dict[str, Any], topic: str, records: Sequence[tuple[bytes, bytes | None]],
                    partitions: int, say: Any) -> None:
    """Write upsert records in one transaction (partitioned by key, as a producer of a
    table does). Starting the transaction is retried while the broker comes back from
    a restart (nothing is written then); a failed commit is not (it may have landed)."""
    ensure_topics(settings, [TopicSpec(topic, partitions)])
    writer = TransactionalWriter(settings, f"chaos-upserts-{uuid.uuid4()}", timeout_ms=60_000)
    try:
        for attempt in range(1, 6):
            try:
                writer.initialise()
                break
            except (RefoldError, KafkaException) as exc:
                if attempt == 5:
                    raise
                say(f"  starting the upsert records' transaction failed ({exc}); again in 5s")
                time.sleep(5)
        writer.begin()
        for key, value in records:
            writer.send(topic, key, value)
        writer.commit()
    finally:
        writer.close()


class JoinFeed:
    """The join pipeline's input (`refold.dev.joinload`): `events` order events over
    `events // 20` customers (at least 10, at most `keys`) in 20 regions, written to
    its two topics (keyed by `id`) chunk by chunk in the order they were made, and what
    its view must end as: the reference join and grouped view
    (`joinload.reference_view`) up to `REFERENCE_LIMIT` records, past that the join of
    the live rows (`joinload.expected_view`; the reference recomputes a region's sums
    over all its rows at every record, too slow for millions)."""

    REFERENCE_LIMIT = 50_000

    def __init__(self, events: int, keys: int, seed: int) -> None:
        tag = uuid.uuid4().hex[:6]
        self.topics = (f"chaos-orders-{tag}", f"chaos-customers-{tag}")
        self.workload = joinload.JoinWorkload(orders=events, customers=max(10, min(keys, events // 20)), seed=seed)
        self.records = list(joinload.generate_join(self.workload))
        self.parts: list[tuple[list[bytes], list[bytes]]] = []

    @property
    def events(self) -> int:
        return len(self.records)

    def cut(self, parts: int) -> None:
        self.parts = list(joinload.join_chunks(self.records, parts))

    def write(self, settings: dict[str, Any], index: int, last: bool, partitions: int, say: Any,
              half: int | None = None) -> None:
        """Write chunk `index` of both topics (the last chunk: every chunk left; `half` 0 or
        1: the first or the second half of each topic's part of it)."""
        if index == 0:  # both topics before any engine starts (the first chunks hold customers only)
            ensure_topics(settings, [TopicSpec(topic, partitions) for topic in self.topics])
        for chunk in self.parts[index:] if last else self.parts[index:index + 1]:
            for topic, rows in zip(self.topics, chunk, strict=True):
                if part := halved(rows, half):
                    produce_chunk(settings, topic, part, partitions, say, key=("id",))

    def verify(self, pipeline: Any, settings: dict[str, Any]) -> Any:
        """The pipeline's outputs against the expected view (`joinload.check_join`)."""
        if self.events <= self.REFERENCE_LIMIT:
            expected, refused = joinload.reference_view(self.records)
            assert not refused, "the reference refused join input the generator made"
        else:
            expected = joinload.expected_view(self.records)
        return joinload.check_join(pipeline, settings, expected, self.events)


def verify_pipeline(pipeline: Any, settings: dict[str, Any], feed: JoinFeed | None) -> tuple[Any, int]:
    """One chaos pipeline's outputs against the reference (`refold.ops.verify`; the join
    pipeline's against its feed's expected view), and the peak memory the check took
    (bytes). The harness runs it in a process of its own per pipeline: the reference and a
    million records' outputs read back take gigabytes, which a Python process keeps once
    it had them (one process verifying five pipelines of `make chaos`'s defaults one after
    the other grew past 20 GB)."""
    if feed is not None:
        report = feed.verify(pipeline, settings)
    else:
        report = verify(pipeline, settings, dead_letters=pipeline.view.window is not None)
    return report, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux: KiB)
