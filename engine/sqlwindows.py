"""Event-time windows in a view's SQL (`refold.sql`), as Spark writes them:

    SELECT team, window.start, window.end, SUM(points) AS points
    FROM scores GROUP BY window(at, '1 hour'), team

- `window(t, '<size>')` → `window: {time: t, tumble: <size>}`;
  `window(t, '<size>', '<slide>')` → a hop; `session_window(t, '<gap>')` → a session.
  Durations are Spark's interval strings (`'1 hour'`, `'15 minutes'`, `'1 hour 30
  minutes'`) or `INTERVAL` literals (`INTERVAL 1 HOUR`), written into the spec in the
  largest unit that divides them (`1h`, `90m`, `500ms`).
- `window.start` and `window.end` (`session_window.…` for a session) are the output
  columns `window_start` and `window_end`; a query selects both (a windowed view's rows
  carry their window), unaliased or `AS window_start`/`AS window_end`.
- A `lateness` has no SQL form (Spark's watermark is set outside the query): write it
  beside the query, `view: {sql: …, window: {lateness: 10m}}`.

Spark's parser reads `window(…)` only in its own grammar; `sqlglot` does not, so the
`window` of `window(` and `window.` is renamed before parsing (same length, so every
position in an error stays right). Flink's window table functions (`TUMBLE(…)`,
`HOP(…)`, `SESSION(…)`, `CUMULATE(…)`) are refused by name.
"""

from __future__ import annotations

import itertools
import re
from typing import Any, Final

import sqlglot
from sqlglot import exp
from sqlglot.errors import TokenError

RENAMED: Final = "rf_win"  # `window` renamed (as long as it)
SESSION: Final = "session_window"
REFUSED: Final = ("tumble", "hop", "session", "cumulate")
_UNITS_MS: Final = {"millisecond": 1, "second": 1000, "minute": 60_000, "hour": 3_600_000, "day": 86_400_000,
                    "week": 7 * 86_400_000}
_SHOWN: Final = (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1))
_PART = re.compile(r"\s*(\d+)\s*([a-z]+)\s*", re.IGNORECASE)


class SqlWindowError(ValueError):
    """A window the query writes in a way Refold does not read (`refold.sql` names it)."""


def renamed(sql: str, dialect: str) -> str:
    """The query with `window(`/`window.` renamed for the parser; SqlWindowError for
    Flink's window functions."""
    try:
        tokens = sqlglot.tokenize(sql, read=dialect)
    except TokenError:
        return sql
    out = sql
    for token, following in itertools.pairwise(tokens):
        name = token.text.lower()
        if name in REFUSED and following.text == "(":
            column = token.col - (token.end - token.start)
            raise SqlWindowError(f"{token.text}(…) (line {token.line}, column {column}): Flink's window table "
                                 "functions are not supported; write GROUP BY window(t, '1 hour'), … "
                                 "(or session_window(t, '30 minutes'))")
        if name == "window" and following.text in ("(", "."):
            out = out[:token.start] + RENAMED + out[token.end + 1:]
    return out


def is_window(node: exp.Expression) -> bool:
    """Whether a node is a `window(…)` or `session_window(…)` call."""
    return isinstance(node, exp.Anonymous) and str(node.this).lower() in (RENAMED, SESSION)


def window_of(node: exp.Anonymous, at: str) -> dict[str, Any]:
    """The `view.window` mapping of a `window(…)`/`session_window(…)` in GROUP BY."""
    session = str(node.this).lower() == SESSION
    name = SESSION if session else "window"
    args = node.expressions
    if not args or not isinstance(args[0], exp.Column):
        raise SqlWindowError(f"{name}(…) {at}: its first argument is the event-time column")
    time = args[0].name
    durations = [duration(arg, name, at) for arg in args[1:]]
    if session:
        if len(durations) != 1:
            raise SqlWindowError(f"session_window(…) {at}: takes the column and the gap")
        return {"time": time, "session": {"gap": durations[0]}}
    if len(durations) == 1:
        return {"time": time, "tumble": durations[0]}
    if len(durations) == 2:
        return {"time": time, "hop": {"size": durations[0], "slide": durations[1]}}
    raise SqlWindowError(f"window(…) {at}: takes the column, the size and maybe the slide (a start offset is "
                         "not supported: windows are aligned to the epoch)")


def duration(node: exp.Expression, name: str, at: str) -> str:
    """A Spark interval (a string or an `INTERVAL` literal) as a config duration."""
    if isinstance(node, exp.Literal) and node.is_string:
        text = node.this
    elif isinstance(node, exp.Interval):
        unit = node.args.get("unit")
        text = f"{node.this.name} {unit.name if unit is not None else ''}"
    else:
        raise SqlWindowError(f"{name}(…) {at}: a duration is a string ('1 hour') or an INTERVAL literal")
    total, pos = 0, 0
    text = text.strip()
    if text.lower().startswith("interval "):
        text = text[len("interval "):]
    while pos < len(text):
        match = _PART.match(text, pos)
        unit = match.group(2).lower() if match else ""
        if unit.endswith("s") and unit[:-1] in _UNITS_MS:
            unit = unit[:-1]
        if match is None or unit not in _UNITS_MS:
            raise SqlWindowError(f"{name}(…) {at}: {text!r} is not a duration Refold reads (e.g. '1 hour', "
                                 "'15 minutes', '1 hour 30 minutes')")
        total += int(match.group(1)) * _UNITS_MS[unit]
        pos = match.end()
    if total <= 0:
        raise SqlWindowError(f"{name}(…) {at}: {text!r} is not a positive duration")
    return next(f"{total // ms}{unit}" for unit, ms in _SHOWN if total % ms == 0)


def bound_of(node: exp.Expression) -> str | None:
    """`window_start`/`window_end` for a selected `window.start`/`window.end`
    (`session_window.…`), None for any other column."""
    if not isinstance(node, exp.Column) or node.table.lower() not in (RENAMED, SESSION):
        return None
    if node.name.lower() == "start":
        return "window_start"
    if node.name.lower() == "end":
        return "window_end"
    return None
