"""A windowed view's live state over time, with a lateness: is it bounded by the horizon?

Streams a seeded changelog (`refold.dev.testing.Workload`, each row's time in `at`, as
`bench.hotpath --view tumble` has it) through the native core of the bench's grouped
view per tumbling window (`refold_native.WindowCore`, one per shard as the engine keys
them), batch by batch, without Spark, a broker or a store, and keeps each shard's live
`P.state` records (the state records each batch writes, a tombstone deleting one). The
lateness is the horizon: `--horizons` of them span the events' times. One horizon's
worth is each shard's live state at the end of the first batch that reaches past the
first horizon (the watermark has moved at most a batch past the first event's time:
next to nothing has closed); it is set against the largest live state at the end of
any later batch: a bounded state stays under `--bound` times it (exit status 1
otherwise). Live state: records, and bytes of key + value. A retraction of a row whose
window closed is a dead letter `late`, and a later retraction of the `+C` of such a
refused correction one `not live`: both counted, neither changes the state.

    python -m bench.winstate [--events 10000000] [--keys 20000] [--horizons 100]
                             [--window 1m] [--batch N] [--shards 4] [--live-rows 200000]

The input's memory stays bounded over 10M events: each row carries its time
(`Workload.time_column`), and the generator forgets its oldest live rows past
`--live-rows` (never retracted after). Retractions still reach rows many horizons back
(dead letters `late`). Timing the rows afterwards (`bench.hotpath.timed`) held about
3 GB per million events, and the 10M run did not fit in 24 GiB.

The events' times advance about 9.1 ms per event (`generate`), so `--events` and
`--horizons` set the lateness: the events' time span / horizons, in whole seconds (the
printed span says how many horizons it was).
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from bench.hotpath import windowed_spec
from bench.run import pipeline
from refold.dev.testing import Workload, generate
from refold.model.changelog import Op
from refold.reduce import SourceEvent
from refold.runtime.native import native_core

OPS = {"+A": Op.APPEND, "-R": Op.RETRACT, "-C": Op.CORRECT_FROM, "+C": Op.CORRECT_TO}
MEAN_STEP_MS = 9.1  # generate's event times: randint(0, 20) ms a step, a tenth of the steps two events


@dataclass
class Shard:
    """One shard's core and its live `P.state` records (key -> bytes of key + value)."""

    core: Any
    live: dict[bytes, int] = field(default_factory=dict)
    size: int = 0
    first: tuple[int, int] | None = None  # (records, bytes) after the first horizon
    peak: tuple[int, int] = (0, 0)  # the largest (records, bytes) after it
    offset: int = 0
    late: int = 0  # units dead-lettered `late` (a retraction of a row whose window closed)
    not_live: int = 0  # and `not live` (a retraction of the `+C` of a unit refused `late`)

    def apply(self, units: list[list[tuple[SourceEvent, None]]]) -> None:
        self.core.touched(units)
        rejected, _view, _delta, state = self.core.apply_batch(units)[:4]
        for refused in rejected:
            if refused[2] == "late":
                self.late += 1
            elif refused[2] == "not live":
                self.not_live += 1
            else:
                raise SystemExit(f"a unit refused: {refused}")
        for key, value in state:
            self.size -= self.live.pop(key, 0)
            if value is not None:
                self.live[key] = len(key) + len(value)
                self.size += self.live[key]

    def measure(self, past_first: bool) -> None:
        now = (len(self.live), self.size)
        if not past_first:
            self.first = now
        elif now[1] > self.peak[1]:
            self.peak = now


def units_of(events: Iterator[dict[str, Any]], shards: int, key_column: str) -> Iterator[tuple[int, int, list[dict[str, Any]]]]:
    """(shard, event time, unit) in input order: a `-C` with its `+C` is one unit."""
    pending: list[dict[str, Any]] = []
    for event in events:
        pending.append(event)
        if event["op"] == "-C":
            continue
        shard = zlib.crc32(orjson.dumps({key_column: pending[0][key_column]})) % shards
        yield shard, max(e["at"] for e in pending), pending
        pending = []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--horizons", type=int, default=100)
    parser.add_argument("--window", default="1m", help="the tumbling window's size")
    parser.add_argument("--batch", type=int, default=None,
                        help="events per batch, all shards (default: a quarter of a horizon's, so that the first "
                             "measure is taken within a quarter horizon past the first)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--bound", type=float, default=2.0)
    parser.add_argument("--live-rows", type=int, default=200_000,
                        help="the generator's live rows kept for retraction (its memory's bound; 0: all)")
    args = parser.parse_args(argv)
    workload = Workload(events=args.events, keys=args.keys, time_column="at", live_rows=args.live_rows or None)
    horizon_s = max(1, round(args.events * MEAN_STEP_MS / 1000 / args.horizons))
    if args.batch is None:
        args.batch = max(1000, args.events // args.horizons // 4)
    spec = pipeline("winstate", "winstate-source", "127.0.0.1:1", args.batch, spark={"core": "native"})
    spec = windowed_spec(spec, "tumble", f"{horizon_s}s", size=args.window)
    shards = [Shard(native_core(spec)) for _ in range(args.shards)]
    first_end = workload.start_time + horizon_s * 1000
    batch: list[list[list[tuple[SourceEvent, None]]]] = [[] for _ in shards]
    in_batch = 0
    past_first = False
    latest = workload.start_time
    started = time.process_time()

    def flush() -> None:
        nonlocal in_batch
        for shard, units in zip(shards, batch, strict=True):
            if units:
                shard.apply(units)
            shard.measure(past_first)
            units.clear()
        in_batch = 0

    for index, at, unit in units_of(generate(workload), args.shards, workload.key_column):
        shard = shards[index]
        events = []
        for event in unit:
            row = {k: v for k, v in event.items() if k not in ("op", "event_time")}
            events.append((SourceEvent(OPS[event["op"]], row, (event["event_time"], index, shard.offset)), None))
            shard.offset += 1
        batch[index].append(events)
        in_batch += len(unit)
        latest = max(latest, at)
        if in_batch >= args.batch:
            flush()
            if not past_first and latest >= first_end:
                past_first = True  # this batch's state is the first horizon's
    flush()
    spent = time.process_time() - started
    span_s = (latest - workload.start_time) / 1000
    print(f"windowed live state: {args.events:,} events, {args.keys:,} keys, tumble {args.window}, lateness "
          f"{horizon_s}s (the horizon), event times over {span_s:,.0f} s = {span_s / horizon_s:.0f} horizons, "
          f"{args.shards} shards, batch {args.batch:,}; {spent:.0f} CPU s")
    worst = 0.0
    for number, shard in enumerate(shards):
        assert shard.first is not None
        ratio = shard.peak[1] / shard.first[1] if shard.first[1] else float("inf")
        worst = max(worst, ratio)
        print(f"shard {number}: first horizon {shard.first[0]:,} records {shard.first[1]:,} B; largest after it "
              f"{shard.peak[0]:,} records {shard.peak[1]:,} B ({ratio:.2f}x); at the end {len(shard.live):,} records "
              f"{shard.size:,} B, {len(shard.core):,} windows held; {shard.late:,} units late, {shard.not_live:,} not live")
    print(f"largest / first horizon's live state, worst shard: {worst:.2f}x (bound {args.bound}x): "
          f"{'bounded' if worst < args.bound else 'NOT bounded'}")
    return 0 if worst < args.bound else 1


if __name__ == "__main__":
    sys.exit(main())
