"""JVM dependencies, resolved with Maven from Maven Central into `.refold/jars/<name>/`.

Two pinned sets, each described by a pom beside this file: `kafka-broker` (a
local Apache Kafka broker) and `spark-connectors` (Spark's Kafka source). A set
is resolved once; a stamp holding the pom's hash makes a changed pom resolve again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from refold.errors import PrerequisiteError

POMS = Path(__file__).resolve().parent / "jvm"
SETS = ("kafka-broker", "spark-connectors")


def project_home() -> Path:
    """Refold's working folder: $REFOLD_HOME, else `.refold` at the repository root."""
    env = os.environ.get("REFOLD_HOME")
    if env:
        return Path(env).resolve()
    return Path(__file__).resolve().parent.parent / ".refold"


def jars_home() -> Path:
    """Where resolved jars live. $REFOLD_JARS lets several homes share one cache."""
    env = os.environ.get("REFOLD_JARS")
    return Path(env).resolve() if env else project_home() / "jars"


def require(tool: str, hint: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise PrerequisiteError(f"{tool} is not installed ({hint})")
    return path


def resolve(name: str) -> list[Path]:
    """The jars of set `name`, resolving them with Maven first when needed."""
    if name not in SETS:
        raise ValueError(f"unknown jar set {name!r}; known: {', '.join(SETS)}")
    pom = POMS / f"{name}.pom.xml"
    target = jars_home() / name
    stamp = target / ".pom-sha256"
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()
    if not (stamp.exists() and stamp.read_text().strip() == digest):
        mvn = require("mvn", "apt-get install maven")
        require("java", "apt-get install openjdk-17-jre-headless")
        print(f"resolving {name} jars with Maven into {target} …", file=sys.stderr, flush=True)
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        result = subprocess.run(
            [mvn, "-q", "-B", "-f", str(pom), "dependency:copy-dependencies",
             f"-DoutputDirectory={target}", "-DincludeScope=runtime"],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            shutil.rmtree(target, ignore_errors=True)
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
            raise PrerequisiteError(f"Maven could not resolve the {name} jars:\n{tail}")
        stamp.write_text(digest + "\n")
    jars = sorted(target.glob("*.jar"))
    if not jars:
        raise PrerequisiteError(f"no jars in {target}; delete it and run `refold jars` again")
    return jars


def spark_jars() -> list[Path]:
    return resolve("spark-connectors")


def kafka_classpath() -> str:
    return os.pathsep.join(str(p) for p in resolve("kafka-broker"))
