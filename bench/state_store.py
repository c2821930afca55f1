"""The executors' local state store (refold.state): what a batch pays to load its
touched keys, restore them into a reducer and write its changes back, with real
GroupedReducer records.

    python -m bench.state_store [KEYS] [TOUCHED]     (defaults 100000 10000)
"""
from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

from refold.config import ViewSpec
from refold.model.changelog import Op
from refold.reduce import SourceEvent, make_reducer
from refold.reduce.values import key_bytes
from refold.state.store import ShardId, ShardStore, Stamp

KEYS = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
TOUCHED = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
SPEC = ViewSpec.model_validate({"key": ["player"], "columns": {
    "total": {"sum": "score"}, "best": {"max": "score"}, "games": {"count": "*"}, "latest": {"last": "score"}}})


def events(keys: range, tag0: int) -> list[SourceEvent]:
    # two distinct rows per key -> summary + 2 live rows = 3 records per key
    out = []
    for i in keys:
        for j in range(2):
            out.append(SourceEvent(Op.APPEND, {"player": f"player-{i:07d}", "score": (i * 7 + j) % 1000, "game": j},
                                   (tag0 + i, 0, tag0 + 2 * i + j)))
    return out


def timed(what: str, fn, n: int, unit: str):
    t = time.perf_counter()
    out = fn()
    s = time.perf_counter() - t
    print(f"{what:58s} {s * 1000:8.1f} ms  {s / n * 1e6:6.2f} µs/{unit}")
    return out


def _round(shard: ShardId, root: Path, kjs: list[bytes], touched: list[int], r: int, label: str, stored: int) -> None:
    """One measured round over the touched keys (cold: just opened; warm: the second run)."""
    with ShardStore.open(shard, root) as store:
        got = timed(f"load_keys {TOUCHED} keys, {label}", lambda: store.load_keys(kjs), TOUCHED, "key")
        if label.startswith("warm"):
            got = timed(f"load_keys {TOUCHED} keys, {label}", lambda: store.load_keys(kjs), TOUCHED, "key")
        assert len(got) == 3 * TOUCHED, len(got)
        timed(f"records_of x{TOUCHED} (one iterator each)", lambda: [store.records_of(k) for k in kjs], TOUCHED, "key")
        fresh = make_reducer(SPEC)
        timed("reducer.restore of the loaded records", lambda: fresh.restore(got), TOUCHED, "key")
        # per touched key: a new row in, an old row out -> summary + 2 row records = 3 changes
        batch = [[SourceEvent(Op.APPEND, {"player": f"player-{i:07d}", "score": 5, "game": 9 + r}, (KEYS * 9 + i, 0, KEYS * 9 + i)),
                  SourceEvent(Op.RETRACT, ({"player": f"player-{i:07d}", "score": (i * 7) % 1000, "game": 0} if r == 0 else {"player": f"player-{i:07d}", "score": 5, "game": 9}), (KEYS * 9 + i, 0, KEYS * 9 + i))]
                 for i in touched]
        def run():
            for unit in batch:
                fresh.apply(unit)
            return fresh.take_state_changes()
        changes = timed("reducer: 1 row in + 1 out per key, take_state_changes", run, TOUCHED, "key")
        timed(f"store.apply of {len(changes)} changes + stamp", lambda: store.apply(changes, Stamp(2 if label.startswith('cold') else 3, stored + 1)), len(changes), "record")
        # a python LRU of records per key: what a hit would save
        lru = {k: store.records_of(k) for k in kjs}
        timed(f"dict lookup of {TOUCHED} keys (an LRU hit, best case)", lambda: [r for k in kjs for r in lru[k]], TOUCHED, "key")


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="refold-bench-"))
    shard = ShardId("bench", "0", 0)
    reducer = make_reducer(SPEC)
    for e in events(range(KEYS), 0):
        reducer.apply([e])
    records = reducer.take_state_changes()
    print(f"{KEYS} keys, {len(records)} records, {sum(len(k) + len(v or b'') for k, v in records) / len(records):.0f} bytes/record (key+value)")
    with ShardStore.open(shard, root) as store:
        timed("initial load: apply all records in one batch", lambda: store.apply(records, Stamp(1, len(records))), len(records), "record")
    size = sum(f.stat().st_size for f in shard.directory(root).rglob("*") if f.is_file())
    print(f"on disk after close: {size / len(records):.0f} bytes/record")

    rng = random.Random(7)
    touched = rng.sample(range(KEYS), TOUCHED)
    kjs = [key_bytes((f"player-{i:07d}",)) for i in touched]
    for r, label in enumerate(("cold (just opened)", "warm (second run)")):
        _round(shard, root, kjs, touched, r, label, len(records))
    t = time.perf_counter()
    s = ShardStore.open(shard, root)
    s.close()
    print(f"{'open + close':58s} {(time.perf_counter() - t) * 1000:8.1f} ms")
    full = ShardStore.open(shard, root)
    timed("items(): full scan", lambda: sum(1 for _ in full.items()), len(records), "record")
    full.close()


if __name__ == "__main__":
    main()
