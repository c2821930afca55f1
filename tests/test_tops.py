"""A global Top-N's stages 2 and 3 (refold.runtime.tops), without Kafka: each shard's
local-top changes, ranked again unit by unit, give the one-shard leaderboard."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from refold.config import ViewSpec
from refold.model.changelog import Op
from refold.reduce import SourceEvent
from refold.reduce.topn import TopNReducer
from refold.runtime.batch import InputRecord, Outgoing
from refold.runtime.tops import LocalTops, RankReader, local_top_record

SPEC = ViewSpec.model_validate({"top_n": {"n": 3, "order_by": {"score": "desc"}}})
SHARDS = 3


def _units(seed: int, count: int) -> list[list[SourceEvent]]:
    """Random units over 8 players with few scores (ties, copies of one row):
    appends, retractions of live rows, corrections that may move a row to another player."""
    rng = random.Random(seed)
    live: list[dict[str, Any]] = []
    units = []
    for step in range(count):
        fresh = {"player": f"p{rng.randrange(8)}", "score": rng.randrange(6)}
        choice = rng.randrange(10)
        if choice < 5 or not live:
            live.append(fresh)
            units.append([SourceEvent(Op.APPEND, fresh, (rng.randrange(50), 0, step * 2))])
        elif choice < 7:
            units.append([SourceEvent(Op.RETRACT, live.pop(rng.randrange(len(live))), (rng.randrange(50), 0, step * 2))])
        else:
            old = live.pop(rng.randrange(len(live)))
            live.append(fresh)
            time = rng.randrange(50)
            units.append([SourceEvent(Op.CORRECT_FROM, old, (time, 0, step * 2)),
                          SourceEvent(Op.CORRECT_TO, fresh, (time, 0, step * 2 + 1))])
    return units


def _shard(row: dict[str, Any]) -> int:  # by message key (the player), as stage 1 routes a global Top-N
    return int(row["player"][1:]) % SHARDS


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(1, 120))
def test_the_shards_local_tops_ranked_again_give_the_one_shard_leaderboard(seed: int, count: int) -> None:
    one = TopNReducer(SPEC)
    shards = [LocalTops(SPEC) for _ in range(SHARDS)]
    ranker = TopNReducer(SPEC)
    reader = RankReader()
    for number, unit in enumerate(_units(seed, count)):
        expected = one.apply(unit)
        records = []
        for index in reversed(range(SHARDS)):  # the shards commit in any order
            part = [event for event in unit if _shard(event.row) == index]
            moved = shards[index].apply(part) if part else []
            if moved:
                value = local_top_record([1, number], list(unit[0].tag), unit[0].tag[2], moved)
                records.append(InputRecord(0, len(records), None, value, 0))
        units = reader.read(records, {}, Outgoing()).units
        assert len(units) <= 1  # a unit's halves come together again
        got = ranker.apply([event for event, _ in units[0]]) if units else []
        assert got == expected, (number, unit)
    assert ranker.view() == one.view()


def test_the_reader_orders_units_by_close_then_merge_key_then_id() -> None:
    row = {"player": "p1", "score": 1}
    values = [local_top_record([2, 1], [5, 0, 9], 9, [[5, 0, 9, int(Op.APPEND), row]]),
              b'{"close":[2,1]}',
              local_top_record([1, 7], [8, 1, 4], 4, [[8, 1, 4, int(Op.APPEND), row]]),
              local_top_record([1, 7], [3, 2, 6], 6, [[3, 2, 6, int(Op.APPEND), row]]),
              local_top_record([1, 7], [3, 2, 6], 6, [[3, 2, 7, int(Op.RETRACT), row]])]
    records = [InputRecord(0, offset, None, value, 0) for offset, value in enumerate(values)]
    units = RankReader().read(records, {}, Outgoing()).units
    assert [[(int(event.op), event.tag) for event, _ in unit] for unit in units] == [
        [(int(Op.RETRACT), (3, 2, 7)), (int(Op.APPEND), (3, 2, 6))],  # one unit from two shards: leaving first
        [(int(Op.APPEND), (8, 1, 4))],
        [(int(Op.APPEND), (5, 0, 9))],  # a later close: a later stage-2 segment
    ]
