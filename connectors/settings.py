"""Every driver's settings: the pydantic models an `outputs.materialize` entry is
validated into when the pipeline file is read (`refold.config`), before any topic,
connection or Spark session exists.

This module is light on purpose: `refold.config` imports it, so it imports pydantic
and nothing of a driver (no psycopg, no pyarrow). Each model names the class that
implements its driver (`implementation`, "module:Class"); that module is imported
only when the driver is built (`refold.connectors.protocol.build_driver`).

`MaterializeSettings` is the union of the models, told apart by `driver:`. A new
driver adds its model here, to that union, and its class in a module of its own.
Secrets are `SecretStr` (never in a repr or a message); unknown settings are refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, get_args
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from refold.errors import ConfigError


def _plain(value: str, longest: int | None = None) -> str:
    """A name safe in SQL and in file names unquoted: letters, digits, '_'."""
    if not (value and (value[0].isalpha() or value[0] == "_") and all(c.isalnum() or c == "_" for c in value)):
        raise ValueError(f"{value!r}: use letters, digits and '_' (start with a letter or '_')")
    if longest is not None and len(value) > longest:
        raise ValueError(f"{value!r}: at most {longest} characters")
    return value


class DriverSettings(BaseModel):
    """Every entry takes these settings; its driver's model adds its own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # "module:Class" of the driver, imported when it is built
    implementation: ClassVar[str]

    driver: str
    name: str | None = None  # the materialization name (its driver-checkpoint key); default: driver
    view: str | None = None  # the target of the view binding; None: no view binding
    delta: str | None = None  # the target of the delta binding; None: no delta binding
    parallelism: int = Field(default=2, ge=1, le=256)  # parts per transaction (drivers with a Sink)

    @field_validator("name", "view", "delta")
    @classmethod
    def _plain_names(cls, value: str | None) -> str | None:
        return None if value is None else _plain(value)

    @model_validator(mode="after")
    def _some_binding(self) -> DriverSettings:
        if self.view is None and self.delta is None:
            raise ValueError("name a target for the view (view: NAME) or the deltas (delta: NAME)")
        return self

    @property
    def materialization(self) -> str:
        return self.name or self.driver


class SQLiteSettings(DriverSettings):
    """`driver: sqlite`: a local SQLite database file (remote store authoritative)."""

    implementation: ClassVar[str] = "refold.connectors.sqlite:SQLiteDriver"

    driver: Literal["sqlite"]
    path: str  # the database file; its folder must exist
    view: str | None = "view"
    timeout: float = 30.0  # seconds to wait for a lock held by another connection


class ParquetSettings(DriverSettings):
    """`driver: parquet`: Parquet files in a folder (recovery log with idempotent apply)."""

    implementation: ClassVar[str] = "refold.connectors.parquet:ParquetDriver"

    driver: Literal["parquet"]
    path: str  # the root folder; it must exist
    view: str | None = "view"
    compression: str = "zstd"


class WebhookSettings(DriverSettings):
    """`driver: webhook`: delta rows POSTed as JSON (push-only delta updates, at-least-once)."""

    implementation: ClassVar[str] = "refold.connectors.webhook:WebhookDriver"

    driver: Literal["webhook"]
    url: str
    delta: str | None = "delta"
    headers: dict[str, SecretStr] = Field(default_factory=dict)  # e.g. Authorization; never logged
    timeout: float = 10.0  # seconds per request
    attempts: int = 5  # per part and commit, with exponential backoff
    backoff: float = 0.2  # seconds before the second attempt; doubles each time

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r}: write http(s)://host[:port]/path")
        return value

    @model_validator(mode="after")
    def _some_binding(self) -> WebhookSettings:  # replaces the base class's check
        if self.view is not None:
            raise ValueError("view: a webhook takes delta updates only (push-only); use delta: NAME")
        if self.delta is None:
            raise ValueError("delta: name the binding (it goes into each body)")
        return self


class PostgresSettings(DriverSettings):
    """`driver: postgres`: tables in a PostgreSQL database (remote store authoritative)."""

    implementation: ClassVar[str] = "refold.connectors.postgres:PostgresDriver"

    driver: Literal["postgres"]
    dsn: SecretStr  # a libpq connection string or URL
    schema_: str = Field(default="public", alias="schema")  # created when missing
    view: str | None = "view"
    checkpoints_table: str = "refold_checkpoints"
    batch_size: int = Field(default=5000, ge=1, le=1_000_000)  # keys per Load query
    connect_timeout: int = Field(default=10, ge=1, le=600)  # seconds

    @field_validator("schema_", "checkpoints_table")
    @classmethod
    def _plain_sql_names(cls, value: str) -> str:
        return _plain(value, longest=63)  # PostgreSQL's identifier limit


