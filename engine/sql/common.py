"""What the SQL translator's parts share: the dialect, the refused parts, the error, and
where a node stands in the query."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from sqlglot import exp

DIALECT: Final = "spark"
PLACE: Final = "place"  # the Top-N view's place column (SEMANTICS.md, Top-N views)
MAX_N: Final = 10_000  # TopNSpec's bound
STRUCTS: Final = ("window", "session_window")  # Spark's time-window functions, named as their result
BOUNDS: Final = ("window_start", "window_end")  # a windowed view's columns (SEMANTICS.md, Windows)
FLINK_WINDOWS: Final = ("tumble", "hop", "session", "cumulate")
FLINK_TABLE_FUNCTIONS: Final = ("tumble", "hop")  # the window table functions Refold takes
WINDOW_TIME: Final = "window_time"  # Flink's time attribute of a window table function's rows

# aggregate function → (the view's aggregation, the name an unnamed aggregate gets)
AGGREGATES: Final[dict[type[exp.Expression], tuple[str, str]]] = {
    exp.Sum: ("sum", "sum"),
    exp.Count: ("count", "count"),
    exp.Avg: ("avg", "avg"),
    exp.Min: ("min", "min"),
    exp.Max: ("max", "max"),
    exp.First: ("first", "first"),
    exp.FirstValue: ("first", "first"),
    exp.Last: ("last", "last"),
    exp.LastValue: ("last", "last"),
    exp.ArrayUniqueAgg: ("set", "set"),  # COLLECT_SET
}
SUPPORTED: Final = "SUM, COUNT, AVG, MIN, MAX, FIRST/FIRST_VALUE, LAST/LAST_VALUE, COLLECT_SET"

# query parts no view shape takes, with what to say about each
REFUSED_PARTS: Final[dict[str, str]] = {
    "joins": "JOIN inside a subquery or a table function: not supported (a join is the query's own FROM a JOIN b ON …)",
    "having": "HAVING: a filter on aggregates is not exact under retraction here; not supported",
    "order": "ORDER BY outside ROW_NUMBER() OVER (…): a view has no order; for a Top-N write "
             "ROW_NUMBER() OVER (ORDER BY …) AS place … WHERE place <= N",
    "limit": "LIMIT: for a Top-N write ROW_NUMBER() OVER (ORDER BY …) AS place … WHERE place <= N",
    "offset": "OFFSET: not supported",
    "distinct": "SELECT DISTINCT: not supported",
    "with_": "WITH: common table expressions are not supported",
    "qualify": "QUALIFY: write the Top-N as SELECT * FROM (…) WHERE place <= N",
    "laterals": "LATERAL VIEW: not supported",
    "windows": "WINDOW: named windows are not supported",
    "pivots": "PIVOT: not supported",
    "prewhere": "PREWHERE: not supported",
    "cluster": "CLUSTER BY: not supported",
    "distribute": "DISTRIBUTE BY: not supported",
    "sort": "SORT BY: not supported",
}


class SqlError(ValueError):
    """A view query Refold cannot run exactly (or cannot read): the construct and its place."""


@dataclass(frozen=True)
class SqlView:
    """What a query means: the view spec (the YAML form's `view:` mapping) and the table
    it reads, with where that table is named (for the check against `source.topic`)."""

    spec: dict[str, Any]
    table: str
    table_at: str
    tables: tuple[tuple[str, str], ...] = ()  # a join's two sources, each with where it is named


def _is_non_null_literal(node: exp.Expression | None) -> bool:
    return isinstance(node, exp.Literal)


def _sql_name(node: exp.Expression) -> str:
    return node.sql_name() if hasattr(node, "sql_name") else type(node).__name__.upper()


def _at(node: Any) -> str:
    """`(line L, column C)` where a node starts: its first positioned part's place."""
    if node is None:
        return ""
    metas = [part.meta for part in node.walk() if part.meta and "line" in part.meta and "start" in part.meta]
    if not metas:
        return ""
    first = min(metas, key=lambda meta: meta["start"])
    return f"(line {first['line']}, column {first['col'] - (first['end'] - first['start'])})"
