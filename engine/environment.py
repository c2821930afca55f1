"""Every environment variable Refold reads, in one place.

Each function reads the variable when called (tests and harnesses set them per
process), so nothing here is cached. Writing variables for child processes (the
TLS password for openssl, PYSPARK_PYTHON for Spark's workers) is not reading and
stays where the child is started.
"""

from __future__ import annotations

import os
from pathlib import Path

BOOTSTRAP_SERVERS = "REFOLD_BOOTSTRAP_SERVERS"  # the Kafka cluster, when no flag names one
HOME = "REFOLD_HOME"  # Refold's working folder (local servers, jars, demo data)
JARS = "REFOLD_JARS"  # where resolved jar sets live
PG_BINDIR = "REFOLD_PG_BINDIR"  # the PostgreSQL server binaries for `refold pg`
TRANSACTION_TIMEOUT_MS = "REFOLD_TRANSACTION_TIMEOUT_MS"  # the engine producer's transaction.timeout.ms
SEND_OFFSETS_SECONDS = "REFOLD_SEND_OFFSETS_SECONDS"  # the deadline of send_offsets_to_transaction
# Set by a driver whose Spark JVM writes to a pipe it reads (refold.spark.logs), for the
# Python workers that JVM starts: their log records go to stderr as relay lines.
LOG_RELAY = "REFOLD_LOG_RELAY"
# Test hooks: read by refold.spark.job, parsed by refold.runtime.hooks; never set in production.
TEST_CRASH = "REFOLD_TEST_CRASH"
TEST_CRASH_WORKER = "REFOLD_TEST_CRASH_WORKER"
TEST_STALL_IN_TXN_SECONDS = "REFOLD_TEST_STALL_IN_TXN_SECONDS"
TEST_STALL_UNTIL = "REFOLD_TEST_STALL_UNTIL"


def _get(name: str) -> str | None:
    return os.environ.get(name) or None


def bootstrap_servers() -> str | None:
    """`$REFOLD_BOOTSTRAP_SERVERS`, or None when unset or empty."""
    return _get(BOOTSTRAP_SERVERS)


def checkout_root() -> Path | None:
    """The repository this package runs from (`pip install -e`), or None when installed."""
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "engine").is_dir():
        return root
    return None


def home() -> Path:
    """Refold's working folder: `$REFOLD_HOME`, else `.refold` in a checkout, else `~/.refold`."""
    env = _get(HOME)
    if env:
        return Path(env).expanduser().resolve()
    root = checkout_root()
    return root / ".refold" if root is not None else Path.home() / ".refold"


def jars_home() -> Path:
    """Where resolved jar sets live: `$REFOLD_JARS`, else `<home>/jars`."""
    env = _get(JARS)
    return Path(env).expanduser().resolve() if env else home() / "jars"


def pg_bindir() -> Path | None:
    """`$REFOLD_PG_BINDIR`: PostgreSQL server binaries chosen by hand."""
    env = _get(PG_BINDIR)
    return Path(env) if env else None


def transaction_timeout_ms(default: int = 60_000) -> int:
    """The engine producer's `transaction.timeout.ms` (the chaos harness shortens it)."""
    env = _get(TRANSACTION_TIMEOUT_MS)
    return int(env) if env else default


def send_offsets_seconds(default: float = 15.0) -> float:
    """`$REFOLD_SEND_OFFSETS_SECONDS`: how long the transactional writer waits for
    `send_offsets_to_transaction` before it counts the transaction as timed out
    (docs/kafka-cluster.md, "After a broker's loss")."""
    env = _get(SEND_OFFSETS_SECONDS)
    return float(env) if env else default


def log_relay() -> bool:
    """`$REFOLD_LOG_RELAY`: this Python worker's log records are relayed to its driver."""
    return _get(LOG_RELAY) == "1"


def test_hook_settings() -> dict[str, str]:
    """The test-hook variables that are set (empty in production)."""
    names = (TEST_CRASH, TEST_CRASH_WORKER, TEST_STALL_IN_TXN_SECONDS, TEST_STALL_UNTIL)
    return {name: value for name in names if (value := _get(name))}
