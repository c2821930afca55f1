"""Joins in SQL: `SELECT … FROM a [AS x] [INNER | LEFT [OUTER] | RIGHT [OUTER] | FULL
[OUTER]] JOIN b [AS y] ON x.c = y.d [AND …]`, becoming `view.join` (docs/SEMANTICS.md,
Joins), optionally followed by `GROUP BY` aggregates over the joined rows (a grouped
view over the join's output, `key` + `columns` beside `join`).

The tables are the pipeline's sources by their names in `sources:`. Every column is
qualified by its table's name or alias (the sources' schemas are not known here, so an
unqualified column could be either's). Without GROUP BY, each selected column (`x.c` or
`x.c AS name`) becomes an output column, `name` (default: the column's name) →
`<source>.<column>`. With GROUP BY, the columns the query names become the
join's output columns under their own names, and the grouped view reduces those.
`RIGHT JOIN` is the `LEFT JOIN` of the tables swapped. Refused, by line and column: a
condition other than an AND of equalities of a column of each table, `USING`,
`NATURAL`, `CROSS`/`SEMI`/`ANTI` joins, more than one join, a join of a subquery or in
one, a table joined with itself, `SELECT *`, unqualified columns, `WHERE` beside a join,
and time windows or a Top-N over a join.
"""

from __future__ import annotations

from typing import Any

from sqlglot import exp

from refold.sql.common import DIALECT, REFUSED_PARTS, SqlError, SqlView, _at
from refold.sql.windows import _time_window

JOIN_TABLE = "__join__"  # the table the grouped part of a query reads: the join's output


def join_view(query: exp.Select) -> SqlView:
    """The view of a SELECT whose FROM has a JOIN."""
    from refold.sql import _grouped

    for part, message in REFUSED_PARTS.items():
        if part != "joins" and query.args.get(part):
            value = query.args[part]
            node = value[0] if isinstance(value, list) else value
            raise SqlError(f"{message} ({_at(node).strip('()')})")
    joins = query.args["joins"]
    if len(joins) > 1:
        raise SqlError(f"a second JOIN, of {joins[1].this.name} {_at(joins[1])}: a view joins two "
                       "sources (one JOIN)")
    join = joins[0]
    if query.args.get("where") is not None:
        raise SqlError(f"WHERE {_at(query.args['where'])} beside a JOIN: not supported yet")
    first = _source(query.args["from_"].this, "FROM")
    second = _source(join.this, "JOIN")
    if first[0] == second[0]:
        raise SqlError(f"JOIN {_at(join)}: {first[0]!r} joined with itself is not supported")
    aliases = {first[1]: first[0], second[1]: second[0]}
    if len(aliases) < 2:
        raise SqlError(f"JOIN {_at(join)}: the two tables need names apart (AS …)")
    kind = _kind(join)
    left, right = (second[0], first[0]) if kind == "right" else (first[0], second[0])
    on = _condition(join, aliases, left)
    spec: dict[str, Any] = {"left": left, "right": right, "on": on,
                            "type": "left" if kind == "right" else kind}
    group = query.args.get("group")
    if group is None:
        spec["columns"] = _selected(query, aliases)
        return SqlView({"join": spec}, left, _at(query.args["from_"].this), tables=_tables(first, second, query, join))
    # GROUP BY over the join: its columns are the columns the query names, by their own names
    for item in group.expressions:
        if _time_window(item) is not None:
            raise SqlError(f"a time window {_at(item)} over a JOIN: not supported yet")
    reduced = query.copy()
    reduced.set("joins", None)
    reduced.set("from_", exp.From(this=exp.to_table(JOIN_TABLE)))
    columns: dict[str, str] = {}
    for column in list(reduced.find_all(exp.Column)):
        if isinstance(column.parent, exp.Join):
            continue
        source = _qualified(column, aliases)
        name = column.name
        if columns.setdefault(name, source) != source:
            raise SqlError(f"{column.sql(dialect=DIALECT)} {_at(column)}: {name!r} of both tables is named in a "
                           "grouped join; not supported yet")
        column.set("table", None)
    grouped = _grouped(reduced)
    if "window" in grouped.spec:
        raise SqlError(f"a time window {_at(group)} over a JOIN: not supported yet")
    spec["columns"] = columns
    return SqlView({"join": spec, **grouped.spec}, left, _at(query.args["from_"].this),
                   tables=_tables(first, second, query, join))


def _tables(first: tuple[str, str], second: tuple[str, str], query: exp.Select,
            join: exp.Join) -> tuple[tuple[str, str], ...]:
    return ((first[0], _at(query.args["from_"].this)), (second[0], _at(join.this)))


