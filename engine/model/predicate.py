"""A view's row filter (`view.where`, a SQL view's `WHERE`): which source rows it reduces.

The condition is SQL (Spark's dialect, parsed by `sqlglot`) over the row's columns:
comparisons (`=`, `<>`/`!=`, `<`, `<=`, `>`, `>=`), `AND`, `OR`, `NOT`, `IS [NOT]
NULL`, `[NOT] IN (literals)`, `[NOT] BETWEEN`, with column names and literals
(numbers, strings, `TRUE`/`FALSE`, `NULL`). It has SQL's three values: a comparison
with a null (or absent) column is unknown, and a row is kept only when the condition
is true. A comparison between a number and a string (or a boolean) is not guessed
at: the event is refused (`schema mismatch`) and dead-lettered.

How the filter applies to a changelog's units, exactly under retraction:
`refold.reduce.where`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, TokenError

DIALECT = "spark"
Row = dict[str, Any]
Truth = bool | None  # SQL's three values: None is unknown
Condition = Callable[[Row], Truth]


class FilterTypeError(Exception):
    """A comparison of values of different kinds (a number and a string)."""


def parse_condition(text: str) -> Any:
    """The condition's syntax tree; ValueError naming what it cannot read."""
    try:
        node = sqlglot.parse_one(text, read=DIALECT)
    except (ParseError, TokenError) as exc:
        raise ValueError(f"where: not a condition Refold can read: {exc}") from exc
    compile_condition(node)  # refuses what it cannot evaluate
    return node


def compile_condition(node: Any) -> Condition:
    """A function of a row giving True, False or None (unknown)."""
    if isinstance(node, exp.Paren):
        return compile_condition(node.this)
    if isinstance(node, exp.And):
        left, right = compile_condition(node.this), compile_condition(node.expression)
        return lambda row: _and(left(row), right(row))
    if isinstance(node, exp.Or):
        left, right = compile_condition(node.this), compile_condition(node.expression)
        return lambda row: _or(left(row), right(row))
    if isinstance(node, exp.Not):
        inner = compile_condition(node.this)
        return lambda row: _not(inner(row))
    if isinstance(node, exp.Is):
        value = _operand(node.this)
        if not isinstance(node.expression, exp.Null):
            raise ValueError(f"where: {node.sql(dialect=DIALECT)}: only IS NULL and IS NOT NULL")
        return lambda row: value(row) is None
    if type(node) in _COMPARISONS:
        left_value, right_value = _operand(node.this), _operand(node.expression)
        compare = _COMPARISONS[type(node)]
        return lambda row: _compare(compare, left_value(row), right_value(row))
    if isinstance(node, exp.In):
        value = _operand(node.this)
        if node.args.get("query") or node.args.get("unnest") or node.args.get("field"):
            raise ValueError(f"where: {node.sql(dialect=DIALECT)}: IN takes a list of literals")
        options = [_literal(option) for option in node.expressions]
        return lambda row: _in(value(row), options)
    if isinstance(node, exp.Between):
        value, low, high = _operand(node.this), _operand(node.args["low"]), _operand(node.args["high"])
        return lambda row: _and(_compare(_ge, value(row), low(row)), _compare(_le, value(row), high(row)))
    if isinstance(node, exp.Boolean):
        truth = bool(node.this)
        return lambda row: truth
    if isinstance(node, exp.Column):  # a boolean column
        name = node.name
        return lambda row: _boolean(row.get(name))
    raise ValueError(f"where: {node.sql(dialect=DIALECT)}: not a condition Refold evaluates (comparisons, AND, "
                     "OR, NOT, IS NULL, IN, BETWEEN over columns and literals)")


def _operand(node: Any) -> Callable[[Row], Any]:
    if isinstance(node, exp.Paren):
        return _operand(node.this)
    if isinstance(node, exp.Column):
        name = node.name
        return lambda row: row.get(name)
    value = _literal(node)
    return lambda row: value


def _literal(node: Any) -> Any:
    if isinstance(node, exp.Null):
        return None
    if isinstance(node, exp.Boolean):
        return bool(node.this)
    if isinstance(node, exp.Neg) and isinstance(node.this, exp.Literal) and not node.this.is_string:
        return -_number(node.this.this)
    if isinstance(node, exp.Literal):
        return node.this if node.is_string else _number(node.this)
    raise ValueError(f"where: {node.sql(dialect=DIALECT)}: a column or a literal is expected here")


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return type(value).__name__


def _compare(compare: Callable[[Any, Any], bool], left: Any, right: Any) -> Truth:
    if left is None or right is None:
        return None
    kinds = _kind(left), _kind(right)
    if kinds[0] != kinds[1] or kinds[0] not in ("boolean", "number", "string"):
        raise FilterTypeError(f"a {kinds[0]} compared with a {kinds[1]}")
    return compare(left, right)


def _in(value: Any, options: list[Any]) -> Truth:
    if value is None:
        return None
    found: Truth = False
    for option in options:
        truth = _compare(_eq, value, option)
        if truth:
            return True
        if truth is None:
            found = None
    return found


def _boolean(value: Any) -> Truth:
    if value is None or isinstance(value, bool):
        return value
    raise FilterTypeError(f"a {_kind(value)} used as a condition")


def _and(left: Truth, right: Truth) -> Truth:
    if left is False or right is False:
        return False
    if left is None or right is None:
        return None
    return True


def _or(left: Truth, right: Truth) -> Truth:
    if left is True or right is True:
        return True
    if left is None or right is None:
        return None
    return False


def _not(value: Truth) -> Truth:
    return None if value is None else not value


def _eq(a: Any, b: Any) -> bool:
    return bool(a == b)


def _le(a: Any, b: Any) -> bool:
    return bool(a <= b)


def _ge(a: Any, b: Any) -> bool:
    return bool(a >= b)


_COMPARISONS: dict[type[exp.Expression], Callable[[Any, Any], bool]] = {
    exp.EQ: _eq,
    exp.NEQ: lambda a, b: bool(a != b),
    exp.LT: lambda a, b: bool(a < b),
    exp.LTE: _le,
    exp.GT: lambda a, b: bool(a > b),
    exp.GTE: _ge,
}
