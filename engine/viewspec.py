"""The view part of the pipeline file (`view:`): grouped and Top-N views, their SQL form,
and event-time windows; and the durations the pipeline file writes (`500ms`, `5m`,
`1h`, `1d`). `refold.config` re-exports every name here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

AGGREGATIONS = ("sum", "count", "avg", "min", "max", "first", "last", "last_write_wins", "set")



class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ColumnSpec(_Model):
    """One reduced column: an aggregation over one input column (`count` may use "*")."""

    agg: Literal["sum", "count", "avg", "min", "max", "first", "last", "last_write_wins", "set"]
    column: str


class TopNSpec(_Model):
    """`n` rows per `partition_by` group, ranked by `order_by`; `columns`: the row columns
    each output row carries (default: every column of the row)."""

    n: Annotated[int, Field(ge=1, le=10_000)]
    order_by: dict[str, Literal["asc", "desc"]]
    partition_by: list[str] = []
    columns: list[str] | None = None

    @field_validator("order_by")
    @classmethod
    def _not_empty(cls, value: dict[str, str]) -> dict[str, str]:
        if not value:
            raise ValueError("order_by needs at least one column")
        return value

    @field_validator("columns")
    @classmethod
    def _row_columns(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("columns: name at least one row column (or leave it out for all of them)")
        if "place" in value:
            raise ValueError("columns: 'place' is the output's own column, not a row column")
        if len(set(value)) != len(value):
            raise ValueError("columns: a column is named twice")
        return value


class HopSpec(_Model):
    """A hopping (sliding) window: `size` long, a new one every `slide`."""

    size: str
    slide: str

    @model_validator(mode="after")
    def _sizes(self) -> HopSpec:
        size, slide = duration_ms(self.size), duration_ms(self.slide)
        if slide > size:
            raise ValueError(f"hop: slide {self.slide} is longer than size {self.size} "
                             "(events between windows would belong to none)")
        return self


class SessionSpec(_Model):
    """A session window: rows of one key whose event times are less than `gap` apart."""

    gap: str

    @field_validator("gap")
    @classmethod
    def _gap(cls, value: str) -> str:
        duration_ms(value)
        return value


class WindowSpec(_Model):
    """`view.window`: the view groups (or ranks) per event-time window of the row's `time`
    column (ISO-8601 text or epoch milliseconds). Exactly one of `tumble`, `hop`,
    `session`. `lateness`: the horizon after which a window closes (docs/windows.md);
    none: windows never close. Windows are aligned to the epoch (a 1h tumble starts on
    the hour, UTC); `window_end` is exclusive."""

    time: str
    tumble: str | None = None
    hop: HopSpec | None = None
    session: SessionSpec | None = None
    lateness: str | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> WindowSpec:
        kinds = [name for name in ("tumble", "hop", "session") if getattr(self, name) is not None]
        if len(kinds) != 1:
            raise ValueError("window: write exactly one of tumble, hop or session"
                             + (f" (got {', '.join(kinds)})" if kinds else ""))
        if self.tumble is not None:
            duration_ms(self.tumble)
        if self.lateness is not None:
            millis = parse_duration(self.lateness) * 1000
            if millis < 0 or millis != int(millis):
                raise ValueError(f"lateness {self.lateness!r}: a whole number of milliseconds, 0 or more")
        return self

    @property
    def kind(self) -> Literal["tumble", "hop", "session"]:
        return "tumble" if self.tumble is not None else "hop" if self.hop is not None else "session"

    @property
    def size_ms(self) -> int:
        """A tumble's or hop's length (a session: its gap)."""
        if self.tumble is not None:
            return duration_ms(self.tumble)
        if self.hop is not None:
            return duration_ms(self.hop.size)
        assert self.session is not None
        return duration_ms(self.session.gap)

    @property
    def slide_ms(self) -> int:
        """How far apart windows start: a hop's slide, a tumble's size (a session: its gap)."""
        return duration_ms(self.hop.slide) if self.hop is not None else self.size_ms

    @property
    def gap_ms(self) -> int | None:
        return duration_ms(self.session.gap) if self.session is not None else None

    @property
    def lateness_ms(self) -> int | None:
        return None if self.lateness is None else int(parse_duration(self.lateness) * 1000)


JOIN_TYPES = ("inner", "left", "full")
_SOURCE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,100}$")


class JoinSpec(_Model):
    """`view.join`: an equi-join of two sources' changelogs (docs/SEMANTICS.md, Joins).

    `left`/`right` name sources of the pipeline's `sources:`; `on` pairs a left column
    with a right column (`[[customer_id, id]]`), all equal for rows to match (a null
    never matches); `type` is `inner`, `left` (outer) or `full` (outer). `columns` maps
    each output column to `<source>.<column>`, in output order. `key`: the output
    columns that name a joined row, so a correction of a side emits `-C`/`+C` for the
    joined rows whose key stays (default: the whole row, so a correction emits `-R`/`+A`)."""

    left: str
    right: str
    on: list[tuple[str, str]]
    type: Literal["inner", "left", "full"] = "inner"
    columns: dict[str, str]
    key: list[str] | None = None

    @field_validator("left", "right")
    @classmethod
    def _source_name(cls, value: str) -> str:
        if not _SOURCE_NAME.match(value):
            raise ValueError(f"{value!r}: a source's name in sources: (letters, digits, '_' or '-')")
        return value

    @field_validator("on")
    @classmethod
    def _on(cls, value: list[tuple[str, str]]) -> list[tuple[str, str]]:
        if not value:
            raise ValueError("on: at least one [left column, right column] pair")
        if len(set(value)) != len(value):
            raise ValueError("on: a pair of columns is named twice")
        return value

    @model_validator(mode="after")
    def _shape(self) -> JoinSpec:
        if self.left == self.right:
            raise ValueError(f"a join of {self.left!r} with itself is not supported")
        if not self.columns:
            raise ValueError("columns: name at least one output column, e.g. {id: orders.id}")
        for name, source in self.columns.items():
            side, dot, column = source.partition(".")
            if not dot or not column or side not in (self.left, self.right):
                raise ValueError(f"columns.{name}: {source!r} is not <source>.<column> of "
                                 f"{self.left!r} or {self.right!r}")
        if self.key is not None:
            if not self.key:
                raise ValueError("key: at least one output column (or leave it out: the whole row)")
            unknown = [name for name in self.key if name not in self.columns]
            if unknown:
                raise ValueError(f"key: {', '.join(map(repr, unknown))} is not an output column")
        return self

    def side_of(self, source: str) -> int:
        """0 for the left source, 1 for the right one."""
        return 0 if source == self.left else 1

    @property
    def outputs(self) -> list[tuple[str, int, str]]:
        """(output column, side 0/1, the side's column), in output order."""
        out = []
        for name, source in self.columns.items():
            side, _, column = source.partition(".")
            out.append((name, self.side_of(side), column))
        return out

    @property
    def sides_on(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The join columns of the left side and of the right side, pair by pair."""
        return tuple(pair[0] for pair in self.on), tuple(pair[1] for pair in self.on)

    @property
    def output_key(self) -> list[str]:
        """The output columns that name a joined row (`key`, else all of them)."""
        return list(self.key) if self.key is not None else list(self.columns)


class ViewSpec(_Model):
    """Either `key` + `columns` (a grouped reduction) or `top_n` (a leaderboard), and
    optionally `where`: a SQL condition on the source rows (comparisons, AND, OR, NOT,
    IS NULL, IN, BETWEEN over columns and literals); the view reduces the rows it holds
    true for, applied to retractions and corrections alike (a correction whose old row
    fails becomes an append of the new one, and the other way round). Or `sql`: a query
    in Spark SQL's dialect that becomes one of them (`refold explain` prints which).
    `SELECT k, SUM(c) AS total, COUNT(*) AS n FROM topic WHERE … GROUP BY k` is a
    grouped view: the key is the GROUP BY columns; the aggregates are SUM, COUNT (`*`,
    a column), AVG, MIN, MAX, FIRST/FIRST_VALUE, LAST/LAST_VALUE and COLLECT_SET (the
    `set` aggregation: each distinct value with its live copies); an aggregate without
    `AS` is named `<function>_<column>` (`count` for COUNT(*)). `SELECT * FROM (SELECT
    ROW_NUMBER() OVER (PARTITION BY p ORDER BY s DESC) AS place, * FROM topic WHERE …)
    WHERE place <= N` is a Top-N; a list of columns instead of `*` becomes
    `top_n.columns`. `FROM` names the source topic. Windows are Spark's functions:
    `SELECT k, window.start, window.end, SUM(c) AS total FROM topic GROUP BY window(ts,
    '1 hour'), k` is `window: {time: ts, tumble: 1h}`; `window(ts, '1 hour', '15
    minutes')` a hop `{size: 1h, slide: 15m}`; `session_window(ts, '30 minutes')` a
    session `{gap: 30m}` (its bounds: `session_window.start`/`.end`); intervals as Spark
    writes them ('10 seconds', '1 day', '500 milliseconds', `INTERVAL 1 HOUR`). The
    bounds must be selected and come out as `window_start` and `window_end`.
    `ROW_NUMBER() OVER (PARTITION BY window(ts, '1 day'), p ORDER BY …)` is a Top-N per
    window. Flink's `FROM TABLE(TUMBLE(TABLE topic, DESCRIPTOR(ts), INTERVAL '1' HOUR))`
    (or `HOP(…, slide, size)`) with `window_start, window_end` in GROUP BY (or PARTITION
    BY) is the same view. Spark SQL has no watermark clause: a `sql` view's lateness is
    written beside the query, `window: {lateness: 10m}`, its only window setting.
    `join`: an equi-join of two of the pipeline's `sources:` (`JoinSpec`); with `key` +
    `columns` beside it, a grouped view over the joined rows (whose columns `key` and
    `columns` name). In SQL: `SELECT o.id, c.region FROM orders o LEFT JOIN customers c
    ON o.cust = c.id`, optionally with GROUP BY aggregates (docs/sql.md, Joins). More
    than one join, non-equi conditions, HAVING, DISTINCT, RANK/DENSE_RANK, ORDER BY or
    LIMIT outside the window, expressions inside aggregates or of the window's bounds, a
    bound that is not a number, `ASC` without `NULLS LAST` (Refold ranks nulls last), a window's start time
    or offset, Flink's CUMULATE/SESSION and group windows are refused before anything
    starts, naming the construct and its line and column."""

    key: list[str] = []
    columns: dict[str, ColumnSpec] = {}
    top_n: TopNSpec | None = None
    where: str | None = None
    window: WindowSpec | None = None
    join: JoinSpec | None = None
    sql: str | None = None
    _sql_from: tuple[str, str] | None = PrivateAttr(default=None)  # (table, where it is named)
    _sql_tables: tuple[tuple[str, str], ...] = PrivateAttr(default=())  # a join's two tables

    @model_validator(mode="before")
    @classmethod
    def _from_sql(cls, value: Any) -> Any:
        if not isinstance(value, Mapping) or value.get("sql") is None:
            return value
        sql = value["sql"]
        if not isinstance(sql, str):
            raise ValueError("sql: a query, as text")
        from refold.sql import translate

        translated = translate(sql).spec
        window = _sql_window(value.get("window"), translated.get("window"))
        if window is not None:
            translated = {**translated, "window": window}
        written = {name: value[name] for name in ("key", "columns", "top_n", "where", "join")
                   if value.get(name) not in (None, [], {})}
        # a view dumped with its spec (model_dump) reads back when the spec is the query's
        if written and not _same_view(cls, {**written, "window": window}, translated):
            raise ValueError(f"write the view either as sql or as key/columns/top_n/where, not both "
                             f"({', '.join(written)})")
        return {**value, **translated}

    @field_validator("where")
    @classmethod
    def _condition(cls, value: str | None) -> str | None:
        if value is not None:
            from refold.model.predicate import parse_condition

            parse_condition(value)
        return value

    def model_post_init(self, context: Any) -> None:
        if self.sql is not None:
            from refold.sql import translate

            view = translate(self.sql)
            self._sql_from = (view.table, view.table_at)
            self._sql_tables = view.tables

    @property
    def sql_tables(self) -> tuple[tuple[str, str], ...]:
        """A `sql` join's two tables, each with where the query names it (else empty)."""
        return self._sql_tables

    @property
    def sql_table(self) -> tuple[str, str] | None:
        """The table a `sql` view reads and where the query names it (None: no sql)."""
        return self._sql_from

    @field_validator("columns", mode="before")
    @classmethod
    def _parse_columns(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        parsed: dict[str, Any] = {}
        for name, spec in value.items():
            if isinstance(spec, Mapping) and set(spec) != {"agg", "column"}:
                if len(spec) != 1:
                    raise ValueError(
                        f"column {name!r}: write one aggregation, e.g. {{sum: score}}, got {dict(spec)!r}"
                    )
                ((agg, column),) = spec.items()
                if agg not in AGGREGATIONS:
                    raise ValueError(
                        f"column {name!r}: unknown aggregation {agg!r}; "
                        f"known: {', '.join(AGGREGATIONS)}"
                    )
                spec = {"agg": agg, "column": column}
            parsed[name] = spec
        return parsed

    @model_validator(mode="after")
    def _shape(self) -> ViewSpec:
        if self.join is not None:
            for name in ("top_n", "window", "where"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} beside join: not supported yet (a join, optionally grouped by key "
                                     "and columns over its output)")
            if bool(self.key) != bool(self.columns):
                raise ValueError("key and columns beside join: write both (a grouped view over the joined rows) "
                                 "or neither (the joined rows are the view)")
            if not self.key:
                return self
            named = [*self.key, *(spec.column for spec in self.columns.values() if spec.column != "*")]
            unknown = [column for column in dict.fromkeys(named) if column not in self.join.columns]
            if unknown:
                raise ValueError(f"{', '.join(map(repr, unknown))}: not an output column of the join "
                                 f"({', '.join(self.join.columns)})")
        if self.top_n is not None:
            if self.key or self.columns:
                raise ValueError("a top_n view has no key/columns: its rows are keyed by place")
            return self
        if not self.key:
            raise ValueError("key: a view needs at least one key column (or a top_n)")
        if not self.columns:
            raise ValueError("columns: a view needs at least one reduced column")
        for name, spec in self.columns.items():
            if name in self.key:
                raise ValueError(f"column {name!r} has the name of a key column")
            if spec.column == "*" and spec.agg != "count":
                raise ValueError(f"column {name!r}: only count may use '*'")
        return self

    @property
    def is_top_n(self) -> bool:
        return self.top_n is not None


def _sql_window(written: Any, translated: dict[str, Any] | None) -> dict[str, Any] | None:
    """The window of a `sql` view: the query's, with the `lateness` written beside the
    query (`view.window.lateness`: Spark SQL has no watermark clause)."""
    if written is None:
        return translated
    if not isinstance(written, Mapping):
        raise ValueError("window: beside sql, write only the window's lateness, e.g. window: {lateness: 10m}")
    if translated is None:
        raise ValueError("window: the query has no time window (window(…), session_window(…) or a TUMBLE/HOP "
                         "table function); beside sql, view.window takes only the lateness of the query's window")
    merged = {**translated, **({"lateness": written["lateness"]} if written.get("lateness") is not None else {})}
    others = sorted(name for name, setting in written.items() if name != "lateness" and setting is not None)
    # a view dumped with its spec (model_dump) reads back when the window is the query's
    if others and not _same_window(written, merged):
        raise ValueError(f"window: beside sql, write only the window's lateness; the query gives its "
                         f"time and kind ({', '.join(others)})")
    return merged


def _same_window(written: Mapping[str, Any], merged: dict[str, Any]) -> bool:
    try:
        return WindowSpec.model_validate(written) == WindowSpec.model_validate(merged)
    except ValidationError:
        return False


def _same_view(model: type[ViewSpec], written: dict[str, Any], translated: dict[str, Any]) -> bool:
    """Whether a view's spec, as written beside its `sql`, is the spec the query gives."""
    try:
        return model.model_validate(written) == model.model_validate(translated)
    except ValidationError:
        return False


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str | float | int) -> float:
    """'500ms' → 0.5, '2s' → 2.0, '1m' → 60.0, '1h' → 3600.0, '1d' → 86400.0; a bare
    number is seconds."""
    if isinstance(text, int | float):
        return float(text)
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"duration {text!r}: write e.g. 500ms, 2s, 5m, 1h or 1d")
    number, unit = float(match.group(1)), match.group(2) or "s"
    return number * _UNIT_SECONDS[unit]


def duration_ms(text: str | float | int) -> int:
    """A duration in whole milliseconds ('1h' → 3600000); refuses 0 and fractions of a ms."""
    millis = parse_duration(text) * 1000
    if millis <= 0 or millis != int(millis):
        raise ValueError(f"duration {text!r}: a positive whole number of milliseconds")
    return int(millis)
