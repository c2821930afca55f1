"""The windowed input generator (`refold.dev.windowload`) the windowed crash tests, the
chaos harness and `make bench-windows` feed: what it promises about its input."""

from __future__ import annotations

from collections import Counter

from refold.config import ViewSpec
from refold.dev.windowload import WindowWorkload, generate_windowed, late_events
from refold.model.changelog import Op
from refold.model.reasons import Reason
from refold.reduce import SourceEvent
from refold.reference import merge_partitions, reference_changelog


def test_the_input_is_out_of_order_with_late_events_within_and_beyond_the_horizon() -> None:
    w = WindowWorkload(events=1500, keys=12, window_ms=1000, lateness_ms=1000, horizons=30, seed=5)
    records = list(generate_windowed(w))
    assert len(records) == w.events
    live: Counter[tuple[str, int, int]] = Counter()
    for index, record in enumerate(records):  # each -C right before its +C, each retraction of a generated row
        row = (record["player_name"], record["score"], record["ts"])
        if record["op"] in ("+A", "+C"):
            live[row] += 1
        else:
            assert live[row] > 0, (index, record)
            live[row] -= 1
        if record["op"] == "-C":
            assert records[index + 1]["op"] == "+C" and records[index + 1]["ts"] == record["ts"]
    times = [r["ts"] for r in records]
    span = max(times) - min(times)
    assert 0.9 * w.horizons * w.horizon_ms < span < 1.1 * w.horizons * w.horizon_ms
    late = late_events(records, w.window_ms)
    assert 0 < sum(late) < len(records) // 2
    # the reference over it, one partition: late events within the horizon applied, others dead-lettered
    spec = ViewSpec.model_validate(w.view("tumble"))
    events = [SourceEvent(Op.parse(r["op"]), {k: v for k, v in r.items() if k != "op"}, (0, 0, i))
              for i, r in enumerate(records)]
    result = reference_changelog(spec, merge_partitions({0: events}))
    reasons = Counter(reason for _i, _p, reason in result.dead_letters)
    assert reasons[Reason.LATE] > 0
    assert sum(late) > reasons[Reason.LATE]  # some late events were applied


def test_late_events_are_those_whose_window_had_ended() -> None:
    records = [{"ts": 1500}, {"ts": 2100}, {"ts": 1999}, {"ts": 900}, {"ts": 3000}, {"ts": 2999}]
    # 1999 after 2100: [1000, 2000) had ended; 2999 after 3000: [2000, 3000) too
    assert late_events(records, 1000) == [False, False, True, True, False, True]
