"""Test doubles that ship with Refold: a seeded changelog generator.

Used by the tests, the chaos harness and the benchmarks. Every changelog it
makes is valid (retractions only of live rows, each `-C` right before its `+C`
for the same key) unless asked for bad records too.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Workload:
    events: int = 10_000
    keys: int = 1_000
    retract_share: float = 0.2  # share of retractions and corrections together
    hot_share: float = 0.2  # share of events that go to the hottest 1% of keys
    seed: int = 7
    key_column: str = "player_name"
    teams: int = 3  # how many values `team` takes (3: red, blue, green; more: team0, team1, …)
    start_time: int = 1_700_000_000_000
    time_column: str | None = None  # a column each row carries its event time in (a windowed view's `time`)
    live_rows: int | None = None  # past this many live rows the oldest are forgotten (never retracted):
    # memory bounded for long runs (None: every live row may be retracted, memory grows with them)


def generate(workload: Workload) -> Iterator[dict[str, Any]]:
    """Yield event records (`op` as code, `event_time`, row columns) in order."""
    rng = random.Random(workload.seed)
    live: dict[str, list[dict[str, Any]]] = {}
    live_keys: list[str] = []
    where: dict[str, int] = {}  # key -> index in live_keys, for O(1) removal
    oldest: deque[tuple[str, dict[str, Any]]] = deque()  # (`live_rows`) rows in the order they were added
    count = 0  # live rows
    hot = max(1, workload.keys // 100)
    t = workload.start_time

    def new_row(key: str, event_time: int) -> dict[str, Any]:
        nonlocal count
        row = _row(rng, key, workload.key_column, workload.teams)
        if workload.time_column is not None:
            row[workload.time_column] = event_time
        if workload.live_rows is not None:
            oldest.append((key, row))
        count += 1
        return row

    def gone(key: str) -> None:  # the key's last live row went
        del live[key]
        last = live_keys.pop()
        if last != key:
            live_keys[where[key]] = last
            where[last] = where[key]
        del where[key]

    def forget() -> None:  # the oldest rows still live, past `live_rows`
        nonlocal count
        while workload.live_rows is not None and count > workload.live_rows:
            key, row = oldest.popleft()
            rows = live.get(key, [])
            for index, held in enumerate(rows):
                if held is row:
                    del rows[index]
                    count -= 1
                    if not rows:
                        gone(key)
                    break

    produced = 0
    while produced < workload.events:
        t += rng.randint(0, 20)
        event_time = t - rng.randint(0, 50) if rng.random() < 0.05 else t  # some go backwards
        if live_keys and rng.random() < workload.retract_share:
            key = live_keys[rng.randrange(len(live_keys))]
            rows = live[key]
            row = rows.pop(rng.randrange(len(rows)))
            count -= 1
            if rng.random() < 0.5 or produced + 2 > workload.events:
                yield {"op": "-R", "event_time": event_time, **row}
                produced += 1
            else:
                new = new_row(key, event_time)
                rows.append(new)
                yield {"op": "-C", "event_time": event_time, **row}
                yield {"op": "+C", "event_time": event_time, **new}
                produced += 2
            if not rows:
                gone(key)
            forget()
            continue
        if rng.random() < workload.hot_share:
            index = rng.randrange(hot)
        else:
            index = rng.randrange(workload.keys)
        key = f"k{index:07d}"
        row = new_row(key, event_time)
        if key not in live:
            live[key] = []
            where[key] = len(live_keys)
            live_keys.append(key)
        live[key].append(row)
        yield {"op": "+A", "event_time": event_time, **row}
        produced += 1
        forget()


def _row(rng: random.Random, key: str, key_column: str, teams: int = 3) -> dict[str, Any]:
    return {
        key_column: key,
        "score": rng.randint(0, 1000),
        "bonus": None if rng.random() < 0.1 else round(rng.uniform(0, 10), 2),
        "team": rng.choice(_TEAMS) if teams == 3 else f"team{rng.randrange(teams)}",
    }


_TEAMS = ("red", "blue", "green")
