"""How Refold connects to Kafka: one typed model, rendered where a client is built.

Users write librdkafka's dotted settings (`security.protocol`, `sasl.password`, ...)
in a pipeline's `kafka:` block, in a `--kafka-config` properties file and as
`-X key=value`. `KafkaConnection` takes them exactly as written, holds every secret
as a `SecretStr` (its repr, str, `model_dump()` and validation errors show
`**********`), and reveals them only in its two renderings:

- `librdkafka()`: the dict confluent-kafka's producers, consumers and admin clients
  take — the settings as written, secrets in clear;
- `java()`: the security settings of Spark's Kafka source (the Java client, each
  option prefixed `kafka.`), translated as below. Anything else under `ssl.*` or
  `sasl.*` is refused with a ConfigError rather than silently dropped: a Spark source
  that quietly connects without it would be a security hole or a confusing failure.

    librdkafka                               Java client
    security.protocol                        security.protocol
    sasl.mechanism(s)                        sasl.mechanism
    sasl.username + sasl.password            sasl.jaas.config (Scram/Plain LoginModule)
    ssl.ca.location (a PEM file)             ssl.truststore.location, type PEM
    ssl.ca.pem                               ssl.truststore.certificates, type PEM
    ssl.keystore.location/.password (PKCS12) ssl.keystore.location/.password, type PKCS12
    ssl.endpoint.identification.algorithm    the same ("none" becomes "")

Both renderings hold passwords: pass them to a client, never to a log.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import CoreSchema, core_schema

from refold.errors import ConfigError

_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}
# Secrets whose names say neither "password", "passphrase" nor "secret".
_SECRET_KEYS = frozenset(
    {
        "ssl.key.pem",
        "ssl_key",
        "sasl.oauthbearer.config",
        "sasl.oauthbearer.assertion.private.key.pem",
        "sasl.jaas.config",
    }
)


def is_secret(key: str) -> bool:
    """Whether setting `key` holds a secret (a password, a private key, a client secret)."""
    name = key.lower()
    return name in _SECRET_KEYS or any(
        word in name for word in ("password", "passphrase", "secret")
    )


class _Unreadable:
    """Stands in, during validation, for a secret that is not text: errors show this."""

    def __repr__(self) -> str:
        return "<a secret that is not text>"


_UNREADABLE = _Unreadable()


def _hide_secrets(data: Any) -> Any:
    """Before validation: secrets into SecretStr, numbers and booleans of the typed
    settings into text. Never raises, so that no error can show a secret in clear."""
    if not isinstance(data, Mapping):
        return data
    tidy: dict[Any, Any] = {}
    for key, value in data.items():
        scalar = isinstance(value, str | int | float | bool)
        if isinstance(key, str) and is_secret(key) and value is not None:
            if not isinstance(value, SecretStr):
                value = SecretStr(_text(value)) if scalar else _UNREADABLE
        elif key in _TYPED and scalar:
            value = _text(value)
        tidy[key] = value
    return tidy


def _text(value: str | int | float | bool) -> str:
    """A setting's value as librdkafka reads it (booleans as true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class KafkaConnection(BaseModel):
    """The Kafka clients' settings, as librdkafka names them (e.g. `security.protocol`,
    `sasl.mechanism`, `sasl.username`, `sasl.password`, `ssl.ca.location`). The keys
    below are the ones Refold reads or translates for Spark's Kafka source; any other
    librdkafka setting is passed to the clients as written. Passwords, private keys and
    client secrets are never shown in logs or errors. See docs/SECURITY.md."""

    model_config = ConfigDict(
        extra="allow", frozen=True, hide_input_in_errors=True, serialize_by_alias=True
    )

    bootstrap_servers: str | None = Field(default=None, alias="bootstrap.servers")
    security_protocol: str | None = Field(default=None, alias="security.protocol")
    sasl_mechanism: str | None = Field(default=None, alias="sasl.mechanism")
    sasl_mechanisms: str | None = Field(default=None, alias="sasl.mechanisms")
    sasl_username: str | None = Field(default=None, alias="sasl.username")
    sasl_password: SecretStr | None = Field(default=None, alias="sasl.password")
    ssl_ca_location: str | None = Field(default=None, alias="ssl.ca.location")
    ssl_ca_pem: str | None = Field(default=None, alias="ssl.ca.pem")
    ssl_keystore_location: str | None = Field(default=None, alias="ssl.keystore.location")
    ssl_keystore_password: SecretStr | None = Field(default=None, alias="ssl.keystore.password")
    ssl_endpoint_identification_algorithm: str | None = Field(
        default=None, alias="ssl.endpoint.identification.algorithm"
    )

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        # Outermost, so that every later error (field or model) sees the secrets hidden.
        return core_schema.no_info_before_validator_function(_hide_secrets, handler(source))

    @classmethod
    def of(cls, settings: Mapping[str, Any], where: str = "kafka") -> KafkaConnection:
        """Validated settings; a ConfigError at `where`, naming each bad setting, if not."""
        try:
            return cls.model_validate(settings)
        except ValidationError as exc:
            problems = []
            for error in exc.errors(include_input=False):
                message = error["msg"].removeprefix("Value error, ")
                where_in = ".".join(str(part) for part in error["loc"])
                problems.append(f"{where_in}: {message}" if where_in else message)
            raise ConfigError("; ".join(problems), where) from exc

    @field_validator("security_protocol")
    @classmethod
    def _protocol(cls, value: str | None) -> str | None:
        if value is not None and value.upper() not in _PROTOCOLS:
            raise ValueError("write one of " + ", ".join(_PROTOCOLS))
        return value

    @model_validator(mode="after")
    def _consistent(self) -> KafkaConnection:
        for key, value in (self.model_extra or {}).items():
            if not isinstance(value, str | int | float | bool | SecretStr | None):
                raise ValueError(f"{key}: a setting is a string, a number or true/false")
        one, other = self.sasl_mechanism, self.sasl_mechanisms
        if one and other and one.upper() != other.upper():
            raise ValueError("sasl.mechanism and sasl.mechanisms differ: write one of them")
        return self

    @property
    def mechanism(self) -> str | None:
        """The SASL mechanism, however it was spelled."""
        return self.sasl_mechanism or self.sasl_mechanisms

    def merged(self, overrides: Mapping[str, Any], where: str = "kafka") -> KafkaConnection:
        """These settings with `overrides` on top (validated together)."""
        return KafkaConnection.of(_overlay(self._items(), overrides), where)

    def librdkafka(self) -> dict[str, Any]:
        """The settings for confluent-kafka's clients, as written, secrets in clear."""
        return {key: _reveal(value) for key, value in self._items().items()}

    def java(self) -> dict[str, str]:
        """The security settings for Spark's Kafka source (to be prefixed `kafka.`).
        Raises ConfigError, naming the `kafka.` setting, for what has no translation."""
        untranslated = [key for key in self.model_extra or {} if key.startswith(("ssl.", "sasl."))]
        if untranslated:
            raise ConfigError(
                "not translated for Spark's Kafka source (Java client); supported: "
                + ", ".join(sorted(_JAVA_TRANSLATED)),
                where=f"kafka.{untranslated[0]}",
            )
        out: dict[str, str] = {}
        if self.security_protocol is not None:
            out["security.protocol"] = self.security_protocol.upper()
        if self.mechanism is not None:
            out["sasl.mechanism"] = self.mechanism.upper()
        if self.sasl_username is not None or self.sasl_password is not None:
            out["sasl.jaas.config"] = self._jaas()
        out.update(self._java_tls())
        return out

    def _jaas(self) -> str:
        name = (self.mechanism or "GSSAPI").upper()
        module = _LOGIN_MODULES.get(name)
        if module is None:
            raise ConfigError(
                f"sasl.username/sasl.password with mechanism {name}: Spark's source supports "
                + ", ".join(_LOGIN_MODULES),
                where="kafka.sasl.mechanism",
            )
        user = _jaas_quote(self.sasl_username or "")
        password = _jaas_quote(_reveal(self.sasl_password) or "")
        return f"{module} required username={user} password={password};"

    def _java_tls(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.ssl_ca_location is not None:
            if Path(self.ssl_ca_location).is_dir():
                raise ConfigError(
                    "a directory of CA certificates has no Java equivalent: name one PEM file",
                    where="kafka.ssl.ca.location",
                )
            out["ssl.truststore.type"] = "PEM"
            out["ssl.truststore.location"] = self.ssl_ca_location
        if self.ssl_ca_pem is not None:
            out["ssl.truststore.type"] = "PEM"
            out["ssl.truststore.certificates"] = self.ssl_ca_pem
        if self.ssl_keystore_location is not None:
            out["ssl.keystore.type"] = "PKCS12"
            out["ssl.keystore.location"] = self.ssl_keystore_location
            if self.ssl_keystore_password is not None:
                out["ssl.keystore.password"] = self.ssl_keystore_password.get_secret_value()
        algorithm = self.ssl_endpoint_identification_algorithm
        if algorithm is not None:
            out["ssl.endpoint.identification.algorithm"] = "" if algorithm == "none" else algorithm
        return out

    def _items(self) -> dict[str, Any]:
        """Every setting given, by its librdkafka name; secrets still hidden."""
        items = {
            field.alias or name: getattr(self, name)
            for name, field in type(self).model_fields.items()
        }
        items.update(self.model_extra or {})
        return {key: value for key, value in items.items() if value is not None}

    def __repr_args__(self) -> Iterator[tuple[str, Any]]:
        yield from self._items().items()


_TYPED = frozenset(field.alias or name for name, field in KafkaConnection.model_fields.items())
_JAVA_TRANSLATED = _TYPED - {"bootstrap.servers", "security.protocol"}


def _overlay(settings: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` with `overrides` on top; either name of the SASL mechanism replaces both."""
    mechanism = {"sasl.mechanism", "sasl.mechanisms"}
    dropped = mechanism if overrides.keys() & mechanism else set()
    return {**{k: v for k, v in settings.items() if k not in dropped}, **overrides}


def _reveal(value: Any) -> Any:
    return value.get_secret_value() if isinstance(value, SecretStr) else value


def _jaas_quote(value: str) -> str:
    """A JAAS option value: double-quoted, with backslashes and quotes escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


# The command line: `--kafka-config FILE` and `-X KEY=VALUE` ------------------------------------
# FILE is a properties file, one `key=value` per line, `#` comments, as kcat and the Kafka
# tools read them; `-X` settings win over the file's. Keep passwords in the file (mode
# 0600), not in `-X`, where `ps` shows them.


def load_properties(path: str | Path) -> dict[str, str]:
    """`key=value` lines (also `key: value`); blank lines and `#`/`!` comments skipped."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", where=str(path)) from exc
    settings: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped[0] in "#!":
            continue
        key, value = _split(stripped)
        if not key:
            raise ConfigError("write key=value", where=f"{path}:{number}")
        settings[key] = value
    return settings


def parse_overrides(items: Sequence[str] | None) -> dict[str, str]:
    """`-X key=value` arguments as a dict (the value is never echoed in errors)."""
    settings: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"-X takes key=value, got {key.strip()!r} without '='", where="-X")
        settings[key.strip()] = value.strip()
    return settings


def client_settings(config_file: str | None, overrides: Sequence[str] | None) -> dict[str, str]:
    """The settings of `--kafka-config FILE` with `-X` on top, not yet validated."""
    settings = load_properties(config_file) if config_file else {}
    return _overlay(settings, parse_overrides(overrides))


def command_line_where(config_file: str | None, overrides: Sequence[str] | None) -> str:
    """How an error names the command line's settings."""
    if config_file and overrides:
        return f"{config_file} and -X"
    return config_file or "-X"


def _split(line: str) -> tuple[str, str]:
    cuts = [i for i in (line.find("="), line.find(":")) if i >= 0]
    if not cuts:
        return "", ""
    cut = min(cuts)
    return line[:cut].strip(), line[cut + 1 :].strip()
