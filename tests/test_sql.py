"""Views written in SQL (`refold.sql`): each form equals its YAML twin, means what the
query means (checked against SQLite running the same query over the live rows), and
every construct Refold cannot run exactly is refused with its name and position."""

from __future__ import annotations

import math
import sqlite3
from typing import Any

import pytest
import sqlglot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refold.config import Pipeline, ViewSpec, load_pipeline, parse_pipeline
from refold.errors import ConfigError
from refold.model.changelog import Op
from refold.ops.explain import explain, view_spec
from refold.reduce import Rejected, SourceEvent, make_reducer
from refold.reduce.where import condition_of, filter_unit
from refold.reference import fold_changelog, reference_changelog
from refold.sql import SqlError, translate

RFC015_QUERY = """select
  *
from (
  select
    ROW_NUMBER() OVER (ORDER BY score desc) AS place,
    match_time,
    player_name,
    score,
  from match_scores
) where place <= 2"""


def pipeline(view: dict[str, Any], topic: str = "scores") -> Pipeline:
    return parse_pipeline({"pipeline": "p", "source": {"topic": topic}, "view": view,
                           "outputs": {"view": {"topic": "p.view"}}})


# Each SQL form and its YAML twin -------------------------------------------------------

TWINS = [
    pytest.param(
        "SELECT team, player_name, SUM(score) AS total, COUNT(*) AS games, AVG(score) AS mean, "
        "MIN(score) AS low, MAX(score) AS best, FIRST(score) AS opener, LAST(score) AS latest, "
        "COLLECT_SET(league) AS leagues, COUNT(bonus) AS bonuses FROM scores GROUP BY team, player_name",
        {"key": ["team", "player_name"], "columns": {
            "total": {"sum": "score"}, "games": {"count": "*"}, "mean": {"avg": "score"},
            "low": {"min": "score"}, "best": {"max": "score"}, "opener": {"first": "score"},
            "latest": {"last": "score"}, "leagues": {"set": "league"}, "bonuses": {"count": "bonus"}}},
        id="grouped-every-aggregate",
    ),
    pytest.param(
        "select player_name, sum(score), count(1), first_value(score), last_value(score) "
        "from scores group by player_name",
        {"key": ["player_name"], "columns": {
            "sum_score": {"sum": "score"}, "count": {"count": "*"},
            "first_score": {"first": "score"}, "last_score": {"last": "score"}}},
        id="grouped-unnamed-aggregates",
    ),
    pytest.param(
        "SELECT s.player_name, SUM(s.score) AS total FROM scores AS s GROUP BY s.player_name",
        {"key": ["player_name"], "columns": {"total": {"sum": "score"}}},
        id="grouped-qualified-columns",
    ),
    pytest.param(
        "SELECT player_name, SUM(score) AS total FROM scores WHERE league = 'pro' AND (bonus IS NOT NULL "
        "OR score BETWEEN 10 AND 20) AND team IN ('red', 'blue') GROUP BY player_name",
        {"key": ["player_name"], "columns": {"total": {"sum": "score"}},
         "where": "league = 'pro' AND (NOT bonus IS NULL OR score BETWEEN 10 AND 20) AND team IN ('red', 'blue')"},
        id="grouped-where",
    ),
    pytest.param(
        RFC015_QUERY.replace("match_scores", "scores"),
        {"top_n": {"n": 2, "order_by": {"score": "desc"}, "columns": ["match_time", "player_name", "score"]}},
        id="rfc015-top-n",
    ),
    pytest.param(
        "SELECT * FROM (SELECT ROW_NUMBER() OVER (PARTITION BY league ORDER BY score DESC, time ASC NULLS LAST)"
        " AS place, * FROM scores) WHERE place <= 3",
        {"top_n": {"n": 3, "order_by": {"score": "desc", "time": "asc"}, "partition_by": ["league"]}},
        id="top-n-partitioned-all-columns",
    ),
    pytest.param(
        "SELECT place, league, player_name FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY league ORDER BY "
        "score DESC) AS place FROM scores) ranked WHERE 5 > place",
        {"top_n": {"n": 4, "order_by": {"score": "desc"}, "partition_by": ["league"],
                   "columns": ["player_name"]}},
        id="top-n-outer-projection",
    ),
    pytest.param(
        "SELECT * FROM (SELECT ROW_NUMBER() OVER (ORDER BY score DESC) AS place, * FROM scores "
        "WHERE NOT banned) WHERE place <= 5",
        {"top_n": {"n": 5, "order_by": {"score": "desc"}}, "where": "NOT banned"},
        id="top-n-where",
    ),
]


