"""Windowed views written in SQL (`refold.sql`): Spark's `window(…)` and `session_window(…)`,
and Flink's window table functions `TUMBLE`/`HOP`, give the view their YAML twin gives; the
lateness is written beside the query. (Refusals, with their name and position: test_sql.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from refold.config import Pipeline, ViewSpec, parse_pipeline
from refold.errors import ConfigError
from refold.sql import SqlError, translate

HOURLY = ("SELECT k, window.start AS window_start, window.end AS window_end, SUM(x) AS total "
          "FROM t GROUP BY window(ts, '1 hour'), k")


def without_sql(view: ViewSpec) -> ViewSpec:
    """The view a `sql` view is, as if written in YAML (the query itself left out)."""
    return ViewSpec.model_validate(view.model_dump(exclude={"sql"}))


TWINS = [
    pytest.param(
        {"sql": HOURLY},
        {"key": ["k"], "columns": {"total": {"sum": "x"}}, "window": {"time": "ts", "tumble": "1h"}},
        id="tumble",
    ),
    pytest.param(
        {"sql": "SELECT k, window.start, window.end, SUM(x) AS total, COUNT(*) AS n FROM t "
                "GROUP BY window(ts, '1 hour', '15 minutes'), k"},
        {"key": ["k"], "columns": {"total": {"sum": "x"}, "n": {"count": "*"}},
         "window": {"time": "ts", "hop": {"size": "1h", "slide": "15m"}}},
        id="hop",
    ),
    pytest.param(
        {"sql": "select user_id, session_window.start, session_window.end, count(*) as clicks\n"
                "from t\ngroup by user_id, session_window(ts, '30 minutes')"},
        {"key": ["user_id"], "columns": {"clicks": {"count": "*"}},
         "window": {"time": "ts", "session": {"gap": "30m"}}},
        id="session",
    ),
    pytest.param(
        {"sql": "SELECT team, player, window.end, window.start, MAX(score) FROM t WHERE score > 0 "
                "GROUP BY team, WINDOW(t.event_time, INTERVAL 1 DAY), player"},
        {"key": ["team", "player"], "columns": {"max_score": {"max": "score"}}, "where": "score > 0",
         "window": {"time": "event_time", "tumble": "1d"}},
        id="tumble-where-interval-literal",
    ),
    pytest.param(
        {"sql": HOURLY, "window": {"lateness": "10m"}},
        {"key": ["k"], "columns": {"total": {"sum": "x"}},
         "window": {"time": "ts", "tumble": "1h", "lateness": "10m"}},
        id="lateness-beside-the-query",
    ),
    pytest.param(
        {"sql": "SELECT * FROM (SELECT ROW_NUMBER() OVER (PARTITION BY window(ts, '1 day'), team "
                "ORDER BY score DESC) AS place, * FROM t) WHERE place <= 3"},
        {"top_n": {"n": 3, "order_by": {"score": "desc"}, "partition_by": ["team"]},
         "window": {"time": "ts", "tumble": "1d"}},
        id="top-n-per-window",
    ),
    pytest.param(
        {"sql": "SELECT place, player, score FROM (SELECT ROW_NUMBER() OVER (PARTITION BY "
                "window(ts, '1 hour', '30 minutes') ORDER BY score DESC) AS place, player, score FROM t) "
                "WHERE place <= 10", "window": {"lateness": "1h"}},
        {"top_n": {"n": 10, "order_by": {"score": "desc"}, "columns": ["player", "score"]},
         "window": {"time": "ts", "hop": {"size": "1h", "slide": "30m"}, "lateness": "1h"}},
        id="top-n-per-hop-with-lateness",
    ),
    pytest.param(
        {"sql": "SELECT k, window_start, window_end, SUM(x) AS total\n"
                "FROM TABLE(TUMBLE(TABLE t, DESCRIPTOR(ts), INTERVAL '1' HOUR))\n"
                "GROUP BY window_start, window_end, k"},
        {"key": ["k"], "columns": {"total": {"sum": "x"}}, "window": {"time": "ts", "tumble": "1h"}},
        id="flink-tumble",
    ),
    pytest.param(
        {"sql": "SELECT k, window_start, window_end, COUNT(*) AS n FROM TABLE(\n"
                "  HOP(TABLE t, DESCRIPTOR(ts), INTERVAL '15' MINUTES, INTERVAL '1' HOUR))\n"
                "WHERE x > 0 GROUP BY k, window_end, window_start", "window": {"lateness": "5m"}},
        {"key": ["k"], "columns": {"n": {"count": "*"}}, "where": "x > 0",
         "window": {"time": "ts", "hop": {"size": "1h", "slide": "15m"}, "lateness": "5m"}},
        id="flink-hop-slide-before-size",
    ),
    pytest.param(
        {"sql": "SELECT * FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY window_start, window_end, team "
                "ORDER BY score DESC) AS place FROM TABLE(TUMBLE(TABLE t, DESCRIPTOR(ts), INTERVAL '1' DAY))) "
                "WHERE place <= 3"},
        {"top_n": {"n": 3, "order_by": {"score": "desc"}, "partition_by": ["team"]},
         "window": {"time": "ts", "tumble": "1d"}},
        id="flink-window-top-n",
    ),
    pytest.param(
        {"sql": "SELECT window_start, window_end, place, team, player FROM (SELECT window_start, window_end, team, "
                "player, ROW_NUMBER() OVER (PARTITION BY window_start, window_end, team ORDER BY score DESC) AS "
                "place FROM TABLE(TUMBLE(TABLE t, DESCRIPTOR(ts), INTERVAL '1' DAY))) WHERE place <= 3"},
        {"top_n": {"n": 3, "order_by": {"score": "desc"}, "partition_by": ["team"], "columns": ["player"]},
         "window": {"time": "ts", "tumble": "1d"}},
        id="flink-window-top-n-columns",
    ),
]


@pytest.mark.parametrize(("sql_view", "yaml_view"), TWINS)
def test_a_windowed_query_is_its_yaml_twin(sql_view: dict[str, Any], yaml_view: dict[str, Any]) -> None:
    from_sql, from_yaml = ViewSpec.model_validate(sql_view), ViewSpec.model_validate(yaml_view)
    assert without_sql(from_sql) == from_yaml
    assert from_sql.window == from_yaml.window is not None
    assert from_sql.sql == sql_view["sql"] and from_sql.sql_table is not None and from_sql.sql_table[0] == "t"
    # a view dumped with its spec (as `refold explain` and model_dump do) reads back as itself
    assert ViewSpec.model_validate(from_sql.model_dump()) == from_sql


@pytest.mark.parametrize(("interval", "duration"), [
    ("'1 hour'", "1h"), ("'15 minutes'", "15m"), ("'10 seconds'", "10s"), ("'1 day'", "1d"),
    ("'500 milliseconds'", "500ms"), ("'1 minute'", "1m"), ("'90 minutes'", "90m"), ("'60 minutes'", "1h"),
    ("'1 hour 30 minutes'", "90m"), ("'2 weeks'", "14d"), ("'1500 milliseconds'", "1500ms"),
    ("'3000 microseconds'", "3ms"), ("'interval 2 hours'", "2h"), ("'  5  MINUTES '", "5m"),
    ("INTERVAL 1 HOUR", "1h"), ("INTERVAL '1' HOUR", "1h"), ("INTERVAL '1 hour'", "1h"),
    ("INTERVAL 90 MINUTES", "90m"), ("INTERVAL 10 SECONDS", "10s"), ("INTERVAL 250 MILLISECONDS", "250ms"),
])
def test_spark_intervals_become_refold_durations(interval: str, duration: str) -> None:
    """In the largest unit that writes the length whole: the form `refold explain` prints
    and the YAML twin is written in."""
    spec = translate(f"SELECT window.start, window.end, k, COUNT(*) AS n FROM t GROUP BY window(ts, {interval}), k")
    assert spec.spec["window"] == {"time": "ts", "tumble": duration}
    session = translate(f"SELECT session_window.start, session_window.end, k, COUNT(*) AS n FROM t "
                        f"GROUP BY k, session_window(ts, {interval})")
    assert session.spec["window"] == {"time": "ts", "session": {"gap": duration}}


def test_the_bounds_come_out_as_window_start_and_window_end() -> None:
    """With or without AS: Spark names them `window.start`; Refold's rows carry
    `window_start`/`window_end` (docs/sql.md, Windows)."""
    bare = translate("SELECT k, window.start, window.end, SUM(x) AS total FROM t GROUP BY window(ts, '1 hour'), k")
    assert bare.spec == translate(HOURLY).spec
    with pytest.raises(SqlError, match=r"window.end AS 'stop' \(line 2, column 8\): .*write AS window_end"):
        translate("SELECT k, window.start,\n       window.end AS stop, SUM(x) FROM t GROUP BY window(ts, '1 hour'), k")


@pytest.mark.parametrize(("view", "message"), [
    ({"sql": HOURLY, "window": {"lateness": "10m", "tumble": "2h"}},
     r"view: window: beside sql, write only the window's lateness; the query gives its time and kind \(tumble\)"),
    ({"sql": HOURLY, "window": {"time": "other", "lateness": "10m"}}, r"the query gives its time and kind \(time\)"),
    ({"sql": HOURLY, "window": "10m"}, r"view: window: beside sql, write only the window's lateness, e\.g\."),
    ({"sql": "SELECT k, SUM(x) AS s FROM t GROUP BY k", "window": {"lateness": "1m"}},
     r"view: window: the query has no time window \(window\(…\), session_window\(…\) or a TUMBLE/HOP"),
    ({"sql": HOURLY, "window": {"lateness": "soon"}}, r"view\.window: duration 'soon'"),
    ({"sql": "SELECT k, window.start, window.end, SUM(x) AS s FROM t GROUP BY window(ts, '1 hour', '2 hours'), k"},
     r"view\.window\.hop: hop: slide 2h is longer than size 1h"),
])
def test_what_a_windowed_sql_view_cannot_be_is_a_config_error(view: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_pipeline({"pipeline": "p", "source": {"topic": "t"}, "view": view, "outputs": {"view": {"topic": "o"}}})


def validated(view: dict[str, Any], emit: str = "per_event") -> dict[str, Any] | str:
    """The pipeline a view gives, as settings without the query text, or why it is refused."""
    try:
        pipeline = parse_pipeline({"pipeline": "p", "source": {"topic": "t"}, "view": view,
                                   "outputs": {"view": {"topic": "o", "emit": emit}}})
    except ConfigError as exc:
        return str(exc)
    assert isinstance(pipeline, Pipeline)
    return pipeline.model_dump(exclude={"view": {"sql"}})


@pytest.mark.parametrize(("sql_view", "yaml_view"), TWINS)
@pytest.mark.parametrize("emit", ["per_event", "final"])
def test_a_windowed_sql_pipeline_is_its_yaml_twin(sql_view: dict[str, Any], yaml_view: dict[str, Any],
                                                  emit: str) -> None:
    """Each setting checked across the pipeline (emit: final needs a lateness, …) holds
    for the query as for its twin: both validate to the same pipeline, or both are
    refused with the same reason."""
    assert validated(sql_view, emit) == validated(yaml_view, emit)
    if emit == "final" and "lateness" not in sql_view.get("window", {}):
        assert validated(sql_view, emit) == ("pipeline: outputs.view.emit: final writes a window's result when "
                                             "the window closes: it needs view.window with a lateness")


def test_the_table_function_names_its_table_where_it_stands() -> None:
    """The pipeline checks a query's table against `source.topic`, pointing at `TABLE t`."""
    view = translate("SELECT k, window_start, window_end, SUM(x) AS s\nFROM TABLE(TUMBLE(TABLE db.scores, "
                     "DESCRIPTOR(ts), INTERVAL '1' HOUR)) GROUP BY window_start, window_end, k")
    assert (view.table, view.table_at) == ("db.scores", "(line 2, column 25)")
    with pytest.raises(ConfigError, match=r"FROM other \(line 1, column 70\) is not the source topic 't'"):
        parse_pipeline({"pipeline": "p", "source": {"topic": "t"}, "outputs": {"view": {"topic": "o"}}, "view": {
            "sql": "SELECT k, window_start, window_end, SUM(x) AS s FROM TABLE(HOP(TABLE other, DESCRIPTOR(ts), "
                   "INTERVAL '1' MINUTE, INTERVAL '1' HOUR)) GROUP BY window_start, window_end, k"}})


def test_a_column_named_window_is_a_column_without_a_time_window() -> None:
    """Only beside window(…) is a bare `window` Spark's struct (then refused when selected)."""
    assert translate("SELECT k, MAX(window) AS w FROM t GROUP BY k").spec["columns"] == {"w": {"max": "window"}}
    top = translate("SELECT * FROM (SELECT ROW_NUMBER() OVER (PARTITION BY session_window ORDER BY x DESC) AS place, "
                    "session_window, x FROM t) WHERE place <= 1")
    assert top.spec["top_n"]["partition_by"] == ["session_window"]
    with pytest.raises(SqlError, match=r"window \(line 1, column 11\): a windowed view selects window.start"):
        translate("SELECT k, window, window.start, window.end, SUM(x) FROM t GROUP BY window(ts, '1 hour'), k")
