"""One shard path's hot loop alone: CPU per event of the reduction without Spark or a commit.

Spark only fetches records; the engine's time goes into each shard's `ShardProcessor`
(decode, pair, merge, reduce, render, state records), which runs in a Spark task on an
executor (`refold.spark.tasks`). This runs exactly that, through `BatchProcessor` (one
`ShardProcessor` per source partition, each shard's batch between `resume()` and
`suspend()` as `refold.runtime.processor._run_shard` runs it), over a seeded changelog
(`refold.dev.testing.Workload`) already in memory, with `_commit` replaced by a count
of what would be sent, and prints the process CPU seconds of the best of `--repeat`
runs (all of the process's threads: RocksDB's included).

`--store rocksdb` (the default) keeps each shard's state in a real local RocksDB
store (`refold.state`) in a fresh temporary directory per run, as the engine does:
what the engine pays per batch is in the figure — opening the store (`resume`) and
closing it (`suspend`), loading the batch's touched keys the reducer does not hold
(`_load`; within one run the reducer keeps the keys it loaded, as a Python worker's
kept processor does, up to `spark.state_cache_keys`), and writing the batch's state
changes with the stamp after the commit (`_stamp`, which also asks the broker for
`P.state`'s high watermark: a round trip, little CPU). `--store memory` overrides those
as the at-least-once baseline does (`bench.baseline.SparkSinkShard`: the reducer holds
everything, no store): the reduction alone, comparable with the figures before the
local store existed. Use it to compare two versions of the code (run each on the same
machine, one after the other): CPU seconds are less noisy than wall time on a shared
machine, not free of noise.

Needs a broker for the processors' start (their transactional producers are
initialised and the empty checkpoints and `P.state` read): the local one is started
when none is running.

    python -m bench.hotpath [--events 200000] [--keys 20000] [--batch 100000] [--repeat 2]
                            [--store rocksdb|memory] [--core python,native] [--commit] [--provenance off]
                            [--view grouped|top_n|tumble|hop|session] [--lateness 10m]
                            [--window-size 1h] [--emit final] [--top-n]
    python -m bench.hotpath --view join [--orders 100000] [--customers 10000] [--batch 10000]
    python -m bench.hotpath --view join-shard [--orders 200000] [--batch 50000] [--core read,decode,python]

`--commit` sends and commits each shard's batch as the engine does (a `BatchProcessor`: its
transactions, the trace index, the stamp), so the figure holds the commit's CPU, the Kafka
client's threads' included; `--provenance off` leaves out the cause headers and the trace
index (`outputs.provenance: off`): with `--commit`, what provenance costs a shard.

`--core` runs each reduction core in turn (`spark.core`; default both, then their
ratio): `python` the Python reducer, `native` the Rust core (`refold_native`).

`--view tumble|hop|session` runs the grouped view per event-time window (docs/windows.md)
over a time column `at` each row carries (its `+A`'s event time, kept by its `-R`/`-C`):
tumble 1m, hop 1m every 30s, session gap 30s (no delta output: a session view has
none), with `--lateness` (default none: no window closes). A core that does not run
the view is said so and left out. The 200,000 events' times span about 33 minutes, so
tumbling 1m windows make about 124,000 (key, window) pairs of 20,000 keys, most
holding one event: each event mostly opens a window, a new key of the grouped core.
`--window-size 1h` puts the whole run in one window, as many pairs as the grouped view
has keys: the windowed twin of `--view grouped` (the windows' own cost alone).
`--emit final` (with a `--lateness`) writes each window's row once, as it closes.
`--top-n` with `--view tumble|hop` ranks instead: each player's best three scores per
window (the `--view top_n` view per window).

`--view join` runs the join's reducers alone, in memory, without a broker
(`bench.hotpath_join`: its own options); `--view join-shard` a join's shard with its
reading and commit, its batches read by the native cores or by the Python readers
(`bench.hotpath_joinshard`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.run import pipeline
from refold.config import Pipeline, ViewSpec
from refold.dev.testing import Workload, generate
from refold.kafka.io import TopicSpec, ensure_topics
from refold.recovery.records import Checkpoint, first_checkpoint
from refold.runtime.batch import InputRecord
from refold.runtime.batch import Outgoing as _Outgoing
from refold.runtime.native import why_not
from refold.runtime.processor import BatchProcessor, ShardProcessor
from refold.spark.job import engine_topics

# `--view top_n`: each player's best three scores (co-partitioned: one shard per partition)
TOP_N_VIEW = ViewSpec.model_validate({"top_n": {"n": 3, "order_by": {"score": "desc"}, "partition_by": ["player_name"]}})
# `--view tumble|hop|session`: the windows of the bench's grouped view over the rows' `at`
WINDOWS: dict[str, dict[str, Any]] = {
    "tumble": {"tumble": "1m"},
    "hop": {"hop": {"size": "1m", "slide": "30s"}},
    "session": {"session": {"gap": "30s"}},
}


class DryShard(ShardProcessor):
    """Reduces like the engine, with its local store; counts the records of each batch
    instead of sending them."""

    sent = 0

    def _commit(self, out: _Outgoing, checkpoint: Checkpoint) -> None:
        self.sent += len(out.view) + len(out.delta) + len(out.state) + len(out.dlq)


class MemoryDryShard(DryShard):
    """A `DryShard` without a local store: its reducer holds every key (`--store memory`)."""

    def lock(self) -> None:
        pass

    def suspend(self) -> None:
        pass

    def resume(self) -> bool:
        return True

    def restore(self) -> None:  # an empty reducer (or core) holding every key, the checkpoint of a first start
        self.checkpoint = first_checkpoint(self.pipeline, self.shard)
        self._forget_reducer()
        self.held_all = True

    def _over_cache(self, wanted: set[Any]) -> bool:
        return False  # it never starts empty again: nothing to load the keys back from

    def _load(self, touched: set[Any], *, forget: bool = True) -> None:
        pass

    def _stamp(self, state: Sequence[tuple[bytes, bytes | None]], checkpoint: Checkpoint) -> None:
        pass


class DryProcessor(BatchProcessor):
    """The engine's shards, each a `DryShard` (or a `MemoryDryShard`)."""

    shard_type: type[ShardProcessor] = DryShard

    def __init__(self, pipeline: Any, settings: dict[str, Any], memory: bool = False) -> None:
        self.shard_type = MemoryDryShard if memory else DryShard
        super().__init__(pipeline, settings)

    @property
    def sent(self) -> int:
        return sum(shard.sent for shard in self.shards.values() if isinstance(shard, DryShard))


