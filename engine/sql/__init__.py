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
(`where`, `refold.model.predicate`). `FROM a JOIN b ON a.x = b.y` is a join of two of
the pipeline's sources (`refold.sql.joins`). Anything else — other joins, `HAVING`,
`DISTINCT`, windows other than `ROW_NUMBER`, a place bound that is not a literal,
expressions inside aggregates or of the window's bounds, Flink's `CUMULATE`/`SESSION`,
`ORDER BY`/`LIMIT` outside the window — is refused by
`SqlError`, naming the construct and where it stands in the query, before anything
starts: Refold runs a query only when it can run it exactly under retraction.
"""

from __future__ import annotations

from typing import Any

from sqlglot import exp
from sqlglot.errors import ParseError, TokenError

from refold.sql.common import (
    AGGREGATES,
    BOUNDS,
    DIALECT,
    MAX_N,
    PLACE,
    REFUSED_PARTS,
    SUPPORTED,
    WINDOW_TIME,
    SqlError,
    SqlView,
    _at,
    _is_non_null_literal,
    _sql_name,
)
from refold.sql.windows import (
    _parse,
    _table_function,
    _table_function_bound,
    _time_window,
    _TimeWindow,
    _window_bound,
    _window_reference,
)


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
    for subquery in query.find_all(exp.Subquery):
        for inner in subquery.find_all(exp.Join):
            raise SqlError(f"JOIN inside a subquery {_at(inner)}: not supported (a join is the query's own "
                           "FROM a JOIN b ON …)")
    source = query.args.get("from_")
    if query.args.get("joins"):
        from refold.sql.joins import join_view

        return join_view(query)
    if source is not None and isinstance(source.this, exp.Subquery):
        return _top_n(query, source.this)
    return _grouped(query)


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


def _column(node: exp.Expression, context: str) -> str:
    """The name of a plain column reference (a table qualifier is allowed)."""
    if not isinstance(node, exp.Column):
        raise SqlError(f"{context} {node.sql(dialect=DIALECT)} {_at(node)}: a plain column is expected here")
    if _window_reference(node) is not None:
        raise SqlError(f"{context} {node.sql(dialect=DIALECT)} {_at(node)}: the window's bounds are not columns of "
                       "the source rows; write window(ts, …) itself in GROUP BY or PARTITION BY")
    return node.name
