"""The transactional writer: the one owner of a transactional Kafka producer.

As Kafka Streams' `StreamsProducer`, `TransactionalWriter` begins, sends, sends the
consumed offsets, commits and aborts, and turns every outcome of the client into
one of four:

- **committed**: `commit()` returns; every record sent since `begin()` is visible to
  read_committed readers, and so are the consumed offsets.
- **fenced**: `FencedError` (a `UserError`: the engine stops with exit code 2).
  Another producer took the transactional id within the transaction's timeout;
  this writer is dead and must not be initialised again (that would fence the
  new owner in turn).
- **timed out**: `TransactionTimedOut`, a `TransactionFailed`: a client call did not
  return within its deadline, or the coordinator aborted a transaction that
  outlived `transaction.timeout.ms`.
- **failed**: `TransactionFailed` (an `OperationalError`): the transaction did not
  commit, or whether it did is unknown (a `commit_transaction` that timed out may
  still complete). Call `initialise()`, which settles it (a new producer's
  `init_transactions` aborts it or waits for its commit), then re-read from Kafka
  whatever was derived from it, and run it again if it is not there.

It knows producer settings, a transactional id, a timeout and the records it is
given; nothing of batches, views, checkpoints or pipelines. Every librdkafka and
confluent-kafka workaround lives here, and nowhere else (docs/ENGINE.md, "The
transactional writer", has their stories).

Not thread-safe: one thread drives a writer.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from refold import environment
from refold.errors import InternalError, OperationalError, UserError
from refold.kafka.deadline import bounded, brokers_of, gone_from
from refold.kafka.io import consumer_config, delivery_failures, producer_config

log = logging.getLogger(__name__)

Headers = Sequence[tuple[str, bytes]]

# Seconds each client call may take.
_INIT_SECONDS = 60
_FLUSH_SECONDS = 120
_COMMIT_SECONDS = 120
_ABORT_SECONDS = 60
_SEND_OFFSETS_MARGIN = 5.0  # its own timeout is this much shorter than its deadline: librdkafka#5456
_FATAL_CAUSE_SECONDS = 5
_CLOSE_FLUSH_SECONDS = 5

_FENCED_CODES = frozenset({KafkaError._FENCED, KafkaError.PRODUCER_FENCED})


class FencedError(UserError):
    """Another producer took over this transactional id: this one stops for good."""


class TransactionFailed(OperationalError):
    """A transaction did not commit, or whether it did is unknown: `initialise()` the
    writer again (which settles it), re-read from Kafka what was derived from it, and
    run it again if it is not there."""


class TransactionTimedOut(TransactionFailed):
    """A client call outlived its deadline, or the transaction outlived
    `transaction.timeout.ms` and the coordinator aborted it."""


class NotEnoughReplicas(TransactionFailed):
    """The cluster could not take the transaction's writes within the producer's retry
    budget: fewer in-sync replicas than `min.insync.replicas` (NOT_ENOUGH_REPLICAS,
    NOT_ENOUGH_REPLICAS_AFTER_APPEND), or no leader that answered in time (a cluster
    that lost its quorum). The message names the topic-partitions. Raised only when the
    transaction surely did not commit (it never began, records of it were refused, or
    the client made it abortable): it was aborted, or the coordinator aborts it at its
    timeout when the abort itself fails; nothing of it is visible. A commit that timed
    out may still land and stays a TransactionFailed."""


# Errors of a cluster that cannot take a write, or did not in time: a delivery report
# with one of them, or a transaction call failing with one, is a NotEnoughReplicas.
_UNAVAILABLE_CODES = frozenset({
    KafkaError.NOT_ENOUGH_REPLICAS,
    KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
    KafkaError._MSG_TIMED_OUT,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError._TIMED_OUT,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.NOT_COORDINATOR,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
})
_REPLICA_CODES = frozenset({KafkaError.NOT_ENOUGH_REPLICAS, KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND})


class TransactionalWriter:
    """One transactional id's producer, and every outcome of it as committed, fenced,
    timed out or failed (see the module's docstring).

    The lifecycle: `initialise()` once, then per transaction `begin()`, `send()`*,
    `commit()`; after a `TransactionFailed`, `initialise()` again; `close()` at the end.
    `label` names the owner in messages (e.g. "pipeline 'scores'").
    """

    def __init__(
        self,
        settings: Mapping[str, Any],
        transactional_id: str,
        *,
        timeout_ms: int,
        consumer_group: str | None = None,
        label: str | None = None,
    ) -> None:
        self.transactional_id = transactional_id
        self.timeout_ms = timeout_ms
        self.label = label
        self._conf = producer_config(
            settings,
            # A transactional.id makes the producer idempotent, and idempotence means
            # acks=all: librdkafka refuses `enable.idempotence=false` or `acks` other than
            # `all` beside it (tests/test_kafka_cluster.py checks both refusals).
            **{
                "transactional.id": transactional_id,
                "transaction.timeout.ms": timeout_ms,
                # a Python callback per failed record only, not per record (docs/ENGINE.md)
                "delivery.report.only.error": True,
            },
        )
        self._group_conf = (
            consumer_config(settings, **{"group.id": consumer_group}) if consumer_group is not None else None
        )
        self._group: Consumer | None = None  # only for the group metadata send_offsets needs
        self._producer: Producer | None = None
        self._wedged: list[Producer] = []  # stuck in a call that ignored its timeout: never destroyed
        self._errors: list[KafkaError] = []
        self._failed_at: dict[tuple[str, int], KafkaError] = {}  # topic-partitions of failed deliveries
        self._on_delivery: Callable[..., None] | None = None
        self._began = 0.0  # monotonic time of begin()
        self._brokers: set[int] = set()  # the brokers the cluster listed when the producer began

    @property
    def closed(self) -> bool:
        """No producer: never initialised, closed, or fenced."""
        return self._producer is None

    # Lifecycle -----------------------------------------------------------------------

    def initialise(self) -> None:
        """Start, or start again after a failed transaction: a new producer whose
        `init_transactions` fences every older producer of this transactional id (a
        zombie, or this writer's own stuck one) and aborts their open transaction, so a
        read_committed reader sees the topics settled when it returns.

        Raises UserError naming the id when Kafka refuses it (an ACL, an unreachable broker).
        """
        self._drop_producer()
        producer = Producer(self._conf)
        try:
            producer.init_transactions(_INIT_SECONDS)
        except KafkaException as exc:
            err = _kafka_error(exc)
            if err is not None and err.code() in _UNAVAILABLE_CODES:
                partition = transaction_state_partition(self.transactional_id, producer)
                raise NotEnoughReplicas(_unavailable_message(
                    [f"__transaction_state[{partition}]" if partition is not None else "__transaction_state"],
                    err, f"the transaction coordinator of {self.transactional_id!r} could not start it",
                )) from exc
            raise UserError(
                f"cannot initialise transactions as {self.transactional_id!r}: {describe_kafka_error(exc)}"
            ) from exc
        self._producer = producer
        self._brokers = brokers_of(producer) or set()

    def close(self) -> None:
        """Flush what is still queued (briefly) and let go of the clients."""
        self._drop_producer()
        if self._group is not None:
            self._group.close()
            self._group = None

    def _drop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None and producer not in self._wedged:
            with contextlib.suppress(KafkaException):
                producer.flush(_CLOSE_FLUSH_SECONDS)

    # The transaction -----------------------------------------------------------------

    def begin(self) -> None:
        """Open a transaction. Raises FencedError or TransactionFailed."""
        producer = self._ready()
        self._errors, collect = delivery_failures()
        failed_at = self._failed_at = {}

        def on_delivery(err: KafkaError | None, msg: Any) -> None:
            if err is not None:
                failed_at.setdefault((msg.topic(), msg.partition()), err)
            collect(err, msg)

        self._on_delivery = on_delivery
        self._began = time.monotonic()
        try:
            producer.begin_transaction()
        except (KafkaException, SystemError) as exc:
            self._fail(exc)

    def send(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None = None,
        partition: int | None = None,
    ) -> None:
        """Queue one record in the open transaction (waiting while the client's queue is
        full), to `partition` when given, else where the key's hash puts it. A record the
        broker refuses shows at `commit()`. Raises FencedError or TransactionFailed when
        the client already knows the transaction is lost."""
        producer = self._ready()
        kafka_headers: list[tuple[str, str | bytes | None]] | None = None if headers is None else list(headers)
        where = -1 if partition is None else partition  # -1: the partitioner's choice
        while True:
            try:
                producer.produce(topic, value, key, where, on_delivery=self._on_delivery, headers=kafka_headers)
                return
            except BufferError:
                producer.poll(0.05)
            except (KafkaException, SystemError) as exc:
                self._fail(exc)

    def send_all(self, topic: str, records: Iterable[tuple[bytes | None, bytes | None]],
                 partition: int | None = None) -> None:
        """`send` for many records of one topic, without headers, in their order: one
        loop with the client's call bound, for the engine's outputs (`send`'s own
        checks per record cost about as much as the client's call)."""
        producer = self._ready()
        produce, on_delivery = producer.produce, self._on_delivery
        where = -1 if partition is None else partition
        try:
            for key, value in records:
                while True:
                    try:
                        produce(topic, value, key, where, on_delivery)
                        break
                    except BufferError:
                        producer.poll(0.05)
        except (KafkaException, SystemError) as exc:
            self._fail(exc)

    def send_all_headed(self, topic: str, records: Iterable[tuple[bytes | None, bytes | None, Headers | None]],
                        partition: int | None = None) -> None:
        """`send_all` of records with their headers (None: none)."""
        producer = self._ready()
        produce, on_delivery = producer.produce, self._on_delivery
        where = -1 if partition is None else partition
        try:
            for key, value, headers in records:
                while True:
                    try:
                        produce(topic, value, key, where, on_delivery, headers=headers)  # type: ignore[arg-type]
                        break
                    except BufferError:
                        producer.poll(0.05)
        except (KafkaException, SystemError) as exc:
            self._fail(exc)

    def flush(self) -> None:
        """Wait until every record sent so far in the open transaction is acknowledged
        (by every in-sync replica: the producer is idempotent, acks=all); the transaction
        stays open. Raises as `commit()` does when the cluster refused a record."""
        producer = self._ready()
        try:
            producer.flush(_FLUSH_SECONDS)
            if self._errors:
                self._refused_deliveries()
        except (KafkaException, SystemError) as exc:
            self._fail(exc)

    def commit(self, consumed: Mapping[str, Mapping[int, int]] | None = None) -> None:
        """Commit the open transaction, with `consumed` (topic → partition → next offset)
        as the consumer group's offsets. Returns once committed; raises FencedError,
        TransactionTimedOut or TransactionFailed (see the module's docstring)."""
        producer = self._ready()
        try:
            producer.flush(_FLUSH_SECONDS)
            if self._errors:
                self._refused_deliveries()
            positions = [
                TopicPartition(topic, partition, offset)
                for topic, offsets in sorted((consumed or {}).items())
                for partition, offset in sorted(offsets.items())
            ]
            if positions:
                metadata = self._group_metadata()
                deadline = environment.send_offsets_seconds()
                own = max(1.0, deadline - _SEND_OFFSETS_MARGIN)
                self._bounded(
                    "send_offsets_to_transaction",
                    deadline,
                    lambda: producer.send_offsets_to_transaction(positions, metadata, own),
                    gone=gone_from(producer, self._brokers),  # librdkafka#5511: see refold.kafka.deadline
                )
            producer.commit_transaction(_COMMIT_SECONDS)
        except (KafkaException, SystemError) as exc:
            self._fail(exc)

    def _refused_deliveries(self) -> NoReturn:
        """The transaction's records the cluster did not take: abort it and raise
        NotEnoughReplicas naming their topic-partitions when the cluster could not take a
        write, else the first error as any client error."""
        first = self._errors[0]
        unavailable = {tp: err for tp, err in self._failed_at.items() if err.code() in _UNAVAILABLE_CODES}
        if first.code() not in _UNAVAILABLE_CODES or not unavailable:
            raise KafkaException(first)
        self._abort()
        names = [f"{topic}[{partition}]" for topic, partition in sorted(unavailable)]
        worst = next((err for err in unavailable.values() if err.code() in _REPLICA_CODES), first)
        raise NotEnoughReplicas(_unavailable_message(names, worst, "the transaction's records were not taken"))

    def _ready(self) -> Producer:
        producer = self._producer
        if producer is None:
            raise InternalError(
                f"the writer of transactional id {self.transactional_id!r} is not initialised (or was fenced)"
            )
        return producer

    def _group_metadata(self) -> Any:
        if self._group_conf is None:
            raise InternalError("consumed offsets given to a writer without a consumer group")
        if self._group is None:
            self._group = Consumer(self._group_conf)
        return self._group.consumer_group_metadata()

    # The client's outcomes -----------------------------------------------------------

    def _bounded(self, what: str, seconds: float, call: Callable[[], None],
                 gone: Callable[[], str | None] | None = None) -> None:
        """Run a client call that may ignore its own timeout under a deadline (given up
        sooner when `gone()` says a broker it may wait on left: `refold.kafka.deadline`).
        Past it, TransactionTimedOut; the stuck producer stays referenced (never destroyed
        under the thread still waiting in it) until a new one's `init_transactions` fences
        it. An exception of the call is raised here as it came."""
        reason = bounded(seconds, call, gone)
        if reason is not None:
            if self._producer is not None:
                self._wedged.append(self._producer)
            raise TransactionTimedOut(f"{what} {reason}")

    def _fail(self, exc: KafkaException | SystemError) -> NoReturn:
        """Raise the outcome of a client error: FencedError, TransactionTimedOut or
        TransactionFailed (after aborting the transaction when the client asks for it)."""
        if isinstance(exc, SystemError):
            # A fatal error (a fence while records are in flight) is raised inside flush()
            # while the client goes on calling the failed records' delivery callbacks, so
            # flush() ends in a SystemError caused by it (confluent-kafka-python#865).
            if not isinstance(exc.__cause__, KafkaException):
                raise exc
            kafka_exc: KafkaException = exc.__cause__
            # The client keeps the exception raised in its delivery callback, and its
            # traceback's frames hold the client: a cycle through C that no garbage
            # collection breaks, so a producer let go (fenced, or replaced after this
            # failure) would live on. Their frames go.
            for link in (exc, kafka_exc, exc.__context__):
                if link is not None:
                    link.__traceback__ = None
        else:
            kafka_exc = exc
        err = _kafka_error(kafka_exc)
        if err is not None and err.code() == KafkaError._FATAL:
            err = self._fatal_cause(err)
        fenced = err is not None and err.code() in _FENCED_CODES
        # The coordinator aborts a transaction that outlives transaction.timeout.ms by
        # bumping the epoch, which the client reports as a fence: only a fence inside the
        # timeout is another producer taking over.
        if fenced and (time.monotonic() - self._began) * 1000 < self.timeout_ms:
            self._producer = None  # fenced for good: nothing of it to flush or abort
            owner = f"another instance of {self.label}" if self.label else "another producer"
            raise FencedError(
                f"fenced: {owner} took over transactional id {self.transactional_id!r}; this one stops"
            ) from exc
        if err is not None and err.txn_requires_abort():
            self._abort()
            # Only an abortable error is sure not to have committed: a commit that timed
            # out may still land, and stays a TransactionFailed (outcome unknown).
            if not fenced and err.code() in _UNAVAILABLE_CODES:
                raise NotEnoughReplicas(_unavailable_message(
                    [f"{topic}[{partition}]" for topic, partition in sorted(self._failed_at)]
                    or [f"the partitions of transactional id {self.transactional_id!r}"], err,
                    "the transaction could not commit in time",
                )) from exc
        failure = TransactionTimedOut if fenced else TransactionFailed
        raise failure(describe_kafka_error(kafka_exc)) from exc

    def abort(self) -> None:
        """Abort the open transaction (nothing of it becomes visible); a failure to abort
        is logged, and the next `initialise()` settles it."""
        self._abort()

    def _abort(self) -> None:
        producer = self._producer
        if producer is None:
            return
        try:
            producer.abort_transaction(_ABORT_SECONDS)
        except KafkaException as abort_exc:
            log.warning("abort failed too: %s", describe_kafka_error(abort_exc))

    def _fatal_cause(self, err: KafkaError) -> KafkaError:
        """Why the producer is in a fatal state: `produce()` says only `_FATAL` (a zombie
        fenced while it sends), the transactional API names the cause."""
        if self._producer is not None:
            try:
                self._producer.abort_transaction(_FATAL_CAUSE_SECONDS)
            except KafkaException as exc:
                cause = _kafka_error(exc)
                if cause is not None:
                    return cause
        return err


def _unavailable_message(where: Sequence[str], err: KafkaError, what: str) -> str:
    shown = ", ".join(where[:8]) + (f" and {len(where) - 8} more" if len(where) > 8 else "")
    return (
        f"the Kafka cluster cannot take writes to {shown}: {what} ({err.name()}: {err.str()}). "
        "Fewer of their replicas are in sync than min.insync.replicas (or none of their leaders "
        "answered in time: brokers down, a cluster without its controller quorum); the "
        "transaction was aborted (or never began) and nothing of it is visible. Bring the brokers back and run again."
    )


def java_string_hash(text: str) -> int:
    """Java's String.hashCode (UTF-16 code units, 32-bit wrap-around)."""
    value = 0
    data = text.encode("utf-16-be")
    for index in range(0, len(data), 2):
        value = (31 * value + int.from_bytes(data[index:index + 2], "big")) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def transaction_state_partition(transactional_id: str, client: Any) -> int | None:
    """The `__transaction_state` partition of a transactional id, as the broker maps it
    (`Utils.abs(id.hashCode) % partitions`), or None when the client cannot say how many
    partitions that topic has."""
    try:
        metadata = client.list_topics("__transaction_state", timeout=3)
        count = len(metadata.topics["__transaction_state"].partitions)
    except (KafkaException, KeyError):
        return None
    if not count:
        return None
    code = java_string_hash(transactional_id)
    return (0 if code == -(1 << 31) else abs(code)) % count


def _kafka_error(exc: BaseException) -> KafkaError | None:
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return None


def describe_kafka_error(exc: BaseException) -> str:
    """A client error for a message: its name, its kind, its text, and for a refused
    authorization the ACL a transactional writer needs."""
    err = _kafka_error(exc)
    if err is not None:
        kind = "fatal" if err.fatal() else ("retriable" if err.retriable() else "error")
        hint = _ACL_HINTS.get(err.code(), "")
        return f"{err.name()} ({kind}): {err.str()}{hint}"
    return str(exc)


_ACL_HINTS = {
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: (
        " (the user needs WRITE and DESCRIBE on the TransactionalId: a PREFIXED ACL on the "
        "pipeline's transactional_id_prefix; see docs/SECURITY.md)"
    ),
    KafkaError.GROUP_AUTHORIZATION_FAILED: (
        " (the user needs READ on the consumer group refold.<pipeline>; see docs/SECURITY.md)"
    ),
    KafkaError.TOPIC_AUTHORIZATION_FAILED: " (the user needs ACLs on the topic; see docs/SECURITY.md)",
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: (
        " (brokers older than Kafka 3.0 want IDEMPOTENT_WRITE on the cluster for "
        "idempotent and transactional writes)"
    ),
}
