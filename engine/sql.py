"""Views written in SQL (`view: {sql: "…"}`), translated into the view spec the YAML gives.

Two query shapes, in Spark SQL's dialect (parsed by `sqlglot`, never by hand):

- a grouped view::

      SELECT team, player_name, SUM(score) AS total, COUNT(*) AS games
      FROM scores GROUP BY team, player_name

  → `key: [team, player_name]` (the GROUP BY order) and one column per aggregate:
  `SUM` → sum, `COUNT(*)`/`COUNT(1)` → count "*", `COUNT(c)` → count c, `AVG`, `MIN`,
  `MAX`, `FIRST`/`FIRST_VALUE` → first, `LAST`/`LAST_VALUE` → last, `COLLECT_SET` →
  set. An aggregate without `AS name` is named `<function>_<column>` (`count` for
  `COUNT(*)`).
- a Top-N view, as RFC-015 writes its leaderboard::

      SELECT * FROM (
        SELECT ROW_NUMBER() OVER (PARTITION BY league ORDER BY score DESC) AS place, *
        FROM scores
      ) WHERE place <= 3

  → `top_n: {n: 3, order_by: {score: desc}, partition_by: [league]}`; an inner (or
  outer) list of columns instead of `*` becomes `top_n.columns`, the row columns each
  output row carries.

Either shape may be windowed over event time with Spark's own functions, which
become `view.window` (docs/sql.md, Windows)::

      SELECT team, window.start, window.end, SUM(score) AS total
      FROM scores GROUP BY window(match_time, '1 hour'), team

→ `window: {time: match_time, tumble: 1h}`; `window(ts, '1 hour', '15 minutes')` is a
hop, `session_window(ts, '30 minutes')` a session, and `ROW_NUMBER() OVER (PARTITION BY
window(ts, '1 day'), team …)` a Top-N per window. The bounds are selected as
`window.start`/`window.end` and come out as `window_start`/`window_end`; intervals
become Refold durations. Flink's window table functions are the same views:
`FROM TABLE(TUMBLE(TABLE scores, DESCRIPTOR(match_time), INTERVAL '1' HOUR))` (or
`HOP(…, slide, size)`) with `window_start, window_end` in GROUP BY or PARTITION BY.
The lateness is not the query's: it is written beside it (`view.window.lateness`,
merged by `refold.config.ViewSpec`).

The `FROM` table is the pipeline's source topic (a dotted name may be written as is,
`FROM db.public.scores`, or quoted); its `WHERE` becomes the view's row filter
(`where`, `refold.model.predicate`). Anything else — joins, `HAVING`,
`DISTINCT`, windows other than `ROW_NUMBER`, a place bound that is not a literal,
expressions inside aggregates or of the window's bounds, Flink's `CUMULATE`/`SESSION`,
`ORDER BY`/`LIMIT` outside the window — is refused by
`SqlError`, naming the construct and where it stands in the query, before anything
starts: Refold runs a query only when it can run it exactly under retraction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

from sqlglot import exp
from sqlglot.dialects.dialect import Dialect
from sqlglot.errors import ParseError, TokenError
from sqlglot.tokens import TokenType

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
    "joins": "JOIN: a view reads one source topic; joins are not supported",
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


def translate(sql: str) -> SqlView:
    """The view spec of a query (see the module docstring); SqlError when Refold cannot
    run it exactly."""
    try:
        statements = [s for s in _parse(sql) if s is not None]
    except ParseError as exc:
        first = exc.errors[0] if exc.errors else {}
        where = f" at line {first['line']}, column {first['col']}" if "line" in first else ""
        raise SqlError(f"not a query Refold can read{where}: {first.get('description', exc)}") from exc
    except TokenError as exc:
        raise SqlError(f"not a query Refold can read: {exc}") from exc
    if len(statements) != 1:
        raise SqlError(f"one SELECT statement, got {len(statements)}")
    query = statements[0]
    if isinstance(query, exp.SetOperation):
        raise SqlError(f"{type(query).__name__.upper()} {_at(query)}: a view is one SELECT; not supported")
    if not isinstance(query, exp.Select):
        raise SqlError(f"a view is a SELECT, got {type(query).__name__.upper()} {_at(query)}")
    source = query.args.get("from_")
    if source is not None and isinstance(source.this, exp.Subquery):
        return _top_n(query, source.this)
    return _grouped(query)


def _parse(sql: str) -> list[exp.Expr | None]:
    """The statements of a query, parsed from its tokens so that Spark's `window(…)` reads
    as the function it is (sqlglot takes the keyword WINDOW for a named-window clause),
    and Flink's `TABLE(TUMBLE(TABLE t, …))` as a call whose first argument is the column-
    like name `t` (sqlglot reads no `TABLE t` argument)."""
    dialect = Dialect.get_or_raise(DIALECT)
    tokens = dialect.tokenize(sql)
    kept = []
    for index, token in enumerate(tokens):
        before = [t.token_type for t in tokens[max(index - 2, 0):index]]
        following = tokens[index + 1] if index + 1 < len(tokens) else None
        if following is not None and following.token_type == TokenType.L_PAREN:
            if token.text.lower() in FLINK_WINDOWS and not (
                    before == [TokenType.TABLE, TokenType.L_PAREN] and token.text.lower() in FLINK_TABLE_FUNCTIONS):
                column = token.col - (token.end - token.start)
                raise SqlError(f"{token.text}(…) (line {token.line}, column {column}): of Flink's window functions "
                               "Refold takes the table functions TABLE(TUMBLE(TABLE t, DESCRIPTOR(ts), size)) and "
                               "TABLE(HOP(TABLE t, DESCRIPTOR(ts), slide, size)); for sessions or a group window "
                               "write Spark's GROUP BY window(ts, '1 hour'), window(ts, '1 hour', '15 minutes') or "
                               "session_window(ts, '30 minutes')")
            if token.token_type == TokenType.WINDOW:
                token.token_type = TokenType.VAR
        if (token.token_type == TokenType.TABLE and index >= 2 and before[-1] == TokenType.L_PAREN
                and tokens[index - 2].text.lower() in FLINK_TABLE_FUNCTIONS
                and following is not None and following.token_type in (TokenType.VAR, TokenType.IDENTIFIER)):
            continue  # TUMBLE(TABLE t, …): the table is the call's first argument
        kept.append(token)
    return list(dialect.parser().parse(kept, sql))


@dataclass(frozen=True)
class _TimeWindow:
    """A `window(…)`/`session_window(…)` call (its name: the struct Spark names after the
    function, `window.start`, `session_window.end`) or Flink's window table function
    (`TUMBLE`/`HOP`: its bounds are the columns `window_start`/`window_end`), and the
    `view.window` it is."""

    name: str
    spec: dict[str, Any]
    node: exp.Expression

    @property
    def session(self) -> bool:
        return self.name == "session_window"

    @property
    def table_function(self) -> bool:
        return self.name not in STRUCTS


def _table_function_bound(node: exp.Expression, window: _TimeWindow | None, context: str) -> str | None:
    """`window_start`/`window_end` for those columns of a window table function's rows
    (None: the node is not one); SqlError for `window_time` or an expression of them."""
    if window is None or not window.table_function:
        return None
    if isinstance(node, exp.Column) and node.name in BOUNDS and node.table.lower() not in STRUCTS:
        return node.name
    for column in node.find_all(exp.Column):
        if column.name == WINDOW_TIME:
            raise SqlError(f"{context} {WINDOW_TIME} {_at(column)}: Refold's windowed rows have no time attribute; "
                           "a window is window_start and window_end")
        if column.name in BOUNDS:
            raise SqlError(f"{context} {node.sql(dialect=DIALECT)} {_at(node)}: {window.name}(…)'s window_start and "
                           "window_end are taken as they are; expressions of them are not supported here")
    return None


def _time_window(node: exp.Expression) -> _TimeWindow | None:
    """The time window a `window(ts, size[, slide])` or `session_window(ts, gap)` call is
    (None: the node is not such a call)."""
    if not isinstance(node, exp.Anonymous) or str(node.this).lower() not in STRUCTS:
        return None
    name = str(node.this).lower()
    arguments = node.expressions
    shown = f"{name}(…) {_at(node)}"
    if name == "session_window":
        if len(arguments) != 2:
            raise SqlError(f"{shown}: write session_window(time_column, 'gap')")
        time, gap = arguments
        spec: dict[str, Any] = {"session": {"gap": _duration(gap, shown)}}
    else:
        if len(arguments) == 4:
            raise SqlError(f"{shown}: a start time (window's fourth argument) is not supported: Refold's windows "
                           "are aligned to the epoch (a 1 hour window starts on the hour, UTC)")
        if len(arguments) not in (2, 3):
            raise SqlError(f"{shown}: write window(time_column, 'size') or window(time_column, 'size', 'slide')")
        time, size, *slide = arguments
        spec = ({"hop": {"size": _duration(size, shown), "slide": _duration(slide[0], shown)}} if slide
                else {"tumble": _duration(size, shown)})
    if not isinstance(time, exp.Column):
        raise SqlError(f"{shown}: its time is {time.sql(dialect=DIALECT)} {_at(time)}; a plain column is expected "
                       "(ISO-8601 text or epoch milliseconds)")
    return _TimeWindow(name, {"time": time.name, **spec}, node)


# Spark's interval units → microseconds (months and years have no fixed length)
_INTERVAL_UNITS: Final = {"microsecond": 1, "millisecond": 1000, "second": 1_000_000, "minute": 60_000_000,
                          "hour": 3_600_000_000, "day": 86_400_000_000, "week": 604_800_000_000}
_INTERVAL_PART: Final = re.compile(r"(\d+)\s*([a-z]+)")
# a Refold duration in the largest unit that writes it whole: what `refold explain` prints
_REFOLD_UNITS: Final = (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000))


def _duration(node: exp.Expression, where: str) -> str:
    """A Refold duration (`1h`, `15m`, `500ms`) of one of Spark's interval arguments: a
    string ('1 hour', '15 minutes', '1 hour 30 minutes') or INTERVAL 1 HOUR."""
    if isinstance(node, exp.Interval):
        value, unit = node.this, node.args.get("unit")
        text = f"{value.this if isinstance(value, exp.Literal) else value.sql(dialect=DIALECT)}"
        if unit is not None:
            text = f"{text} {unit.sql(dialect=DIALECT)}"
    elif isinstance(node, exp.Literal) and node.is_string:
        text = node.this
    else:
        raise SqlError(f"{where}: {node.sql(dialect=DIALECT)} {_at(node)} is not an interval: write e.g. "
                       "'1 hour', '15 minutes' or INTERVAL 10 SECONDS")
    millis = _interval_ms(text)
    if millis is None:
        raise SqlError(f"{where}: interval {text!r} {_at(node)}: a window's length is a positive whole number of "
                       "milliseconds, in weeks, days, hours, minutes, seconds, milliseconds or microseconds, e.g. "
                       "'1 hour' or '1 hour 30 minutes' (months and years have no fixed length)")
    for unit, size in _REFOLD_UNITS:
        if millis % size == 0:
            return f"{millis // size}{unit}"
    return f"{millis}ms"


def _interval_ms(text: str) -> int | None:
    """Milliseconds of a Spark interval string; None when it is not one Refold takes (a
    window's length is a positive whole number of milliseconds)."""
    words = text.strip().lower().removeprefix("interval").strip()
    parts = _INTERVAL_PART.findall(words)
    if not parts or _INTERVAL_PART.sub("", words).strip():
        return None
    micros = 0
    for number, unit in parts:
        size = _INTERVAL_UNITS.get(unit.removesuffix("s"))
        if size is None:
            return None
        micros += int(number) * size
    return micros // 1000 if micros > 0 and micros % 1000 == 0 else None


def _window_reference(node: exp.Expression, bare: bool = False) -> exp.Column | None:
    """The first reference to a window struct's field (`window.start`, `session_window.end`)
    in an expression; with `bare`, to the struct itself (`window`) too (without a time
    window in the query, a column named `window` is the source row's)."""
    for column in node.find_all(exp.Column):
        if column.table.lower() in STRUCTS or (bare and not column.table and column.name.lower() in STRUCTS):
            return column
    return None


def _window_bound(item: exp.Expression, window: _TimeWindow | None) -> str | None:
    """`window_start`/`window_end` for a selected `window.start`/`window.end` (with or
    without AS window_start/window_end); None for an item that is not about the window;
    SqlError for any other use of the window struct."""
    name, value = (item.alias, item.this) if isinstance(item, exp.Alias) else (None, item)
    for call in value.find_all(exp.Anonymous):
        if str(call.this).lower() in STRUCTS:
            raise SqlError(f"{str(call.this).lower()}(…) {_at(call)} in SELECT: a windowed view groups by it and "
                           f"selects {str(call.this).lower()}.start and .end (the struct itself is not supported)")
    bound = _table_function_bound(value, window, "SELECT")
    if bound is not None:
        if name and name != bound:
            raise SqlError(f"{bound} AS {name!r} {_at(item)}: the window's bounds keep their names")
        return bound
    reference = _window_reference(value, bare=window is not None and not window.table_function)
    if reference is None:
        return None
    struct = reference.table.lower() or reference.name.lower()
    if window is not None and window.table_function:
        raise SqlError(f"{reference.sql(dialect=DIALECT)} {_at(reference)}: the bounds of {window.name}(…) are the "
                       "columns window_start and window_end")
    if window is None:
        raise SqlError(f"{reference.sql(dialect=DIALECT)} {_at(reference)} without window(…) or session_window(…) "
                       "in GROUP BY")
    if struct != window.name:
        raise SqlError(f"{reference.sql(dialect=DIALECT)} {_at(reference)}: the bounds of {window.name}(…) are "
                       f"{window.name}.start and {window.name}.end")
    if value is not reference or reference.name.lower() not in ("start", "end") or not reference.table:
        raise SqlError(f"{value.sql(dialect=DIALECT)} {_at(value)}: a windowed view selects {window.name}.start and "
                       f"{window.name}.end themselves (they come out as window_start and window_end); the whole "
                       "window struct or expressions of it are not supported")
    bound = f"window_{reference.name.lower()}"
    if name and name != bound:
        raise SqlError(f"{reference.sql(dialect=DIALECT)} AS {name!r} {_at(item)}: the window's bounds come out "
                       f"as window_start and window_end (write AS {bound}, or no AS)")
    return bound


def _grouped(query: exp.Select) -> SqlView:
    _refuse_parts(query)
    table, table_at, table_window = _table(query)
    group = query.args.get("group")
    if group is None:
        if any(isinstance(e, exp.Window) for e in query.find_all(exp.Window)):
            window = query.find(exp.Window)
            raise SqlError(f"a window function {_at(window)} outside a Top-N: write SELECT * FROM "
                           "(SELECT ROW_NUMBER() OVER (…) AS place, … FROM topic) WHERE place <= N")
        raise SqlError(f"SELECT {_at(query)} without GROUP BY: a grouped view needs GROUP BY its key "
                       "columns (a single global row is not supported)")
    for part in ("rollup", "cube", "grouping_sets"):
        if group.args.get(part):
            raise SqlError(f"GROUP BY {part.upper().replace('_', ' ')} {_at(group)}: not supported")
    key: list[str] = []
    time_window = table_window
    grouped_bounds = set()
    for item in group.expressions:
        found = _time_window(item)
        if found is not None:
            if time_window is not None:
                raise SqlError(f"a second {found.name}(…) {_at(item)}: a view has one time window")
            time_window = found
            continue
        bound = _table_function_bound(item, time_window, "GROUP BY")
        if bound is not None:
            grouped_bounds.add(bound)
            continue
        column = _column(item, "GROUP BY")
        if column in key:
            raise SqlError(f"GROUP BY names {column!r} twice {_at(item)}")
        key.append(column)
    if table_window is not None and grouped_bounds != set(BOUNDS):
        raise SqlError(f"GROUP BY {_at(group)} over {table_window.name}(…): group by window_start and window_end "
                       "(and the key columns)")
    if time_window is not None and table_window is None:
        for item in group.expressions:
            if isinstance(item, exp.Column) and item.name in BOUNDS:
                raise SqlError(f"GROUP BY {item.name} {_at(item)} beside {time_window.name}(…): the window's own "
                               "columns have that name")
    selected: set[str] = set()
    columns: dict[str, dict[str, str]] = {}
    for item in query.expressions:
        name, value = (item.alias, item.this) if isinstance(item, exp.Alias) else (None, item)
        if isinstance(value, exp.Star):
            raise SqlError(f"SELECT * {_at(item)} in a grouped view: name the key columns and aggregates")
        bound = _window_bound(item, time_window)
        if bound is not None:
            if bound in selected:
                raise SqlError(f"{value.sql(dialect=DIALECT)} {_at(item)} is selected twice")
            selected.add(bound)
            continue
        if isinstance(value, exp.Column):
            column = _column(value, "SELECT")
            if column not in key:
                raise SqlError(f"{column!r} {_at(value)} is neither grouped nor aggregated: add it to GROUP BY "
                               "or aggregate it")
            if name and name != column:
                raise SqlError(f"{column!r} AS {name!r} {_at(item)}: key columns keep their names")
            selected.add(column)
            continue
        agg, column = _aggregate(value)
        name = name or (agg_name(value) if column == "*" else f"{agg_name(value)}_{column}")
        if name in columns or name in key or (time_window is not None and name in BOUNDS):
            raise SqlError(f"two output columns are named {name!r} {_at(item)}: name them apart with AS")
        columns[name] = {agg: column}
    missing = [column for column in key if column not in selected]
    if missing:
        raise SqlError(f"GROUP BY {', '.join(missing)} {_at(group)}: select the grouped columns too "
                       "(a view's rows carry their key)")
    if time_window is not None and not set(BOUNDS) <= selected:
        name = time_window.name
        bounds = "window_start and window_end" if time_window.table_function else f"{name}.start and {name}.end"
        raise SqlError(f"{name}(…) {_at(time_window.node)}: select {bounds} too (a windowed view's rows carry "
                       "their window as window_start and window_end)")
    if not columns:
        raise SqlError(f"SELECT {_at(query)}: a grouped view needs at least one aggregate")
    windowed = {"window": time_window.spec} if time_window is not None else {}
    return SqlView({"key": key, "columns": columns, **windowed, **_where(query, time_window)}, table, table_at)


def agg_name(node: exp.Expression) -> str:
    """The name part an unnamed aggregate gets (`sum`, `count`, `first`, …)."""
    return AGGREGATES[type(node)][1]


def _aggregate(node: exp.Expression) -> tuple[str, str]:
    """(aggregation, column) of one aggregate call."""
    kind = AGGREGATES.get(type(node))
    if kind is None:
        if isinstance(node, exp.Window):
            raise SqlError(f"a window function {_at(node)} in a grouped view: not supported")
        if isinstance(node, exp.AggFunc):
            raise SqlError(f"{_sql_name(node)} {_at(node)}: not an aggregate Refold has (it has {SUPPORTED})")
        raise SqlError(f"{node.sql(dialect=DIALECT)!r} {_at(node)}: a grouped view selects key columns and "
                       f"aggregates of columns ({SUPPORTED})")
    agg = kind[0]
    argument = node.this
    if isinstance(argument, exp.Distinct):
        raise SqlError(f"{_sql_name(node)}(DISTINCT …) {_at(node)}: distinct aggregates are not supported "
                       "(COLLECT_SET gives the distinct values with their live copies)")
    extra = [k for k, a in node.args.items()
             if k not in ("this", "big_int") and a is not None and a is not False and not (isinstance(a, list) and not a)]
    if extra:
        raise SqlError(f"{_sql_name(node)} {_at(node)}: takes one column")
    if agg == "count" and (isinstance(argument, exp.Star) or _is_non_null_literal(argument)):
        return agg, "*"
    if not isinstance(argument, exp.Column):
        shown = argument.sql(dialect=DIALECT) if argument is not None else ""
        raise SqlError(f"{_sql_name(node)}({shown}) {_at(node)}: aggregates take a column, not an expression")
    return agg, _column(argument, _sql_name(node))


def _top_n(outer: exp.Select, subquery: exp.Subquery) -> SqlView:
    inner = subquery.this
    if not isinstance(inner, exp.Select):
        raise SqlError(f"the subquery {_at(subquery)} is not a SELECT")
    where = outer.args.get("where")
    if where is None:
        raise SqlError(f"SELECT … FROM (subquery) {_at(outer)} without WHERE place <= N: a Top-N view "
                       "needs its bound")
    outer_without_where = outer.copy()
    outer_without_where.set("where", None)
    _refuse_parts(outer_without_where)
    if outer.args.get("group") is not None:
        raise SqlError(f"GROUP BY {_at(outer.args['group'])} over a subquery: not supported")
    _refuse_parts(inner)
    if inner.args.get("group") is not None:
        raise SqlError(f"GROUP BY {_at(inner.args['group'])} inside a Top-N: ranking aggregates is not supported")
    table, table_at, table_window = _table(inner)
    for item in [*inner.expressions, *outer.expressions]:
        value = item.this if isinstance(item, exp.Alias) else item
        reference = None if isinstance(value, exp.Window) else _window_reference(value)
        if reference is not None:
            raise SqlError(f"{reference.sql(dialect=DIALECT)} {_at(reference)} in a Top-N: a Top-N per window "
                           "(ROW_NUMBER() OVER (PARTITION BY window(ts, …), …)) carries window_start and "
                           "window_end in its rows itself")
    window: exp.Window | None = None
    inner_columns: list[str] | None = []
    for item in inner.expressions:
        name, value = (item.alias, item.this) if isinstance(item, exp.Alias) else (None, item)
        if isinstance(value, exp.Window):
            if window is not None:
                raise SqlError(f"a second window function {_at(value)}: a Top-N has one ROW_NUMBER()")
            if not isinstance(value.this, exp.RowNumber):
                raise SqlError(f"{_sql_name(value.this)}() {_at(value)}: a Top-N ranks with ROW_NUMBER() "
                               "(ties are broken by event order); RANK and DENSE_RANK are not supported")
            if name != PLACE:
                raise SqlError(f"ROW_NUMBER() OVER (…) {_at(value)} must be named {PLACE!r} (AS {PLACE}): it is "
                               "the Top-N view's key column")
            window = value
        elif isinstance(value, exp.Star):
            inner_columns = None
        elif _table_function_bound(value, table_window, "SELECT") is not None:
            if name and name != value.name:
                raise SqlError(f"{value.name} AS {name!r} {_at(item)}: the window's bounds keep their names")
        elif isinstance(value, exp.Column):
            column = _column(value, "SELECT")
            if name and name != column:
                raise SqlError(f"{column!r} AS {name!r} {_at(item)}: row columns keep their names")
            if column == PLACE:
                raise SqlError(f"a row column named {PLACE!r} {_at(value)}: the place column has that name")
            if inner_columns is not None and column not in inner_columns:
                inner_columns.append(column)
        else:
            raise SqlError(f"{value.sql(dialect=DIALECT)!r} {_at(value)}: a Top-N's subquery selects "
                           "ROW_NUMBER() OVER (…) AS place and columns (or *)")
    if window is None:
        raise SqlError(f"the subquery {_at(subquery)} has no ROW_NUMBER() OVER (…) AS place")
    for part in ("spec", "alias"):
        if window.args.get(part):
            raise SqlError(f"ROW_NUMBER() OVER (…) {_at(window)}: a window frame or a named window is not supported")
    partition_by = []
    time_window = table_window
    partitioned_bounds = set()
    for item in window.args.get("partition_by") or []:
        bound = _table_function_bound(item, table_window, "PARTITION BY")
        if bound is not None:
            partitioned_bounds.add(bound)
            continue
        found = _time_window(item)
        if found is not None:
            if found.session:
                raise SqlError(f"session_window(…) {_at(item)} in a Top-N: a Top-N ranks per tumbling or hopping "
                               "window (window(…)); session windows are not supported there")
            if time_window is not None:
                raise SqlError(f"a second {found.name}(…) {_at(item)}: a Top-N ranks per one time window")
            time_window = found
            continue
        column = _column(item, "PARTITION BY")
        if column not in partition_by:
            partition_by.append(column)
    if table_window is not None and partitioned_bounds != set(BOUNDS):
        raise SqlError(f"ROW_NUMBER() OVER (…) {_at(window)} over {table_window.name}(…): partition by window_start "
                       "and window_end (and the partition columns): a Top-N over a window table function ranks "
                       "per window")
    order = window.args.get("order")
    if order is None or not order.expressions:
        raise SqlError(f"ROW_NUMBER() OVER (…) {_at(window)} needs ORDER BY: a Top-N ranks by its columns")
    order_by: dict[str, str] = {}
    for ordered in order.expressions:
        if _table_function_bound(ordered.this, table_window, "ORDER BY") is not None:
            raise SqlError(f"ORDER BY {ordered.this.sql(dialect=DIALECT)} {_at(ordered)}: a Top-N per window ranks "
                           "within its window; order by the row's columns")
        column = _column(ordered.this, "ORDER BY")
        desc = bool(ordered.args.get("desc"))
        if ordered.args.get("nulls_first"):
            raise SqlError(f"ORDER BY {column} {'DESC' if desc else 'ASC'} {_at(ordered)}: Refold ranks nulls last "
                           f"in either direction (Spark's default puts them first for ASC): write "
                           f"{column} {'DESC' if desc else 'ASC'} NULLS LAST")
        if column in order_by:
            raise SqlError(f"ORDER BY names {column!r} twice {_at(ordered)}")
        order_by[column] = "desc" if desc else "asc"
    if inner_columns is not None:
        missing = [c for c in partition_by if c not in inner_columns]
        if missing:
            raise SqlError(f"PARTITION BY {', '.join(missing)} {_at(window)}: select the partition columns too "
                           "(a Top-N's rows carry them)")
    n = _place_bound(where.this)
    columns = _outer_columns(outer, inner_columns, partition_by, table_window)
    top_n: dict[str, Any] = {"n": n, "order_by": order_by, "partition_by": partition_by}
    if columns is not None:
        top_n["columns"] = [c for c in columns if c not in partition_by]
    windowed = {"window": time_window.spec} if time_window is not None else {}
    return SqlView({"top_n": top_n, **windowed, **_where(inner, time_window)}, table, table_at)


def _where(query: exp.Select, window: _TimeWindow | None = None) -> dict[str, str]:
    """`{"where": condition}` of a SELECT's WHERE (checked: `refold.model.predicate`)."""
    where = query.args.get("where")
    if where is None:
        return {}
    if window is not None and window.table_function:
        for column in where.this.find_all(exp.Column):
            if column.name in (*BOUNDS, WINDOW_TIME):
                raise SqlError(f"WHERE … {column.name} {_at(column)}: WHERE filters the source rows, before their "
                               "window; a filter on windows is not supported")
    reference = _window_reference(where.this)
    if reference is not None:
        raise SqlError(f"WHERE … {reference.sql(dialect=DIALECT)} {_at(reference)}: WHERE filters the source rows, "
                       "which have no window; a filter on windows is not supported")
    from refold.model.predicate import compile_condition

    try:
        compile_condition(where.this)
    except ValueError as exc:
        raise SqlError(f"{exc} {_at(where)}".replace("where: ", "WHERE ", 1)) from None
    return {"where": where.this.sql(dialect=DIALECT)}


def _outer_columns(outer: exp.Select, inner: list[str] | None, partition_by: list[str],
                   window: _TimeWindow | None) -> list[str] | None:
    """The row columns the outer SELECT keeps: None for all of the source row's."""
    items = outer.expressions
    if len(items) == 1 and isinstance(items[0], exp.Star):
        return inner
    columns: list[str] = []
    for item in items:
        name, value = (item.alias, item.this) if isinstance(item, exp.Alias) else (None, item)
        if _table_function_bound(value, window, "SELECT") is not None:
            if name and name != value.name:
                raise SqlError(f"{value.name} AS {name!r} {_at(item)}: the window's bounds keep their names")
            continue
        if not isinstance(value, exp.Column):
            raise SqlError(f"{value.sql(dialect=DIALECT)!r} {_at(value)}: the outer SELECT of a Top-N "
                           "selects * or columns of its subquery")
        column = _column(value, "SELECT")
        if name and name != column:
            raise SqlError(f"{column!r} AS {name!r} {_at(item)}: columns keep their names")
        if inner is not None and column != PLACE and column not in inner:
            raise SqlError(f"{column!r} {_at(value)} is not a column of the subquery")
        if column not in columns:
            columns.append(column)
    if PLACE not in columns:
        raise SqlError(f"the outer SELECT {_at(outer)} must select {PLACE!r}: it is the Top-N view's key")
    missing = [c for c in partition_by if c not in columns]
    if missing:
        raise SqlError(f"the outer SELECT {_at(outer)} must select the partition columns ({', '.join(missing)})")
    return [c for c in columns if c != PLACE]


def _place_bound(condition: exp.Expression) -> int:
    """N of `place <= N` (or `place < N + 1`, `N >= place`)."""
    comparisons: dict[type[exp.Expression], tuple[bool, int]] = {
        exp.LTE: (True, 0), exp.LT: (True, -1), exp.GTE: (False, 0), exp.GT: (False, -1),
    }
    kind = comparisons.get(type(condition))
    if kind is None:
        raise SqlError(f"WHERE {condition.sql(dialect=DIALECT)} {_at(condition)}: a Top-N's only condition is "
                       f"{PLACE} <= N (or {PLACE} < N)")
    place_left, adjust = kind
    place_side, bound = (condition.this, condition.expression) if place_left else (condition.expression, condition.this)
    if not (isinstance(place_side, exp.Column) and place_side.name == PLACE):
        raise SqlError(f"WHERE {condition.sql(dialect=DIALECT)} {_at(condition)}: a Top-N's only condition is "
                       f"{PLACE} <= N (or {PLACE} < N)")
    if not (isinstance(bound, exp.Literal) and not bound.is_string and bound.this.isdigit()):
        raise SqlError(f"WHERE … {bound.sql(dialect=DIALECT)} {_at(bound)}: the Top-N's bound must be a whole "
                       "number literal")
    n = int(bound.this) + adjust
    if not 1 <= n <= MAX_N:
        raise SqlError(f"WHERE {condition.sql(dialect=DIALECT)} {_at(condition)}: N must be within 1..{MAX_N}")
    return n


def _refuse_parts(query: exp.Select) -> None:
    for part, message in REFUSED_PARTS.items():
        value = query.args.get(part)
        if value:
            node = value[0] if isinstance(value, list) else value
            raise SqlError(f"{message} ({_at(node).strip('()')})")


def _table(query: exp.Select) -> tuple[str, str, _TimeWindow | None]:
    """The source table a SELECT reads: its full dotted name, where it is named, and the
    window of Flink's window table function around it (None: a plain table)."""
    source = query.args.get("from_")
    if source is None:
        raise SqlError(f"SELECT {_at(query)} without FROM: name the source topic")
    table = source.this
    if (isinstance(table, exp.Table) and isinstance(table.this, exp.Anonymous)
            and str(table.this.this).upper() == "TABLE"):
        if table.args.get("joins") or query.args.get("joins"):
            raise SqlError(f"{REFUSED_PARTS['joins']} ({_at(table).strip('()')})")
        return _table_function(table.this)
    if not isinstance(table, exp.Table) or not isinstance(table.this, exp.Identifier):
        raise SqlError(f"FROM {source.sql(dialect=DIALECT)} {_at(source)}: a view reads one source topic")
    if table.args.get("joins"):
        raise SqlError(f"{REFUSED_PARTS['joins']} ({_at(table).strip('()')})")
    parts = [part.name for part in table.parts]
    return ".".join(parts), _at(table), None


def _table_function(call: exp.Anonymous) -> tuple[str, str, _TimeWindow]:
    """The table and the window of `TABLE(TUMBLE(TABLE t, DESCRIPTOR(ts), size))` or
    `TABLE(HOP(TABLE t, DESCRIPTOR(ts), slide, size))` (Flink's argument order)."""
    inner = call.expressions
    if len(inner) != 1 or not isinstance(inner[0], exp.Anonymous) \
            or str(inner[0].this).lower() not in FLINK_TABLE_FUNCTIONS:
        raise SqlError(f"FROM TABLE(…) {_at(call)}: the table functions Refold reads are Flink's TUMBLE and HOP")
    function = inner[0]
    kind = str(function.this).upper()
    shown = f"{kind}(…) {_at(function)}"
    usage = ("TUMBLE(TABLE t, DESCRIPTOR(ts), size)" if kind == "TUMBLE"
             else "HOP(TABLE t, DESCRIPTOR(ts), slide, size)")
    arguments = function.expressions
    expected = 3 if kind == "TUMBLE" else 4
    if len(arguments) == expected + 1:
        raise SqlError(f"{shown}: an offset (its last argument) is not supported: Refold's windows are aligned to "
                       "the epoch (a 1 hour window starts on the hour, UTC)")
    if len(arguments) != expected:
        raise SqlError(f"{shown}: write {usage}")
    data, descriptor, *lengths = arguments
    if not isinstance(data, exp.Column):
        raise SqlError(f"{shown}: its table {data.sql(dialect=DIALECT)} {_at(data)}: write TABLE topic (one source "
                       f"topic): {usage}")
    if not (isinstance(descriptor, exp.Anonymous) and str(descriptor.this).upper() == "DESCRIPTOR"
            and len(descriptor.expressions) == 1 and isinstance(descriptor.expressions[0], exp.Column)):
        raise SqlError(f"{shown}: its time column {descriptor.sql(dialect=DIALECT)} {_at(descriptor)}: write "
                       f"DESCRIPTOR(column): {usage}")
    time = descriptor.expressions[0].name
    spec: dict[str, Any] = ({"tumble": _duration(lengths[0], shown)} if kind == "TUMBLE" else
                            {"hop": {"size": _duration(lengths[1], shown), "slide": _duration(lengths[0], shown)}})
    table = ".".join(part.name for part in data.parts)
    return table, _at(data), _TimeWindow(kind, {"time": time, **spec}, function)


def _column(node: exp.Expression, context: str) -> str:
    """The name of a plain column reference (a table qualifier is allowed)."""
    if not isinstance(node, exp.Column):
        raise SqlError(f"{context} {node.sql(dialect=DIALECT)} {_at(node)}: a plain column is expected here")
    if _window_reference(node) is not None:
        raise SqlError(f"{context} {node.sql(dialect=DIALECT)} {_at(node)}: the window's bounds are not columns of "
                       "the source rows; write window(ts, …) itself in GROUP BY or PARTITION BY")
    return node.name


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
