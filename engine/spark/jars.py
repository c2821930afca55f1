"""JVM dependencies, resolved with Maven from Maven Central into `.refold/jars/<name>/`.

Five pinned sets, each described by a pom beside this module (`jvm/<name>.pom.xml`):

- `kafka-broker`: a local Apache Kafka broker (`refold.dev.localkafka`);
- `kafka-tools`: Kafka's command-line tools, for the chaos harness's `find-hanging`
  check after a run (`refold.dev.hanging`);
- `spark-connectors`: Spark's Kafka source and sink, passed to Spark as `spark.jars`;
- `flink-connectors`: Flink's Kafka SQL connector, for the Flink contender of `make bench`;
- `lakehouse-readers`: delta-spark and Iceberg's Spark runtime (with SQLite's JDBC driver),
  for a Spark session that reads the tables of the `delta` and `iceberg` drivers (tests,
  users); never passed to the engine's own session.

A set is resolved once. Its folder keeps a stamp with the pom's hash and the jar
names; a changed pom, or a jar gone missing, makes the set resolve again.
Resolution runs under a file lock, into a scratch folder that is renamed into
place, so concurrent callers (a test run and a demo) never see half a set.

Where things live: `refold.environment.home()` is `$REFOLD_HOME`, else `.refold` at the root
of a source checkout, else `~/.refold` (an installed package). The jar cache is
`<home>/jars`, or `$REFOLD_JARS` so that several homes can share one cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from refold import environment
from refold.errors import PrerequisiteError

POMS = Path(__file__).resolve().parent / "jvm"
SETS = (
    "kafka-broker",
    "kafka-tools",  # the chaos harness's `find-hanging` check only
    "spark-connectors",
    "flink-connectors",  # `make bench` only
    "lakehouse-readers",  # tests and readers of the Delta/Iceberg tables only, not the engine's Spark session
)
_STAMP = ".resolved.json"
_MAVEN_NS = {"m": "http://maven.apache.org/POM/4.0.0"}


def require(tool: str, hint: str) -> str:
    """The path of an executable on PATH, or a PrerequisiteError saying how to get it."""
    path = shutil.which(tool)
    if path is None:
        raise PrerequisiteError(f"{tool} is not installed or not on PATH ({hint})")
    return path


def require_java() -> str:
    return require("java", "Java 17 or newer, e.g. apt-get install openjdk-17-jre-headless")


def describe(name: str) -> str:
    """A human title of a set from its pom: 'Kafka 4.1.1'."""
    root = ET.parse(_pom(name)).getroot()
    title = root.findtext("m:name", default=name, namespaces=_MAVEN_NS)
    version = root.findtext("m:properties/m:refold.version", default="", namespaces=_MAVEN_NS)
    return f"{title} {version}".strip()


def resolve(name: str) -> list[Path]:
    """The jars of set `name`, resolving them with Maven first when needed."""
    pom = _pom(name)
    target = environment.jars_home() / name
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()
    jars = _resolved(target, digest)
    if jars is not None:
        return jars
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{name}.lock"):
        jars = _resolved(target, digest)  # another process may have finished meanwhile
        if jars is None:
            jars = _resolve_with_maven(name, pom, target, digest)
    return jars


def spark_jars() -> list[Path]:
    """Jars to pass as `spark.jars`: Spark's Kafka connector without what pyspark ships."""
    jars = resolve("spark-connectors")
    bundled = _pyspark_artifacts()
    clashing = [jar for jar in jars if artifact_of(jar.name) in bundled]
    if clashing:
        names = ", ".join(jar.name for jar in clashing)
        print(
            f"refold: leaving out {names}: pyspark ships its own "
            f"(add an exclusion to {_pom('spark-connectors').name})",
            file=sys.stderr,
        )
    return [jar for jar in jars if jar not in clashing]


def kafka_tools_classpath() -> str:
    """The class path of Kafka's command-line tools (`org.apache.kafka.tools.*`)."""
    return os.pathsep.join(str(jar) for jar in resolve("kafka-tools"))


def kafka_classpath() -> str:
    """The Java class path of the local Kafka broker."""
    return os.pathsep.join(str(jar) for jar in resolve("kafka-broker"))


_VERSION_TAIL = re.compile(r"-\d[^/]*$")


def artifact_of(jar_name: str) -> str:
    """'kafka-clients-3.9.1.jar' → 'kafka-clients' (the name without its version)."""
    return _VERSION_TAIL.sub("", jar_name.removesuffix(".jar"))


# ------------------------------------------------------------------------------------


def _pom(name: str) -> Path:
    if name not in SETS:
        raise ValueError(f"unknown jar set {name!r}; known: {', '.join(SETS)}")
    return POMS / f"{name}.pom.xml"


def _resolved(target: Path, digest: str) -> list[Path] | None:
    """The set's jars when its stamp matches the pom and every jar is there."""
    try:
        stamp = json.loads((target / _STAMP).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict) or stamp.get("pom_sha256") != digest:
        return None
    jars = [target / str(jar) for jar in stamp.get("jars", [])]
    if not jars or not all(jar.is_file() for jar in jars):
        return None
    return jars


def _resolve_with_maven(name: str, pom: Path, target: Path, digest: str) -> list[Path]:
    mvn = require("mvn", "Apache Maven 3.8 or newer, e.g. apt-get install maven")
    require_java()
    print(f"resolving {describe(name)} jars with Maven…", file=sys.stderr, flush=True)
    started = time.monotonic()
    scratch = target.with_name(f".{name}.{os.getpid()}.tmp")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    command = [
        mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(pom),
        "dependency:copy-dependencies", f"-DoutputDirectory={scratch}", "-DincludeScope=runtime",
    ]  # fmt: skip
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        raise PrerequisiteError(f"cannot run Maven ({mvn}): {exc.strerror}") from exc
    jars = sorted(p.name for p in scratch.glob("*.jar"))
    if result.returncode != 0 or not jars:
        shutil.rmtree(scratch, ignore_errors=True)
        raise PrerequisiteError(
            f"Maven could not resolve the {describe(name)} jars from {pom} "
            f"(exit {result.returncode}):\n{_maven_errors(result.stdout + result.stderr)}"
        )
    (scratch / _STAMP).write_text(json.dumps({"pom_sha256": digest, "jars": jars}, indent=1))
    if target.exists():
        shutil.rmtree(target)
    scratch.rename(target)
    print(
        f"resolved {len(jars)} jars into {target} ({time.monotonic() - started:.0f}s)",
        file=sys.stderr,
        flush=True,
    )
    return [target / jar for jar in jars]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MAVEN_BOILERPLATE = re.compile(r"full stack trace|Re-run Maven|For more information|\[Help \d+\] http")


def _maven_errors(output: str) -> str:
    """Maven's [ERROR] lines without colour codes and boilerplate (else its last lines)."""
    lines = [_ANSI.sub("", line).rstrip() for line in output.splitlines()]
    errors = [
        line
        for line in lines
        if line.startswith("[ERROR]") and line != "[ERROR]" and not _MAVEN_BOILERPLATE.search(line)
    ]
    return "\n".join(errors or [line for line in lines if line][-20:]) or "(no output)"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pyspark_artifacts() -> frozenset[str]:
    """Artifact names of the jars the installed pyspark ships (empty without pyspark)."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        return frozenset()
    folder = Path(spec.origin).resolve().parent / "jars"
    return frozenset(artifact_of(jar.name) for jar in folder.glob("*.jar"))