@pytest.mark.parametrize(("sql", "yaml_view"), TWINS)
def test_sql_view_is_its_yaml_twin(sql: str, yaml_view: dict[str, Any]) -> None:
    from_sql, from_yaml = pipeline({"sql": sql}).view, pipeline(yaml_view).view
    assert (from_sql.key, from_sql.columns, from_sql.top_n) == (from_yaml.key, from_yaml.columns, from_yaml.top_n)
    assert from_sql.sql == sql and from_yaml.sql is None
    # what `refold explain` prints is a view spec that parses to the same view again
    assert pipeline(view_spec(pipeline({"sql": sql}))).view == from_yaml


def test_rfc015_query_runs_as_written() -> None:
    view = translate(RFC015_QUERY)
    assert view.spec == {"top_n": {"n": 2, "order_by": {"score": "desc"}, "partition_by": [],
                                   "columns": ["match_time", "player_name", "score"]}}
    assert (view.table, view.table_at) == ("match_scores", "(line 9, column 8)")


def test_the_example_leaderboard_is_the_rfc_query(capsys: pytest.CaptureFixture[str]) -> None:
    example = load_pipeline("examples/leaderboard.yaml")
    assert example.view.sql is not None and example.view.sql.strip() == RFC015_QUERY
    from refold.cli.main import main

    assert main(["explain", "examples/leaderboard.yaml"]) == 0
    printed = capsys.readouterr().out
    assert "order_by: {score: desc}" in printed and "columns: [match_time, player_name, score]" in printed
    assert "# output key: place" in printed and "merging every partition" in printed
    assert explain(example) == printed.rstrip("\n")


def test_from_names_the_source_topic() -> None:
    assert pipeline({"sql": "SELECT k, SUM(v) AS s FROM db.public.scores GROUP BY k"}, "db.public.scores")
    assert pipeline({"sql": "SELECT k, SUM(v) AS s FROM `scores-1` GROUP BY k"}, "scores-1")
    with pytest.raises(ConfigError, match=r"FROM other \(line 1, column 28\) is not the source topic 'scores'"):
        pipeline({"sql": "SELECT k, SUM(v) AS s FROM other GROUP BY k"})


def test_sql_or_key_columns_not_both() -> None:
    with pytest.raises(ConfigError, match="either as sql or as key/columns/top_n"):
        pipeline({"sql": "SELECT k, SUM(v) AS s FROM scores GROUP BY k", "key": ["j"]})
    # a pipeline dumped and read back (its spec beside its query) is the same pipeline
    sql_pipeline = pipeline({"sql": "SELECT k, SUM(v) AS s FROM scores WHERE v > 0 GROUP BY k"})
    assert Pipeline.model_validate_json(sql_pipeline.model_dump_json(by_alias=True)) == sql_pipeline


# Refused constructs: named, with their position ------------------------------------------

