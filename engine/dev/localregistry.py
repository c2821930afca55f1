"""A real local schema registry: Apicurio Registry, its Confluent-compatible API on 127.0.0.1.

For the tests that need a registry server rather than confluent-kafka's in-process
`mock://` one (`tests/test_registry_server.py`), and for local use:

    python -m refold.dev.localregistry build|start|stop|status

Apicurio publishes its runnable app (Quarkus's fast-jar layout: `quarkus-run.jar`
beside `lib/`, `app/`, `quarkus/`) on Maven Central as the `all` tar.gz of
`io.apicurio:apicurio-registry-app`. `build()` fetches it with Maven once and unpacks
it into the jar cache (`refold.environment.jars_home()`, `.refold/jars` or
`$REFOLD_JARS`), which test sessions share whatever their `REFOLD_HOME`:

    <jars>/apicurio-registry/<version>/   the app, with a `.built` stamp when complete

The app is built for Java 21: `find_java()` picks a JDK of 21 or newer (`$JAVA_HOME`,
else the newest in /usr/lib/jvm, else `java` on PATH). A running server's files live
under `<home>/registry/` (home: `refold.environment.home()`, i.e. `.refold/`):

    registry.log    the JVM's stdout and stderr
    registry.pid    the pid of the running JVM (its own process group)
    registry.port   the HTTP port of the last start

Storage is Apicurio's default, H2 in memory: every start begins empty. Compared with
Apicurio's own defaults, the server listens on 127.0.0.1 only (its management
interface too, on a free port), new subjects are BACKWARD compatible (the Confluent
default; Apicurio's is none), schemas are compared in canonical form and the access
log is off. `RegistryInfo.url` is the Confluent-compatible base URL
(`http://127.0.0.1:PORT/apis/ccompat/v7`), the `url` of a pipeline's
`schema_registry`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from refold import environment
from refold.dev.localproc import HOST, ServerStartError, free_port, stop_server
from refold.dev.localproc import bindable as _bindable
from refold.dev.localproc import kill_group as _kill_group
from refold.dev.localproc import locked as _locked
from refold.dev.localproc import rotate as _rotate
from refold.dev.localproc import running_pid as _running_pid_in
from refold.dev.localproc import say as _say
from refold.dev.localproc import signal_group as _signal_group
from refold.dev.localproc import spawn as _spawn
from refold.dev.localproc import tail as _tail
from refold.environment import home as project_home
from refold.errors import PrerequisiteError
from refold.spark.jars import require

VERSION = "3.3.3"
ARTIFACT = f"io.apicurio:apicurio-registry-app:{VERSION}:tar.gz:all"
MIN_JAVA = 21  # the app is compiled for Java 21 (maven.compiler.release in its pom)
CCOMPAT_PATH = "/apis/ccompat/v7"
JVM_OPTIONS = (
    "-Xms64m",
    "-Xmx512m",
    "-XX:+UseSerialGC",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
SETTINGS = (  # Quarkus/Apicurio settings on top of the app's own application.properties
    "quarkus.http.access-log.enabled=false",
    "apicurio.rules.global.compatibility=BACKWARD",
    "apicurio.ccompat.use-canonical-hash=true",
)
_JVM_ROOT = Path("/usr/lib/jvm")
_JAVA_HINT = (
    "install a JDK of 21 or newer (e.g. Temurin 25 in /usr/lib/jvm/temurin-25-jdk-amd64) "
    "or point JAVA_HOME at one"
)
_STAMP = ".built"
_HOME_MARK = "-Drefold.registry.home="  # on the JVM's command line: tells our server apart


@dataclass(frozen=True, slots=True)
class RegistryInfo:
    """A running local registry."""

    pid: int
    port: int
    home: Path  # the server's folder, <project home>/registry

    @property
    def url(self) -> str:
        """The Confluent-compatible API (a pipeline's `schema_registry.url`)."""
        return f"http://{HOST}:{self.port}{CCOMPAT_PATH}"

    @property
    def log_file(self) -> Path:
        return self.home / "registry.log"


def registry_home(home: Path | None = None) -> Path:
    """The server's folder inside a Refold home (default: `project_home()`)."""
    return (home if home is not None else project_home()).resolve() / "registry"


def app_dir() -> Path:
    """Where the unpacked app of `VERSION` lives (built or not)."""
    return environment.jars_home() / "apicurio-registry" / VERSION


# Prerequisites and build ------------------------------------------------------------------


def java_version(java: str | os.PathLike[str]) -> int | None:
    """The feature version of a `java` executable (17, 21, 25), or None when it does
    not run. Reads the JDK's `release` file when there is one, else asks `java -version`."""
    path = Path(java)
    release = path.resolve().parent.parent / "release"
    with contextlib.suppress(OSError):
        found = re.search(r'^JAVA_VERSION="(\d+)', release.read_text(), re.MULTILINE)
        if found:
            return int(found.group(1))
    try:
        result = subprocess.run(
            [str(java), "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r'version "(\d+)(?:\.(\d+))?', result.stderr + result.stdout)
    if not found:
        return None
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major  # "1.8.0" is Java 8


def find_java() -> str:
    """A `java` of MIN_JAVA or newer: `$JAVA_HOME`'s, else the newest under
    /usr/lib/jvm, else the one on PATH. Raises PrerequisiteError naming what was found."""
    candidates: list[Path] = []
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidates.append(Path(java_home) / "bin" / "java")
    candidates.extend(sorted(_JVM_ROOT.glob("*/bin/java")))
    on_path = shutil.which("java")
    if on_path:
        candidates.append(Path(on_path))
    seen: dict[Path, int | None] = {}
    for candidate in candidates:
        if os.access(candidate, os.X_OK) and candidate.resolve() not in seen:
            seen[candidate.resolve()] = java_version(candidate)
    if java_home:
        first = (Path(java_home) / "bin" / "java").resolve()
        if (seen.get(first) or 0) >= MIN_JAVA:
            return str(first)
    usable = [(version, str(path)) for path, version in seen.items() if version and version >= MIN_JAVA]
    if usable:
        return max(usable)[1]
    found = ", ".join(f"Java {version or '?'} ({path})" for path, version in seen.items()) or "no java at all"
    raise PrerequisiteError(
        f"Apicurio Registry {VERSION} needs Java {MIN_JAVA} or newer; found {found}: {_JAVA_HINT}"
    )


def built() -> Path | None:
    """The app's folder when it is built, else None."""
    target = app_dir()
    if (target / _STAMP).is_file() and (target / "quarkus-run.jar").is_file():
        return target
    return None


def build(*, quiet: bool = False) -> Path:
    """The runnable app's folder, fetching and unpacking it first when needed.

    Idempotent and safe to call concurrently (a file lock; the app is unpacked into a
    scratch folder renamed into place). Raises PrerequisiteError when Maven or a Java
    of MIN_JAVA or newer is missing, or Maven cannot fetch the artifact."""
    done = built()
    if done is not None:
        return done
    find_java()  # fail before a long download when the server could not run anyway
    mvn = require("mvn", "Apache Maven 3.8 or newer, e.g. apt-get install maven")
    target = app_dir()
    with _locked(target.parent):
        done = built()  # another process may have finished meanwhile
        if done is not None:
            return done
        return _build(mvn, target, quiet)


def _build(mvn: str, target: Path, quiet: bool) -> Path:
    started = time.monotonic()
    scratch = target.with_name(f".{VERSION}.{os.getpid()}.tmp")
    shutil.rmtree(scratch, ignore_errors=True)
    download = scratch / "download"
    download.mkdir(parents=True)
    _say(quiet, f"building Apicurio Registry {VERSION}: fetching {ARTIFACT} (~160 MB) with Maven …")
    command = [
        mvn, "-q", "-B", "-Dstyle.color=never", "dependency:copy",
        f"-Dartifact={ARTIFACT}", f"-DoutputDirectory={download}",
    ]  # fmt: skip
    try:
        result = subprocess.run(command, cwd=scratch, capture_output=True, text=True, check=False)
    except OSError as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        raise PrerequisiteError(f"cannot run Maven ({mvn}): {exc.strerror}") from exc
    archives = sorted(download.glob("*.tar.gz"))
    if result.returncode != 0 or len(archives) != 1:
        shutil.rmtree(scratch, ignore_errors=True)
        output = "\n".join((result.stdout + result.stderr).strip().splitlines()[-20:]) or "(no output)"
        raise PrerequisiteError(f"Maven could not fetch {ARTIFACT} (exit {result.returncode}):\n{output}")
    _say(quiet, f"unpacking {archives[0].name} …")
    app = scratch / "app"
    # Python's tarfile, not Maven's unpack: the archive has PAX long names Maven cuts short
    with tarfile.open(archives[0]) as archive:
        archive.extractall(app, filter="data")
    if not (app / "quarkus-run.jar").is_file():
        shutil.rmtree(scratch, ignore_errors=True)
        raise PrerequisiteError(f"{ARTIFACT} has no quarkus-run.jar: not the runnable app")
    (app / _STAMP).write_text(f"{ARTIFACT}\n")
    if target.exists():
        shutil.rmtree(target)
    app.rename(target)
    shutil.rmtree(scratch, ignore_errors=True)
    _say(quiet, f"built Apicurio Registry {VERSION} into {target} ({time.monotonic() - started:.0f}s)")
    return target


# Lifecycle ---------------------------------------------------------------------------


def start(
    port: int | None = None,
    timeout: float = 180.0,
    *,
    home: Path | None = None,
    quiet: bool = False,
    die_with_parent: bool = False,
) -> RegistryInfo:
    """Start the registry and wait until its Confluent-compatible API answers.

    Builds the app first when needed. Harmless when the registry already runs: it
    returns the running one (whatever its port). `port`: None takes a free one.
    `die_with_parent` (Linux) sends the server SIGTERM when the calling thread's
    process dies, for test sessions that may be killed; call it from the main thread.
    Raises PrerequisiteError (no Maven, no Java 21+, port taken) or ServerStartError
    (the server exited or did not answer within `timeout` seconds, its build not
    counted; the process is then killed; the error names its log file).
    """
    base = registry_home(home)
    base.mkdir(parents=True, exist_ok=True)
    app = build(quiet=quiet)
    with _locked(base):
        running = status(home)
        if running is not None:
            _say(quiet, f"the schema registry already runs at {running.url} (pid {running.pid})")
            return running
        return _launch(base, app, port, timeout, quiet=quiet, die_with_parent=die_with_parent)


def stop(timeout: float = 30.0, *, home: Path | None = None) -> bool:
    """Stop the registry: SIGTERM to its process group, then SIGKILL after `timeout`
    seconds. Removes the pid file. Returns False when none ran."""
    base = registry_home(home)
    return stop_server(base, _pid_file(base), lambda: _running_pid(base), timeout)


def status(home: Path | None = None) -> RegistryInfo | None:
    """The running local registry, or None. Does not ask the server anything."""
    base = registry_home(home)
    pid = _running_pid(base)
    if pid is None:
        return None
    try:
        port = int((base / "registry.port").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return RegistryInfo(pid, port, base)


def kill_hard(home: Path | None = None) -> bool:
    """kill -9 the registry's process group. False when none ran."""
    base = registry_home(home)
    with _locked(base):
        pid = _running_pid(base)
        if pid is None:
            return False
        _kill_group(pid)
        _pid_file(base).unlink(missing_ok=True)
        return True


@contextlib.contextmanager
def running(
    port: int | None = None,
    timeout: float = 180.0,
    *,
    home: Path | None = None,
    quiet: bool = True,
    die_with_parent: bool = False,
) -> Iterator[RegistryInfo]:
    """A registry for the `with` block (a test fixture's): started unless one already
    runs in `home`, and then stopped at the end (one that already ran is left alone)."""
    already = status(home) is not None
    info = start(port, timeout, home=home, quiet=quiet, die_with_parent=die_with_parent)
    try:
        yield info
    finally:
        if not already:
            stop(home=home)


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether the Confluent-compatible API at `url` lists its subjects."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/subjects", timeout=timeout) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


# Command line --------------------------------------------------------------------------


def cli(args: argparse.Namespace) -> int:
    """`build|start|stop|status [--port N]`. Exit 1 from `status` when none runs."""
    action = args.action
    if action == "build":
        print(f"Apicurio Registry {VERSION} is in {build()}")
        return 0
    if action == "start":
        info = start(getattr(args, "port", None))
        print(f"the schema registry runs at {info.url} (pid {info.pid})")
        print(f"  log  {info.log_file}")
        return 0
    if action == "stop":
        print("the schema registry stopped" if stop() else "the schema registry was not running")
        return 0
    if action == "status":
        found = status()
        if found is None:
            print("the schema registry is not running")
            return 1
        state = "answers" if answers(found.url) else "does not answer yet"
        print(f"the schema registry runs at {found.url} (pid {found.pid}, {state})")
        print(f"  log  {found.log_file}")
        return 0
    raise ValueError(f"unknown action {action!r}: build, start, stop or status")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m refold.dev.localregistry",
        description=f"A local Apicurio Registry {VERSION} (Confluent-compatible API) on {HOST}.",
    )
    parser.add_argument("action", choices=("build", "start", "stop", "status"))
    parser.add_argument("--port", type=int, default=None, help="HTTP port (default: a free one)")
    try:
        return cli(parser.parse_args(argv))
    except PrerequisiteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


# Inside ----------------------------------------------------------------------------------


def _launch(
    base: Path, app: Path, port: int | None, timeout: float, *, quiet: bool, die_with_parent: bool
) -> RegistryInfo:
    java = find_java()
    if port is None:
        port = free_port()
    elif not _bindable(port):
        raise PrerequisiteError(f"port {port} on {HOST} is taken by another program; choose another")
    management_port = free_port()
    settings = (
        f"quarkus.http.host={HOST}",
        f"quarkus.http.port={port}",
        f"quarkus.management.host={HOST}",
        f"quarkus.management.port={management_port}",
        *SETTINGS,
    )
    command = [
        java,
        *JVM_OPTIONS,
        f"{_HOME_MARK}{base}",
        *(f"-D{setting}" for setting in settings),
        "-jar",
        str(app / "quarkus-run.jar"),
    ]
    log_file = base / "registry.log"
    _rotate(log_file)
    (base / "registry.port").write_text(f"{port}\n")
    started = time.monotonic()
    proc = _spawn(
        command,
        what=f"Apicurio Registry {VERSION} on {HOST}:{port}",
        log_file=log_file,
        pid_file=_pid_file(base),
        cwd=base,
        die_with_parent=die_with_parent,
    )
    info = RegistryInfo(proc.pid, port, base)
    _say(quiet, f"starting the schema registry on {info.url} (log {log_file}) …")
    _await_answer(info, proc, started + timeout, timeout)
    _say(quiet, f"the schema registry is ready at {info.url} ({time.monotonic() - started:.1f}s)")
    return info


def _await_answer(info: RegistryInfo, proc: subprocess.Popen[bytes], deadline: float, timeout: float) -> None:
    """Until the new server answers; when it exits or `deadline` passes first, kill it,
    remove its pid file and raise ServerStartError."""
    while not answers(info.url):
        exited = proc.poll()
        if exited is not None or time.monotonic() > deadline:
            if exited is None:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(10)
            _pid_file(info.home).unlink(missing_ok=True)
            why = f"exited with {exited}" if exited is not None else f"did not answer in {timeout:.0f}s"
            raise ServerStartError(
                f"the schema registry on {info.url} {why}", log_file=info.log_file, log_tail=_tail(info.log_file)
            )
        time.sleep(0.25)


def _pid_file(base: Path) -> Path:
    return base / "registry.pid"


def _running_pid(base: Path) -> int | None:
    """The pid in the pid file, if that process lives and is this home's registry."""
    return _running_pid_in(_pid_file(base), (f"{_HOME_MARK}{base}",))


if __name__ == "__main__":
    sys.exit(main())