def _source(table: exp.Expression, where: str) -> tuple[str, str]:
    """(source name, the name the query calls it by) of a FROM or JOIN table."""
    if isinstance(table, exp.Subquery):
        raise SqlError(f"{where} (subquery) {_at(table)}: a join of a subquery is not supported; join sources")
    if not isinstance(table, exp.Table) or not isinstance(table.this, exp.Identifier):
        raise SqlError(f"{where} {table.sql(dialect=DIALECT)} {_at(table)}: a join reads sources by their names")
    if len(table.parts) > 1:
        raise SqlError(f"{where} {table.sql(dialect=DIALECT)} {_at(table)}: a join names sources by their "
                       "names in sources: (no dots)")
    return table.name, table.alias_or_name


def _kind(join: exp.Join) -> str:
    side = (join.side or "").upper()
    kind = (join.kind or "").upper()
    if join.args.get("using"):
        raise SqlError(f"JOIN … USING {_at(join)}: not supported; write ON a.x = b.x")
    if join.args.get("method"):
        raise SqlError(f"{str(join.args['method']).upper()} JOIN {_at(join)}: not supported; write ON a.x = b.y")
    if kind in ("CROSS", "SEMI", "ANTI") or join.args.get("on") is None:
        shown = f"{kind} JOIN" if kind else "a JOIN without ON"
        raise SqlError(f"{shown} {_at(join)}: not supported; a view joins on equal columns (ON a.x = b.y)")
    if kind not in ("", "INNER", "OUTER") or (kind == "OUTER" and not side) or side not in ("", "LEFT", "RIGHT", "FULL"):
        raise SqlError(f"{side} {kind} JOIN {_at(join)}: not supported".replace("  ", " ").lstrip())
    return {"": "inner", "LEFT": "left", "RIGHT": "right", "FULL": "full"}[side]


def _condition(join: exp.Join, aliases: dict[str, str], left: str) -> list[list[str]]:
    """The [left column, right column] pairs of an ON that is an AND of equalities."""
    pairs: list[list[str]] = []
    pending = [join.args["on"]]
    while pending:
        node = pending.pop(0)
        if isinstance(node, exp.Paren):
            pending.insert(0, node.this)
            continue
        if isinstance(node, exp.And):
            pending[:0] = [node.this, node.expression]
            continue
        if not isinstance(node, exp.EQ) or not all(isinstance(s, exp.Column) for s in (node.this, node.expression)):
            raise SqlError(f"ON … {node.sql(dialect=DIALECT)} {_at(node)}: a join's condition is an AND of "
                           "equalities of a column of each table (a.x = b.y); not supported")
        a, b = (_qualified(side, aliases) for side in (node.this, node.expression))
        (a_source, a_column), (b_source, b_column) = (s.split(".", 1) for s in (a, b))
        if a_source == b_source:
            raise SqlError(f"ON … {node.sql(dialect=DIALECT)} {_at(node)}: compare a column of each table")
        pair = [a_column, b_column] if a_source == left else [b_column, a_column]
        if pair not in pairs:
            pairs.append(pair)
    return pairs


def _qualified(column: exp.Column, aliases: dict[str, str]) -> str:
    """`<source>.<column>` of a column reference qualified by a table's name or alias."""
    table = column.table
    if not table:
        raise SqlError(f"{column.sql(dialect=DIALECT)} {_at(column)}: qualify the column with its table "
                       f"({' or '.join(aliases)}) in a join")
    if table not in aliases:
        raise SqlError(f"{column.sql(dialect=DIALECT)} {_at(column)}: {table!r} is not a table of the join "
                       f"({', '.join(aliases)})")
    if column.args.get("db") or column.args.get("catalog"):
        raise SqlError(f"{column.sql(dialect=DIALECT)} {_at(column)}: write table.column")
    return f"{aliases[table]}.{column.name}"


def _selected(query: exp.Select, aliases: dict[str, str]) -> dict[str, str]:
    """A join's output columns from its SELECT list: name → `<source>.<column>`."""
    columns: dict[str, str] = {}
    for item in query.expressions:
        name, value = (item.alias, item.this) if isinstance(item, exp.Alias) else (None, item)
        if isinstance(value, exp.Star) or (isinstance(value, exp.Column) and isinstance(value.this, exp.Star)):
            raise SqlError(f"SELECT * {_at(item)} over a JOIN: name the columns (a.x, b.y AS z)")
        if not isinstance(value, exp.Column):
            raise SqlError(f"{value.sql(dialect=DIALECT)!r} {_at(item)}: a join selects columns of its tables "
                           "(or GROUP BY aggregates of them)")
        name = name or value.name
        if name in columns:
            raise SqlError(f"two output columns are named {name!r} {_at(item)}: name them apart with AS")
        columns[name] = _qualified(value, aliases)
    return columns
