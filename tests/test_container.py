"""The engine image, built with podman from docker/Dockerfile and run for real
(`make test-container`; not in `make test`).

The used-by story end to end: a broker on the host (the test run's), the RFC-015 match
scores produced on the host with `refold produce`, the engine in its container
(`--network=host`, no volume: Kafka is its recovery log), the view and delta topics
consumed on the host and compared with the reference (`refold.reference`), across a
`podman stop` in mid-stream and a `podman start`, then in a new container.

The build runs on stand-in base images where the official ones cannot be pulled
(`refold.dev.container`); podman's storage, and with it the layer cache, is
`.refold/container/` (REFOLD_CONTAINER_HOME).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from refold.config import load_pipeline
from refold.dev.container import Podman, image_size, podman_build
from refold.ops.verify import verify

pytestmark = [pytest.mark.container, pytest.mark.kafka, pytest.mark.spark]

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "localhost/refold-engine:test"
REFOLD = str(Path(sys.executable).parent / "refold")


@pytest.fixture(scope="module")
def podman() -> Podman:
    return Podman()


@pytest.fixture(scope="module")
def image(podman: Podman) -> str:
    standins = os.environ.get("REFOLD_CONTAINER_STANDINS", "yes") != "no"
    seconds = podman_build(podman, IMAGE, standins=standins)
    size = image_size(podman, IMAGE)
    print(f"\nimage {IMAGE}: built in {seconds:.0f} s, {size / 1e6:.0f} MB")
    return IMAGE


def in_image(podman: Podman, image: str, *command: str) -> subprocess.CompletedProcess[str]:
    return podman("run", "--rm", "--network=host", "--entrypoint", command[0], image, *command[1:],
                  check=False, timeout=120)


def test_image_holds_the_engine_and_no_build_tools(podman: Podman, image: str) -> None:
    done = in_image(podman, image, "refold", "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"refold {version('refold')}"
    assert in_image(podman, image, "id", "-u").stdout.strip() == "10001"  # not root
    # the native core imports, and Java runs Spark's JVM
    done = in_image(podman, image, "python", "-c", "import refold_native, pyspark; print(pyspark.__version__)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == version("pyspark")
    assert in_image(podman, image, "java", "-version").returncode == 0
    jars = in_image(podman, image, "sh", "-c", "ls $REFOLD_JARS/*/*.jar $REFOLD_JARS/*.jar 2>/dev/null | wc -l")
    assert int(jars.stdout.strip()) > 0
    # nothing of the build: no compiler, JDK, Maven, pip, and no CA bundle of the build host
    tools = in_image(podman, image, "sh", "-c",
                     "for t in cargo rustc gcc cc javac mvn pip pip3; do command -v $t; done; "
                     "ls /run/secrets 2>/dev/null; true")
    assert tools.stdout.strip() == "", tools.stdout
    host_extra_ca = Path("/usr/local/share/ca-certificates")
    for cert in host_extra_ca.glob("*.crt"):
        found = in_image(podman, image, "sh", "-c", f"grep -c -F '{_first_key_line(cert)}' "
                         "/etc/ssl/certs/ca-certificates.crt || true")
        assert found.stdout.strip() == "0", f"{cert.name} is in the image"
    inspect = json.loads(podman("image", "inspect", image).stdout)[0]
    assert inspect["Healthcheck"]["Test"][0] in ("CMD", "CMD-SHELL")  # podman's inspect
    assert "9464/tcp" in inspect["Config"]["ExposedPorts"]


def _first_key_line(cert: Path) -> str:
    lines = [line for line in cert.read_text().splitlines() if line and not line.startswith("-----")]
    return lines[len(lines) // 2]  # a line from the middle of the certificate's base64


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def more_scores(count: int, seed: int) -> list[bytes]:
    """Match scores in the RFC-015 example's shape, after its six events."""
    rng = random.Random(seed)
    players = ["Alice", "Bob", "Charlie", "Dana", "Emil", "Fatima", "Goran", "Hana"]
    rows = []
    for i in range(count):
        match = 10 + seed * 1000 + i // 4
        t = 1704067200000 + match * 60_000
        rows.append(orjson.dumps({
            "op": "+A", "event_time": t, "match_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t / 1000)),
            "match_id": match, "player_name": rng.choice(players), "score": rng.randint(0, 150),
        }))
    return rows