REFUSED = [
    ("SELECT k, SUM(v) FROM scores JOIN teams ON scores.t > teams.t GROUP BY k", r"ON … scores.t > teams.t \(line 1, column 44\).*equalities"),
    ("SELECT k, SUM(v) FROM scores GROUP BY k HAVING SUM(v) > 1", r"HAVING.*line 1, column 48"),
    ("SELECT k, COUNT(DISTINCT v) FROM scores GROUP BY k", r"COUNT\(DISTINCT …\) \(line 1, column 11\)"),
    ("SELECT k, SUM(v * 2) FROM scores GROUP BY k", r"SUM\(v \* 2\) \(line 1, column 11\).*not an expression"),
    ("SELECT k, STDDEV(v) FROM scores GROUP BY k", r"STDDEV \(line 1, column 11\): not an aggregate"),
    ("SELECT k, SUM(v) FROM scores GROUP BY k ORDER BY k", r"ORDER BY outside ROW_NUMBER.*line 1, column 50"),
    ("SELECT k, SUM(v) FROM scores GROUP BY k LIMIT 3", r"LIMIT.*line 1, column 47"),
    ("SELECT DISTINCT k, SUM(v) FROM scores GROUP BY k", r"SELECT DISTINCT"),
    ("SELECT k, v, SUM(v) FROM scores GROUP BY k", r"'v' \(line 1, column 11\) is neither grouped nor aggregated"),
    ("SELECT SUM(v) FROM scores", r"without GROUP BY"),
    ("SELECT k, SUM(v) FROM scores GROUP BY k UNION SELECT k, SUM(v) FROM more GROUP BY k", r"UNION"),
    ("WITH s AS (SELECT * FROM scores) SELECT k, SUM(v) FROM s GROUP BY k", r"WITH: common table expressions"),
    ("SELECT k AS key, SUM(v) FROM scores GROUP BY k", r"'k' AS 'key' \(line 1, column 8\): key columns keep"),
    ("SELECT * FROM (SELECT RANK() OVER (ORDER BY v DESC) AS place, * FROM scores) WHERE place <= 3",
     r"RANK\(\) \(line 1, column 23\).*RANK and DENSE_RANK are not supported"),
    ("SELECT * FROM (SELECT DENSE_RANK() OVER (ORDER BY v DESC) AS place, * FROM scores) WHERE place <= 3",
     r"DENSE_RANK\(\)"),
    ("SELECT * FROM (SELECT ROW_NUMBER() OVER (ORDER BY v DESC) AS place, * FROM scores) WHERE place <= n",
     r"WHERE … n \(line 1, column 99\): the Top-N's bound must be a whole number literal"),
    ("SELECT * FROM (SELECT ROW_NUMBER() OVER (ORDER BY v) AS place, * FROM scores) WHERE place <= 3",
     r"ORDER BY v ASC \(line 1, column 51\).*NULLS LAST"),
    ("SELECT * FROM (SELECT ROW_NUMBER() OVER (ORDER BY v DESC) AS rn, * FROM scores) WHERE rn <= 3",
     r"must be named 'place'"),
    ("SELECT * FROM (SELECT ROW_NUMBER() OVER (ORDER BY v DESC) AS place, * FROM scores) WHERE place <= 3 "
     "AND v > 0", r"a Top-N's only condition is place <= N"),
    ("SELECT * FROM (SELECT ROW_NUMBER() OVER (ORDER BY v DESC) AS place, * FROM scores)", r"without WHERE"),
    ("SELECT * FROM (SELECT ROW_NUMBER() OVER (PARTITION BY t ORDER BY v DESC) AS place, k, v FROM scores) "
     "WHERE place <= 3", r"PARTITION BY t \(line 1, column 23\): select the partition columns too"),
    ("SELECT * FROM (SELECT ROW_NUMBER() OVER () AS place, * FROM scores) WHERE place <= 3", r"needs ORDER BY"),
    ("SELECT * FROM (SELECT ROW_NUMBER() OVER (ORDER BY v DESC) AS place, * FROM scores) WHERE place <= 0",
     r"N must be within 1\.\.10000"),
    ("SELECT k, SUM(v) FROM scores GROUP BY window(event_time, '10 minutes'), k",
     r"window\(…\) \(line 1, column 39\): select window.start and window.end too"),
    ("SELECT k, SUM(v) FROM scores GROUP BY TUMBLE(event_time, INTERVAL '1' HOUR), k",
     r"TUMBLE\(…\) \(line 1, column 39\): of Flink's window functions Refold takes the table functions"),
    ("SELECT k, window_start, window_end, SUM(v) AS s\nFROM TABLE(\n  CUMULATE(TABLE scores, DESCRIPTOR(ts), "
     "INTERVAL '1' HOUR, INTERVAL '1' DAY)) GROUP BY window_start, window_end, k",
     r"CUMULATE\(…\) \(line 3, column 3\): of Flink's window functions Refold takes .*TUMBLE.*HOP.*for sessions"),
    ("SELECT k, window_start, window_end, SUM(v) FROM TABLE(SESSION(TABLE scores PARTITION BY k, DESCRIPTOR(ts), "
     "INTERVAL '5' MINUTES)) GROUP BY window_start, window_end, k", r"SESSION\(…\) \(line 1, column 55\)"),
    ("SELECT k, window_start, window_end, SUM(v) FROM TABLE(TUMBLE(TABLE scores, DESCRIPTOR(ts), INTERVAL '1' HOUR, "
     "INTERVAL '5' MINUTES)) GROUP BY window_start, window_end, k",
     r"TUMBLE\(…\) \(line 1, column 55\): an offset \(its last argument\) is not supported"),
    ("SELECT k, window_start, window_end, SUM(v) FROM TABLE(TUMBLE(TABLE scores, ts, INTERVAL '1' HOUR)) "
     "GROUP BY window_start, window_end, k", r"its time column ts \(line 1, column 76\): write DESCRIPTOR\(column\)"),
    ("SELECT k, window_start, window_end, SUM(v) FROM TABLE(TUMBLE(TABLE (SELECT * FROM scores), DESCRIPTOR(ts), "
     "INTERVAL '1' HOUR)) GROUP BY window_start, window_end, k", r"its table .* write TABLE topic"),
    ("SELECT k, window_start, window_end, SUM(v) FROM TABLE(TUMBLE(TABLE scores, DESCRIPTOR(ts), INTERVAL '1' HOUR)) "
     "GROUP BY window_start, k", r"GROUP BY \(line 1, column 121\) over TUMBLE\(…\): group by window_start and "
     "window_end"),
    ("SELECT k, window_start, SUM(v) FROM TABLE(TUMBLE(TABLE scores, DESCRIPTOR(ts), INTERVAL '1' HOUR)) "
     "GROUP BY window_start, window_end, k", r"TUMBLE\(…\) \(line 1, column 43\): select window_start and window_end"),
    ("SELECT k, window_start, window_end, window_time, SUM(v) FROM TABLE(TUMBLE(TABLE scores, DESCRIPTOR(ts), "
     "INTERVAL '1' HOUR)) GROUP BY window_start, window_end, k",
     r"SELECT window_time \(line 1, column 37\): Refold's windowed rows have no time attribute"),
    ("SELECT k, window_start, window_end, MAX(window_end) FROM TABLE(TUMBLE(TABLE scores, DESCRIPTOR(ts), "
     "INTERVAL '1' HOUR)) GROUP BY window_start, window_end, k",
     r"SELECT MAX\(window_end\) \(line 1, column 37\): .*expressions of them are not supported"),
    ("SELECT k, window_start AS ws, window_end, SUM(v) FROM TABLE(TUMBLE(TABLE scores, DESCRIPTOR(ts), "
     "INTERVAL '1' HOUR)) GROUP BY window_start, window_end, k", r"window_start AS 'ws' \(line 1, column 11\)"),
    ("SELECT k, window.start, window.end, SUM(v) FROM TABLE(TUMBLE(TABLE scores, DESCRIPTOR(ts), "
     "INTERVAL '1' HOUR)) GROUP BY window_start, window_end, k",
     r"window.start \(line 1, column 11\): the bounds of TUMBLE\(…\) are the columns window_start and window_end"),
    ("SELECT k, window_start, window_end, SUM(v) FROM TABLE(TUMBLE(TABLE scores, DESCRIPTOR(ts), INTERVAL '1' HOUR)) "
     "WHERE window_end > 0 GROUP BY window_start, window_end, k",
     r"WHERE … window_end \(line 1, column 118\): WHERE filters the source rows, before their window"),
    ("SELECT k, window_start, window_end, SUM(v) FROM TABLE(TUMBLE(TABLE scores, DESCRIPTOR(ts), INTERVAL '1' HOUR)) "
     "GROUP BY window_start, window_end, session_window(ts, '1 minute'), k",
     r"a second session_window\(…\) \(line 1, column 147\): a view has one time window"),
    ("SELECT * FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY team ORDER BY v DESC) AS place "
     "FROM TABLE(TUMBLE(TABLE scores, DESCRIPTOR(ts), INTERVAL '1' DAY))) WHERE place <= 3",
     r"ROW_NUMBER\(\) OVER \(…\) \(line 1, column 26\) over TUMBLE\(…\): partition by window_start and "
     "window_end"),
    ("SELECT * FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY window_start, window_end ORDER BY window_end DESC) "
     "AS place FROM TABLE(TUMBLE(TABLE scores, DESCRIPTOR(ts), INTERVAL '1' DAY))) WHERE place <= 3",
     r"ORDER BY window_end \(line 1, column 92\): a Top-N per window ranks within its window"),
    ("SELECT k, window(ts, '1 hour') AS w, SUM(v) FROM scores GROUP BY window(ts, '1 hour'), k",
     r"window\(…\) \(line 1, column 11\) in SELECT: a windowed view groups by it and selects window.start"),
    ("SELECT k, window, SUM(v) FROM scores GROUP BY window(ts, '1 hour'), k",
     r"window \(line 1, column 11\): a windowed view selects window.start and window.end themselves"),
    ("SELECT k, window.start, window.end + 1, SUM(v) FROM scores GROUP BY window(ts, '1 hour'), k",
     r"window.end \+ 1 \(line 1, column 25\): .*expressions of it are not supported"),
    ("SELECT k, CAST(window.start AS STRING), window.end, SUM(v) FROM scores GROUP BY window(ts, '1 hour'), k",
     r"CAST\(window.start AS STRING\) \(line 1, column 16\): .*the whole window struct or expressions"),
    ("SELECT k, window.start, window.end, MAX(window.end) FROM scores GROUP BY window(ts, '1 hour'), k",
     r"MAX\(window.end\) \(line 1, column 37\)"),
    ("SELECT k, window.start AS ws, window.end, SUM(v) FROM scores GROUP BY window(ts, '1 hour'), k",
     r"window.start AS 'ws' \(line 1, column 11\): the window's bounds come out as window_start and window_end"),
    ("SELECT k, window.start, window.end, SUM(v) FROM scores GROUP BY session_window(ts, '5 minutes'), k",
     r"window.start \(line 1, column 11\): the bounds of session_window\(…\) are session_window.start"),
    ("SELECT k, window.start, window.end, SUM(v) FROM scores GROUP BY k",
     r"window.start \(line 1, column 11\) without window\(…\) or session_window\(…\) in GROUP BY"),
    ("SELECT k, window.start, window.end, SUM(v) FROM scores GROUP BY window(ts, '1 hour'), window(ts, '1 day'), k",
     r"a second window\(…\) \(line 1, column 87\): a view has one time window"),
    ("SELECT k, window.start, window.end, SUM(v) FROM scores GROUP BY window(ts, '1 hour', '5 minutes', "
     "'1 minute'), k", r"window\(…\) \(line 1, column 65\): a start time .* aligned to the epoch"),
    ("SELECT k, window.start, window.end, SUM(v) FROM scores GROUP BY window(ts, '1 month'), k",
     r"interval '1 month' \(line 1, column 76\): .*months and years have no fixed length"),
    ("SELECT k, window.start, window.end, SUM(v) FROM scores GROUP BY window(ts, '10 microseconds'), k",
     r"interval '10 microseconds' .*: a window's length is a positive whole number of milliseconds"),
    ("SELECT k, window.start, window.end, SUM(v) FROM scores GROUP BY window(ts, '0 seconds'), k",
     r"interval '0 seconds' \(line 1, column 76\): a window's length is a positive"),
    ("SELECT k, window.start, window.end, SUM(v) FROM scores GROUP BY window(ts, 3600), k",
     r"3600 \(line 1, column 76\) is not an interval"),
    ("SELECT k, window.start, window.end, SUM(v) FROM scores GROUP BY window(ts + 1, '1 hour'), k",
     r"its time is ts \+ 1 \(line 1, column 72\); a plain column is expected"),
    ("SELECT k, window.start, window.end, SUM(v) AS window_end FROM scores GROUP BY window(ts, '1 hour'), k",
     r"two output columns are named 'window_end' \(line 1, column 37\)"),
    ("SELECT window_start, window.start, window.end, SUM(v) FROM scores GROUP BY window(ts, '1 hour'), window_start",
     r"GROUP BY window_start \(line 1, column 98\) beside window\(…\)"),
    ("SELECT k, window.start, window.end, SUM(v) FROM scores GROUP BY window(ts, '1 hour'), window.start, k",
     r"GROUP BY window.start \(line 1, column 87\): the window's bounds are not columns of the source rows"),
    ("SELECT k, window.start, window.end, SUM(v) FROM scores WHERE window.end > 0 GROUP BY window(ts, '1 hour'), k",
     r"WHERE … window.end \(line 1, column 62\): WHERE filters the source rows, which have no window"),
    ("SELECT * FROM (SELECT ROW_NUMBER() OVER (PARTITION BY window(ts, '1 hour') ORDER BY window.start DESC) AS "
     "place, * FROM scores) WHERE place <= 3", r"ORDER BY window.start \(line 1, column 85\): the window's bounds"),
    ("SELECT * FROM (SELECT ROW_NUMBER() OVER (PARTITION BY session_window(ts, '1 hour') ORDER BY v DESC) AS place, "
     "* FROM scores) WHERE place <= 3", r"session_window\(…\) \(line 1, column 55\) in a Top-N"),
    ("SELECT * FROM (SELECT ROW_NUMBER() OVER (PARTITION BY window(ts, '1 hour') ORDER BY v DESC) AS place, "
     "window.start, v FROM scores) WHERE place <= 3", r"window.start \(line 1, column 103\) in a Top-N"),
    ("SELECT k, SUM(v) FROM scores WHERE v + 1 > 2 GROUP BY k",
     r"WHERE v \+ 1: a column or a literal is expected here \(line 1, column 36\)"),
    ("SELECT k, SUM(v) FROM scores WHERE UPPER(k) = 'A' GROUP BY k", r"WHERE UPPER\(k\): a column or a literal"),
    ("SELECT k, SUM(v) FROM scores WHERE v IN (SELECT v FROM other) GROUP BY k", r"IN takes a list of literals"),
    ("SELEC k FROM scores", r"not a query Refold can read at line 1"),
    ("SELECT k, SUM(v) FROM scores GROUP BY k; SELECT 1", r"one SELECT statement, got 2"),
]


