"""A seeded, out-of-order changelog for windowed views: what the windowed crash tests,
the chaos harness's windowed pipeline and `make bench-windows` feed a view with
`window: {time: ts, tumble: …, lateness: …}`.

Rows are `{"player_name": key, "score": n, "ts": epoch ms}`. A stream clock moves
forward unevenly so that the input spans `horizons` horizons of event time (one
horizon: the lateness plus the window size, the span of event time a shard's open
windows cover). Most events are near the clock (a few hundredths of a window behind:
out of order, on time); `late_share` of the appends are late by up to `late_by`
windows, so with a lateness of one window some fall within the horizon (they correct
a window already written) and some beyond it (a `late` dead letter). Corrections
(`-C`/`+C`: a new score, the same time) and retractions (`-R`) pick a live row among
the recent ones, so some of them are late too, within or beyond the horizon. Every
`-C` is right before its `+C`; every retraction names a row the generator appended
and has not retracted (whether the view still holds it is the view's business: a
retraction of a row in a closed window is late).

`late_events` says which events are late by a definition every contender shares: the
window that holds the event's time had already ended when it came (its end is at or
before the largest time seen before it, in input order).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class WindowWorkload:
    events: int = 1_000_000
    keys: int = 1_000
    window_ms: int = 60_000  # the tumble's size
    lateness_ms: int = 60_000  # the view's lateness (the contenders' watermark delay)
    late_share: float = 0.05  # appends late by up to `late_by` windows
    late_by: float = 2.0
    correct_share: float = 0.05  # -C/+C pairs (a new score, the same time)
    retract_share: float = 0.02  # -R
    horizons: float = 100.0  # the event time the input spans, in horizons (lateness + window)
    seed: int = 1
    start_time: int = 1_700_000_000_000

    @property
    def horizon_ms(self) -> int:
        return self.window_ms + self.lateness_ms

    @property
    def step_ms(self) -> float:
        """The clock's mean step per event."""
        return self.horizons * self.horizon_ms / max(1, self.events)

    def view(self, kind: str = "tumble") -> dict[str, Any]:
        """The pipeline's `view` over this input: per player and window, the total,
        count and best score; `kind` tumble (one window) or session (gap: one window)."""
        window: dict[str, Any] = {"time": "ts", "lateness": f"{self.lateness_ms}ms"}
        window |= {"tumble": f"{self.window_ms}ms"} if kind == "tumble" else {"session": {"gap": f"{self.window_ms}ms"}}
        return {"key": ["player_name"], "columns": {"total": {"sum": "score"}, "games": {"count": "*"},
                                                    "best": {"max": "score"}}, "window": window}


def generate_windowed(w: WindowWorkload) -> Iterator[dict[str, Any]]:
    """Yield event records (`op` as code, then the row's columns) in input order."""
    rng = random.Random(w.seed)
    clock = float(w.start_time)
    step = w.step_ms
    jitter = max(1, w.window_ms // 50)
    recent: list[dict[str, Any]] = []  # live rows a retraction or a correction may pick, oldest first
    keep = max(16, int(3 * w.horizon_ms / max(step, 1e-9)))  # about three horizons' worth of rows
    produced = 0
    while produced < w.events:
        clock += rng.uniform(0, 2 * step)
        now = int(clock)
        choice = rng.random()
        if recent and choice < w.retract_share + w.correct_share:
            # mostly a row of the last horizon; now and then an older one
            reach = min(len(recent), max(1, int(keep / 3)) if rng.random() < 0.8 else len(recent))
            row = recent.pop(len(recent) - 1 - rng.randrange(reach))
            if choice < w.retract_share or produced + 2 > w.events:
                yield {"op": "-R", **row}
                produced += 1
                continue
            new = {**row, "score": rng.randint(0, 1000)}
            yield {"op": "-C", **row}
            yield {"op": "+C", **new}
            recent.append(new)
            produced += 2
            continue
        if rng.random() < w.late_share:
            ts = now - rng.randint(1, max(1, int(w.late_by * w.window_ms)))
        else:
            ts = now - rng.randint(0, jitter)
        row = {"player_name": f"k{rng.randrange(w.keys):06d}", "score": rng.randint(0, 1000), "ts": ts}
        recent.append(row)
        if len(recent) > keep:
            del recent[: len(recent) - keep]
        yield {"op": "+A", **row}
        produced += 1


def late_events(records: Sequence[dict[str, Any]], window_ms: int) -> list[bool]:
    """Per record: whether it is late (its tumble window's end is at or before the
    largest time of the records before it)."""
    latest: int | None = None
    out = []
    for record in records:
        ts = record["ts"]
        end = (ts // window_ms + 1) * window_ms
        out.append(latest is not None and end <= latest)
        latest = ts if latest is None else max(latest, ts)
    return out
