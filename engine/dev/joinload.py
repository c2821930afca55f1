"""A seeded pair of changelogs for a join: orders and customers, what the chaos harness's
join pipeline and `make bench-join` feed a view of revenue per region over
`orders ⋈ customers` (docs/SEMANTICS.md, Joins; `JOIN_VIEW`).

- **customers** `{"id", "region", "name"}`, keyed by `id`: an `+A` of every customer
  first, then, spread among the orders, corrections (`-C`/`+C`) moving a customer to
  another region (each of its orders' joined rows moves with it) and retractions (`-R`:
  its orders then join nothing);
- **orders** `{"id", "customer_id", "amount"}`, keyed by `id`: appends of new orders for
  any customer (a retracted one too), retractions of live orders, corrections of an
  order's amount.

Every record has an `event_time` counting up by 1 ms in the order they were made, over
both topics, so a merged join's shard (which merges both sources' units by event time
within a batch) sees them close to that order. Every `-C` is right before its `+C` (same
side, same message key); every retraction names a row of its side that is live, so a
correct engine refuses nothing: no dead letters.

The expected view, two ways: `expected_view` over the live rows at the end (a hash join
and a sum; fast enough for the bench's million events), and `reference_view`, the
reference join (`refold.reference_joins`) unit by unit, run per join key (a unit changes
the joined rows of its key only, so this is the reference join over the whole input in
its order) and the reference grouped view (`refold.reference`) over its records. The
final view is a function of the live rows whatever order the two topics are merged in
(nothing is refused), which is what a merged join's output is compared with
(`check_join`: a re-grouping view's changelog depends on the batches, as
`refold verify` says of re-grouping views).
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from refold.model import jsonbytes
from refold.model.changelog import Op
from refold.reduce.types import SourceEvent

ORDERS, CUSTOMERS = 0, 1  # the join's sides: left, right
SIDE_NAMES = ("orders", "customers")
JOIN = {
    "left": "orders", "right": "customers", "on": [["customer_id", "id"]], "type": "inner",
    "columns": {"order_id": "orders.id", "customer_id": "orders.customer_id", "amount": "orders.amount",
                "region": "customers.region"},
    "key": ["order_id"],  # a customer's move corrects each of its orders' joined rows in place
}
# SELECT c.region, SUM(o.amount) AS revenue, COUNT(*) AS orders FROM orders o JOIN customers c
# ON o.customer_id = c.id GROUP BY c.region
JOIN_VIEW = {"join": JOIN, "key": ["region"], "columns": {"revenue": {"sum": "amount"}, "orders": {"count": "*"}}}

Record = tuple[int, dict[str, Any]]  # (side, the event record: `op` as code, the row, `event_time`)


@dataclass(frozen=True, slots=True)
class JoinWorkload:
    orders: int = 1_000_000  # order events (a -C/+C pair counts two)
    customers: int = 50_000
    regions: int = 20
    order_retract_share: float = 0.05
    order_correct_share: float = 0.05  # -C/+C of an order's amount
    customer_moves: float = 0.4  # -C/+C pairs moving a customer, per customer, over the run
    customer_retracts: float = 0.05  # -R of a customer, per customer, over the run
    seed: int = 1
    start_time: int = 1_700_000_000_000

    def region(self, index: int) -> str:
        return f"region-{index:02d}"


def generate_join(w: JoinWorkload) -> Iterator[Record]:
    """Yield `(side, record)` in the order made: the customers' appends, then the orders
    with the customers' moves and retractions among them."""
    rng = random.Random(w.seed)
    clock = w.start_time
    customers: dict[int, dict[str, Any]] = {}
    for cid in range(w.customers):
        row = {"id": cid, "region": w.region(rng.randrange(w.regions)), "name": f"customer {cid}"}
        customers[cid] = row
        yield CUSTOMERS, {"op": "+A", **row, "event_time": clock}
        clock += 1
    live_ids = list(customers)
    changes = int(w.customers * (w.customer_moves + w.customer_retracts))
    change_share = changes / max(1, w.orders)  # a customer change after an order event, this often
    retract_of_changes = w.customer_retracts / max(1e-9, w.customer_moves + w.customer_retracts)
    orders: list[dict[str, Any]] = []  # live orders (a random one is taken by swapping with the last)
    next_id = 0
    made = 0
    while made < w.orders:
        choice = rng.random()
        if orders and choice < w.order_retract_share + w.order_correct_share and \
                (choice < w.order_retract_share or made + 2 <= w.orders):
            at = rng.randrange(len(orders))
            old = orders[at]
            if choice < w.order_retract_share:
                orders[at] = orders[-1]
                orders.pop()
                yield ORDERS, {"op": "-R", **old, "event_time": clock}
                made += 1
            else:
                new = {**old, "amount": rng.randint(1, 10_000)}
                orders[at] = new
                yield ORDERS, {"op": "-C", **old, "event_time": clock}
                yield ORDERS, {"op": "+C", **new, "event_time": clock}
                made += 2
        else:
            row = {"id": next_id, "customer_id": rng.randrange(w.customers), "amount": rng.randint(1, 10_000)}
            next_id += 1
            orders.append(row)
            yield ORDERS, {"op": "+A", **row, "event_time": clock}
            made += 1
        clock += 1
        if live_ids and rng.random() < change_share:
            at = rng.randrange(len(live_ids))
            cid = live_ids[at]
            old = customers[cid]
            if rng.random() < retract_of_changes:
                live_ids[at] = live_ids[-1]
                live_ids.pop()
                del customers[cid]
                yield CUSTOMERS, {"op": "-R", **old, "event_time": clock}
            else:
                moved = (int(old["region"].rsplit("-", 1)[1]) + 1 + rng.randrange(max(1, w.regions - 1))) % w.regions
                new = {**old, "region": w.region(moved)}
                customers[cid] = new
                yield CUSTOMERS, {"op": "-C", **old, "event_time": clock}
                yield CUSTOMERS, {"op": "+C", **new, "event_time": clock}
            clock += 1