@pytest.mark.parametrize(("sql", "message"), REFUSED, ids=[m.split("\\")[0].split(":")[0][:40] for _, m in REFUSED])
def test_refused_constructs_are_named_with_their_position(sql: str, message: str) -> None:
    with pytest.raises(SqlError, match=message):
        translate(sql)
    with pytest.raises(ConfigError, match=message):  # before anything starts: the pipeline does not parse
        pipeline({"sql": sql})


# What the query means: SQLite runs it over the live rows ------------------------------------

GROUPED_SQL = ("SELECT k, t, SUM(v) AS total, COUNT(*) AS n, COUNT(b) AS nb, AVG(b) AS mean_b, "
               "MIN(v) AS low, MAX(b) AS high FROM scores GROUP BY k, t")
TOP_SQL = ("SELECT * FROM (SELECT ROW_NUMBER() OVER (PARTITION BY t ORDER BY v DESC) AS place, t, k, v "
           "FROM scores) WHERE place <= 2")
TOP_ASC_SQL = ("SELECT place, k, v FROM (SELECT ROW_NUMBER() OVER (ORDER BY v ASC NULLS LAST) AS place, * "
               "FROM scores) WHERE place < 4")
GROUPED_WHERE_SQL = ("SELECT k, COUNT(*) AS n, SUM(v) AS total, MAX(v) AS high FROM scores "
                     "WHERE (b > 3 OR b IS NULL) AND t <> 'y' GROUP BY k")
