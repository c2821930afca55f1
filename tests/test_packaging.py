"""The built wheel works outside a checkout: installed into a fresh virtualenv in a
temporary folder, `refold --help`, the Avro schemas and `refold produce` to the real
broker all work without the repository on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Consumer

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv outside the checkout with the wheel built from it (and its
    pinned dependencies, from pip's cache when this machine has them)."""
    where = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(where / "dist"), str(ROOT)],
        check=True, timeout=600,
    )  # fmt: skip
    wheels = list((where / "dist").glob("refold-*.whl"))
    assert len(wheels) == 1, wheels
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # --no-compile: no .pyc for pyspark, pandas, pyarrow … (half of the install time)
    subprocess.run([venv / "bin" / "pip", "install", "--quiet", "--no-compile", str(wheels[0])], check=True, timeout=900)
    return venv


def _run(venv: Path, *args: str, cwd: Path, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REFOLD_HOME")}
    env["REFOLD_HOME"] = str(cwd / "home")  # not the checkout's .refold
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, input=stdin.decode() if stdin else None,
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_the_wheel_runs_outside_the_checkout(installed: Path, tmp_path: Path, bootstrap_servers: str, topic) -> None:
    python = installed / "bin" / "python"
    where = _run(installed, python, "-c", "import refold; print(refold.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert str(installed) in where.stdout and str(ROOT) not in where.stdout

    helped = _run(installed, installed / "bin" / "refold", "--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert "produce" in helped.stdout and "run" in helped.stdout

    schemas = _run(
        installed, python, "-c",
        "from refold.codecs import load_schema, schema_dir\n"
        "for name in ('checkpoint', 'deadletter', 'event_system', 'state'):\n"
        "    assert load_schema(name)['type'] == 'record', name\n"
        "print(schema_dir())",
        cwd=tmp_path,
    )  # fmt: skip
    assert schemas.returncode == 0, schemas.stderr
    assert str(installed) in schemas.stdout

    # the JVM files ship as package data of refold.spark.jvm: the Maven poms, Spark's log4j2 file
    jvm = _run(
        installed, python, "-c",
        "from refold.spark.jars import POMS\nfrom refold.spark.logs import LOG4J\n"
        "assert LOG4J.is_file() and (POMS / 'spark-connectors.pom.xml').is_file()\nprint(LOG4J)",
        cwd=tmp_path,
    )  # fmt: skip
    assert jvm.returncode == 0, jvm.stderr
    assert str(installed) in jvm.stdout
    versioned = _run(installed, installed / "bin" / "refold", "--version", cwd=tmp_path)
    assert versioned.returncode == 0 and versioned.stdout.strip() == f"refold {version('refold')}", versioned

    name = topic(partitions=1)
    lines = b'{"op":"+A","player_name":"Alice","score":100}\n{"op":"-C","player_name":"Alice","score":100}\n' \
            b'{"op":"+C","player_name":"Alice","score":120}\n'
    produced = _run(
        installed, installed / "bin" / "refold", "--bootstrap-servers", bootstrap_servers,
        "produce", name, "-", "--key", "player_name", cwd=tmp_path, stdin=lines,
    )  # fmt: skip
    assert produced.returncode == 0, produced.stderr
    assert "3" in produced.stdout + produced.stderr

    consumer = Consumer({
        "bootstrap.servers": bootstrap_servers, "group.id": f"wheel-{name}",
        "auto.offset.reset": "earliest", "isolation.level": "read_committed",
    })  # fmt: skip
    try:
        consumer.subscribe([name])
        values = []
        for _ in range(60):
            message = consumer.poll(1.0)
            if message is not None and not message.error():
                values.append(orjson.loads(message.value()))
            if len(values) == 3:
                break
    finally:
        consumer.close()
    assert [v["op"] for v in values] == ["+A", "-C", "+C"] or [v["op"] for v in values] == [0, 2, 3]
