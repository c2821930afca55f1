"""SQL joins (`refold.sql.joins`) and the pipeline file's `sources:` and `view.join`."""

from __future__ import annotations

from typing import Any

import pytest

from refold.config import JoinSpec, parse_pipeline
from refold.errors import ConfigError
from refold.sql import SqlError, translate


def join_of(sql: str) -> dict[str, Any]:
    return translate(sql).spec


def test_inner_join_with_aliases() -> None:
    spec = join_of("SELECT o.id, o.amount, c.region AS area FROM orders AS o JOIN customers c ON o.cust = c.id")
    assert spec == {"join": {"left": "orders", "right": "customers", "on": [["cust", "id"]], "type": "inner",
                             "columns": {"id": "orders.id", "amount": "orders.amount", "area": "customers.region"}}}
    JoinSpec.model_validate(spec["join"])


@pytest.mark.parametrize(("written", "kind"), [
    ("JOIN", "inner"), ("INNER JOIN", "inner"), ("LEFT JOIN", "left"), ("LEFT OUTER JOIN", "left"),
    ("FULL OUTER JOIN", "full"), ("FULL JOIN", "full"),
])
def test_join_kinds(written: str, kind: str) -> None:
    spec = join_of(f"SELECT orders.id, customers.region FROM orders {written} customers ON orders.cust = customers.id")
    assert spec["join"]["type"] == kind
    assert spec["join"]["left"] == "orders"


def test_right_join_is_the_left_join_swapped() -> None:
    spec = join_of("SELECT o.id, c.region FROM orders o RIGHT JOIN customers c ON c.id = o.cust AND o.shop = c.shop")
    assert spec["join"] == {"left": "customers", "right": "orders", "on": [["id", "cust"], ["shop", "shop"]],
                            "type": "left", "columns": {"id": "orders.id", "region": "customers.region"}}


def test_grouped_view_over_a_join() -> None:
    spec = join_of("SELECT c.region, SUM(o.amount) AS revenue, COUNT(*) AS orders\n"
                   "FROM orders o LEFT JOIN customers c ON o.cust = c.id GROUP BY c.region")
    assert spec == {
        "join": {"left": "orders", "right": "customers", "on": [["cust", "id"]], "type": "left",
                 "columns": {"region": "customers.region", "amount": "orders.amount"}},
        "key": ["region"],
        "columns": {"revenue": {"sum": "amount"}, "orders": {"count": "*"}},
    }


@pytest.mark.parametrize(("sql", "message"), [
    ("SELECT o.id FROM orders o JOIN customers c ON o.cust > c.id", r"ON … o.cust > c.id \(line 1, column 47\).*equalities"),
    ("SELECT o.id FROM orders o JOIN customers c ON o.cust = c.id OR o.x = c.y", "ON … .*OR.*equalities"),
    ("SELECT o.id FROM orders o JOIN customers c ON o.cust = 1", "equalities"),
    ("SELECT o.id FROM orders o JOIN customers c ON o.cust = c.id JOIN shops s ON s.id = o.shop",
     r"a second JOIN, of shops \(line 1, column 66\)"),
    ("SELECT * FROM (SELECT ROW_NUMBER() OVER (ORDER BY o.amount DESC) AS place, o.id FROM orders o\n"
     "JOIN customers c ON o.cust = c.id) WHERE place <= 3", r"JOIN inside a subquery \(line 2, column 6\)"),
    ("SELECT o.id FROM (SELECT * FROM orders) o JOIN customers c ON o.cust = c.id", "subquery"),
    ("SELECT o.id FROM orders o JOIN customers c USING (id)", "USING"),
    ("SELECT o.id FROM orders o CROSS JOIN customers c", "CROSS JOIN"),
    ("SELECT o.id FROM orders o LEFT SEMI JOIN customers c ON o.cust = c.id", "SEMI"),
    ("SELECT o.id FROM orders o NATURAL JOIN customers c", "NATURAL"),
    ("SELECT * FROM orders o JOIN customers c ON o.cust = c.id", r"SELECT \* \(line 1, column 8\)"),
    ("SELECT id FROM orders o JOIN customers c ON o.cust = c.id", "qualify the column"),
    ("SELECT x.id FROM orders o JOIN customers c ON o.cust = c.id", "'x' is not a table of the join"),
    ("SELECT o.id, c.id FROM orders o JOIN customers c ON o.cust = c.id", "two output columns are named 'id'"),
    ("SELECT a.id FROM orders a JOIN orders b ON a.id = b.parent", "joined with itself"),
    ("SELECT o.id FROM orders o JOIN customers c ON o.cust = c.id WHERE c.region = 'eu'", "WHERE.*beside a JOIN"),
    ("SELECT o.id FROM orders o JOIN customers c ON o.id = o.cust", "a column of each table"),
    ("SELECT o.id + 1 AS n FROM orders o JOIN customers c ON o.cust = c.id", "selects columns"),
    ("SELECT c.region, SUM(o.amount) AS s FROM orders o JOIN customers c ON o.cust = c.id GROUP BY c.region "
     "HAVING SUM(o.amount) > 1", "HAVING"),
    ("SELECT c.id, SUM(o.id) AS s FROM orders o JOIN customers c ON o.cust = c.id GROUP BY c.id",
     "'id' of both tables"),
    ("SELECT c.region, window.start, window.end, SUM(o.amount) AS s FROM orders o JOIN customers c "
     "ON o.cust = c.id GROUP BY window(o.ts, '1 hour'), c.region", "time window .* over a JOIN"),
    ("SELECT o.id FROM db.orders o JOIN customers c ON o.cust = c.id", "no dots"),
])
def test_refusals_name_the_construct_and_where(sql: str, message: str) -> None:
    with pytest.raises(SqlError, match=message):
        translate(sql)


