"""Kafka client settings given on the command line: `--kafka-config FILE` and `-X KEY=VALUE`.

Both are librdkafka settings, exactly as a pipeline file's `kafka:` block takes them
(`security.protocol`, `sasl.mechanism`, `sasl.username`, `sasl.password`,
`ssl.ca.location`, ...). FILE is a properties file, one `key=value` per line, `#`
comments, as kcat and the Kafka tools read them; `-X` settings win over the file's.
Keep passwords in the file (mode 0600), not in `-X`, where `ps` shows them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from refold.errors import ConfigError


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


def client_settings(config_file: str | None, overrides: Sequence[str] | None) -> dict[str, Any]:
    """The settings of `--kafka-config FILE` with `-X` on top."""
    settings: dict[str, Any] = load_properties(config_file) if config_file else {}
    settings.update(parse_overrides(overrides))
    return settings


def _split(line: str) -> tuple[str, str]:
    cuts = [i for i in (line.find("="), line.find(":")) if i >= 0]
    if not cuts:
        return "", ""
    cut = min(cuts)
    return line[:cut].strip(), line[cut + 1 :].strip()