TOP_WHERE_SQL = ("SELECT * FROM (SELECT ROW_NUMBER() OVER (PARTITION BY k ORDER BY v DESC) AS place, k, v, b "
                 "FROM scores WHERE b BETWEEN 2 AND 7 OR v IN (1, 2, 3, 4, 5)) WHERE place <= 2")
YAML_TWINS = {
    GROUPED_WHERE_SQL: {"key": ["k"], "columns": {"n": {"count": "*"}, "total": {"sum": "v"}, "high": {"max": "v"}},
                        "where": "(b > 3 OR b IS NULL) AND t <> 'y'"},
    TOP_WHERE_SQL: {"top_n": {"n": 2, "order_by": {"v": "desc"}, "partition_by": ["k"], "columns": ["v", "b"]},
                    "where": "b BETWEEN 2 AND 7 OR v IN (1, 2, 3, 4, 5)"},
    GROUPED_SQL: {"key": ["k", "t"], "columns": {"total": {"sum": "v"}, "n": {"count": "*"}, "nb": {"count": "b"},
                                                 "mean_b": {"avg": "b"}, "low": {"min": "v"}, "high": {"max": "b"}}},
    TOP_SQL: {"top_n": {"n": 2, "order_by": {"v": "desc"}, "partition_by": ["t"], "columns": ["k", "v"]}},
    TOP_ASC_SQL: {"top_n": {"n": 3, "order_by": {"v": "asc"}, "columns": ["k", "v"]}},
}


