"""`python -m bench.hotpath --view join`: the join's reducer alone, CPU per event, Python
(`refold.reduce.join.JoinReducer`) against the native core (`refold_native.JoinCore`).

The workload: orders joined with customers on `orders.cust = customers.cid` (inner,
output key `oid`): `--customers` customers (`+A`), then `--orders` orders (`+A`), with a
random earlier order retracted (`-R`) after every 20th (5%) and a random customer moved to
another region (`-C`/`+C`, so every joined row of its orders is corrected) after every
100th order (10% of the customers at the defaults). The events are decoded rows in memory,
in batches of `--batch` events; the reducer holds every join key (as `--store memory`):
each batch is its units applied and its `P.state` records taken, with Python's collector
paused as a shard pauses it (`refold.runtime.collector`), nothing decoded, rendered or
committed. So the figures are the reducers' own, beside the grouped reducers' over the
same orders in the same run (sum and count of `amount` per `cust`: `GroupedReducer` with
`take_state_changes`, `GroupedCore.apply_batch`, which also renders its view records as
JSON) — not the shard path's figures of `--view grouped`, which decode and render too.

Cores: `python` the Python reducer one unit at a time; `native` `JoinCore.apply` one unit at
a time (the drop-in); `native-batch` `JoinCore.apply_batch`, a batch's units in one call.
`view` and `view-read`: the join and a grouped view over it (sum and count of `amount` per
`region`, with its deltas and cause headers), both native, as a join shard runs them:
`view` in two calls, the join's `ViewChange`s made into the view's units in Python
(`as_units`), `view-read` in one (`GroupedCore.join_read`, the joined records never Python
objects); per event of both sides, view records rendered.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from refold.config import JoinSpec, ViewSpec
from refold.model.changelog import Op
from refold.reduce import GroupedReducer, SourceEvent
from refold.reduce.join import JoinReducer
from refold.runtime.batch import InputRecord
from refold.runtime.collector import collector_paused

JOIN = JoinSpec(left="orders", right="customers", on=[("cust", "cid")], type="inner", key=["oid"],
                columns={"oid": "orders.oid", "cust": "orders.cust", "amount": "orders.amount",
                         "region": "customers.region", "name": "customers.name"})
GROUPED = ViewSpec.model_validate({"key": ["cust"], "columns": {"total": {"sum": "amount"}, "n": {"count": "*"}}})
REGIONS = ("eu", "us", "asia", "africa", "oceania")

JoinUnit = tuple[int, list[SourceEvent]]


def workload(orders: int, customers: int, seed: int = 7) -> list[JoinUnit]:
    """The units of both sides in order (side 0 orders, 1 customers)."""
    rng = random.Random(seed)
    units: list[JoinUnit] = []
    offset = 0

    def unit(side: int, *events: tuple[Op, dict[str, Any]]) -> None:
        nonlocal offset
        units.append((side, [SourceEvent(op, row, (offset + i, side, offset + i)) for i, (op, row) in enumerate(events)]))
        offset += len(events)

    people = [{"cid": c, "region": rng.choice(REGIONS), "name": f"customer {c}"} for c in range(customers)]
    for row in people:
        unit(1, (Op.APPEND, row))
    live: list[dict[str, Any]] = []
    for o in range(orders):
        order = {"oid": o, "cust": rng.randrange(customers), "amount": rng.randrange(1, 500)}
        live.append(order)
        unit(0, (Op.APPEND, order))
        if o % 20 == 19:
            gone = live.pop(rng.randrange(len(live)))
            unit(0, (Op.RETRACT, gone))
        if o % 100 == 99:
            c = rng.randrange(customers)
            old = people[c]
            new = people[c] = {**old, "region": rng.choice([r for r in REGIONS if r != old["region"]])}
            unit(1, (Op.CORRECT_FROM, old), (Op.CORRECT_TO, new))
    return units


def batches(units: list[JoinUnit], size: int) -> list[list[JoinUnit]]:
    out: list[list[JoinUnit]] = [[]]
    events = 0
    for item in units:
        if events >= size:
            out.append([])
            events = 0
        out[-1].append(item)
        events += len(item[1])
    return out


def run_units(reducer: Any, cut: list[list[JoinUnit]]) -> int:
    """Each unit through `reducer.apply` (the workload has no refusals), each batch's
    state records taken: `JoinReducer` or `JoinCore`, the drop-in."""
    records = 0
    for batch in cut:
        with collector_paused():
            for side, events in batch:
                records += len(reducer.apply(side, events))
            records += len(reducer.take_state_changes())
    return records


def native_join() -> Any:
    import refold_native

    return refold_native.JoinCore(JOIN.sides_on, JOIN.outputs, JOIN.output_key, JOIN.type)


def run_native_batch(cut: list[list[JoinUnit]]) -> int:
    core = native_join()
    records = 0
    for batch in cut:
        with collector_paused():
            _, changes, state = core.apply_batch(batch)
            records += sum(map(len, changes)) + len(state)
    return records


def view_core() -> Any:
    """The grouped view over the join, as `refold.runtime.native.join_view_core` makes it."""
    import refold_native

    core = refold_native.GroupedCore(["region"], [("total", "sum", "amount"), ("n", "count", "*")], "changelog", True)
    core.provenance = True
    core.name_join_causes("orders", "customers", 1)
    return core


def run_view(cut: list[list[JoinUnit]], fused: bool) -> int:
    """The join and the view over it, a batch in two calls or (`fused`) in one."""
    from refold.runtime.joins import as_units

    join, view = native_join(), view_core()
    records = 0
    for batch in cut:
        with collector_paused():
            if fused:
                view.join_read(join, [(side, [(event, None) for event in events]) for side, events in batch])
                view.touched_read()
                _, out, delta, state = view.apply_read()
                state = join.take_state_changes() + state
            else:
                _, changes, state = join.apply_batch(batch)
                units = [[(event, None) for event in sub] for (_, events), made in zip(batch, changes, strict=True)
                         for sub in as_units(made, events[0].tag)]
                view.touched(units)
                _, out, delta, view_state = view.apply_batch(units)
                state += view_state
            records += len(out) + len(delta) + len(state)
    return records


def grouped_units(cut: list[list[JoinUnit]]) -> list[list[tuple[tuple[SourceEvent, InputRecord], ...]]]:
    """The orders' units of each batch as the grouped reducers take them."""
    return [[tuple((event, InputRecord(0, event.tag[2], None, None, 0)) for event in events)
             for side, events in batch if side == 0] for batch in cut]


