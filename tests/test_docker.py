"""The engine container, checked with what runs here (no Docker engine on these machines):

- the entrypoint script runs for real, against the test broker, on a tiny pipeline;
- compose.yaml is parsed and cross-checked against the Dockerfile, the entrypoint
  and the pipeline file it mounts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from refold.cli.produce import produce
from refold.config import load_pipeline, parse_pipeline
from refold.ops.verify import read_view_changes

DOCKER = Path(__file__).resolve().parent.parent / "docker"
ENTRYPOINT = DOCKER / "entrypoint.sh"


def compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def dockerfile() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined."""
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.kafka
@pytest.mark.spark
def test_entrypoint_runs_the_mounted_pipeline(bootstrap_servers, topic, tmp_path: Path) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=1)
    with open("examples/match_scores.jsonl", "rb") as handle:
        produce(settings, source, handle.read().splitlines(), ["player_name"], progress=False)
    name = f"dk{uuid.uuid4().hex[:8]}"
    pipeline_file = tmp_path / "pipeline.yaml"
    data = yaml.safe_load((DOCKER / "pipeline.yaml").read_text())  # the pipeline compose mounts
    data.update(pipeline=name, source={**data["source"], "topic": source},
                outputs={"view": {**data["outputs"]["view"], "topic": f"{name}.view"}}, trigger="200ms")
    data.pop("metrics")  # no fixed port in tests
    pipeline_file.write_text(yaml.safe_dump(data))
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # `refold` as in the image
        "REFOLD_BOOTSTRAP_SERVERS": bootstrap_servers,
        "REFOLD_PIPELINE": str(pipeline_file),
        "REFOLD_UNTIL_IDLE": "2",
        "REFOLD_HOME": str(tmp_path / "home"),
    }
    done = subprocess.run(["bash", str(ENTRYPOINT)], env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:]
    pipeline = load_pipeline(pipeline_file)
    got = [(c.op.code, c.row["place"], c.row["player_name"], c.row["score"]) for c in read_view_changes(pipeline, settings)]
    assert got == [
        ("+A", 1, "Alice", 100), ("+A", 2, "Bob", 80),
        ("-C", 2, "Bob", 80), ("+C", 2, "Charlie", 90),
        ("-C", 1, "Alice", 100), ("+C", 1, "Charlie", 110),
        ("-C", 2, "Charlie", 90), ("+C", 2, "Alice", 100),
    ]
    # not a terminal: structured log lines, one JSON object each, on stdout
    lines = [orjson.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    batches = [line for line in lines if line.get("message") == "batch committed"]
    assert batches and sum(line["in"] for line in batches) == 6
    assert all({"time", "level", "message"} <= line.keys() for line in lines)


def test_entrypoint_refuses_to_start_without_its_settings(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "REFOLD_BOOTSTRAP_SERVERS"}
    done = subprocess.run(["bash", str(ENTRYPOINT)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "REFOLD_BOOTSTRAP_SERVERS" in done.stderr
    env.update(REFOLD_BOOTSTRAP_SERVERS="kafka:19092", REFOLD_PIPELINE=str(tmp_path / "missing.yaml"))
    done = subprocess.run(["bash", str(ENTRYPOINT)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "no pipeline file" in done.stderr
    pipeline_file = tmp_path / "pipeline.yaml"
    pipeline_file.write_text((DOCKER / "pipeline.yaml").read_text())
    env.update(REFOLD_PIPELINE=str(pipeline_file), REFOLD_KAFKA_CONFIG=str(tmp_path / "missing.properties"))
    done = subprocess.run(["bash", str(ENTRYPOINT)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "REFOLD_KAFKA_CONFIG" in done.stderr


def test_dockerfile_installs_the_entrypoint_as_a_non_root_user() -> None:
    lines = dockerfile()
    froms = [line for line in lines if line.startswith("FROM ")]
    assert len(froms) == 4 and all("python:3.11" in line for line in froms[2:])
    # the native core is built from source in a Rust stage (or taken from the image the
    # NATIVE_WHEELS build argument names, which defaults to that stage) and installed into the venv
    assert froms[0].startswith("FROM rust:") and froms[0].endswith(" AS native")
    assert "ARG NATIVE_WHEELS=native" in lines[: lines.index(froms[0])]
    assert froms[1] == "FROM ${NATIVE_WHEELS} AS native-wheels"
    assert any("pip wheel" in line and "./native" in line for line in lines)
    assert any(line.startswith("COPY --from=native-wheels /wheels ") for line in lines)
    assert any("pip install" in line and "/wheels/refold_native-" in line for line in lines)
    runtime = lines[lines.index(froms[-1]):]
    assert any("openjdk-17-jre-headless" in line for line in runtime)
    assert any(re.search(r"\brefold jars\b", line) for line in lines), "jars are resolved at build time"
    (copy,) = [line for line in runtime if line.startswith("COPY docker/entrypoint.sh ")]
    target = copy.split()[-1]
    (entry,) = [line for line in runtime if line.startswith("ENTRYPOINT ")]
    assert target in orjson.loads(entry.removeprefix("ENTRYPOINT "))
    users = [line.split()[1] for line in runtime if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert os.access(ENTRYPOINT, os.X_OK)
    # every path the build copies exists in the repository
    for line in lines:
        if line.startswith("COPY ") and "--from=" not in line:
            for path in line.split()[1:-1]:
                assert (DOCKER.parent / path).exists(), path


def test_compose_wires_kafka_postgres_and_the_engine() -> None:
    spec = compose()
    services = spec["services"]
    assert set(services) == {"kafka", "postgres", "engine", "spark-master", "spark-worker"}
    kafka, postgres, engine = services["kafka"], services["postgres"], services["engine"]
    assert kafka["image"].startswith("apache/kafka:")
    kafka_env = kafka["environment"]
    assert "controller" in kafka_env["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper
    assert kafka_env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "1"  # transactions on one node
    assert postgres["image"].startswith("postgres:")
    for service in services.values():
        assert service["healthcheck"]["test"], service

    # the engine reaches Kafka on a listener Kafka advertises under its service name
    advertised = dict(item.split("://") for item in kafka_env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    bootstrap = engine["environment"]["REFOLD_BOOTSTRAP_SERVERS"]
    assert bootstrap in advertised.values() and bootstrap.startswith("kafka:")
    listeners = dict(item.split("://") for item in kafka_env["KAFKA_LISTENERS"].split(","))
    host_listener = next(name for name, where in advertised.items() if where.startswith("127.0.0.1:"))
    host_port = advertised[host_listener].split(":")[1]
    assert listeners[host_listener] == f":{host_port}" and f"{host_port}:{host_port}" in kafka["ports"]
    assert engine["depends_on"] == {"kafka": {"condition": "service_healthy"},
                                    "postgres": {"condition": "service_healthy"}}

    # the engine: built from docker/Dockerfile, its entrypoint not overridden, the
    # pipeline mounted where the entrypoint looks, metrics exposed; no volume for state
    assert (DOCKER / engine["build"]["context"]).resolve() == DOCKER.parent  # the repository root
    assert engine["build"]["dockerfile"] == "docker/Dockerfile" and (DOCKER / "Dockerfile").is_file()
    assert "entrypoint" not in engine and "command" not in engine
    mounts = [volume.split(":") for volume in engine["volumes"]]
    assert all(mode == "ro" for *_parts, mode in mounts), "the engine keeps no state"
    pipeline_path = engine["environment"]["REFOLD_PIPELINE"]
    assert pipeline_path == "/pipeline/pipeline.yaml" and pipeline_path in ENTRYPOINT.read_text()
    ((host_file, target, _mode),) = mounts
    assert target == pipeline_path
    mounted = load_pipeline(DOCKER / host_file)
    metrics_port = engine["environment"]["REFOLD_METRICS_PORT"]
    assert mounted.metrics is not None and str(mounted.metrics.port) == metrics_port
    assert f"{metrics_port}:{metrics_port}" in engine["ports"]
    assert metrics_port in " ".join(engine["healthcheck"]["test"])
    assert f"EXPOSE {metrics_port}" in dockerfile()
    assert "REFOLD_METRICS_PORT" in ENTRYPOINT.read_text() and "REFOLD_BOOTSTRAP_SERVERS" in ENTRYPOINT.read_text()

    # named volumes only for the services whose state must survive
    assert set(spec["volumes"]) == {"kafka-data", "postgres-data"}
    assert [v.split(":")[1] for v in kafka["volumes"]] == [kafka_env["KAFKA_LOG_DIRS"]]
    assert [v.split(":")[1] for v in postgres["volumes"]] == ["/var/lib/postgresql/data"]
    # the postgres settings the engine gets are the server's
    assert engine["environment"]["PGUSER"] == postgres["environment"]["POSTGRES_USER"]
    assert engine["environment"]["PGDATABASE"] == postgres["environment"]["POSTGRES_DB"]
    assert parse_pipeline(yaml.safe_load((DOCKER / host_file).read_text())).pipeline == "leaderboard"


def test_compose_runs_a_spark_master_and_a_worker_from_the_engine_image() -> None:
    services = compose()["services"]
    engine, master, worker = services["engine"], services["spark-master"], services["spark-worker"]
    # the engine's image and build: the daemons run the driver's Spark and Python packages
    for daemon in (master, worker):
        assert daemon["image"] == engine["image"] and daemon["build"] == engine["build"]
        assert daemon["entrypoint"][:2] == ["/usr/bin/tini", "--"]
        spark_class = Path(daemon["entrypoint"][2])
        assert spark_class.name == "spark-class"
        assert daemon["environment"]["SPARK_HOME"] == str(spark_class.parent.parent)
        # the venv the Dockerfile makes, on the image's Python
        python = next(line for line in dockerfile() if line.startswith("FROM python:")).split()[1]
        version = re.match(r"python:(\d+\.\d+)", python)
        assert version is not None
        assert spark_class.is_relative_to(f"/opt/venv/lib/python{version[1]}/site-packages/pyspark")
        assert "spark.master.rest.enabled=false" in daemon["environment"]["SPARK_DAEMON_JAVA_OPTS"]
        assert "volumes" not in daemon, "Spark keeps no state"
    assert master["command"][0] == "org.apache.spark.deploy.master.Master"
    assert worker["command"][0] == "org.apache.spark.deploy.worker.Worker"
    options = dict(zip(master["command"][1::2], master["command"][2::2], strict=True))
    # the worker registers with the master under its service name and port …
    assert options["--host"] == "spark-master"
    assert worker["command"][-1] == f"spark://spark-master:{options['--port']}"
    assert worker["depends_on"] == {"spark-master": {"condition": "service_healthy"}}
    # … and is healthy once the master, whose UI port its health check asks, lists it
    ui = options["--webui-port"]
    assert f"http://spark-master:{ui}/json/" in worker["healthcheck"]["test"][-1]
    assert f"http://127.0.0.1:{ui}/json/" in master["healthcheck"]["test"][-1]
    assert master["ports"] == [f"127.0.0.1:{ui}:{ui}"]  # the UI can kill apps: loopback only
    worker_options = dict(zip(worker["command"][1:-1:2], worker["command"][2:-1:2], strict=True))
    assert worker_options["--host"] == "spark-worker"
    assert "'spark-worker'" in worker["healthcheck"]["test"][-1]
    assert int(worker_options["--cores"]) >= 1 and worker_options["--memory"].endswith("g")


def test_refold_version_names_the_package() -> None:
    from importlib.metadata import version

    done = subprocess.run([str(Path(sys.executable).parent / "refold"), "--version"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"refold {version('refold')}"
