"""A real local PostgreSQL server: Debian's binaries, one cluster, on 127.0.0.1.

For the PostgreSQL materialization driver's tests and CI, and for local use
(`refold pg start|stop|status`). The binaries come from Debian's `postgresql` package
(`/usr/lib/postgresql/<version>/bin`, the newest version found; `$REFOLD_PG_BINDIR`
names another folder). Everything else lives under `<home>/postgres/` (home:
`refold.environment.home()`, i.e. `.refold/`, or the `home` argument):

    data/        the cluster (initdb on first start); its unix socket too
    server.log   the postmaster's stdout and stderr
    password     the superuser's password (mode 0600)
    port         the port of the last start, reused by the next one when free

The superuser is `refold` with a random password (scram-sha-256 for every
connection); `ServerInfo.dsn(database)` builds a libpq URL. `initdb` and `postgres`
refuse to run as root: a root caller runs them as the `postgres` system user (the
Debian package creates it), so the data folder belongs to that user and each folder
above it must let that user through; `start` checks and says which folder does not.

The postmaster is our own child process (no `pg_ctl`): its pid and port come from
`data/postmaster.pid`, which PostgreSQL writes and removes. `stop` asks for a fast
shutdown (SIGINT), then an immediate one, then SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import re
import secrets
import signal
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refold import environment
from refold.dev.localproc import HOST, ServerStartError, free_port, parent_death_signal
from refold.dev.localproc import alive as _alive
from refold.dev.localproc import bindable as _bindable
from refold.dev.localproc import locked as _locked
from refold.dev.localproc import say as _say
from refold.dev.localproc import tail as _tail
from refold.dev.localproc import wait_gone as _wait_gone
from refold.environment import home as project_home
from refold.errors import PrerequisiteError

SUPERUSER = "refold"
SYSTEM_USER = "postgres"  # who runs the server when the caller is root
_DEBIAN_ROOT = Path("/usr/lib/postgresql")
_INSTALL_HINT = "install Debian's `postgresql` package (apt-get install -y postgresql)"
_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes; PostgreSQL refuses longer socket paths
_DURABLE_OFF = ("fsync=off", "synchronous_commit=off", "full_page_writes=off")
_DATABASE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


@dataclass(frozen=True, slots=True)
class Binaries:
    """The PostgreSQL server programs of one installed version."""

    bindir: Path
    version: str

    @property
    def initdb(self) -> Path:
        return self.bindir / "initdb"

    @property
    def postgres(self) -> Path:
        return self.bindir / "postgres"


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """A running local server. The password stays out of reprs."""

    pid: int
    port: int
    home: Path  # the server's folder, <project home>/postgres
    password: str = field(repr=False)

    @property
    def data_dir(self) -> Path:
        return self.home / "data"

    @property
    def log_file(self) -> Path:
        return self.home / "server.log"

    def dsn(self, database: str = "postgres") -> str:
        """A libpq URL for `database` as the superuser (it holds the password)."""
        return f"postgresql://{SUPERUSER}:{self.password}@{HOST}:{self.port}/{database}"

    def shown_dsn(self, database: str = "postgres") -> str:
        """The DSN to print: the password masked."""
        return f"postgresql://{SUPERUSER}:***@{HOST}:{self.port}/{database}"


def postgres_home(home: Path | None = None) -> Path:
    """The server's folder inside a Refold home (default: `project_home()`)."""
    return (home if home is not None else project_home()).resolve() / "postgres"


def find_binaries() -> Binaries:
    """The server binaries: `$REFOLD_PG_BINDIR`, else the newest Debian version.

    Raises PrerequisiteError naming the package to install when none is found.
    """
    env = environment.pg_bindir()
    candidates = [env] if env else sorted(
        _DEBIAN_ROOT.glob("*/bin"), key=lambda path: _version_key(path.parent.name), reverse=True
    )
    for bindir in candidates:
        if all(os.access(bindir / name, os.X_OK) for name in ("initdb", "postgres")):
            return Binaries(bindir, bindir.parent.name if not env else "custom")
    where = f"REFOLD_PG_BINDIR={env}" if env else f"{_DEBIAN_ROOT}/<version>/bin"
    raise PrerequisiteError(f"no PostgreSQL server binaries (initdb, postgres) in {where}: {_INSTALL_HINT}")


# Lifecycle ---------------------------------------------------------------------------


