"""The reference's delta updates (DESIGN.md §2, Estuary Flow's delta-updates mode): per
batch and view key, the combine of that batch's events alone, and the fold of delta rows
back into a view. Plain Python like the rest of `refold.reference`, whose interface
re-exports these two functions."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

import orjson

from refold.config import ViewSpec
from refold.model import jsonbytes
from refold.reduce import SourceEvent, value_order


def reference_deltas(spec: ViewSpec, batches: Sequence[Sequence[Sequence[SourceEvent]]]) -> list[dict[str, Any]]:
    """Delta rows per batch of units: each batch's accepted contributions per key (a
    tumble or hop view: per view key and window, `refold.reference_windows`)."""
    if spec.window is not None:
        from refold.reference_windows import window_deltas

        return window_deltas(spec, batches)
    from refold.reference import _Model  # the reference re-exports this module

    model = _Model(spec)
    out: list[dict[str, Any]] = []
    for batch in batches:
        contributions: dict[tuple[Any, ...], list[tuple[int, SourceEvent]]] = {}
        for unit in batch:
            if model.check(unit) is not None:
                continue
            for event in unit:
                group = model.group_of(event.row)
                assert group is not None
                applied = model.apply(event)
                contributions.setdefault(group, []).append((1 if event.op.adds else -1, applied))
        for key in sorted(contributions, key=lambda k: orjson.dumps(list(k))):
            out.append(_delta_row(spec, key, contributions[key]))
    return out


def _delta_row(spec: ViewSpec, key: tuple[Any, ...], signed: list[tuple[int, SourceEvent]],
               names: Sequence[str] | None = None) -> dict[str, Any]:
    row: dict[str, Any] = dict(zip(spec.key if names is None else names, key, strict=True))
    row["_count"] = sum(sign for sign, _ in signed)
    for name, column in spec.columns.items():
        agg, col = column.agg, column.column
        values = [(sign, e.row.get(col), e.tag) for sign, e in signed]
        present = [(sign, v) for sign, v, _ in values if v is not None]
        if agg == "count":
            row[name] = row["_count"] if col == "*" else sum(sign for sign, _ in present)
        elif agg in ("sum", "avg"):
            total: Any = sum((sign * Fraction(v) for sign, v in present), Fraction(0))
            total = float(total) if any(type(v) is float for _, v in present) else int(total)
            row[name] = total if agg == "sum" else {"sum": total, "count": sum(sign for sign, _ in present)}
        elif agg in ("min", "max", "set"):
            diffs: Counter[Any] = Counter()
            for sign, v in present:
                diffs[v] += sign
            row[name] = [[v, d] for v, d in sorted(diffs.items(), key=lambda item: value_order(item[0])) if d]
        else:
            row[name] = [
                [list(tag), v, sign]
                for sign, v, tag in sorted(values, key=lambda c: (c[2], orjson.dumps(c[1]), c[0]))
            ]
    return row


def fold_deltas(spec: ViewSpec, delta_rows: Iterable[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Combine delta rows per key, then apply each aggregation: the view they add up to
    (a windowed view's rows are keyed by the view key and the window bounds)."""
    names = (*spec.key, "window_start", "window_end") if spec.window is not None else tuple(spec.key)
    acc: dict[tuple[Any, ...], dict[str, Any]] = {}
    for delta in delta_rows:
        key = tuple(delta[c] for c in names)
        state = acc.setdefault(key, {"_count": 0})
        state["_count"] += delta["_count"]
        for name, column in spec.columns.items():
            value = delta[name]
            if column.agg in ("sum", "count"):
                state[name] = state.get(name, 0) + value
            elif column.agg == "avg":
                total = state.setdefault(name, {"sum": 0, "count": 0})
                total["sum"] += value["sum"]
                total["count"] += value["count"]
            elif column.agg in ("min", "max", "set"):
                counts = state.setdefault(name, Counter())
                for v, d in value:
                    counts[v] += d
            else:
                counts = state.setdefault(name, Counter())
                for tag, v, d in value:
                    counts[(tuple(tag), jsonbytes.dumps(v))] += d
    view: dict[tuple[Any, ...], dict[str, Any]] = {}
    for key, state in acc.items():
        if state["_count"] <= 0:
            continue
        row: dict[str, Any] = dict(zip(names, key, strict=True))
        for name, column in spec.columns.items():
            value = state.get(name)
            if column.agg in ("sum", "count"):
                row[name] = value if value is not None else 0
            elif column.agg == "avg":
                row[name] = value["sum"] / value["count"] if value and value["count"] else None
            elif column.agg in ("min", "max", "set"):
                live = sorted(((v, n) for v, n in (value or {}).items() if n > 0), key=lambda item: value_order(item[0]))
                if column.agg == "set":
                    row[name] = [[v, n] for v, n in live]
                elif not live:
                    row[name] = None
                else:
                    row[name] = (min if column.agg == "min" else max)((v for v, _ in live), key=value_order)
            else:
                tagged = sorted(k for k, n in (value or {}).items() if n > 0)
                pick = tagged[0] if column.agg == "first" else tagged[-1]
                row[name] = orjson.loads(pick[1])
        view[key] = row
    return view
