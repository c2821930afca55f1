"""`refold consume`: read a topic with read_committed and print JSON lines, `op` as its code."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Callable
from typing import IO, Any

import orjson
from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)

from refold.codecs import codec_for
from refold.errors import DecodeError, RecordError, RecordSource
from refold.kafka.io import READER_IGNORES, consumer_config, partitions_of
from refold.model.changelog import Op
from refold.model.reasons import Reason


def render(value: bytes | None, key: bytes | None, decode: Callable[[bytes, RecordSource], Any], source: RecordSource) -> bytes:
    """One output line for one record. JSON values keep their fields with `op` as its
    code; a tombstone prints its key with `"value": null`; undecodable values print
    as an error object with the record's position (never the payload)."""
    if value is None:
        key_json: Any = None
        if key is not None:
            try:
                key_json = orjson.loads(key)
            except orjson.JSONDecodeError:
                key_json = key.decode("utf-8", "replace")
        return orjson.dumps({"key": key_json, "value": None})
    try:
        record = decode(value, source)
    except RecordError as exc:
        return orjson.dumps({"error": exc.reason, "at": source.describe()})
    if isinstance(record, dict) and "op" in record:
        with contextlib.suppress(ValueError):
            record["op"] = Op.parse(record["op"]).code
    return orjson.dumps(record)


def consume(
    settings: dict[str, Any],
    topic: str,
    *,
    from_beginning: bool = False,
    until_idle: float | None = None,
    fmt: str = "jsonl",
    schema: str | None = None,
    out: IO[bytes] | None = None,
) -> int:
    """Print records until idle for `until_idle` seconds (forever when None). Returns the count."""
    out = out or sys.stdout.buffer
    if fmt == "jsonl":
        def decode(value: bytes, source: RecordSource) -> Any:
            try:
                return orjson.loads(value)
            except orjson.JSONDecodeError as exc:
                raise DecodeError(Reason.UNDECODABLE, source, detail=f"not JSON: {exc}", value=value) from exc
    else:
        codec = codec_for(fmt, schema)

        def decode(value: bytes, source: RecordSource) -> Any:
            return codec.decode(value, source).to_record()

    partitions = partitions_of(settings, topic)
    consumer = Consumer(consumer_config(settings, **{"enable.partition.eof": False}))
    start = OFFSET_BEGINNING if from_beginning else OFFSET_END
    consumer.assign([TopicPartition(topic, p, start) for p in partitions])
    stop = False

    def on_signal(_signum: int, _frame: Any) -> None:
        nonlocal stop
        stop = True

    previous = signal.signal(signal.SIGINT, on_signal)
    count = 0
    last_seen = time.monotonic()
    try:
        while not stop:
            batch = consumer.consume(num_messages=1000, timeout=0.2)
            if not batch:
                if until_idle is not None and time.monotonic() - last_seen >= until_idle:
                    break
                continue
            last_seen = time.monotonic()
            for msg in batch:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF or err.code() in READER_IGNORES:
                        continue
                    raise KafkaException(err)
                source = RecordSource(msg.topic(), msg.partition(), msg.offset())
                out.write(render(msg.value(), msg.key(), decode, source) + b"\n")
                count += 1
            out.flush()
    finally:
        signal.signal(signal.SIGINT, previous)
        consumer.close()
    return count