@st.composite
def live_changelogs(draw: st.DrawFn) -> list[list[SourceEvent]]:
    """Valid units only (appends, retractions and corrections of live rows, duplicates
    included); distinct rows have distinct `v`, so a ranking has no ties between them."""
    used: set[int] = set()
    live: list[dict[str, Any]] = []
    units: list[list[SourceEvent]] = []

    def fresh() -> dict[str, Any]:
        v = draw(st.integers(-50, 50).filter(lambda x: x not in used))
        used.add(v)
        return {"k": draw(st.sampled_from("ab")), "t": draw(st.sampled_from("xy")), "v": v,
                "b": draw(st.one_of(st.none(), st.integers(0, 9)))}

    for index in range(draw(st.integers(1, 40))):
        tag = (index, 0, index)
        choice = draw(st.integers(0, 9))
        if choice < 5 or not live:
            row = fresh() if choice > 0 or not live else dict(live[draw(st.integers(0, len(live) - 1))])
            units.append([SourceEvent(Op.APPEND, row, tag)])
            live.append(row)
        elif choice < 7:
            row = live.pop(draw(st.integers(0, len(live) - 1)))
            units.append([SourceEvent(Op.RETRACT, row, tag)])
        else:
            row = live.pop(draw(st.integers(0, len(live) - 1)))
            new = fresh()
            units.append([SourceEvent(Op.CORRECT_FROM, row, tag), SourceEvent(Op.CORRECT_TO, new, tag)])
            live.append(new)
    return units


