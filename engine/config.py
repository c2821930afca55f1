"""The pipeline file, typed at the edge (DESIGN.md §5).

The YAML is validated into frozen pydantic models with `extra="forbid"`; every
problem is reported with the path of the setting (`view.columns.total`). The
`kafka:` block is a `KafkaConnection` (refold.kafka.connection): librdkafka's dotted
keys as written, secrets hidden, rendered for a client only where one is built.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from refold import environment
from refold.connectors.settings import MaterializeSettings, check_distinct, describe_problem
from refold.errors import ConfigError
from refold.kafka.connection import KafkaConnection
from refold.viewspec import AGGREGATIONS as AGGREGATIONS
from refold.viewspec import ColumnSpec as ColumnSpec
from refold.viewspec import HopSpec as HopSpec
from refold.viewspec import JoinSpec as JoinSpec
from refold.viewspec import SessionSpec as SessionSpec
from refold.viewspec import TopNSpec as TopNSpec
from refold.viewspec import ViewSpec as ViewSpec
from refold.viewspec import WindowSpec as WindowSpec
from refold.viewspec import duration_ms as duration_ms
from refold.viewspec import parse_duration as parse_duration

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
_SOURCE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,100}$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceSpec(_Model):
    """The input topic. `debezium-json` reads Debezium change events (JSON converter,
    with or without its `payload` wrapper) as changelog events; the engine keeps each
    table key's last row, so an update without `before` and a delete with only the
    key's columns (PostgreSQL's default replica identity) are completed from it, and a
    full `before` that is not that row is a dead letter (`before differs`).

    `key` names the columns the messages are keyed by (default: the view key; for a
    Top-N, `partition_by`). A view whose key includes every one of them is
    co-partitioned with its source and runs one shard per source partition; any other
    view runs as one shard that merges the partitions. For a co-partitioned view the
    engine checks the message keys (the JSON object of these columns, as
    `refold produce --key` writes it): when the first records of a run are keyed
    otherwise it stops before committing anything; a later record keyed otherwise is
    a dead letter (`key mismatch`). Debezium's keys (the table's key, with or without
    their `schema`/`payload` envelope) are checked on a run's first record only.

    `form: upsert` reads a table written as key → latest row (a compacted topic, Kafka
    Connect, ksqlDB, Flink's `upsert-kafka`, Refold's own upsert outputs): each value is
    the whole row without `op` (key columns it lacks come from the message key, the JSON
    object of the `key` columns), a tombstone (null value) deletes the key. The engine
    keeps the row each message key last put into the view and turns every record into
    the changelog it means: a new key `+A`, a changed row `-C` old `+C` new, an identical
    row nothing, a tombstone `-R` old (for an absent key: nothing, counted). Formats
    `jsonl` and `avro` (the row's schema, without `op`)."""

    topic: str
    format: Literal["jsonl", "avro", "debezium-json"] = "jsonl"
    form: Literal["changelog", "upsert"] = "changelog"
    schema_path: str | None = Field(default=None, alias="schema")
    key: list[str] = []  # the message-key columns, when they differ from the view key

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    # `format: avro` needs `schema:` unless a schema registry names each record's
    # writer schema: checked by Pipeline._cross, which sees `schema_registry`.


class _AvroOutput(_Model):
    """An output's value format: JSON objects, or Avro records of the row schema
    `schema` (an .avsc of the row's fields; the engine adds `op` where the form has
    it). With `schema_registry` Avro values are in the Confluent wire format."""

    format: Literal["jsonl", "avro"] = "jsonl"
    schema_path: str | None = Field(default=None, alias="schema")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _schema(self) -> _AvroOutput:
        if self.format == "avro" and not self.schema_path:
            raise ValueError("format avro needs schema: path/to/row.avsc")
        return self


class ViewOutput(_AvroOutput):
    """`partitioning`: `shard` (a new pipeline's: shard s writes partition s, so each `-C`
    is followed by its `+C` there) or `key` (murmur2 of the view key, kept by a pipeline
    that first committed with it); settled at the first start (the manual: Concepts)."""

    topic: str
    form: Literal["changelog", "retract", "upsert"] = "changelog"
    emit: Literal["per_event", "per_batch", "final"] = "per_event"
    partitioning: Literal["shard", "key"] | None = None


class DeltaOutput(_AvroOutput):
    topic: str


class Outputs(_Model):
    view: ViewOutput | None = None
    delta: DeltaOutput | None = None
    # each entry validated by its driver's settings model (refold.connectors.settings)
    materialize: list[MaterializeSettings] = []
    # cause headers (`refold.cause`, `refold.retracts`) on the view, delta and dead-letter
    # records (docs/SEMANTICS.md, "Provenance"); `off` (YAML's false) writes none
    provenance: bool = True

    @field_validator("provenance", mode="before")
    @classmethod
    def _on_off(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lower() in ("on", "off"):
            return value.lower() == "on"
        return value

    @model_validator(mode="after")
    def _some(self) -> Outputs:
        if self.view is None and self.delta is None and not self.materialize:
            raise ValueError("outputs: name at least one of view, delta")
        check_distinct(self.materialize)
        return self


class SchemaRegistrySpec(_Model):
    """A Confluent-compatible schema registry: Avro values (source `format: avro`,
    outputs with `format: avro`) are then in its wire format (magic byte 0, the
    4-byte schema id, the Avro binary); output schemas are registered under
    `<topic>-value`. `mock://NAME` is confluent-kafka's in-process mock (tests)."""

    url: str
    basic_auth_user_info: SecretStr | None = None  # "user:password"

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://", "mock://")):
            raise ValueError(f"{value!r}: write http(s)://host:port (or mock://name in tests)")
        return value


class MetricsSpec(_Model):
    """A Prometheus endpoint (`/metrics`) served by `refold run`; off unless set."""

    port: Annotated[int, Field(ge=1, le=65535)]
    host: str = "0.0.0.0"


class SparkSpec(_Model):
    master: str = "local[2]"
    conf: dict[str, str] = {}
    checkpoint_dir: str | None = None  # a cache; Kafka is authoritative
    # view keys a Python worker's reducers keep in memory in front of the local stores, all its
    # shards together (past it, the least recently used shards' reducers start empty)
    state_cache_keys: Annotated[int, Field(ge=1)] = 200_000
    state_dir: str | None = None  # the executors' local stores; default <Refold home>/state
    # the reduction core of a grouped view: `auto` the native one (refold_native, built from native/)
    # where it runs the view, else Python; `native` refuses a view it cannot run; `python` never native
    core: Literal["auto", "native", "python"] = "auto"

    @field_validator("conf")
    @classmethod
    def _conf(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if key.rsplit(".", 1)[-1] in _SPLITTING_OPTIONS:
                raise ValueError(f"{key}: Refold runs one task per source partition (a shard's transaction, "
                                 "state and checkpoint follow the partition); an option that splits "
                                 "partitions into several tasks would run one shard twice at once")
        return value


_SPLITTING_OPTIONS = frozenset({"minPartitions", "maxRecordsPerPartition"})


class Pipeline(_Model):
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)  # secrets

    pipeline: str
    kafka: KafkaConnection = KafkaConnection()
    source: SourceSpec
    # several sources by name (a join's sides); `source` is then the first of them
    sources: dict[str, SourceSpec] = {}
    view: ViewSpec
    outputs: Outputs
    trigger: str = "500ms"
    strict: bool = False
    writer: str = "0"
    transactional_id_prefix: str | None = None
    max_batch_events: Annotated[int, Field(ge=1)] = 200_000
    partitions: Annotated[int, Field(ge=1, le=1000)] = 4  # for topics the engine creates
    # the replicas of each topic the engine creates; unset: min(3, the cluster's brokers)
    replication_factor: Annotated[int, Field(ge=1, le=32)] | None = None
    # a re-grouping view's stage-2 shards (refold.runtime.exchange); "merged": one task merges
    # every partition; unset: settled at start (refold.recovery.layout)
    shards: Annotated[int, Field(ge=1, le=1000)] | Literal["merged"] | None = None
    spark: SparkSpec = SparkSpec()
    schema_registry: SchemaRegistrySpec | None = None
    metrics: MetricsSpec | None = None

    @field_validator("pipeline", "writer")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"{value!r} must be letters, digits, '.', '_' or '-'")
        return value

    @field_validator("trigger")
    @classmethod
    def _trigger(cls, value: str) -> str:
        parse_duration(value)
        return value

    @model_validator(mode="before")
    @classmethod
    def _one_source(cls, value: Any) -> Any:
        """`sources:` instead of `source:`: `source` becomes the first of them."""
        if not isinstance(value, Mapping) or value.get("sources") in (None, {}):
            return value
        sources = value["sources"]
        if not isinstance(sources, Mapping):
            raise ValueError("sources: a mapping of names to sources (topic, format, form, key, schema)")
        first = next(iter(sources.values()))
        # (a pipeline dumped with model_dump reads back: its source is the first of its sources)
        if value.get("source") is not None and value["source"] != first:
            raise ValueError("write source: (one source) or sources: (sources by name), not both")
        return {**value, "source": first}

    @field_validator("sources")
    @classmethod
    def _source_names(cls, value: dict[str, SourceSpec]) -> dict[str, SourceSpec]:
        for name in value:
            if not _SOURCE_NAME.match(name):
                raise ValueError(f"{name!r}: a source's name is letters, digits, '_' or '-' (SQL names it)")
        return value

    def _sources_check(self) -> None:
        """A join's sides are sources of `sources:`; a view that is not a join reads one."""
        join = self.view.join
        if join is None:
            if len(self.sources) > 1:
                raise ValueError(f"sources: names {len(self.sources)} sources ({', '.join(self.sources)}); a view "
                                 "that is not a join reads one")
            if self.view.sql_table is not None and self.sources:
                table, at = self.view.sql_table
                if table not in self.sources and table != self.source.topic:
                    raise ValueError(f"view.sql: FROM {table} {at} is not a source of sources: "
                                     f"({', '.join(self.sources)})")
            return
        if not self.sources:
            raise ValueError("view.join: a join reads two sources: name them in sources: (instead of source:)")
        for name, source in self.sources.items():
            if source.format == "avro" and not source.schema_path and self.schema_registry is None:
                raise ValueError(f"sources.{name}: format avro needs schema: path/to/schema.avsc (or a schema_registry)")
            if source.form == "upsert" and not source.key:
                raise ValueError(f"sources.{name}: form upsert needs the message-key columns: set key")
        for side in ("left", "right"):
            name = getattr(join, side)
            if name not in self.sources:
                at = dict(self.view.sql_tables).get(name)
                where = f"view.sql: {name} {at}" if at else f"view.join.{side}: {name!r}"
                raise ValueError(f"{where} is not a source of sources: ({', '.join(self.sources)})")

    def run_refusal(self) -> str | None:
        """Why the engine cannot run this pipeline yet (None: it can)."""
        join = self.view.join
        if join is None:
            return None
        if self.outputs.materialize:
            return "outputs.materialize: not supported for joins (view.join) yet"
        if not self.view.key and self.outputs.view is not None and self.outputs.view.emit == "per_batch":
            return ("outputs.view.emit: per_batch nets a batch's records per key, and a join's rows are a multiset "
                    "(keys may repeat): not supported for a join without a grouped view over it")
        if not self.view.key and self.outputs.delta is not None:
            return "outputs.delta: a join's rows are not reduced: delta updates need a grouped view over the join (key, columns)"
        ordered = [name for name, spec in self.view.columns.items() if spec.agg in ("first", "last", "last_write_wins")]
        if ordered:
            return (f"view.columns.{ordered[0]}: {self.view.columns[ordered[0]].agg} orders rows by their input event; "
                    "over a join's rows it is not supported yet")
        return None

    @model_validator(mode="after")
    def _cross(self) -> Pipeline:
        if self.sources or self.view.join is not None:
            self._sources_check()
        elif self.view.sql_table is not None and self.view.sql_table[0] != self.source.topic:
            table, at = self.view.sql_table
            raise ValueError(f"view.sql: FROM {table} {at} is not the source topic {self.source.topic!r}")
        if self.outputs.view is not None and self.outputs.view.emit == "final" and (self.view.window is None or self.view.window.lateness is None):
            raise ValueError("outputs.view.emit: final writes a window's result when the window closes: "
                             "it needs view.window with a lateness")
        if (refusal := self.window_refusal()) is not None:
            raise ValueError(refusal)
        if self.view.is_top_n and self.outputs.delta is not None:
            raise ValueError("outputs.delta: delta updates are defined for grouped views, not top_n")
        for i, entry in enumerate(self.outputs.materialize):
            if self.view.is_top_n and entry.delta is not None:
                raise ValueError(f"outputs.materialize[{i}].delta: delta updates are defined for grouped views, not top_n")
        if self.source.format == "avro" and not self.source.schema_path and self.schema_registry is None:
            raise ValueError("source: format avro needs schema: path/to/schema.avsc (or a schema_registry)")
        if self.source.form == "upsert":
            if self.source.format == "debezium-json":
                raise ValueError("source: form upsert reads rows; debezium-json events carry their own op "
                                 "(leave form at changelog)")
            if self.source.format == "avro" and self.schema_registry is not None:
                raise ValueError("source: form upsert reads schemaless Avro rows (schema: the row's .avsc); "
                                 "a schema_registry is not supported for upsert sources yet")
            view_key = self.view.top_n.partition_by if self.view.top_n is not None else self.view.key
            if not (self.source.key or view_key):
                raise ValueError("source: form upsert needs the message-key columns: set source.key")
        if isinstance(self.shards, int) and (refusal := self.shards_refusal()) is not None:
            raise ValueError(f"shards: {refusal}")
        return self

    def window_refusal(self) -> str | None:
        """Why the pipeline's windowed view cannot run as written (None: it can, or it has
        no window)."""
        window = self.view.window
        if window is None:
            return None
        if window.kind == "session" and self.view.top_n is not None:
            return "view.window.session: a Top-N ranks per tumble or hop window, not per session"
        if window.kind == "session" and (self.outputs.delta is not None
                                         or any(m.delta is not None for m in self.outputs.materialize)):
            return ("outputs.delta: delta updates are keyed by the output key, and a session's key "
                    "(its start) moves as sessions merge and split: not defined for session windows")
        if self.outputs.view is not None and self.outputs.view.emit == "per_batch":
            return "outputs.view.emit: per_batch is not supported for windowed views (view.window) yet"
        if isinstance(self.shards, int):
            return ("shards: a windowed view's watermark advances in one shard's input order: it runs "
                    "co-partitioned or merged (leave shards out)")
        if self.source.form != "changelog" or self.source.format == "debezium-json":
            return "view.window: windowed views read a changelog source (form: changelog, not debezium-json) yet"
        if self.outputs.materialize:
            return "outputs.materialize: not supported for windowed views (view.window) yet"
        names = set(self.view.top_n.partition_by if self.view.top_n is not None else [*self.view.key, *self.view.columns])
        if taken := sorted(names & {"window_start", "window_end"}):
            return f"view.window: {', '.join(taken)} is the name of a window bound in the output; rename the column"
        return None

    def shards_refusal(self) -> str | None:
        """Why the view cannot re-group in shards (None: it can): they are for a view that
        re-groups a jsonl changelog keyed by `source.key`."""
        view_key = self.view.top_n.partition_by if self.view.top_n is not None else self.view.key
        if self.view.join is not None:
            return None  # (`run_refusal` says what a join runs in)
        if self.view.window is not None:
            return "a windowed view's watermark advances in one shard's input order: it runs merged"
        if not self.source.key:
            return ("a re-grouping view in shards needs source.key, the columns the source's messages are "
                    "keyed by (its stage 1 checks each key's rows)")
        if set(self.source.key) <= set(view_key):
            return ("the view is co-partitioned with its source (its key includes source.key): it runs one "
                    "shard per source partition already; leave shards out")
        if self.source.form != "changelog" or self.source.format != "jsonl":
            return "a re-grouping view runs in shards over a jsonl changelog source; leave shards out"
        return None

    # Derived names (DESIGN.md §3) -------------------------------------------------
    @property
    def checkpoints_topic(self) -> str:
        return f"{self.pipeline}.checkpoints"

    @property
    def state_topic(self) -> str:
        return f"{self.pipeline}.state"

    @property
    def dlq_topic(self) -> str:
        return f"{self.pipeline}.dlq"

    @property
    def repartition_topic(self) -> str:  # a re-grouping view's routed units, one partition per shard
        return f"{self.pipeline}.repartition"

    @property
    def rows_topic(self) -> str:  # the live rows per message key that its stage 1 checks against
        return f"{self.pipeline}.rows"

    def transactional_id(self, shard: int | str) -> str:
        """The transactional id of one shard of this writer: `<prefix>-<writer>-<shard>`."""
        return f"{self.transactional_id_prefix or self.pipeline}-{self.writer}-{shard}"

    @property
    def trigger_seconds(self) -> float:
        return parse_duration(self.trigger)

    def kafka_settings(self, bootstrap_override: str | None = None) -> dict[str, Any]:
        """librdkafka settings: the pipeline's `kafka:` block rendered, its bootstrap servers
        the override's, else $REFOLD_BOOTSTRAP_SERVERS, else the block's, else the local broker."""
        settings = self.kafka.librdkafka()
        settings["bootstrap.servers"] = (
            bootstrap_override
            or environment.bootstrap_servers()
            or self.kafka.bootstrap_servers
            or DEFAULT_BOOTSTRAP
        )
        return settings


def load_pipeline(path: str | Path) -> Pipeline:
    """Read and validate a pipeline file. Raises ConfigError naming the file and setting."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read pipeline file: {exc.strerror}", where=str(path)) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", where=str(path)) from exc
    return parse_pipeline(data, where=str(path))


def parse_pipeline(data: Any, where: str = "pipeline") -> Pipeline:
    if not isinstance(data, Mapping):
        raise ConfigError("a pipeline file is a mapping (pipeline:, source:, view:, outputs:)", where)
    try:
        return Pipeline.model_validate(data)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            loc = error["loc"]
            if loc[:2] == ("outputs", "materialize") and len(loc) > 2:  # one entry: as its driver says
                problems.append(describe_problem(loc[3:], error, f"outputs.materialize[{loc[2]}]"))
                continue
            message = error["msg"].removeprefix("Value error, ")
            location = ".".join(str(part) for part in loc)
            if not location:  # a check across settings names its settings itself
                problems.append(message)
                continue
            if error["type"] == "extra_forbidden":
                message = "unknown setting"
            elif error["type"] == "missing":
                message = "missing setting"
            problems.append(f"{location}: {message}")
        raise ConfigError("; ".join(problems), where) from exc