def test_refusal_position_on_a_later_line() -> None:
    with pytest.raises(SqlError, match=r"a second JOIN, of shops \(line 3, column 6\)"):
        translate("SELECT o.id\nFROM orders o JOIN customers c ON o.cust = c.id\nJOIN shops s ON s.id = o.shop")


# the pipeline file -------------------------------------------------------------------------

SOURCES = {"orders": {"topic": "orders-topic", "key": ["id"]}, "customers": {"topic": "customers-topic"}}
JOIN = {"left": "orders", "right": "customers", "on": [["cust", "id"]], "type": "left",
        "columns": {"id": "orders.id", "region": "customers.region", "amount": "orders.amount"}}


def pipeline(**parts: Any) -> dict[str, Any]:
    return {"pipeline": "p", "outputs": {"view": {"topic": "out"}}, **parts}


def test_a_join_pipeline_parses_and_runs() -> None:
    p = parse_pipeline(pipeline(sources=SOURCES, view={"join": JOIN}))
    assert p.view.join is not None and p.view.join.type == "left"
    assert p.source.topic == "orders-topic"  # the first of sources:
    assert p.run_refusal() is None
    grouped = parse_pipeline(pipeline(sources=SOURCES, view={"join": JOIN, "key": ["region"],
                                                             "columns": {"revenue": {"sum": "amount"}}}))
    assert grouped.view.key == ["region"]


def test_a_sql_join_pipeline() -> None:
    p = parse_pipeline(pipeline(sources=SOURCES, view={
        "sql": "SELECT c.region, SUM(o.amount) AS revenue FROM orders o JOIN customers c ON o.cust = c.id "
               "GROUP BY c.region"}))
    assert p.view.join is not None and p.view.join.on == [("cust", "id")]
    with pytest.raises(ConfigError, match=r"view.sql: shops \(line 1, column 40\) is not a source of sources: "
                                          r"\(orders, customers\)"):
        parse_pipeline(pipeline(sources=SOURCES, view={
            "sql": "SELECT o.id, s.name FROM orders o JOIN shops s ON o.shop = s.id"}))


def test_sources_stays_compatible_with_one_source() -> None:
    one = parse_pipeline(pipeline(sources={"scores": {"topic": "scores"}}, view={
        "sql": "SELECT player, SUM(score) AS total FROM scores GROUP BY player"}))
    assert one.source.topic == "scores" and one.run_refusal() is None
    plain = parse_pipeline(pipeline(source={"topic": "scores"}, view={"key": ["player"], "columns": {"n": {"count": "*"}}}))
    assert plain.sources == {} and plain.run_refusal() is None


@pytest.mark.parametrize(("parts", "message"), [
    ({"source": {"topic": "t"}, "sources": SOURCES, "view": {"join": JOIN}}, "source: .* or sources: .*not both"),
    ({"source": {"topic": "t"}, "view": {"join": JOIN}}, "view.join: a join reads two sources: name them in sources:"),
    ({"sources": SOURCES, "view": {"join": {**JOIN, "right": "shops", "columns": {"id": "orders.id"}}}},
     r"view.join.right: 'shops' is not a source of sources: \(orders, customers\)"),
    ({"sources": SOURCES, "view": {"key": ["id"], "columns": {"n": {"count": "*"}}}},
     "sources: names 2 sources .* a view that is not a join reads one"),
    ({"sources": SOURCES, "view": {"join": {**JOIN, "type": "right"}}}, "view.join.type"),
    ({"sources": SOURCES, "view": {"join": {**JOIN, "on": []}}}, "view.join.on: .*at least one"),
    ({"sources": SOURCES, "view": {"join": {**JOIN, "columns": {"x": "shops.x"}}}},
     "columns.x: 'shops.x' is not <source>.<column>"),
    ({"sources": SOURCES, "view": {"join": {**JOIN, "key": ["nope"]}}}, "key: 'nope' is not an output column"),
    ({"sources": SOURCES, "view": {"join": JOIN, "key": ["zone"], "columns": {"n": {"count": "*"}}}},
     "'zone': not an output column of the join"),
    ({"sources": SOURCES, "view": {"join": JOIN, "top_n": {"n": 3, "order_by": {"amount": "desc"}}}},
     "top_n beside join: not supported yet"),
    ({"sources": {**SOURCES, "customers": {"topic": "c", "form": "upsert"}}, "view": {"join": JOIN}},
     "sources.customers: form upsert needs the message-key columns"),
    ({"sources": {"bad name": {"topic": "t"}}, "view": {"key": ["a"], "columns": {"n": {"count": "*"}}}},
     "'bad name': a source's name"),
])
def test_config_errors_name_the_setting(parts: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_pipeline(pipeline(**parts))