def start(
    port: int | None = None,
    timeout: float = 60.0,
    *,
    home: Path | None = None,
    quiet: bool = False,
    durable: bool = True,
    die_with_parent: bool = False,
) -> ServerInfo:
    """Start the server and wait until it answers a query.

    Runs `initdb` on first use. Harmless when the server already runs: returns the
    running one. `port`: None reuses the last start's port when free, else a free
    one. `durable=False` turns fsync and synchronous commit off (test sessions: the
    server is thrown away). `die_with_parent` (Linux) sends the server SIGINT when
    the calling thread's process dies; call it from the main thread.
    Raises PrerequisiteError (no binaries, no `postgres` user, unreachable folder,
    port taken) or ServerStartError (the server exited or did not answer in time).
    """
    base = postgres_home(home)
    base.mkdir(parents=True, exist_ok=True)
    with _locked(base):
        running = status(home)
        if running is not None:
            _say(quiet, f"PostgreSQL already runs on {HOST}:{running.port} (pid {running.pid})")
            return running
        binaries = find_binaries()
        runner = _Runner.for_caller()
        runner.check_reachable(base)
        if not (base / "data" / "PG_VERSION").exists():
            _initdb(binaries, runner, base, quiet)
        chosen = port if port is not None else _last_port(base)
        if chosen is None or (port is None and not _bindable(chosen)):
            chosen = free_port()
        if not _bindable(chosen):
            raise PrerequisiteError(f"port {HOST}:{chosen} is taken: pick another with --port")
        return _launch(binaries, runner, base, chosen, timeout, quiet, durable, die_with_parent)


def stop(timeout: float = 30.0, *, home: Path | None = None) -> bool:
    """Stop the server: fast shutdown (SIGINT), then immediate (SIGQUIT), then SIGKILL.
    Returns False when no server ran."""
    base = postgres_home(home)
    with _locked(base):
        running = _running(base)
        if running is None:
            return False
        pid = running[0]
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGQUIT, 10.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            if _wait_gone(pid, wait):
                break
        if sig is signal.SIGKILL:  # nothing removed it
            (base / "data" / "postmaster.pid").unlink(missing_ok=True)
        return True


def status(home: Path | None = None) -> ServerInfo | None:
    """The running local server, or None. Does not ask the server anything."""
    base = postgres_home(home)
    running = _running(base)
    if running is None:
        return None
    return ServerInfo(running[0], running[1], base, _password(base))


def answers(dsn: str, timeout: float = 2.0) -> bool:
    """Whether a server at `dsn` accepts a connection and answers `SELECT 1`."""
    import psycopg

    try:
        with psycopg.connect(dsn, connect_timeout=max(1, int(timeout)), autocommit=True) as conn:
            return conn.execute("SELECT 1").fetchone() == (1,)
    except psycopg.Error:
        return False


def create_database(admin_dsn: str, name: str) -> str:
    """Create database `name` through `admin_dsn` (a role that may create databases);
    returns `admin_dsn` pointed at the new database."""
    import psycopg
    from psycopg import sql

    _check_database_name(name)
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return with_database(admin_dsn, name)


def drop_database(admin_dsn: str, name: str) -> None:
    """Drop database `name` if it exists, closing the sessions still on it."""
    import psycopg
    from psycopg import sql

    _check_database_name(name)
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def with_database(dsn: str, name: str) -> str:
    """`dsn` with its database replaced by `name` (any libpq DSN form)."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params: dict[str, Any] = {**conninfo_to_dict(dsn), "dbname": name}
    return make_conninfo(**params)


# Command line --------------------------------------------------------------------------


def cli(args: argparse.Namespace) -> int:
    """`refold pg start|stop|status [--port N]`. Exit 1 from `status` when none runs."""
    action = args.action
    if action == "start":
        info = start(getattr(args, "port", None))
        _describe(info)
        return 0
    if action == "stop":
        print("PostgreSQL stopped" if stop() else "PostgreSQL was not running")
        return 0
    if action == "status":
        found = status()
        if found is None:
            print(f"PostgreSQL is not running (data in {postgres_home() / 'data'})")
            return 1
        _describe(found)
        return 0
    raise ValueError(f"unknown action {action!r}: start, stop or status")


def _describe(info: ServerInfo) -> None:
    state = "answers" if answers(info.dsn()) else "does not answer yet"
    print(f"PostgreSQL runs on {HOST}:{info.port} (pid {info.pid}, {state})")
    print(f"  dsn      {info.shown_dsn()}  (password in {info.home / 'password'})")
    print(f"  data     {info.data_dir}")
    print(f"  log      {info.log_file}")


# Inside ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Runner:
    """Who runs initdb and postgres: the caller, or the `postgres` user for root."""

    uid: int | None = None  # None: the caller itself
    gid: int | None = None
    groups: tuple[int, ...] = ()

    @classmethod
    def for_caller(cls) -> _Runner:
        if os.geteuid() != 0:
            return cls()
        try:
            entry = pwd.getpwnam(SYSTEM_USER)
        except KeyError:
            raise PrerequisiteError(
                f"PostgreSQL refuses to run as root and there is no `{SYSTEM_USER}` user to run it "
                f"as: {_INSTALL_HINT} (it creates the user), or run as another user"
            ) from None
        groups = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
        return cls(entry.pw_uid, entry.pw_gid, groups)

    def popen_args(self) -> dict[str, Any]:
        if self.uid is None:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def own(self, path: Path) -> None:
        """Give `path` to the server's user (root callers only)."""
        if self.uid is not None and self.gid is not None:
            os.chown(path, self.uid, self.gid)

    def check_reachable(self, base: Path) -> None:
        """Every folder from / to `base` must let the server's user through."""
        if self.uid is None:
            return
        for folder in [*reversed(base.parents), base]:
            info = folder.stat()
            if info.st_uid == self.uid:
                bit = stat.S_IXUSR
            elif info.st_gid in self.groups:
                bit = stat.S_IXGRP
            else:
                bit = stat.S_IXOTH
            if not info.st_mode & bit:
                raise PrerequisiteError(
                    f"the `{SYSTEM_USER}` user, which runs PostgreSQL for root, cannot enter "
                    f"{folder} (mode {stat.filemode(info.st_mode)}): put the server elsewhere "
                    "(REFOLD_HOME) or let that user through (chmod o+x)"
                )


