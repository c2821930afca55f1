"""Time windows in SQL: Spark's `window(…)`/`session_window(…)` and Flink's window table
functions, read into `view.window` (the module docstring of `refold.sql`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

from sqlglot import exp
from sqlglot.dialects.dialect import Dialect
from sqlglot.tokens import TokenType

from refold.sql.common import (
    BOUNDS,
    DIALECT,
    FLINK_TABLE_FUNCTIONS,
    FLINK_WINDOWS,
    STRUCTS,
    WINDOW_TIME,
    SqlError,
    _at,
)


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