class DeltaSettings(DriverSettings):
    """`driver: delta`: Delta Lake tables (delta-rs; remote store authoritative).

    `path` is a local folder (it must exist) or an object-store URI (`s3://…`,
    `az://…`, `gs://…`); each binding is the Delta table `<path>/<target>`, created
    at the first Open. `storage_options` go to delta-rs as they are (credentials,
    endpoint, region: its `storage_options`); their values are secrets, never in a
    repr, a log line or a message. `parallelism` is not used (no parallel writers)."""

    implementation: ClassVar[str] = "refold.connectors.delta:DeltaDriver"

    driver: Literal["delta"]
    path: str  # the folder (or object-store URI) the tables are under: <path>/<view>, <path>/<delta>
    view: str | None = "view"
    storage_options: dict[str, SecretStr] = Field(default_factory=dict)  # delta-rs's; values never logged

    @field_validator("path")
    @classmethod
    def _some_path(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("name a folder or an object-store URI (s3://bucket/prefix)")
        return value


class IcebergSettings(DriverSettings):
    """`driver: iceberg`: Apache Iceberg tables in a catalog (pyiceberg; remote store
    authoritative: each batch is one table commit carrying the shard's checkpoint,
    fenced by the catalog's commit check). `warehouse` is the folder (or object-store
    URI) the tables' files go under; `uri` the catalog: by default a SQLite file
    `<warehouse>/catalog.db` (pyiceberg's SQL catalog), or `http(s)://…` for a REST
    catalog, `sqlite:///…` / `postgresql+psycopg://…` for a SQL catalog elsewhere
    (secret: it may hold a password). `catalog` names the catalog (the SQL catalog's
    rows are keyed by it), `namespace` the namespace the tables are created in
    (`a.b` for a nested one), `properties` are handed to the catalog as they are
    (e.g. `credential`, `token`, `s3.endpoint`; secret values, never logged), and
    `commit_attempts` bounds the commits retried when another shard committed first."""

    implementation: ClassVar[str] = "refold.connectors.iceberg:IcebergDriver"

    driver: Literal["iceberg"]
    warehouse: str  # the folder (it must exist) or object-store URI the tables' files are under
    view: str | None = "view"
    uri: SecretStr | None = None  # the catalog; None: a SQLite catalog file <warehouse>/catalog.db
    catalog: str = "refold"  # the catalog's name
    namespace: str = "refold"  # created when missing; dots separate the levels of a nested one
    properties: dict[str, SecretStr] = Field(default_factory=dict)  # catalog properties; never logged
    commit_attempts: int = Field(default=8, ge=1, le=100)  # per table and batch, when other shards commit

    @field_validator("uri")
    @classmethod
    def _catalog_uri(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        scheme = urlsplit(value.get_secret_value()).scheme
        if scheme not in ("http", "https", "sqlite") and not scheme.startswith("postgresql"):
            raise ValueError(
                f"a catalog URI of scheme {scheme!r}: write http(s)://… (a REST catalog), "
                "sqlite:///… or postgresql+psycopg://… (a SQL catalog)"
            )
        return value

    @field_validator("catalog")
    @classmethod
    def _plain_catalog(cls, value: str) -> str:
        return _plain(value)

    @field_validator("namespace")
    @classmethod
    def _plain_namespace(cls, value: str) -> str:
        for level in value.split("."):
            _plain(level)
        return value


# One `outputs.materialize` entry: the model its `driver:` names.
MaterializeSettings = Annotated[
    SQLiteSettings | ParquetSettings | WebhookSettings | PostgresSettings | DeltaSettings | IcebergSettings,
    Field(discriminator="driver"),
]

# driver name -> its settings model
DRIVERS: dict[str, type[DriverSettings]] = {
    get_args(model.model_fields["driver"].annotation)[0]: model
    for model in get_args(get_args(MaterializeSettings)[0])
}

_ENTRY: TypeAdapter[DriverSettings] = TypeAdapter(MaterializeSettings)


def parse_settings(entry: Mapping[str, Any], where: str = "outputs.materialize[0]") -> DriverSettings:
    """Validate one entry outside a pipeline file (tests, benchmarks). Raises ConfigError
    naming each bad setting, as `refold.config.parse_pipeline` does."""
    try:
        return _ENTRY.validate_python(entry)
    except ValidationError as exc:
        raise ConfigError("; ".join(describe_problem(e["loc"], e, where) for e in exc.errors())) from exc


def describe_problem(loc: Sequence[int | str], error: ErrorDetails, where: str) -> str:
    """One validation problem of an entry as `<where>.<setting>: <message>`.

    `loc` is the error's location inside the entry: it starts with the driver name
    pydantic adds for the union (dropped here), then the setting."""
    kind = error["type"]
    if kind == "union_tag_invalid":
        tag = error.get("ctx", {}).get("tag")
        return f"{where}.driver: unknown driver {tag!r}; known: {', '.join(sorted(DRIVERS))}"
    if kind == "union_tag_not_found":
        return f"{where}.driver: missing setting (e.g. driver: sqlite)"
    if kind == "model_attributes_type":
        return f"{where}: a materialization is a mapping (driver: and its settings)"
    setting = ".".join(str(part) for part in loc[1:])
    message = {"extra_forbidden": "unknown setting", "missing": "missing setting"}.get(kind, error["msg"])
    return f"{where}.{setting}: {message}" if setting else f"{where}: {message}"


def check_distinct(entries: Sequence[DriverSettings]) -> None:
    """Two materializations may not share a name (the key of their driver checkpoints)."""
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        if entry.materialization in seen:
            raise ValueError(
                f"materialize[{i}]: another materialization is named {entry.materialization!r}: "
                "give one of them a name:"
            )
        seen.add(entry.materialization)