def _initdb(binaries: Binaries, runner: _Runner, base: Path, quiet: bool) -> None:
    data = base / "data"
    data.mkdir(mode=0o700, exist_ok=True)
    runner.own(data)
    password = secrets.token_urlsafe(18)
    secret = base / "password"
    secret.touch(mode=0o600)
    secret.write_text(password + "\n")
    # initdb reads the password from a file the server's user can read: one in a
    # private folder of that user's, removed right after.
    private = base / "initdb"
    private.mkdir(mode=0o700, exist_ok=True)
    runner.own(private)
    pwfile = private / "pwfile"
    pwfile.write_text(password + "\n")
    runner.own(pwfile)
    log_file = base / "server.log"
    _say(quiet, f"initdb {data} (PostgreSQL {binaries.version}) …")
    try:
        done = subprocess.run(
            [str(binaries.initdb), "-D", str(data), "-U", SUPERUSER, f"--pwfile={pwfile}",
             "--auth=scram-sha-256", "--encoding=UTF8", "--locale=C", "--no-sync"],
            capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL,
            cwd=data, **runner.popen_args(),
        )  # fmt: skip
    finally:
        pwfile.unlink(missing_ok=True)
        private.rmdir()
    if done.returncode != 0:
        with log_file.open("a") as log:
            log.write(done.stdout + done.stderr)
        raise ServerStartError(
            f"initdb {data} failed (exit {done.returncode})", log_file=log_file, log_tail=_tail(log_file)
        )


def _launch(
    binaries: Binaries,
    runner: _Runner,
    base: Path,
    port: int,
    timeout: float,
    quiet: bool,
    durable: bool,
    die_with_parent: bool,
) -> ServerInfo:
    data = base / "data"
    socket_dir = str(data) if len(f"{data}/.s.PGSQL.{port}") <= _SOCKET_PATH_MAX else ""
    settings = [
        f"listen_addresses={HOST}",
        f"port={port}",
        f"unix_socket_directories={socket_dir}",
        "max_connections=100",
        *(() if durable else _DURABLE_OFF),
    ]
    log_file = base / "server.log"
    (base / "port").write_text(f"{port}\n")
    started = time.monotonic()
    with log_file.open("a") as log:
        proc = subprocess.Popen(
            [str(binaries.postgres), "-D", str(data), *(f"-c{s}" for s in settings)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=data,
            start_new_session=True,  # Ctrl-C in the caller's terminal does not reach it
            # runs after the user change, so the kernel keeps the death signal armed
            preexec_fn=parent_death_signal(os.getpid(), signal.SIGINT) if die_with_parent else None,
            **runner.popen_args(),
        )
    info = ServerInfo(proc.pid, port, base, _password(base))
    _say(quiet, f"starting PostgreSQL {binaries.version} on {HOST}:{port} (data in {data}) …")
    deadline = started + timeout
    while not answers(info.dsn(), timeout=2.0):
        exited = proc.poll()
        if exited is not None or time.monotonic() > deadline:
            if exited is None:
                proc.kill()
                proc.wait(10)
            why = f"exited with {exited}" if exited is not None else f"did not answer in {timeout:.0f}s"
            raise ServerStartError(
                f"PostgreSQL on {HOST}:{port} {why}", log_file=log_file, log_tail=_tail(log_file)
            )
        time.sleep(0.1)
    _say(quiet, f"PostgreSQL is ready on {HOST}:{port} ({time.monotonic() - started:.1f}s)")
    return info


def _running(base: Path) -> tuple[int, int] | None:
    """(pid, port) from the postmaster.pid file, if that process lives."""
    try:
        lines = (base / "data" / "postmaster.pid").read_text().splitlines()
        pid, port = int(lines[0]), int(lines[3])
    except (OSError, ValueError, IndexError):
        return None
    if not _alive(pid):
        return None
    with contextlib.suppress(OSError):  # Linux: make sure the pid was not reused
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if str(base / "data").encode() not in args:
            return None
    return pid, port


def _password(base: Path) -> str:
    try:
        return (base / "password").read_text().strip()
    except OSError as exc:
        raise PrerequisiteError(f"the server's password file is missing: {exc}") from exc


def _last_port(base: Path) -> int | None:
    try:
        return int((base / "port").read_text().strip())
    except (OSError, ValueError):
        return None


def _check_database_name(name: str) -> None:
    if not _DATABASE_NAME.match(name):
        raise ValueError(f"database name {name!r}: letters, digits and _ only, at most 63")


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", name)) or (0,)