def run_grouped_python(cut: list[list[JoinUnit]]) -> int:
    reducer = GroupedReducer(GROUPED)
    records = 0
    for batch in cut:
        with collector_paused():
            for side, events in batch:
                if side == 0:
                    records += len(reducer.apply(events))
            records += len(reducer.take_state_changes())
    return records


def run_grouped_native(units: list[list[tuple[tuple[SourceEvent, InputRecord], ...]]]) -> int:
    import refold_native

    core = refold_native.GroupedCore(list(GROUPED.key), [(n, s.agg, s.column) for n, s in GROUPED.columns.items()],
                                     "changelog", False)
    records = 0
    for batch in units:
        with collector_paused():
            _, view, _, state = core.apply_batch(batch)
            records += len(view) + len(state)
    return records


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hotpath --view join", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=100_000)
    parser.add_argument("--customers", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=10_000, help="events per batch")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--core", default="python,native,native-batch,view,view-read")
    args = parser.parse_args(argv)
    units = workload(args.orders, args.customers)
    cut = batches(units, args.batch)
    events = sum(len(events) for _, events in units)
    orders = sum(len(events) for side, events in units if side == 0)
    grouped = grouped_units(cut)
    runs: dict[str, tuple[Callable[[], int], int]] = {
        "python": (lambda: run_units(JoinReducer(JOIN), cut), events),
        "native": (lambda: run_units(native_join(), cut), events),
        "native-batch": (lambda: run_native_batch(cut), events),
        "view": (lambda: run_view(cut, fused=False), events),
        "view-read": (lambda: run_view(cut, fused=True), events),
        "grouped python": (lambda: run_grouped_python(cut), orders),
        "grouped native": (lambda: run_grouped_native(grouped), orders),
    }
    chosen = [c.strip() for c in args.core.split(",") if c.strip()]
    chosen += [f"grouped {c}" for c in ("python", "native") if c in chosen or f"{c}-batch" in chosen]
    print(f"join: {events:,} events ({orders:,} of orders, {events - orders:,} of customers), "
          f"batches of {args.batch:,} events, best of {args.repeat}", file=sys.stderr)
    best: dict[str, float] = {}
    for name in dict.fromkeys(chosen):
        run, count = runs[name]
        times = []
        for _ in range(args.repeat):
            started = time.process_time()
            records = run()
            times.append(time.process_time() - started)
        best[name] = min(times)
        what = ("grouped view over the orders" if name.startswith("grouped")
                else "join and the view over it" if name.startswith("view") else "join")
        print(f"reducer ({what}, {name.removeprefix('grouped ')} core): {count:,} events, {records:,} records: "
              f"{best[name]:.2f} CPU s, {best[name] / count * 1e6:.2f} µs/event")
    for fast in ("native", "native-batch"):
        if "python" in best and fast in best:
            print(f"join {fast} / python CPU: {best[fast] / best['python']:.3f} ({best['python'] / best[fast]:.1f}x)")
    if "view" in best and "view-read" in best:
        print(f"join and view, one call / two: {best['view-read'] / best['view']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