def sides(records: Sequence[Record]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The orders' and the customers' records, each in order."""
    out: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
    for side, record in records:
        out[side].append(record)
    return out


def join_chunks(records: Sequence[Record], parts: int) -> Iterator[tuple[list[bytes], list[bytes]]]:
    """The input in about `parts` slices in the order it was made, never cut between a
    `-C` and its `+C`; each slice as the orders' and the customers' JSON lines."""
    size = max(1, len(records) // max(1, parts))
    start = 0
    while start < len(records):
        end = min(len(records), start + size)
        while end < len(records) and records[end - 1][1]["op"] == "-C":
            end += 1
        chunk: tuple[list[bytes], list[bytes]] = ([], [])
        for side, record in records[start:end]:
            chunk[side].append(jsonbytes.dumps(record))
        yield chunk
        start = end


def _row(record: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in ("op", "event_time")}


def live_rows(records: Sequence[dict[str, Any]]) -> Counter[bytes]:
    """A side's live rows at the end (canonical JSON → copies); ValueError when a record
    retracts a row that is not live."""
    live: Counter[bytes] = Counter()
    for index, record in enumerate(records):
        row = jsonbytes.dumps(_row(record), option=orjson.OPT_SORT_KEYS)
        if record["op"] in ("+A", "+C"):
            live[row] += 1
        elif live[row] > 0:
            live[row] -= 1
            if not live[row]:
                del live[row]
        else:
            raise ValueError(f"record {index} ({record['op']}) retracts a row that is not live: {row.decode()}")
    return live


def expected_view(records: Sequence[Record]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Revenue and orders per region over the join of the live rows at the end, keyed as
    a view's rows are (`(region,)`)."""
    orders, customers = sides(records)
    regions: dict[int, Counter[str]] = defaultdict(Counter)  # customer id → region → live copies
    for raw, copies in live_rows(customers).items():
        row = orjson.loads(raw)
        regions[row["id"]][row["region"]] += copies
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for raw, copies in live_rows(orders).items():
        row = orjson.loads(raw)
        for region, matches in regions.get(row["customer_id"], Counter()).items():
            totals[region][0] += row["amount"] * copies * matches
            totals[region][1] += copies * matches
    return {(region,): {"region": region, "revenue": revenue, "orders": count}
            for region, (revenue, count) in totals.items() if count}


def reference_view(records: Sequence[Record]) -> tuple[dict[tuple[Any, ...], dict[str, Any]], int]:
    """The reference join (`refold.reference_joins`) over the input, one join key at a
    time (a unit changes the joined rows of its own key only), and the reference grouped
    view over its records, key after key (the view's final rows do not depend on how the
    keys' records interleave when nothing is refused): (its final rows, how many units
    either refused)."""
    from refold.config import JoinSpec, ViewSpec
    from refold.reference import reference_changelog
    from refold.reference_joins import reference_join

    join = JoinSpec.model_validate(JOIN)
    by_key: dict[Any, list[tuple[int, list[SourceEvent]]]] = defaultdict(list)
    for index, (side, record) in enumerate(records):
        event = SourceEvent(Op.parse(record["op"]), _row(record), (record["event_time"], side, index))
        units = by_key[event.row["customer_id" if side == ORDERS else "id"]]
        if event.op is Op.CORRECT_TO:
            units[-1][1].append(event)
        else:
            units.append((side, [event]))
    refused = 0
    joined: list[list[SourceEvent]] = []  # the join's records as the grouped view's units
    for units in by_key.values():
        result = reference_join(join, units)
        refused += len(result.rejected)
        for change in result.changes:
            event = SourceEvent(change.op, dict(change.row), (len(joined), 0, 0))
            if change.op is Op.CORRECT_TO:
                joined[-1].append(event)
            else:
                joined.append([event])
    grouped = ViewSpec.model_validate({k: v for k, v in JOIN_VIEW.items() if k != "join"})
    view = reference_changelog(grouped, joined)
    return view.view, refused + len(view.rejected)


def check_join(pipeline: Any, settings: Mapping[str, Any], expected: Mapping[tuple[Any, ...], dict[str, Any]],
               events: int) -> Any:
    """A join pipeline's committed outputs against `expected` (a `refold.ops.verify.Report`):
    the view changelog folds (each `-C`/`-R` retracts its key's current row, each `-C` is
    followed by its `+C`) to `expected`; the deltas, folded, too; no dead letters (the
    input refuses nothing). `events`: the records of both sources (the report's count)."""
    from refold.kafka.io import read_to_end
    from refold.ops.verify import Report, fold_delta_topic, read_view_changes, same
    from refold.recovery.records import decode_dead_letter
    from refold.reference import fold_changelog

    report = Report(events=events)
    changes = read_view_changes(pipeline, settings)
    report.view_records = len(changes)
    views = []
    try:
        views.append(("view changelog", fold_changelog(changes)))
    except ValueError as exc:
        report.add(f"the view changelog does not fold: {exc}")
    if pipeline.outputs.delta is not None:
        views.append(("folded deltas", fold_delta_topic(pipeline, settings, report)))
    for what, got in views:
        for key in sorted(set(expected) | set(got), key=repr):
            if not same(got.get(key), expected.get(key)):
                report.add(f"{what}: key {key!r} is {got.get(key)!r}, expected {expected.get(key)!r}")
    letters = [decode_dead_letter(m.value()) for m in read_to_end(settings, pipeline.dlq_topic)]
    report.dead_letters = len(letters)
    for letter in letters[:10]:
        report.add(f"a dead letter ({letter.reason}) of {letter.topic}[{letter.partition}]@{letter.offset}")
    return report