def timed(events: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The events with a time column `at` in each row: an added row's event time, which
    its retraction or correction carries too (the same row)."""
    times: dict[bytes, list[int]] = {}
    for event in events:
        row = orjson.dumps({k: v for k, v in event.items() if k not in ("op", "event_time")}, option=orjson.OPT_SORT_KEYS)
        if event["op"] in ("+A", "+C"):
            times.setdefault(row, []).append(event["event_time"])
            yield {**event, "at": event["event_time"]}
        else:
            held = times[row]
            yield {**event, "at": held.pop()}
            if not held:
                del times[row]


def input_records(workload: Workload, partitions: int, windowed: bool = False) -> list[InputRecord]:
    """The workload as the Spark job hands it over: keyed JSON records, partitioned by key
    (`windowed`: each row with its time, `timed`)."""
    records = []
    next_offset = [0] * partitions
    events = generate(workload)
    for event in timed(events) if windowed else events:
        key = orjson.dumps({workload.key_column: event[workload.key_column]})
        partition = zlib.crc32(key) % partitions
        records.append(InputRecord(partition, next_offset[partition], key, orjson.dumps(event), 0))
        next_offset[partition] += 1
    return records


def windowed_spec(spec: Pipeline, kind: str, lateness: str | None, size: str | None = None,
                  emit: str = "per_event", top_n: bool = False) -> Pipeline:
    """The bench's grouped view per `kind` window over `at` (a session view: no delta output);
    `size` a tumbling window's other than 1m; `emit` the view output's; `top_n`: the
    `--view top_n` view per window instead (no delta output)."""
    window: dict[str, Any] = {"time": "at", **WINDOWS[kind]}
    if size is not None:
        if kind != "tumble":
            raise ValueError("--window-size: a tumbling window's only")
        window["tumble"] = size
    if lateness is not None:
        window["lateness"] = lateness
    data = spec.model_dump(mode="json", exclude_unset=True)
    data["view"]["window"] = window
    if kind == "session":
        data["outputs"].pop("delta", None)
    data["outputs"]["view"]["emit"] = emit
    if top_n:
        data["view"] = {**TOP_N_VIEW.model_dump(mode="json", exclude_unset=True), "window": window}
        data["outputs"].pop("delta", None)
    return Pipeline.model_validate(data)


def main(argv: list[str] | None = None) -> int:
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--view")
    chosen, rest = first.parse_known_args(sys.argv[1:] if argv is None else argv)
    if chosen.view == "join":  # the join's reducers (bench.hotpath_join), no broker
        from bench.hotpath_join import main as join_main

        return join_main(rest)
    if chosen.view == "join-shard":  # a join's shard, reading and commit included (bench.hotpath_joinshard)
        from bench.hotpath_joinshard import main as shard_main

        return shard_main(rest)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--retract", type=float, default=0.2)
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--store", choices=("rocksdb", "memory"), default="rocksdb",
                        help="rocksdb: each shard's real local store in a temporary directory (the engine's "
                             "path); memory: no store, the reducer holds everything")
    parser.add_argument("--core", default="python,native",
                        help="the reduction cores to run, one after the other (spark.core: python, native)")
    parser.add_argument("--view", choices=("grouped", "top_n", *WINDOWS), default="grouped",
                        help="grouped: the bench's view (sum, count, max, last per player); top_n: each player's "
                             "best 3 scores; tumble, hop, session: the grouped view per window of the rows' time")
    parser.add_argument("--lateness", default=None,
                        help="a windowed view's lateness (e.g. 10m; default none: no window closes)")
    parser.add_argument("--window-size", default=None,
                        help="--view tumble: the window's size (default 1m; 1h: one window holds the whole run, "
                             "as many (key, window) pairs as the grouped view has keys)")
    parser.add_argument("--emit", choices=("per_event", "final"), default="per_event",
                        help="a windowed view's output: per_event, or final (each window once as it closes; "
                             "needs --lateness)")
    parser.add_argument("--commit", action="store_true",
                        help="send and commit each shard's batch to the broker as the engine does (its "
                             "transaction, the trace index): the commit's CPU in the figure, its threads' too")
    parser.add_argument("--provenance", choices=("on", "off"), default="on",
                        help="off: no cause headers (outputs.provenance: off), what they cost in the hot path")
    parser.add_argument("--top-n", action="store_true",
                        help="--view tumble|hop: each player's best 3 scores per window instead of the grouped view")
    args = parser.parse_args(argv)
    cores = [core.strip() for core in args.core.split(",") if core.strip()]

    from refold.dev.localkafka import ensure_broker

    bootstrap = ensure_broker(None, start_local=True)
    windowed = args.view in WINDOWS
    records = input_records(Workload(events=args.events, keys=args.keys, retract_share=args.retract), 4, windowed)
    name = f"hotpath-{time.strftime('%Y%m%d%H%M%S')}"
    settings: dict[str, Any] = pipeline(name, "hotpath-source", bootstrap, args.batch).kafka_settings(None)
    # the source topic is never read (the records are in memory); its partitions make the shards
    ensure_topics(settings, [TopicSpec("hotpath-source", 4),
                             *engine_topics(pipeline(name, "hotpath-source", bootstrap, args.batch), 4)])
    best: dict[str, float] = {}
    for core in cores:
        runs = []
        for attempt in range(1, args.repeat + 1):
            with tempfile.TemporaryDirectory(prefix="refold-hotpath-") as state_dir:
                spec = pipeline(name, "hotpath-source", bootstrap, args.batch, state_dir=Path(state_dir),
                                spark={"core": core})
                if args.view == "top_n":
                    spec = spec.model_copy(update={"view": TOP_N_VIEW,  # no delta output: grouped views only
                                                   "outputs": spec.outputs.model_copy(update={"delta": None})})
                elif windowed:
                    spec = windowed_spec(spec, args.view, args.lateness, args.window_size, args.emit, args.top_n)
                    if core == "native" and (reason := why_not(spec)) is not None:
                        print(f"native core: not run ({reason})", file=sys.stderr)
                        break
                if args.provenance == "off":
                    spec = spec.model_copy(update={"outputs": spec.outputs.model_copy(update={"provenance": False})})
                if args.commit:  # (a pipeline of its own per run: its transactional ids and offsets start anew)
                    spec = spec.model_copy(update={"pipeline": f"{name}-{core}-{attempt}"})
                    ensure_topics(settings, engine_topics(spec, 4))
                processor = (BatchProcessor(spec, settings) if args.commit
                             else DryProcessor(spec, settings, memory=args.store == "memory"))
                try:
                    started = time.process_time()
                    for start in range(0, len(records), args.batch):
                        processor.process(records[start : start + args.batch])
                    runs.append(time.process_time() - started)
                finally:
                    processor.close()
            sent = "committed" if args.commit else f"{processor.sent:,} records to send"
            print(f"{core} run {attempt}: {runs[-1]:.2f} CPU s, {sent}", file=sys.stderr)
        if not runs:
            continue
        best[core] = min(runs)
        shown = f"{args.view} view" + (", Top-N" if args.top_n else "") + (", emit final" if args.emit == "final" else "")
        print(f"hot path ({shown}, {core} core, {args.store} state): {len(records):,} events, {args.keys:,} keys, "
              f"batch {args.batch:,}: {best[core]:.2f} CPU s (best of {len(runs)}), "
              f"{best[core] / len(records) * 1e6:.1f} µs/event, {len(records) / best[core]:,.0f} events per CPU second")
    if "python" in best and "native" in best:
        print(f"native / python CPU: {best['native'] / best['python']:.3f} "
              f"({best['python'] / best['native']:.1f}x fewer CPU seconds per event)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