def produce_file(bootstrap: str, topic: str, path: Path) -> None:
    done = subprocess.run([REFOLD, "--bootstrap-servers", bootstrap, "produce", topic, str(path),
                           "--key", "player_name", "--per-transaction", "50"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


class Engine:
    """The engine container on a pipeline file, against the host's broker."""

    def __init__(self, podman: Podman, image: str, pipeline_file: Path, bootstrap: str, metrics_port: int,
                 kafka_config: Path) -> None:
        self.podman, self.name = podman, f"refold-e2e-{uuid.uuid4().hex[:8]}"
        self.metrics_port = metrics_port
        self.started = time.monotonic()
        podman("run", "-d", "--name", self.name, "--network=host", "--init",
               "-e", f"REFOLD_BOOTSTRAP_SERVERS={bootstrap}", "-e", f"REFOLD_METRICS_PORT={metrics_port}",
               "-v", f"{pipeline_file}:/pipeline/pipeline.yaml:ro",
               "-v", f"{kafka_config}:/run/secrets/kafka.properties:ro", image, timeout=120)

    def logs(self) -> list[dict[str, Any]]:
        done = self.podman("logs", self.name, check=False)
        lines = []
        for line in (done.stdout + done.stderr).splitlines():
            if line.startswith("{"):
                lines.append(orjson.loads(line))
        return lines

    def raw_logs(self) -> str:
        done = self.podman("logs", self.name, check=False)
        return (done.stdout + done.stderr)[-4000:]

    def batches(self) -> int:
        return sum(1 for line in self.logs() if line.get("message") == "batch committed")

    def wait_for_batches(self, at_least: int, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while self.batches() < at_least:
            assert self.state() == "running", f"the engine container stopped:\n{self.raw_logs()}"
            assert time.monotonic() < deadline, f"no batch committed in {timeout} s:\n{self.raw_logs()}"
            time.sleep(1)
        return time.monotonic() - self.started

    def state(self) -> str:
        return self.podman("inspect", "--format", "{{.State.Status}}", self.name).stdout.strip()

    def stop(self) -> tuple[int, float]:
        started = time.monotonic()
        self.podman("stop", "--time", "90", self.name, timeout=150)
        code = int(self.podman("inspect", "--format", "{{.State.ExitCode}}", self.name).stdout.strip())
        return code, time.monotonic() - started

    def start(self) -> None:
        self.started = time.monotonic()
        self.podman("start", self.name, timeout=120)

    def remove(self) -> None:
        self.podman("rm", "--force", "--time", "5", self.name, check=False, timeout=60)


@pytest.fixture
def engines(podman: Podman) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.remove()


def test_engine_container_end_to_end_across_a_stop(podman: Podman, image: str, engines: list[Engine],
                                                   bootstrap_servers: str, topic: Any, tmp_path: Path) -> None:
    settings = {"bootstrap.servers": bootstrap_servers}
    source = topic(partitions=3)
    name = f"ct{uuid.uuid4().hex[:8]}"
    # the totals example (a grouped view: a view and a delta topic) on the match scores
    data = yaml.safe_load((ROOT / "examples" / "totals.yaml").read_text())
    data.pop("kafka")  # the cluster comes from REFOLD_BOOTSTRAP_SERVERS, as in the image's docs
    data.update(pipeline=name, source={**data["source"], "topic": source},
                outputs={"view": {**data["outputs"]["view"], "topic": f"{name}.view"},
                         "delta": {"topic": f"{name}.delta"}})
    pipeline_file = tmp_path / "pipeline.yaml"
    pipeline_file.write_text(yaml.safe_dump(data))
    pipeline_file.chmod(0o644)
    tmp_path.chmod(0o755)  # readable by the container's user
    pipeline = load_pipeline(pipeline_file)

    # Kafka client settings from a mounted secret file (the entrypoint's default path)
    kafka_config = tmp_path / "kafka.properties"
    kafka_config.write_text(f"security.protocol=PLAINTEXT\nclient.id={name}-engine\n")
    kafka_config.chmod(0o644)

    produce_file(bootstrap_servers, source, ROOT / "examples" / "match_scores.jsonl")
    port = _free_port()
    engine = Engine(podman, image, pipeline_file, bootstrap_servers, port, kafka_config)
    engines.append(engine)
    first_batch = engine.wait_for_batches(1, timeout=300)
    print(f"\nstart to first batch: {first_batch:.1f} s")
    processes = podman("exec", engine.name, "ps", "-eo", "args", timeout=60).stdout
    assert "--kafka-config /run/secrets/kafka.properties run /pipeline/pipeline.yaml" in processes, processes

    # the image's health check asks /metrics, which the host reaches on the host network
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert b"refold_" in response.read()
    health = podman("healthcheck", "run", engine.name, check=False, timeout=60)
    assert health.returncode == 0, health.stdout + health.stderr

    # more scores while it runs; stop it in mid-stream
    chunks = [tmp_path / f"scores-{i}.jsonl" for i in range(4)]
    for i, chunk in enumerate(chunks):
        chunk.write_bytes(b"\n".join(more_scores(150, seed=i)) + b"\n")
    for chunk in chunks[:2]:
        produce_file(bootstrap_servers, source, chunk)
        time.sleep(0.5)
    engine.wait_for_batches(2, timeout=120)
    code, stop_seconds = engine.stop()
    logs = engine.logs()
    assert code == 0, f"SIGTERM did not stop the engine cleanly (exit {code}):\n{engine.raw_logs()}"
    assert any("SIGTERM" in line.get("message", "") for line in logs), engine.raw_logs()
    assert all({"time", "level", "message"} <= line.keys() for line in logs)
    assert "Tini is not running as PID 1" not in engine.raw_logs()  # --init and the image's tini agree
    print(f"stopped on SIGTERM in {stop_seconds:.1f} s")

    # while it is down, more; started again, it resumes from Kafka and the output is exact
    produce_file(bootstrap_servers, source, chunks[2])
    before = engine.batches()
    engine.start()
    engine.wait_for_batches(before + 1, timeout=300)
    wait_until_exact(engine, pipeline, settings, events=6 + 150 * 3)
    code, _ = engine.stop()
    assert code == 0, engine.raw_logs()

    # the container has no volume: a new one, its Spark checkpoint gone, carries on from Kafka
    engine.remove()
    produce_file(bootstrap_servers, source, chunks[3])
    fresh = Engine(podman, image, pipeline_file, bootstrap_servers, _free_port(), kafka_config)
    engines.append(fresh)
    fresh.wait_for_batches(1, timeout=300)
    report = wait_until_exact(fresh, pipeline, settings, events=6 + 150 * 4)
    assert report.view_records > 0 and report.delta_records > 0
    assert report.dead_letters == 0
    code, _ = fresh.stop()
    assert code == 0, fresh.raw_logs()


def wait_until_exact(engine: Engine, pipeline: Any, settings: dict[str, Any], events: int) -> Any:
    """The view and delta topics against the reference over the input, until they match."""
    deadline = time.monotonic() + 180
    while True:
        report = verify(pipeline, settings)
        if report.ok and report.events == events:
            return report
        assert engine.state() == "running", engine.raw_logs()
        assert time.monotonic() < deadline, f"{report.events} events, {report.anomalies[:5]}"
        time.sleep(3)


def test_compose_runs_the_spark_services_from_the_engine_image(podman: Podman, image: str,
                                                               tmp_path: Path) -> None:
    """docker/compose.yaml's Spark master and worker with podman-compose, from the image built
    here. Its Kafka and PostgreSQL services use the official `apache/kafka` and `postgres`
    images, which cannot be pulled where no container registry is reachable; the engine
    service is the image the end-to-end test runs. The compose file is used as it is except
    for what would clash on a shared machine: no port published on the host (the master's
    UI would be on the fixed port 8080), and no build (the image is given)."""
    spec = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = {name: spec["services"][name] for name in ("spark-master", "spark-worker")}
    for service in services.values():
        service.pop("ports", None)
        service.pop("build", None)
        service["image"] = image
    compose_file = tmp_path / "compose.yaml"
    compose_file.write_text(yaml.safe_dump({"name": spec["name"], "services": services}))
    project = f"refoldct{uuid.uuid4().hex[:8]}"
    compose = [str(Path(sys.executable).parent / "podman-compose"), "-f", str(compose_file), "-p", project]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*compose, *args], env=podman.env, capture_output=True, text=True, timeout=180)

    try:
        done = run("up", "-d", "--no-build")
        assert done.returncode == 0, done.stderr[-3000:]
        worker, master = f"{project}_spark-worker_1", f"{project}_spark-master_1"
        ask = ("import json, urllib.request; state = json.load(urllib.request.urlopen("
               "'http://spark-master:8080/json/', timeout=3)); "
               "print(state['status'], sorted((w['host'], w['state']) for w in state['workers']))")
        deadline = time.monotonic() + 120
        while True:
            state = podman("exec", worker, "python", "-c", ask, check=False, timeout=60)
            if state.stdout.strip() == "ALIVE [('spark-worker', 'ALIVE')]":
                break
            assert time.monotonic() < deadline, state.stdout + state.stderr
            time.sleep(2)
        for name in (master, worker):  # the compose file's health checks
            health = podman("healthcheck", "run", name, check=False, timeout=60)
            assert health.returncode == 0, f"{name}: {health.stdout}{health.stderr}"
    finally:
        run("down", "-t", "10")
