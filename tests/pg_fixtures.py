"""PostgreSQL fixtures: one real server for the session, a fresh database per test.

The server is `$REFOLD_POSTGRES_DSN` when set (a role that may create databases; it
must answer), else a local one (`refold.dev.localpg`, Debian's binaries) on a free port,
its cluster in a fresh folder under the system temp dir (pytest's own temp folders
are private to root, and a root session runs the server as the `postgres` user),
with fsync off, stopped and removed at the end of the session. Registered from
`conftest.py` through `pytest_plugins`.

Tests that need the server are marked `postgres` (`POSTGRES_MARKS` for a parameter).
Without a DSN and without server binaries (`HAS_POSTGRES` false) they are skipped on
a developer's machine, but in CI (`CI=true`) they fail: a skip there would pass
untested. A server that is there but does not start or answer always fails.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from refold.errors import PrerequisiteError

IN_CI = os.environ.get("CI", "").lower() in ("true", "1")


def _missing_postgres() -> str | None:
    """Why no server can be had (no DSN, no binaries), or None when one can."""
    if os.environ.get("REFOLD_POSTGRES_DSN"):
        return None
    from refold.dev import localpg

    try:
        localpg.find_binaries()
    except PrerequisiteError as exc:
        return f"no PostgreSQL: set REFOLD_POSTGRES_DSN or {exc}"
    return None


MISSING_POSTGRES = _missing_postgres()
HAS_POSTGRES = MISSING_POSTGRES is None
# The marks of a test (or a parameter) that needs the server: skipped without one,
# except in CI, where the `pg_server` fixture fails instead.
POSTGRES_MARKS = [pytest.mark.postgres] + (
    [pytest.mark.skip(reason=MISSING_POSTGRES)] if MISSING_POSTGRES and not IN_CI else []
)


@dataclass(frozen=True, slots=True)
class PgServer:
    """The session's server: a DSN of a role that may create databases."""

    admin_dsn: str = field(repr=False)
    origin: str  # "env" or "local"

    def create_database(self, name: str) -> str:
        from refold.dev import localpg

        return localpg.create_database(self.admin_dsn, name)

    def drop_database(self, name: str) -> None:
        from refold.dev import localpg

        localpg.drop_database(self.admin_dsn, name)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    from refold.dev import localpg

    env = os.environ.get("REFOLD_POSTGRES_DSN")
    if env:
        if not localpg.answers(env, timeout=10.0):
            pytest.fail("the PostgreSQL server of REFOLD_POSTGRES_DSN does not answer", pytrace=False)
        yield PgServer(env, "env")
        return
    if MISSING_POSTGRES is not None:  # never a silent pass in CI
        if IN_CI:
            pytest.fail(MISSING_POSTGRES, pytrace=False)
        pytest.skip(MISSING_POSTGRES)
    folder = Path(tempfile.mkdtemp(prefix="refold-pg-"))
    folder.chmod(0o755)  # a root session's server runs as `postgres`: let it through
    try:
        info = localpg.start(home=folder, quiet=True, durable=False, die_with_parent=True)
    except Exception as exc:  # binaries, but no server: fail loudly, never skip
        shutil.rmtree(folder, ignore_errors=True)
        pytest.fail(f"no PostgreSQL server for the tests: {exc}", pytrace=False)
    try:
        yield PgServer(info.dsn(), "local")
    finally:
        localpg.stop(home=folder)
        shutil.rmtree(folder, ignore_errors=True)


_UNSAFE = re.compile(r"[^a-z0-9_]+")


@pytest.fixture
def postgres_dsn(pg_server: PgServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """A DSN of a fresh, empty database for this test, dropped after it."""
    stem = _UNSAFE.sub("_", request.node.name.lower()).strip("_")[:40]
    name = f"t_{stem}_{uuid.uuid4().hex[:8]}"
    dsn = pg_server.create_database(name)
    try:
        yield dsn
    finally:
        pg_server.drop_database(name)
