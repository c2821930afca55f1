"""Kafka client helpers: client settings, topics, reading a topic to its end.

Dotted-key librdkafka dicts live here and in `refold.kafka.transactions` (the transactional
writer), at the client boundary, and nowhere else.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, OffsetSpec

from refold.errors import KafkaAuthError, PrerequisiteError, UserError

# Settings that only make sense for one kind of client; stripped from the others.
_PRODUCER_ONLY = ("transactional.id", "linger.ms", "acks", "enable.idempotence", "partitioner")
_CONSUMER_ONLY = ("group.id", "isolation.level", "auto.offset.reset", "enable.auto.commit")

MAX_MESSAGE_BYTES = 8 * 1024 * 1024

# A reader that stops at the end: a fetch at the end (a partition whose last record is
# followed by its transaction's marker) must not wait the broker's 500 ms default for
# data that is not coming
_TO_THE_END = {"fetch.wait.max.ms": 10}
# `consume` waits this long for a full batch: at a partition's tail every call waits it
# whole, so it is short (it was 0.5 s, and each new shard processor's checkpoint read paid it)
_READ_WAIT_SECONDS = 0.01
# Errors a consumer that only assigns partitions (never joins nor commits) may ignore.
# librdkafka needs a group.id and looks up its coordinator even then; under ACLs the
# reader may have no right on that group, and it needs none to fetch.
READER_IGNORES = frozenset({KafkaError.GROUP_AUTHORIZATION_FAILED})


class LibrdkafkaLog:
    """librdkafka's own log lines as DEBUG records of the logger `refold.kafka.librdkafka`
    (the clients' `logger` setting), never printed by the client: its retries ("Connect to
    ipv4#… failed", "Coordinator load in progress: retrying") are routine, and what fails
    for good reaches Refold as an error of the call. `refold -v` shows them. Stateless, so a
    client configuration that holds it can be pickled."""

    __slots__ = ()

    def log(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        _librdkafka.debug(msg, *args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (LibrdkafkaLog, ())


_librdkafka = logging.getLogger("refold.kafka.librdkafka")


def _base(settings: Mapping[str, Any], drop: tuple[str, ...]) -> dict[str, Any]:
    conf = {k: v for k, v in settings.items() if k not in drop}
    conf.setdefault("logger", LibrdkafkaLog())
    # Connect to the brokers as the client starts. With librdkafka's sparse connections a
    # new client's first request often waits for a broker connection on a timer: ~50 ms
    # for metadata and watermarks, 500 ms for a transactional producer's InitProducerId
    # (every new shard processor made several such clients); 1-4 ms without.
    conf.setdefault("enable.sparse.connections", False)
    return conf


# librdkafka reports a refused login or a failed TLS handshake only through error_cb
# and keeps retrying; `list_topics` turns them into a KafkaAuthError at once.
_AUTH_CODES = frozenset({KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED})
_TLS_CODES = frozenset({KafkaError._SSL})


class _AuthWatch:
    """An error_cb that keeps the first authentication or TLS error. (Not a bound
    method of the client: that would make a cycle that keeps the client alive.)"""

    __slots__ = ("error",)

    def __init__(self) -> None:
        self.error: KafkaError | None = None

    def __call__(self, err: KafkaError) -> None:
        if self.error is None and err.code() in _AUTH_CODES | _TLS_CODES:
            self.error = err


class _Admin(AdminClient):
    """An AdminClient that remembers the first authentication or TLS error it met."""

    def __init__(self, conf: dict[str, Any]) -> None:
        self.watch = _AuthWatch()
        # For messages: where and who, never a password.
        self.who: dict[str, Any] = {
            k: conf[k]
            for k in ("bootstrap.servers", "sasl.username", "sasl.mechanism", "sasl.mechanisms")
            if k in conf
        }
        conf.setdefault("error_cb", self.watch)
        super().__init__(conf)


def admin_client(settings: Mapping[str, Any]) -> AdminClient:
    return _Admin(_base(settings, _PRODUCER_ONLY + _CONSUMER_ONLY))


def auth_failure(settings: Mapping[str, Any], err: KafkaError) -> KafkaAuthError:
    """A clear error for a refused login or an untrusted certificate (no secrets in it)."""
    where = settings.get("bootstrap.servers")
    if err.code() in _TLS_CODES:
        return KafkaAuthError(f"TLS handshake with Kafka at {where} failed: {err.str()} (check ssl.ca.location: "
                              "it must hold the CA that signed the broker's certificate)", kafka_error=err)
    user = settings.get("sasl.username")
    mechanism = settings.get("sasl.mechanism") or settings.get("sasl.mechanisms") or "GSSAPI"
    return KafkaAuthError(
        f"Kafka at {where} refused the SASL login of user {user!r} ({mechanism}): {err.str()} "
        "(check sasl.username and sasl.password)",
        kafka_error=err,
    )


def consumer_config(settings: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    conf = _base(settings, _PRODUCER_ONLY)
    conf.setdefault("group.id", "refold-reader")
    conf.setdefault("isolation.level", "read_committed")
    conf.setdefault("enable.auto.commit", False)
    conf.setdefault("enable.partition.eof", True)
    conf.setdefault("auto.offset.reset", "earliest")
    conf.update(extra)
    return conf


def producer_config(settings: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    conf = _base(settings, _CONSUMER_ONLY)
    conf.setdefault("partitioner", "murmur2_random")  # the Java client's partitioning
    conf.setdefault("linger.ms", 5)
    conf.setdefault("message.max.bytes", MAX_MESSAGE_BYTES)
    conf.update(extra)
    return conf


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int = 1
    compacted: bool = False
    config: Mapping[str, str] = field(default_factory=dict)


def ensure_topics(
    settings: Mapping[str, Any],
    specs: list[TopicSpec],
    timeout: float = 30.0,
    *,
    replication_factor: int | None = None,
) -> list[str]:
    """Create the topics that do not exist yet; return the names created. Each gets
    `replication_factor` replicas, by default min(3, the cluster's brokers): one on a
    single broker, three on a production cluster (`replication_for`)."""
    admin = admin_client(settings)
    metadata = list_topics(admin, timeout)
    existing = set(metadata.topics)
    missing = [s for s in specs if s.name not in existing]
    if not missing:
        return []
    replicas = replication_factor or replication_for(len(metadata.brokers))
    new = []
    for spec in missing:
        config = {"max.message.bytes": str(MAX_MESSAGE_BYTES)}
        if spec.compacted:
            config["cleanup.policy"] = "compact"
        config.update(spec.config)
        new.append(NewTopic(spec.name, num_partitions=spec.partitions, replication_factor=replicas, config=config))
    futures = admin.create_topics(new, operation_timeout=timeout, request_timeout=timeout)
    created = []
    for name, future in futures.items():
        try:
            future.result()
            created.append(name)
        except KafkaException as exc:
            code = exc.args[0].code()
            if code == KafkaError.INVALID_REPLICATION_FACTOR:
                raise PrerequisiteError(
                    f"cannot create topic {name!r} with {replicas} replicas on a cluster of "
                    f"{len(metadata.brokers)} brokers: {exc.args[0].str()} (lower replication_factor)"
                ) from exc
            if code != KafkaError.TOPIC_ALREADY_EXISTS:
                raise PrerequisiteError(f"cannot create topic {name!r}: {exc.args[0].str()}") from exc
    _wait_for_topics(admin, [s.name for s in missing], timeout)
    return created


def replication_for(brokers: int) -> int:
    """The replication factor of a topic Refold creates on a cluster of `brokers`."""
    return max(1, min(3, brokers))


def durability_warnings(settings: Mapping[str, Any], topics: list[str], timeout: float = 30.0) -> list[str]:
    """What makes exactly-once weaker than the cluster allows, one sentence each: on a
    cluster of several brokers, topics (of `topics`, and `__transaction_state`) with one
    replica, whose loss loses committed records, or with an effective
    `min.insync.replicas` of 1, where acks=all means one copy. Empty on one broker."""
    admin = admin_client(settings)
    settle = time.monotonic() + min(timeout, 5.0)  # a broker may learn of a new topic a moment late
    while True:
        metadata = list_topics(admin, timeout)
        present = [name for name in topics if name in metadata.topics and metadata.topics[name].partitions]
        if len(present) == len(set(topics)) or time.monotonic() > settle:
            break
        time.sleep(0.2)
    brokers = len(metadata.brokers)
    if brokers < 2:
        return []
    warnings = []
    single = [
        name for name in [*present, "__transaction_state"]
        if name in metadata.topics
        and any(len(p.replicas) < 2 for p in metadata.topics[name].partitions.values())
    ]  # fmt: skip
    if single:
        warnings.append(
            f"topics with a partition of one replica on a cluster of {brokers} brokers: "
            f"{', '.join(single)} (a broker's loss loses their committed records; "
            "Refold creates its topics with min(3, brokers) replicas)"
        )
    weak = []
    for name in present:
        entry = _topic_setting(admin, name, "min.insync.replicas", timeout)
        replicas = max(len(p.replicas) for p in metadata.topics[name].partitions.values())
        if entry == "1" and replicas > 1:
            weak.append(name)
    if weak:
        warnings.append(
            f"topics with min.insync.replicas 1 on a cluster of {brokers} brokers: {', '.join(sorted(weak))} "
            "(acks=all is then satisfied by the leader alone, and a leader's loss may lose a committed "
            "transaction; set min.insync.replicas 2 on the brokers or the topics)"
        )
    return warnings


def _topic_setting(admin: AdminClient, topic: str, key: str, timeout: float) -> str | None:
    """A topic's effective setting (its own, else the broker's default); None when it
    may not be described (ACLs). A broker that has not yet seen a new topic says it
    does not exist: asked again for a few seconds."""
    deadline = time.monotonic() + min(timeout, 10.0)
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    while True:
        try:
            entry = admin.describe_configs([resource], request_timeout=timeout)[resource].result().get(key)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART or time.monotonic() > deadline:
                return None
            time.sleep(0.2)
            continue
        return None if entry is None else str(entry.value)


def _wait_for_topics(admin: AdminClient, names: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        metadata = list_topics(admin, timeout)
        ready = all(n in metadata.topics and metadata.topics[n].error is None
                    and all(p.leader >= 0 for p in metadata.topics[n].partitions.values()) for n in names)
        if ready or time.monotonic() > deadline:
            return
        time.sleep(0.1)


def list_topics(admin: AdminClient | Consumer | Producer, timeout: float = 30.0) -> Any:
    """Cluster metadata. Every command asks for it first, so a refused login or an
    untrusted certificate ends the command here, within seconds (KafkaAuthError)."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            return admin.list_topics(timeout=max(min(remaining, 2.0), 0.1))
        except KafkaException as exc:
            if isinstance(admin, _Admin):
                admin.poll(0)  # serves error_cb
                if admin.watch.error is not None:
                    raise auth_failure(admin.who, admin.watch.error) from exc
            if remaining <= 2.0:
                raise PrerequisiteError(
                    f"cannot reach Kafka: {exc.args[0].str()} "
                    "(is the broker running? `refold kafka start`, or set --bootstrap-servers)"
                ) from exc


def partitions_of(settings: Mapping[str, Any], topic: str, timeout: float = 30.0) -> list[int]:
    """The partition ids of a topic. Raises UserError when the topic does not exist (on a
    cluster, still after 5 s: a broker learns of a topic another just created a moment late)."""
    admin = admin_client({**settings, "allow.auto.create.topics": False})
    settle = time.monotonic() + 5.0
    while True:
        metadata = list_topics(admin, timeout)
        found = metadata.topics.get(topic)
        if found is None:
            # Under ACLs the full listing leaves out topics we may not describe; asked by
            # name, the broker says so (and never whether the topic exists).
            with contextlib.suppress(KafkaException):
                found = admin.list_topics(topic, timeout=min(timeout, 10.0)).topics.get(topic)
        if (found is not None and found.error is None) or len(metadata.brokers) < 2 or time.monotonic() > settle:
            break
        time.sleep(0.2)
    if found is not None and found.error is not None and found.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
        raise PrerequisiteError(
            f"not authorized to describe topic {topic!r} as user {settings.get('sasl.username')!r} "
            "(it needs ACLs on the topic: see docs/SECURITY.md)"
        )
    if found is None or found.error is not None:
        raise UserError(f"topic {topic!r} does not exist on {settings.get('bootstrap.servers')}")
    return sorted(found.partitions)


def read_to_end(
    settings: Mapping[str, Any],
    topic: str,
    *,
    timeout: float = 120.0,
    start: Mapping[int, int] | None = None,
    only: Collection[int] | None = None,
) -> Iterator[Message]:
    """Every committed record of `topic` (of the partitions `only`, when given) from the
    beginning (or `start` offsets) to its current end (the last stable offset:
    read_committed), in offset order within each partition. Partitions interleave
    (wherever a fetch ends): a reader that needs one partition's records together must
    group them by `msg.partition()`.
    """
    partitions = partitions_of(settings, topic)
    if only is not None:
        partitions = [p for p in partitions if p in only]
    consumer = Consumer(consumer_config(settings, **_TO_THE_END))
    try:
        assignment = [
            TopicPartition(topic, p, (start or {}).get(p, OFFSET_BEGINNING)) for p in partitions
        ]
        # the topic's leaders first: a new consumer's first watermark query that had to
        # look them up itself sometimes took 0.5-0.7 s on a busy broker
        consumer.list_topics(topic, timeout=timeout)
        ends = {tp.partition: _high_watermark(consumer, tp, timeout) for tp in assignment}
        remaining = {
            tp.partition
            for tp in assignment
            if ends[tp.partition] > max(tp.offset if tp.offset >= 0 else 0, 0)
        }
        if not remaining:
            return
        consumer.assign(assignment)
        deadline = time.monotonic() + timeout
        while remaining:
            if time.monotonic() > deadline:
                raise PrerequisiteError(
                    f"reading {topic!r} to its end took over {timeout:.0f}s "
                    f"(partitions still open: {sorted(remaining)}; an open transaction?)"
                )
            batch = consumer.consume(num_messages=10_000, timeout=_READ_WAIT_SECONDS)
            for msg in batch:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        remaining.discard(msg.partition())
                        continue
                    if err.code() in READER_IGNORES:
                        continue
                    raise KafkaException(err)
                yield msg
                partition, offset = msg.partition(), msg.offset()
                if partition is not None and offset is not None and offset + 1 >= ends[partition]:
                    remaining.discard(partition)
            if remaining:
                # Aborted records and transaction markers at the tail (a transactional
                # topic's last record is followed by its commit marker): the position
                # moves past them, with the batch that had the last record or after it.
                for tp in consumer.position([TopicPartition(topic, p) for p in list(remaining)]):
                    if tp.offset >= ends[tp.partition]:
                        remaining.discard(tp.partition)
    finally:
        consumer.close()


def next_visible_offsets(
    settings: Mapping[str, Any], topic: str, starts: Mapping[int, int], timeout: float = 30.0
) -> dict[int, int]:
    """Per partition, where a read_committed reader starting at `starts[p]` gets its first
    record: that record's offset, or the partition's end when only transaction markers and
    aborted records follow. (So `next_visible_offsets(...)[p] >= o` means no committed
    record lies in `[starts[p], o)`.)"""
    if not starts:
        return {}
    consumer = Consumer(consumer_config(settings, **_TO_THE_END))
    found: dict[int, int] = {}
    try:
        consumer.assign([TopicPartition(topic, p, o) for p, o in starts.items()])
        deadline = time.monotonic() + timeout
        while len(found) < len(starts):
            if time.monotonic() > deadline:
                raise PrerequisiteError(f"reading {topic!r} partitions {sorted(set(starts) - set(found))} "
                                        f"took over {timeout:.0f}s (an open transaction?)")
            for msg in consumer.consume(num_messages=len(starts), timeout=0.5):
                partition, err = msg.partition(), msg.error()
                if partition is None or partition in found:
                    continue
                if err is None:
                    found[partition] = int(msg.offset() or 0)
                    consumer.pause([TopicPartition(topic, partition)])
                elif err.code() == KafkaError._PARTITION_EOF:
                    # at the end the position has moved past the markers
                    (tp,) = consumer.position([TopicPartition(topic, partition)])
                    found[partition] = max(tp.offset, starts[partition])
                    consumer.pause([TopicPartition(topic, partition)])
                elif err.code() not in READER_IGNORES:
                    raise KafkaException(err)
    finally:
        consumer.close()
    return found


def _high_watermark(consumer: Consumer, tp: TopicPartition, timeout: float) -> int:
    """The high watermark, retrying while a new topic's leader is elected, or while the
    client drops a lost broker of a cluster (the next try asks another)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _low, high = consumer.get_watermark_offsets(tp, timeout=timeout)
            return int(high)
        except KafkaException as exc:
            err = exc.args[0]
            electing = isinstance(err, KafkaError) and (err.retriable() or err.code() in _LEADER_MOVING)
            if not electing or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# librdkafka does not mark these retriable, but on a just-created topic they only mean
# its leader is not settled yet (seen on a busy broker: NOT_LEADER_FOR_PARTITION).
_LEADER_MOVING = frozenset({
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._DESTROY_BROKER, KafkaError._TRANSPORT,  # (a lost broker of a cluster)
})


def open_transactions(settings: Mapping[str, Any], topics: Sequence[str], timeout: float = 90.0) -> list[str]:
    """Partitions whose last stable offset stays below the high watermark (a hanging
    transaction) for `timeout` seconds; waits for the others to settle.

    A committed transaction's markers are written after `commit_transaction` returns,
    so a `read_committed` reader right after a commit (another process's, or a test's)
    may not see it yet: wait here first. (A new producer's `init_transactions` waits
    for its predecessor's markers, so the engine's own recovery needs no wait.)"""
    admin = admin_client(settings)
    hanging: list[str] = []
    for topic in topics:
        for partition in partitions_of(settings, topic):
            tp = TopicPartition(topic, partition)
            deadline = time.monotonic() + timeout
            while True:
                high = _latest(admin, tp, IsolationLevel.READ_UNCOMMITTED)
                stable = _latest(admin, tp, IsolationLevel.READ_COMMITTED)
                if stable >= high:
                    break
                if time.monotonic() > deadline:
                    hanging.append(f"{topic}[{partition}]: last stable offset {stable} < high watermark {high}")
                    break
                time.sleep(0.2)
    return hanging


def _latest(admin: Any, tp: TopicPartition, isolation: IsolationLevel) -> int:
    futures = admin.list_offsets({tp: OffsetSpec.latest()}, isolation_level=isolation, request_timeout=30)
    return int(futures[tp].result().offset)


def delivery_failures() -> tuple[list[KafkaError], Any]:
    """A delivery callback that collects errors, with the list it fills."""
    errors: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            errors.append(err)

    return errors, on_delivery


def eprint(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)
