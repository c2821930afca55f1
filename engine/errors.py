"""One root error; user errors (configuration, prerequisites) apart from internal ones.

Record errors carry the facts of the record they are about (topic, partition,
offset, raw bytes) so that a caller can route the record to a dead-letter topic
instead of flattening the failure into a string.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any


class RefoldError(Exception):
    """Root of every error Refold raises on purpose."""


class UserError(RefoldError):
    """Something the user can fix: configuration, input, environment."""


class ConfigError(UserError):
    """A pipeline file or a command-line setting is wrong. `where` names the setting."""

    def __init__(self, message: str, where: str | None = None) -> None:
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class PrerequisiteError(UserError):
    """Something Refold needs is missing: Java, Maven, a reachable broker, a topic."""


class KafkaAuthError(PrerequisiteError):
    """Kafka refused our credentials, or its TLS certificate is not one we trust.
    Keeps librdkafka's error (never a password)."""

    def __init__(self, message: str, *, kafka_error: object = None) -> None:
        self.kafka_error = kafka_error
        super().__init__(message)


class OperationalError(RefoldError):
    """A runtime failure that is neither the user's nor a bug: a transaction the broker
    aborted or timed out, a store that refused a commit. Nothing was committed;
    restarting the engine retries from the last commit."""


class InternalError(RefoldError):
    """A bug or a broken invariant inside Refold."""


@dataclass(frozen=True, slots=True)
class RecordSource:
    """Where a record came from: enough to find it again and to name it in a message."""

    topic: str | None = None
    partition: int | None = None
    offset: int | None = None
    line: int | None = None  # for records read from a file

    def describe(self) -> str:
        if self.line is not None:
            return f"line {self.line}"
        return f"{self.topic}[{self.partition}]@{self.offset}"


class RecordError(UserError):
    """One input record is bad. Keeps the raw bytes and the record's position.

    `reason` is a short machine-stable phrase (it goes into the dead-letter header
    `refold.reason`); `detail` says more for a human.
    """

    def __init__(
        self,
        reason: str,
        source: RecordSource,
        *,
        detail: str | None = None,
        key: bytes | None = None,
        value: bytes | None = None,
    ) -> None:
        self.reason = reason
        self.source = source
        self.detail = detail
        self.key = key
        self.value = value
        text = f"{source.describe()}: {reason}"
        if detail:
            text += f" ({detail})"
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled whole (a Spark task hands it to the driver)."""
        return (functools.partial(type(self), detail=self.detail, key=self.key, value=self.value),
                (self.reason, self.source))


class DecodeError(RecordError):
    """The bytes of a record could not be decoded (bad JSON, truncated Avro, wrong schema)."""


class InvalidEventError(RecordError):
    """A decoded event breaks the changelog rules (op out of range, unpaired -C, null key...)."""
