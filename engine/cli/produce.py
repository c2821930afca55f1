"""`refold produce`: JSON lines in, changelog events out, transactionally.

Every line is one event with an `op` field. The whole input is checked first when
it is a file (so a bad line writes nothing at all); standard input is checked as it
streams, and a bad line aborts the open transaction. A `-C` and its `+C` always
land in the same transaction.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

from refold.codecs import JsonlCodec, codec_for
from refold.errors import InvalidEventError, RecordSource, UserError
from refold.kafka.io import TopicSpec, ensure_topics, eprint
from refold.kafka.transactions import NotEnoughReplicas, TransactionalWriter, TransactionFailed
from refold.model.changelog import ChangelogEvent, Op, PairingValidator, key_of, message_key_bytes
from refold.model.reasons import Reason


@dataclass(frozen=True, slots=True)
class ProduceResult:
    events: int
    transactions: int
    seconds: float


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
        eprint(f"created topic {topic} ({partitions} partition{'s' if partitions != 1 else ''})")
    writer = TransactionalWriter(settings, f"refold-produce-{uuid.uuid4()}", timeout_ms=60_000)
    try:
        writer.initialise()
    except NotEnoughReplicas as exc:
        raise UserError(str(exc)) from exc
    started = time.monotonic()
    last_report = started
    events = transactions = in_txn = 0
    open_txn = False
    try:
        for _number, event, key in parse_lines(lines, key_columns):
            if not open_txn:
                writer.begin()
                open_txn = True
            # The record timestamp stays the producer's clock: event_time travels in the
            # value. (Old event times as record timestamps would let retention delete them.)
            writer.send(topic, message_key_bytes(key_columns, key), codec.encode(event))
            events += 1
            in_txn += 1
            # End transactions only between units: never between a -C and its +C.
            if in_txn >= per_transaction and event.op is not Op.CORRECT_FROM:
                open_txn = False
                _commit(writer)
                transactions += 1
                in_txn = 0
            now = time.monotonic()
            if progress and now - last_report >= 2.0:
                last_report = now
                eprint(f"  {events:,} events written ({events / (now - started):,.0f}/s)")
        if open_txn:
            open_txn = False
            _commit(writer)
            transactions += 1
    except BaseException:
        if open_txn:
            writer.abort()
        raise
    finally:
        writer.close()
    return ProduceResult(events, transactions, time.monotonic() - started)


def _commit(writer: TransactionalWriter) -> None:
    try:
        writer.commit()
    except NotEnoughReplicas as exc:  # the cluster lost its quorum: named, nothing of it visible
        raise UserError(str(exc)) from exc
    except TransactionFailed as exc:  # nothing to retry from: the user runs produce again
        raise UserError(f"Kafka refused the transaction: {exc}") from exc


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
