"""A secured broker: SASL_SSL + SCRAM-SHA-512 + ACLs, and Refold working through it.

The module starts its OWN local broker in secured mode (certificates made by
`refold.dev.tlsgen`, SCRAM users at format time, the StandardAuthorizer with
`allow.everyone.if.no.acl.found=false`), apart from the session's plaintext one.
Its users: `admin` (super user, makes topics and ACLs), `app` (produces and
consumes `sec-*` topics) and `engine` (runs pipelines under the ACLs of
docs/SECURITY.md, nothing more). Every command runs with `-v` (DEBUG logging) and
no password, key material or record payload may show in what it logs.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    NewTopic,
    ResourcePatternType,
    ResourceType,
)

from refold.cli.main import main as refold_main
from refold.cli.produce import produce
from refold.config import load_pipeline, parse_pipeline
from refold.dev import localkafka, localspark, tlsgen
from refold.errors import ConfigError, PrerequisiteError, UserError
from refold.kafka.connection import KafkaConnection, client_settings, load_properties
from refold.kafka.io import partitions_of
from refold.ops.verify import verify
from refold.recovery.restore import load_checkpoint
from refold.runtime.processor import BatchProcessor

REFOLD = [sys.executable, "-m", "refold.cli.main", "-v"]
MARK = "Zq9payload"  # in every record's key and value: must never reach a log
FAIL_FAST_SECONDS = 30


# The connection model and its translation to Java's client (no broker) --------------------------

SECRETS = {
    "sasl.password": "Sx1-sasl",
    "ssl.key.password": "Sx2-key",
    "ssl.keystore.password": "Sx3-store",
    "sasl.oauthbearer.client.secret": "Sx4-oauth",
    "ssl.key.pem": "Sx5-pem",
    "my.plugin.secret.token": "Sx6-other",
}
SCRAM = {
    "bootstrap.servers": "h:1",
    "security.protocol": "sasl_ssl",
    "sasl.mechanisms": "SCRAM-SHA-512",
    "sasl.username": "engine",
    "sasl.password": 'pa"ss\\word',
    "ssl.endpoint.identification.algorithm": "none",
    "linger.ms": 5,
}
SPEC = {"pipeline": "p", "source": {"topic": "s"}, "view": {"key": ["k"], "columns": {"n": {"count": "*"}}},
        "outputs": {"view": {"topic": "p.view"}}}  # fmt: skip


def test_secrets_never_show_in_repr_str_dump_or_errors() -> None:
    connection = KafkaConnection.of({"sasl.username": "u", "sasl.mechanism": "PLAIN", **SECRETS})
    shown = [repr(connection), str(connection), str(connection.model_dump()), connection.model_dump_json()]
    pipeline = parse_pipeline({**SPEC, "kafka": {**SECRETS}})
    shown += [repr(pipeline), str(pipeline.model_dump()), pipeline.model_dump_json()]
    for bad in ({"security.protocol": "nope"}, {"a.b": [1]}, {"sasl.password": ["Sx1-sasl"]},
                {"ssl.key.password": {"k": "Sx2-key"}}, {"sasl.mechanism": "PLAIN", "sasl.mechanisms": "GSSAPI"}):  # fmt: skip
        for parse in (KafkaConnection.of, lambda kafka: parse_pipeline({**SPEC, "kafka": kafka})):
            with pytest.raises(ConfigError) as caught:
                parse({**SECRETS, **bad})
            shown += [str(caught.value), str(caught.value.__cause__)]
    with pytest.raises(ConfigError) as caught:
        KafkaConnection.of({"ssl.key.location": "/k.pem", **SECRETS}).java()
    shown.append(str(caught.value))
    with pytest.raises(ConfigError) as caught:  # an error elsewhere in the file, the kafka block in its input
        parse_pipeline({**SPEC, "source": {"topic": "s", "format": "avro"}, "kafka": {**SECRETS}})
    shown += [str(caught.value), str(caught.value.__cause__)]
    for text in shown:
        assert not any(secret in text for secret in SECRETS.values()), text
    assert connection.librdkafka() == {"sasl.username": "u", "sasl.mechanism": "PLAIN", **SECRETS}


def test_librdkafka_rendering_passes_the_settings_through(monkeypatch: pytest.MonkeyPatch) -> None:
    secured = {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "app",
               "sasl.password": "pw", "ssl.ca.location": "/tls/ca.pem"}  # fmt: skip
    for settings in (SCRAM, secured, {**secured, "enable.idempotence": True, "ssl.key.password": "x"}):
        assert KafkaConnection.of(settings).librdkafka() == settings
    pipeline = parse_pipeline({**SPEC, "kafka": secured})
    monkeypatch.delenv("REFOLD_BOOTSTRAP_SERVERS", raising=False)
    assert pipeline.kafka_settings() == {**secured, "bootstrap.servers": "127.0.0.1:9092"}
    with_block = parse_pipeline({**SPEC, "kafka": {**secured, "bootstrap.servers": "b:1"}})
    assert with_block.kafka_settings()["bootstrap.servers"] == "b:1"
    monkeypatch.setenv("REFOLD_BOOTSTRAP_SERVERS", "e:1")
    assert with_block.kafka_settings()["bootstrap.servers"] == "e:1"
    assert with_block.kafka_settings("o:1") == {**secured, "bootstrap.servers": "o:1"}


def test_java_client_settings_translate_scram_over_tls(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    java = KafkaConnection.of({**SCRAM, "ssl.ca.location": str(ca)}).java()
    assert java == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.jaas.config": "org.apache.kafka.common.security.scram.ScramLoginModule required "
        'username="engine" password="pa\\"ss\\\\word";',
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(ca),
        "ssl.endpoint.identification.algorithm": "",
    }
    plain = KafkaConnection.of({"sasl.mechanism": "PLAIN", "sasl.username": "u", "sasl.password": "p"}).java()
    assert plain["sasl.jaas.config"].startswith("org.apache.kafka.common.security.plain.PlainLoginModule")
    assert KafkaConnection.of({"bootstrap.servers": "h:1"}).java() == {}
    keystore = {"ssl.keystore.location": "/ks.p12", "ssl.keystore.password": "kp", "ssl.ca.pem": "PEM"}
    assert KafkaConnection.of(keystore).java() == {
        "ssl.keystore.type": "PKCS12", "ssl.keystore.location": "/ks.p12", "ssl.keystore.password": "kp",
        "ssl.truststore.type": "PEM", "ssl.truststore.certificates": "PEM",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "where"),
    [
        ({"ssl.key.location": "/k.pem"}, "kafka.ssl.key.location"),
        ({"sasl.mechanism": "OAUTHBEARER", "sasl.username": "u"}, "kafka.sasl.mechanism"),
        ({"sasl.oauthbearer.config": "x"}, "kafka.sasl.oauthbearer.config"),
        ({"ssl.ca.location": "/"}, "kafka.ssl.ca.location"),
    ],
)
def test_java_client_settings_refuse_what_they_cannot_translate(settings: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError) as caught:
        KafkaConnection.of(settings).java()
    assert caught.value.where == where


def test_cli_client_settings_file_then_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "client.properties"
    path.write_text("# secured\nsecurity.protocol=SASL_SSL\nsasl.password = a=b:c\n\nbootstrap.servers: h:9093\n")
    assert load_properties(path) == {
        "security.protocol": "SASL_SSL",
        "sasl.password": "a=b:c",
        "bootstrap.servers": "h:9093",
    }
    merged = client_settings(str(path), ["sasl.username=app", "security.protocol=SSL"])
    assert merged["security.protocol"] == "SSL" and merged["sasl.username"] == "app"
    with pytest.raises(ConfigError):
        client_settings(None, ["no-equals-sign"])
    path.write_text("security.protocol=SSL\n# a comment\nno separator here\n")
    with pytest.raises(ConfigError) as caught:
        load_properties(path)
    assert caught.value.where == f"{path}:3"
    base = KafkaConnection.of({"sasl.mechanism": "PLAIN", "sasl.password": "old"})
    over = base.merged({"sasl.mechanisms": "SCRAM-SHA-256", "sasl.password": "new"})
    assert over.librdkafka() == {"sasl.mechanisms": "SCRAM-SHA-256", "sasl.password": "new"}
    path.write_text("sasl.mechanism=PLAIN\n")
    assert client_settings(str(path), ["sasl.mechanisms=SCRAM-SHA-256"]) == {"sasl.mechanisms": "SCRAM-SHA-256"}
    assert refold_main(["-X", "security.protocol=bogus", "-X", "sasl.password=Sx9", "consume", "t"]) == 2
    err = capsys.readouterr().err
    assert "-X: security.protocol: write one of PLAINTEXT" in err and "Sx9" not in err


# The secured broker ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SecureBroker:
    bootstrap: str
    security: localkafka.Security
    other_ca: Path  # a CA that did not sign the broker's certificate
    secrets: tuple[str, ...]  # what must never be logged

    def settings(self, user: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"bootstrap.servers": self.bootstrap, **self.security.client_settings(user), **extra}

    def admin(self) -> AdminClient:
        return AdminClient(self.settings())


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    root = tmp_path_factory.mktemp("secure")
    tls = tlsgen.generate(root / "tls")
    other = tlsgen.generate(root / "other-tls", ca_name="someone-else")
    passwords = {name: secrets.token_urlsafe(16) for name in ("admin", "app", "engine")}
    security = localkafka.Security(
        tls,
        admin_password=passwords["admin"],
        users={"app": passwords["app"], "engine": passwords["engine"]},
    )
    home = root / "home"
    try:
        info = localkafka.start(
            localkafka.free_port(), timeout=180.0, home=home, quiet=True, die_with_parent=True, security=security
        )
    except Exception as exc:  # a failure, never a skip
        pytest.fail(f"the secured broker did not start: {exc}", pytrace=False)
    key_lines = [
        line
        for path in (tls.key, root / "tls" / "ca.key")
        for line in path.read_text().splitlines()
        if line and not line.startswith("-----")
    ]
    try:
        yield SecureBroker(
            info.bootstrap,
            security,
            other.ca,
            (*passwords.values(), tls.keystore_password, *key_lines[:3], *key_lines[-3:]),
        )
    finally:
        localkafka.stop(home=home)


def allow(admin: AdminClient, user: str, *grants: tuple[ResourceType, str, ResourcePatternType, list[AclOperation]]) -> None:
    bindings = [
        AclBinding(kind, name, pattern, f"User:{user}", "*", operation, AclPermissionType.ALLOW)
        for kind, name, pattern, operations in grants
        for operation in operations
    ]
    for future in admin.create_acls(bindings, request_timeout=30).values():
        future.result()


@pytest.fixture(scope="module")
def app_acls(secure_broker: SecureBroker) -> None:
    """`app` produces and consumes `sec-*` topics (refold produce's transactional ids
    are `refold-produce-<uuid>`); reads are by assignment, no consumer group."""
    admin = secure_broker.admin()
    allow(
        admin,
        "app",
        (ResourceType.TOPIC, "sec-", ResourcePatternType.PREFIXED,
         [AclOperation.CREATE, AclOperation.WRITE, AclOperation.READ, AclOperation.DESCRIBE]),
        (ResourceType.TRANSACTIONAL_ID, "refold-produce-", ResourcePatternType.PREFIXED,
         [AclOperation.WRITE, AclOperation.DESCRIBE]),
    )  # fmt: skip


def run_cli(args: list[str], timeout: float = 120, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "REFOLD_BOOTSTRAP_SERVERS" and not k.startswith("REFOLD_TEST_")}
    return subprocess.run([*REFOLD, *args], input=stdin, capture_output=True, timeout=timeout, env=env, check=False)


def properties_file(path: Path, settings: dict[str, Any]) -> Path:
    path.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    path.chmod(0o600)
    return path


def assert_nothing_secret(broker: SecureBroker, *logs: bytes) -> None:
    for log in logs:
        text = log.decode(errors="replace")
        for secret in broker.secrets:
            assert secret not in text, "a password or key material reached the log"
        assert MARK not in text, "a record payload reached the log"


def events(n: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(n):
        rows.append({"op": "+A", "event_time": 1000 + i, "player_name": f"{MARK}-{i % 7}", "score": i})
        if i % 5 == 4:
            rows.append({"op": "-C", "event_time": 1000 + i, "player_name": f"{MARK}-{i % 7}", "score": i})
            rows.append({"op": "+C", "event_time": 1000 + i, "player_name": f"{MARK}-{i % 7}", "score": i + 1})
    return rows


# Produce / consume ---------------------------------------------------------------------------------


@pytest.mark.kafka
def test_produce_then_consume_over_sasl_ssl(secure_broker: SecureBroker, app_acls: None, tmp_path: Path) -> None:
    topic = f"sec-rt-{uuid.uuid4().hex[:8]}"
    config = properties_file(tmp_path / "app.properties", secure_broker.settings("app"))
    rows = events(20)
    data = tmp_path / "events.jsonl"
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    produced = run_cli(["--kafka-config", str(config), "produce", topic, str(data), "--key", "player_name"])
    assert produced.returncode == 0, produced.stderr.decode()[-3000:]
    assert f"wrote {len(rows)} events" in produced.stdout.decode()
    consumed = run_cli(
        ["--kafka-config", str(config), "consume", topic, "--from-beginning", "--until-idle", "3"]
    )
    assert consumed.returncode == 0, consumed.stderr.decode()[-3000:]
    got = [orjson.loads(line) for line in consumed.stdout.splitlines()]
    assert sorted(orjson.dumps(r) for r in got) == sorted(orjson.dumps(r) for r in rows)
    assert_nothing_secret(secure_broker, produced.stderr, produced.stdout, consumed.stderr)


# Wrong credentials, untrusted certificate: fail fast, say which -----------------------------------


def _bad_runs(secure_broker: SecureBroker, tmp_path: Path, bad: dict[str, Any], name: str) -> list[tuple[str, subprocess.CompletedProcess[bytes], float]]:
    config = properties_file(tmp_path / f"{name}.properties", secure_broker.settings("app", **bad))
    pipeline = tmp_path / f"{name}.yaml"
    pipeline.write_text(
        yaml.safe_dump(
            {
                "pipeline": f"bad{uuid.uuid4().hex[:8]}",
                "kafka": secure_broker.settings("engine", **bad),
                "source": {"topic": "sec-nothing"},
                "view": {"key": ["player_name"], "columns": {"total": {"sum": "score"}}},
                "outputs": {"view": {"topic": "sec-nothing.view"}},
                "spark": {"checkpoint_dir": str(tmp_path / "spark")},
            }
        )
    )
    data = tmp_path / "one.jsonl"
    data.write_bytes(orjson.dumps(events(1)[0]) + b"\n")
    commands = {
        "produce": ["--kafka-config", str(config), "produce", "sec-bad", str(data), "--key", "player_name"],
        "consume": ["--kafka-config", str(config), "consume", "sec-bad", "--until-idle", "1"],
        "run": ["run", str(pipeline), "--until-idle", "1"],
        "status": ["status", str(pipeline)],
    }

    def timed(args: list[str]) -> tuple[subprocess.CompletedProcess[bytes], float]:
        started = time.monotonic()
        done = run_cli(args, timeout=FAIL_FAST_SECONDS + 60)
        return done, time.monotonic() - started

    with ThreadPoolExecutor(len(commands)) as pool:
        futures = {name: pool.submit(timed, args) for name, args in commands.items()}
        return [(name, *future.result()) for name, future in futures.items()]


@pytest.mark.kafka
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("wrong_password", "refused the SASL login of user"),
        ("untrusted_ca", "TLS handshake with Kafka at"),
    ],
)
def test_wrong_password_or_untrusted_certificate_fails_fast(
    secure_broker: SecureBroker, tmp_path: Path, case: str, expected: str
) -> None:
    bad: dict[str, Any] = (
        {"sasl.password": "not-" + secrets.token_urlsafe(8)}
        if case == "wrong_password"
        else {"ssl.ca.location": str(secure_broker.other_ca)}
    )
    for name, done, seconds in _bad_runs(secure_broker, tmp_path, bad, case):
        err = done.stderr.decode(errors="replace")
        assert done.returncode == 2, f"{name}: exit {done.returncode}\n{err[-2000:]}"
        assert expected in err, f"{name}: {err[-2000:]}"
        assert seconds < FAIL_FAST_SECONDS, f"{name} took {seconds:.0f}s to fail"
        if case == "wrong_password":
            assert bad["sasl.password"] not in err
        assert_nothing_secret(secure_broker, done.stderr, done.stdout)


# The engine under ACLs that allow only its transactional-id prefix ------------------------------


def engine_acls(secure_broker: SecureBroker, pipeline: str, source: str, prefix: str) -> None:
    """What docs/SECURITY.md says the engine needs, and nothing more."""
    admin = secure_broker.admin()
    allow(
        admin,
        "engine",
        (ResourceType.TOPIC, source, ResourcePatternType.LITERAL, [AclOperation.READ, AclOperation.DESCRIBE]),
        (ResourceType.TOPIC, f"{pipeline}.", ResourcePatternType.PREFIXED,
         [AclOperation.CREATE, AclOperation.WRITE, AclOperation.READ, AclOperation.DESCRIBE]),
        (ResourceType.GROUP, f"refold.{pipeline}", ResourcePatternType.LITERAL, [AclOperation.READ]),
        (ResourceType.TRANSACTIONAL_ID, prefix, ResourcePatternType.PREFIXED,
         [AclOperation.WRITE, AclOperation.DESCRIBE]),
    )  # fmt: skip


def engine_pipeline(secure_broker: SecureBroker, tmp_path: Path, source: str, prefix: str) -> dict[str, Any]:
    name = f"sec{uuid.uuid4().hex[:8]}"
    return {
        "pipeline": name,
        "kafka": secure_broker.settings("engine"),
        "source": {"topic": source},
        "view": {"key": ["player_name"], "columns": {"total": {"sum": "score"}, "best": {"max": "score"}}},
        "outputs": {"view": {"topic": f"{name}.view"}, "delta": {"topic": f"{name}.delta"}},
        "transactional_id_prefix": prefix,
        "trigger": "200ms",
        "spark": {"checkpoint_dir": str(tmp_path / "spark" / name)},
    }


@pytest.fixture
def engine_source(secure_broker: SecureBroker, app_acls: None) -> tuple[str, int]:
    source = f"sec-src-{uuid.uuid4().hex[:8]}"
    admin = secure_broker.admin()  # kept alive until the future is done
    admin.create_topics([NewTopic(source, 2, 1)])[source].result(30)
    rows = events(60)
    produce(secure_broker.settings("app"), source, [orjson.dumps(r) for r in rows], ["player_name"],
            progress=False, per_transaction=25)  # fmt: skip
    return source, len(rows)


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[localspark.ClusterInfo]:
    """A standalone cluster (master + 2 workers of 1 core) of this module's own, started
    only when a test asks for it."""
    home = tmp_path_factory.mktemp("secure-spark")
    info = localspark.start(2, 1, "1g", home=home, quiet=True, die_with_parent=True)
    try:
        yield info
    finally:
        localspark.stop(home)


def spark_logs(cluster: localspark.ClusterInfo) -> list[Path]:
    """Every log of the cluster: the master's, the workers', and each executor's
    stdout and stderr (<home>/spark/work/worker-<i>/<app>/<executor>/)."""
    daemons = sorted(cluster.home.glob("*.log"))
    executors = sorted(p for p in (cluster.home / "work").glob("worker-*/*/*/std*") if p.is_file())
    return [*daemons, *executors]


@pytest.mark.kafka
@pytest.mark.spark
# "cluster" is marked slow (`make test-slow`, which CI runs after `make test`): its own
# standalone cluster to start, for what faster tests prove in `make test` — "local" here
# (the engine under the ACLs, nothing secret in what it logs at DEBUG), the shard task
# Spark ships to the executors never showing its settings
# (`test_tasks.test_a_shard_task_never_shows_its_settings`), and pipelines whose tasks
# run on a cluster's executors (`test_cluster`).
@pytest.mark.parametrize("master", ["local", pytest.param("cluster", marks=pytest.mark.slow)])
def test_engine_runs_under_acls_with_its_transactional_id_prefix(
    secure_broker: SecureBroker, engine_source: tuple[str, int], tmp_path: Path, master: str,
    request: pytest.FixtureRequest,
) -> None:
    # "cluster": the shards' tasks run on a standalone cluster's executors, which get the
    # credentials inside the tasks (and the Kafka source's options): none of them may
    # reach the workers' or the executors' logs.
    source, count = engine_source
    prefix = f"team-a.{uuid.uuid4().hex[:6]}"
    spec = engine_pipeline(secure_broker, tmp_path, source, prefix)
    cluster: localspark.ClusterInfo | None = None
    if master == "cluster":
        cluster = request.getfixturevalue("spark_cluster")
        spec["spark"].update(master=cluster.url, conf={
            "spark.executor.cores": "1", "spark.executor.memory": "512m", "spark.cores.max": "2"})
    engine_acls(secure_broker, spec["pipeline"], source, prefix)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    done = run_cli(["run", str(path), "--until-idle", "3"], timeout=300)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:]
    pipeline = load_pipeline(path)
    assert pipeline.transactional_id(0) == f"{prefix}-0-0"
    report = verify(pipeline, secure_broker.settings())
    assert report.anomalies == [], "\n".join(report.anomalies)
    assert report.events == count and report.view_records > 0
    checkpoint = load_checkpoint(pipeline, secure_broker.settings("engine"))
    assert checkpoint is not None and checkpoint.records_in == count
    status = run_cli(["status", str(path)])
    assert status.returncode == 0, status.stderr.decode()[-2000:]
    assert "total lag 0" in status.stdout.decode()
    assert_nothing_secret(secure_broker, done.stderr, done.stdout, status.stderr, status.stdout)
    if cluster is not None:
        logs = spark_logs(cluster)
        ran = [p for p in logs if "Running task" in p.read_text(errors="replace")]
        assert ran, [str(p) for p in logs]  # the tasks did run on the cluster's executors
        for log in logs:
            try:
                assert_nothing_secret(secure_broker, log.read_bytes())
            except AssertionError as exc:
                raise AssertionError(f"{log}: {exc}") from None


@pytest.mark.kafka
def test_engine_without_the_transactional_id_acl_stops_with_a_clear_message(
    secure_broker: SecureBroker, engine_source: tuple[str, int], tmp_path: Path
) -> None:
    source, _count = engine_source
    spec = engine_pipeline(secure_broker, tmp_path, source, "allowed")
    engine_acls(secure_broker, spec["pipeline"], source, "allowed")
    # Every ACL but the one for this prefix: the engine's processor (what `refold run`
    # builds before its first batch) must refuse to start, naming the id and the ACL.
    pipeline = parse_pipeline({**spec, "transactional_id_prefix": "not-allowed"})
    try:
        BatchProcessor(pipeline, pipeline.kafka_settings(secure_broker.bootstrap))
    except UserError as exc:  # not pytest.raises: its traceback would keep the clients alive
        message = str(exc)
    else:
        pytest.fail("the engine started without the ACL on its transactional id")
    assert "not-allowed-0" in message
    assert "TRANSACTIONAL_ID_AUTHORIZATION_FAILED" in message and "TransactionalId" in message
    assert_nothing_secret(secure_broker, message.encode())


@pytest.mark.kafka
def test_a_topic_without_acls_is_named_as_not_authorized(secure_broker: SecureBroker, app_acls: None) -> None:
    with pytest.raises(PrerequisiteError, match="not authorized to describe topic 'private-topic' as user 'app'"):
        partitions_of(secure_broker.settings("app"), "private-topic")
