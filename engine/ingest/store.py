"""The live rows of a topic kept between ingests, stamped with how far they are valid.

As the engine's state shards keep `P.state` (`refold.state.store`), an ingest keeps
the folded live rows of a topic (per primary key) in RocksDB under
`<Refold home>/ingest/`, with a stamp beside them (`stamp.json`): the topic's id
and, per partition, the offset up to which the rows hold every record. The next
ingest, correction or retraction folds only the records after the stamp. The table
is a cache of the topic, never ahead of it:

- the stamp is removed before the table changes and written (atomically, after the
  table is flushed to disk) once the fold is done: a crash in between leaves no
  stamp, and the next run rebuilds from the topic;
- a stamp of another topic id (the topic was deleted and created again), or past a
  partition's end, or unreadable: the table is wiped and rebuilt from the topic;
- a second process that wants the same table while one holds it (its lock file, an
  flock the kernel drops even on kill -9) folds into a private temporary table.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, KafkaException, TopicCollection, TopicPartition

from refold import environment
from refold.ingest.live import FoldReport, LiveRows, LocalTable, fold_topic
from refold.kafka.io import admin_client, consumer_config, partitions_of

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def store_directory(settings: Mapping[str, Any], topic: str, key_columns: Sequence[str]) -> Path:
    """Where the live rows of `topic` grouped by `key_columns` are kept."""
    digest = hashlib.sha256(orjson.dumps([settings.get("bootstrap.servers"), topic, list(key_columns)]))
    return environment.home() / "ingest" / f"{_UNSAFE.sub('_', topic)[:100]}-{digest.hexdigest()[:16]}"


def _topic_id(settings: Mapping[str, Any], topic: str) -> str | None:
    """The topic's id, or None when the cluster does not say."""
    admin = admin_client(settings)  # alive until the answer: a destroyed client cancels it
    try:
        futures = admin.describe_topics(TopicCollection([topic]))
        description = futures[topic].result(timeout=30)
    except (KafkaException, KeyError, TimeoutError, ValueError):
        return None
    return str(description.topic_id) if getattr(description, "topic_id", None) is not None else None


def _high_watermarks(settings: Mapping[str, Any], topic: str) -> dict[int, int]:
    consumer = Consumer(consumer_config(settings))
    try:
        return {p: int(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1])
                for p in partitions_of(settings, topic)}
    finally:
        consumer.close()


def _start(settings: Mapping[str, Any], topic: str, directory: Path, topic_id: str | None) -> dict[int, int] | None:
    """Where to go on folding from, or None when the kept table cannot be used."""
    try:
        stamp = orjson.loads((directory / "stamp.json").read_bytes())
        ends = {int(p): int(o) for p, o in stamp["ends"].items()}
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return None
    if topic_id is None or stamp.get("topic_id") != topic_id:
        return None
    highs = _high_watermarks(settings, topic)
    if any(p not in highs or o > highs[p] for p, o in ends.items()):
        return None
    return ends


def _write_stamp(directory: Path, topic_id: str | None, report: FoldReport) -> None:
    ends = {**report.ends, **report.held}  # a held -C is read again, with its +C
    temporary = directory / "stamp.json.tmp"
    temporary.write_bytes(orjson.dumps({"topic_id": topic_id, "ends": {str(p): o for p, o in ends.items()}}))
    os.replace(temporary, directory / "stamp.json")


@contextlib.contextmanager
def live_rows(settings: Mapping[str, Any], topic: str, key_columns: Sequence[str]) -> Iterator[
        tuple[LiveRows, FoldReport]]:
    """The live rows of `topic` by `key_columns`, caught up to the topic's end, and the
    report of the records folded to get there (see the module's docstring)."""
    directory = store_directory(settings, topic, key_columns)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{directory.name}.lock", "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process has the table: a private one
            with LocalTable(environment.home() / "tmp") as private:
                live = LiveRows(key_columns, private)
                yield live, fold_topic(settings, topic, live)
            return
        topic_id = _topic_id(settings, topic)
        start = _start(settings, topic, directory, topic_id)
        if start is None:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            (directory / "stamp.json").unlink()  # invalid while the table changes
        table = LocalTable(directory=directory)
        try:
            live = LiveRows(key_columns, table)
            report = fold_topic(settings, topic, live, start=start)
            table.flush()
            _write_stamp(directory, topic_id, report)
            yield live, report
        finally:
            table.close()
