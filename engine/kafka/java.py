"""The pipeline's librdkafka security settings, spelled for Java's Kafka client.

The pipeline file's `kafka:` block is librdkafka's (the engine's producer,
consumers and admin client use it as it is). Spark's Kafka source is the Java
client, whose settings are named differently and take credentials as a JAAS line:

    librdkafka                               Java client (Spark: prefixed `kafka.`)
    security.protocol                        security.protocol
    sasl.mechanism(s)                        sasl.mechanism
    sasl.username + sasl.password            sasl.jaas.config (Scram/Plain LoginModule)
    ssl.ca.location (a PEM file)             ssl.truststore.location, type PEM
    ssl.ca.pem                               ssl.truststore.certificates, type PEM
    ssl.keystore.location/.password (PKCS12) ssl.keystore.location/.password, type PKCS12
    ssl.endpoint.identification.algorithm    the same ("none" becomes "")

Any other `ssl.*` or `sasl.*` setting is refused with a ConfigError rather than
silently dropped: a Spark source that quietly connects without it would be
a security hole or a confusing failure. The result holds the password: never log it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from refold.errors import ConfigError

_LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}
_HANDLED = frozenset(
    {
        "sasl.mechanism",
        "sasl.mechanisms",
        "sasl.username",
        "sasl.password",
        "ssl.ca.location",
        "ssl.ca.pem",
        "ssl.keystore.location",
        "ssl.keystore.password",
        "ssl.endpoint.identification.algorithm",
    }
)


def java_client_settings(settings: Mapping[str, Any]) -> dict[str, str]:
    """The Java client settings equivalent to librdkafka `settings`' security part.
    Raises ConfigError (naming the `kafka.` setting) for what has no translation."""
    out: dict[str, str] = {}
    for key in settings:
        if key.startswith(("ssl.", "sasl.")) and key not in _HANDLED:
            raise ConfigError(
                "not translated for Spark's Kafka source (Java client); supported: "
                + ", ".join(sorted(_HANDLED)),
                where=f"kafka.{key}",
            )
    protocol = settings.get("security.protocol")
    if protocol is not None:
        out["security.protocol"] = str(protocol).upper()
    mechanism = settings.get("sasl.mechanism") or settings.get("sasl.mechanisms")
    if mechanism is not None:
        out["sasl.mechanism"] = str(mechanism).upper()
    if "sasl.username" in settings or "sasl.password" in settings:
        name = str(mechanism or "GSSAPI").upper()
        module = _LOGIN_MODULES.get(name)
        if module is None:
            raise ConfigError(
                f"sasl.username/sasl.password with mechanism {name}: Spark's source supports "
                + ", ".join(_LOGIN_MODULES),
                where="kafka.sasl.mechanism",
            )
        user = _jaas_quote(settings.get("sasl.username", ""))
        password = _jaas_quote(settings.get("sasl.password", ""))
        out["sasl.jaas.config"] = f"{module} required username={user} password={password};"
    ca = settings.get("ssl.ca.location")
    if ca is not None:
        if Path(str(ca)).is_dir():
            raise ConfigError(
                "a directory of CA certificates has no Java equivalent: name one PEM file",
                where="kafka.ssl.ca.location",
            )
        out["ssl.truststore.type"] = "PEM"
        out["ssl.truststore.location"] = str(ca)
    if "ssl.ca.pem" in settings:
        out["ssl.truststore.type"] = "PEM"
        out["ssl.truststore.certificates"] = str(settings["ssl.ca.pem"])
    if "ssl.keystore.location" in settings:
        out["ssl.keystore.type"] = "PKCS12"
        out["ssl.keystore.location"] = str(settings["ssl.keystore.location"])
        if "ssl.keystore.password" in settings:
            out["ssl.keystore.password"] = str(settings["ssl.keystore.password"])
    algorithm = settings.get("ssl.endpoint.identification.algorithm")
    if algorithm is not None:
        out["ssl.endpoint.identification.algorithm"] = "" if str(algorithm) == "none" else str(algorithm)
    return out


def _jaas_quote(value: object) -> str:
    """A JAAS option value: double-quoted, with backslashes and quotes escaped."""
    text = str(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