def live_rows(units: list[list[SourceEvent]]) -> list[dict[str, Any]]:
    live: list[dict[str, Any]] = []
    for unit in units:
        for event in unit:
            if event.op.adds:
                live.append(event.row)
            else:
                live.remove(event.row)
    return live


def sqlite_result(sql: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The query run by SQLite (translated from Spark's dialect by sqlglot) over `rows`."""
    db = sqlite3.connect(":memory:")
    try:
        db.execute("CREATE TABLE scores (k TEXT, t TEXT, v INTEGER, b INTEGER)")
        db.executemany("INSERT INTO scores VALUES (:k, :t, :v, :b)", rows)
        cursor = db.execute(sqlglot.transpile(sql, read="spark", write="sqlite")[0])
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor]
    finally:
        db.close()


def engine_changes(spec: ViewSpec, units: list[list[SourceEvent]]) -> list[Any]:
    """The reducer's view changelog over the units (filtered by `where` as a shard does);
    it equals the reference's."""
    reducer = make_reducer(spec)
    condition = condition_of(spec.where) if spec.where is not None else None
    changes = []
    for unit in units:
        if condition is not None:
            unit = [event for _, event in filter_unit(condition, unit)]
            if not unit:
                continue
        try:
            changes.extend(reducer.apply(unit))
        except Rejected as exc:  # pragma: no cover - the units are valid
            raise AssertionError(f"a valid unit was refused: {exc.reason}") from exc
    expected = reference_changelog(spec, units)
    assert not expected.rejected and changes == expected.changes
    return changes


@pytest.mark.parametrize("sql", [GROUPED_SQL, TOP_SQL, TOP_ASC_SQL, GROUPED_WHERE_SQL, TOP_WHERE_SQL],
                         ids=["grouped", "top-n", "top-n-asc-global", "grouped-where", "top-n-where"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units=live_changelogs())
def test_the_view_is_what_the_query_means(sql: str, units: list[list[SourceEvent]]) -> None:
    spec = pipeline({"sql": sql}).view
    changes = engine_changes(spec, units)
    assert changes == engine_changes(pipeline(YAML_TWINS[sql]).view, units)  # the same changelog as its twin
    view = fold_changelog(changes)
    got = sorted(view.values(), key=lambda row: sorted((k, repr(v)) for k, v in row.items()))
    want = sqlite_result(sql, live_rows(units))
    for row in want:
        if "total" in row and row["total"] is None:  # pragma: no cover - v is never null here
            row["total"] = 0
    want.sort(key=lambda row: sorted((k, repr(v)) for k, v in row.items()))
    assert len(got) == len(want), (got, want)
    for mine, theirs in zip(got, want, strict=True):
        assert mine.keys() == theirs.keys()
        for column, value in theirs.items():
            if isinstance(value, float):  # AVG: Refold's is exact, SQLite's floating point
                assert math.isclose(mine[column], value), (column, mine, theirs)
            else:
                assert mine[column] == value, (column, mine, theirs)


# The row filter on any changelog (bad units too): the shard's path equals the reference ---------------


@st.composite
def any_changelogs(draw: st.DrawFn) -> list[list[SourceEvent]]:
    """Appends, retractions (of live rows or not), correction pairs that cross the
    filter either way, nulls, and now and then a row the condition cannot compare."""
    values = st.one_of(st.none(), st.integers(-3, 3))
    live: list[dict[str, Any]] = []
    units: list[list[SourceEvent]] = []
    for index in range(draw(st.integers(1, 50))):
        tag = (index, 0, index)
        v = draw(st.one_of(values, st.just("text")) if draw(st.integers(0, 30)) == 0 else values)
        fresh = {"k": draw(st.sampled_from("ab")), "v": v}
        choice = draw(st.integers(0, 9))
        if choice < 4 or not live:
            units.append([SourceEvent(Op.APPEND, fresh, tag)])
            live.append(fresh)
        elif choice < 6:
            units.append([SourceEvent(Op.RETRACT, live.pop(draw(st.integers(0, len(live) - 1))), tag)])
        elif choice < 9:
            old = live.pop(draw(st.integers(0, len(live) - 1)))
            units.append([SourceEvent(Op.CORRECT_FROM, old, tag), SourceEvent(Op.CORRECT_TO, fresh, tag)])
            live.append(fresh)
        else:  # maybe not live
            units.append([SourceEvent(Op.RETRACT, fresh, tag)])
    return units


@pytest.mark.parametrize("view", [
    {"key": ["k"], "columns": {"n": {"count": "*"}, "s": {"sum": "v"}, "top": {"max": "v"}}, "where": "v > 0"},
    {"key": ["k"], "columns": {"n": {"count": "*"}, "last": {"last": "v"}}, "where": "NOT (v = 1 OR v IS NULL)"},
    {"top_n": {"n": 2, "order_by": {"v": "desc"}, "partition_by": ["k"]}, "where": "v IN (-1, 1, 3) OR v IS NULL"},
], ids=["grouped", "grouped-not", "top-n"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units=any_changelogs())
def test_the_row_filter_equals_the_reference(view: dict[str, Any], units: list[list[SourceEvent]]) -> None:
    spec = ViewSpec.model_validate(view)
    condition = condition_of(view["where"])
    reducer = make_reducer(spec)
    changes, rejected = [], []
    for index, unit in enumerate(units):
        try:
            kept = [event for _, event in filter_unit(condition, unit)]
            if kept:
                changes.extend(reducer.apply(kept))
        except Rejected as exc:
            rejected.append((index, exc.reason))
    expected = reference_changelog(spec, units)
    assert rejected == expected.rejected
    assert changes == expected.changes
    assert fold_changelog(changes) == expected.view == reducer.view()


def test_a_correction_across_the_filter_is_an_append_or_a_retraction() -> None:
    condition = condition_of("v > 0")
    old, new = {"k": "a", "v": -1}, {"k": "a", "v": 5}
    pair = [SourceEvent(Op.CORRECT_FROM, old, (1, 0, 0)), SourceEvent(Op.CORRECT_TO, new, (1, 0, 1))]
    assert filter_unit(condition, pair) == [(1, SourceEvent(Op.APPEND, new, (1, 0, 1)))]
    back = [SourceEvent(Op.CORRECT_FROM, new, (2, 0, 2)), SourceEvent(Op.CORRECT_TO, old, (2, 0, 3))]
    assert filter_unit(condition, back) == [(0, SourceEvent(Op.RETRACT, new, (2, 0, 2)))]
    assert filter_unit(condition, [SourceEvent(Op.APPEND, {"k": "a"}, (3, 0, 4))]) == []  # absent: unknown
    with pytest.raises(Rejected, match=r"schema mismatch.*a string compared with a number"):
        filter_unit(condition, [SourceEvent(Op.APPEND, {"k": "a", "v": "x"}, (4, 0, 5))])
