"""`refold produce`: JSON lines in, changelog events out, transactionally.

Every line is one event with an `op` field. The whole input is checked first when
it is a file (so a bad line writes nothing at all); standard input is checked as it
streams, and a bad line aborts the open transaction. A `-C` and its `+C` always
land in the same transaction.
"""

from __future__ import annotations

import contextlib
import sys
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

import orjson
from confluent_kafka import KafkaException, Producer

from refold.codecs import JsonlCodec, codec_for
from refold.errors import InvalidEventError, RecordSource, UserError
from refold.kafka.io import TopicSpec, delivery_failures, ensure_topics, eprint, producer_config
from refold.model.changelog import ChangelogEvent, Op, PairingValidator, key_of
from refold.model.reasons import Reason


@dataclass(frozen=True, slots=True)
class ProduceResult:
    events: int
    transactions: int
    seconds: float


def key_bytes(key_columns: Sequence[str], key: tuple[Any, ...]) -> bytes:
    """The Kafka message key: a JSON object of the key columns, in their order."""
    return orjson.dumps(dict(zip(key_columns, key, strict=True)))


def parse_lines(lines: Iterable[bytes], key_columns: Sequence[str]) -> Iterator[tuple[int, ChangelogEvent, tuple[Any, ...]]]:
    """(line number, event, key) for each non-blank line; raises InvalidEventError naming the line."""
    pairing = PairingValidator()
    reader = JsonlCodec()
    number = 0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        source = RecordSource(line=number)
        event = reader.decode(raw, source)  # DecodeError / InvalidEventError naming the line
        try:
            key = key_of(event.row, key_columns)
        except (KeyError, ValueError) as exc:
            raise InvalidEventError(Reason.NULL_KEY, source, detail=str(exc).strip('"'), value=raw) from exc
        problem = pairing.feed(event.op, key)
        if problem:
            raise InvalidEventError(problem, source, value=raw)
        yield number, event, key
    problem = pairing.finish()
    if problem:
        raise InvalidEventError(problem, RecordSource(line=number))


def produce(
    settings: dict[str, Any],
    topic: str,
    lines: Iterable[bytes],
    key_columns: Sequence[str],
    *,
    fmt: str = "jsonl",
    schema: str | None = None,
    per_transaction: int = 10_000,
    prevalidate: bool = True,
    partitions: int = 3,
    progress: bool = True,
) -> ProduceResult:
    codec = codec_for(fmt, schema)
    if prevalidate:
        lines = list(lines)
        for _ in parse_lines(lines, key_columns):
            pass
    created = ensure_topics(settings, [TopicSpec(topic, partitions)])
    if created and progress:
        eprint(f"created topic {topic} ({partitions} partitions)")
    producer = Producer(
        producer_config(settings, **{"transactional.id": f"refold-produce-{uuid.uuid4()}"})
    )
    try:
        producer.init_transactions(30)
    except KafkaException as exc:
        raise UserError(f"cannot start a Kafka transaction: {exc.args[0].str()}") from exc
    errors, on_delivery = delivery_failures()
    started = time.monotonic()
    last_report = started
    events = transactions = in_txn = 0
    open_txn = False
    try:
        for _number, event, key in parse_lines(lines, key_columns):
            if not open_txn:
                producer.begin_transaction()
                open_txn = True
            value = codec.encode(event)
            # The record timestamp stays the producer's clock: event_time travels in the
            # value. (Old event times as record timestamps would let retention delete them.)
            while True:
                try:
                    producer.produce(topic, value, key_bytes(key_columns, key), on_delivery=on_delivery)
                    break
                except BufferError:
                    producer.poll(0.05)
            events += 1
            in_txn += 1
            # End transactions only between units: never between a -C and its +C.
            if in_txn >= per_transaction and event.op is not Op.CORRECT_FROM:
                _commit(producer, errors)
                transactions += 1
                open_txn = False
                in_txn = 0
            now = time.monotonic()
            if progress and now - last_report >= 2.0:
                last_report = now
                eprint(f"  {events:,} events written ({events / (now - started):,.0f}/s)")
        if open_txn:
            _commit(producer, errors)
            transactions += 1
            open_txn = False
    except BaseException:
        if open_txn:
            with contextlib.suppress(KafkaException):
                producer.abort_transaction(30)
        raise
    return ProduceResult(events, transactions, time.monotonic() - started)


def _commit(producer: Producer, errors: list[Any]) -> None:
    producer.flush(60)
    if errors:
        raise UserError(f"Kafka refused a record: {errors[0].str()}")
    producer.commit_transaction(60)


def read_input(path: str) -> tuple[Iterable[bytes], bool]:
    """The lines of FILE, or of standard input for '-'; and whether it is a file."""
    if path == "-":
        stream: IO[bytes] = sys.stdin.buffer
        return iter(stream), False
    try:
        with open(path, "rb") as handle:
            return handle.read().splitlines(), True
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from exc
