"""Ingest, correct and retract: read the topic's live rows, work out the changelog, write
it transactionally, exactly once per ingest.

The live rows come from `refold.ingest.store` (the topic's changelog folded, kept
between runs with a stamp). Who writes to a topic here: one transactional producer per topic, transactional id
`refold-ingest-<TOPIC>`. Its `init_transactions` fences every earlier ingest,
correction or retraction of the topic still running (and aborts its open
transaction) before this one reads the topic: so the live rows it diffs against
cannot change under it by another ingest (a plain `refold produce` is not fenced).

Exactly once per ingest. An ingest is identified by its `--name`, else by the
SHA-256 of its input bytes and the options that give them meaning. Every
transaction of an ingest carries, beside its changes, one record of the compacted
topic `TOPIC.ingests` (key: the identity) saying how far the ingest is
(`partial`, with the input rows done, or `done`). Changes and that record commit
together or not at all, so after a crash at any point:

- the same ingest again reads `TOPIC.ingests`: `done` → nothing is written, and it
  says so; `partial` → a `ledger`, `upsert` or `append` ingest skips the input rows
  already written and goes on from there, against the live rows they left; a
  `snapshot` is diffed again against the live rows, which already hold what the
  interrupted run committed, so the rest is exactly what is still missing;
- a transaction never splits a `-C` from its `+C`.

The same identity with other input bytes is refused.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import struct
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from refold import environment
from refold.codecs import JsonlCodec
from refold.errors import UserError
from refold.ingest import inputs, merge
from refold.ingest.live import FoldReport, LocalTable, Row, group_of
from refold.ingest.merge import Change
from refold.ingest.store import live_rows
from refold.kafka.io import TopicSpec, ensure_topics, partitions_of, read_to_end
from refold.kafka.transactions import TransactionalWriter, TransactionFailed
from refold.model.changelog import ChangelogEvent, Op, canonical_row

TRANSACTION_TIMEOUT_MS = 120_000


def ingests_topic(topic: str) -> str:
    """The compacted topic of a topic's ingest records."""
    return f"{topic}.ingests"


def transactional_id(topic: str) -> str:
    return f"refold-ingest-{topic}"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class IngestResult:
    """What an ingest did: its identity; `already` when it had committed before (nothing
    written); the changes written per op code; transactions; ledger conflicts; the
    topic's records the fold refused (as the engine refuses them)."""

    identity: str
    already: bool = False
    changes: Counter[str] = field(default_factory=Counter)
    transactions: int = 0
    conflicts: list[str] = field(default_factory=list)
    resumed_at: int | None = None
    fold: FoldReport | None = None
    seconds: float = 0.0

    @property
    def written(self) -> int:
        return sum(self.changes.values())


class _TopicWriter:
    """The topic's one transactional producer (see the module's docstring)."""

    def __init__(self, settings: Mapping[str, Any], topic: str) -> None:
        self.topic = topic
        self.codec = JsonlCodec()
        self.writer = TransactionalWriter(settings, transactional_id(topic), timeout_ms=TRANSACTION_TIMEOUT_MS,
                                          label=f"ingest into {topic!r}")
        self.writer.initialise()

    def write(self, changes: Iterable[Change], *, record: Any = None, record_key: bytes | None = None) -> None:
        """One transaction: the changes, then the ingest record (when given)."""

        def send() -> None:
            for change in changes:
                event = ChangelogEvent(change.op, change.row, change.event_time)
                self.writer.send(self.topic, change.group, self.codec.encode(event))

        self._transaction(send, record, record_key)

    def write_encoded(self, records: Sequence[tuple[bytes, bytes]], *, record: Any, record_key: bytes) -> None:
        """One transaction: records (message key, encoded event) as they are, then the
        ingest record."""
        self._transaction(lambda: self.writer.send_all(self.topic, records), record, record_key)

    def _transaction(self, send: Callable[[], object], record: Any, record_key: bytes | None) -> None:
        """One transaction: what `send` sends, then the ingest record (when given). A
        refusal is a UserError saying that nothing of it was written."""
        self.writer.begin()
        try:
            send()
            if record is not None:
                self.writer.send(ingests_topic(self.topic), record_key, orjson.dumps(record))
            self.writer.commit()
        except TransactionFailed as exc:
            raise UserError(f"Kafka refused the transaction into {self.topic!r}: {exc} "
                            "(nothing of it was written; run the same command again)") from exc
        except BaseException:
            self.writer.abort()
            raise

    def close(self) -> None:
        self.writer.close()


# A spooled change: op, the input rows done once it is written (-1: None), the lengths of
# its message key and of its encoded event; then the key and the event.
_SPOOLED = struct.Struct("<bqII")


def _ensure(settings: Mapping[str, Any], topic: str, partitions: int) -> None:
    ensure_topics(settings, [TopicSpec(topic, partitions), TopicSpec(ingests_topic(topic), 1, compacted=True)])


def _last_record(settings: Mapping[str, Any], topic: str, identity: str) -> dict[str, Any] | None:
    """The latest ingest record of `identity`, or None."""
    key = identity.encode()
    found = None
    for msg in read_to_end(settings, ingests_topic(topic)):
        if msg.key() == key:
            value = msg.value()
            found = None if value is None else orjson.loads(value)
    return found


def _tmp_root() -> Path:
    return environment.home() / "tmp"


def ingest(
    settings: Mapping[str, Any],
    topic: str,
    files: Sequence[str],
    *,
    merge_strategy: str,
    primary_key: Sequence[str] = (),
    compare_columns: Sequence[str] | None = None,
    event_time_column: str | None = None,
    deleted_column: str | None = None,
    fmt: str | None = None,
    name: str | None = None,
    partitions: int = 3,
    per_transaction: int = 10_000,
    now: int | None = None,
) -> IngestResult:
    """Ingest FILES (paths, folders, globs; `-` for standard input) into TOPIC under a
    merge strategy (`refold.ingest.merge`), exactly once per identity (`name`, else the
    input's content hash). Raises BadInput (nothing written) for input it cannot take."""
    started = time.monotonic()
    if merge_strategy not in merge.STRATEGIES:
        raise UserError(f"--merge must be one of {', '.join(merge.STRATEGIES)}, not {merge_strategy!r}")
    if merge_strategy in ("ledger", "upsert") and not primary_key:
        raise UserError(f"--merge {merge_strategy} needs --primary-key")
    if compare_columns and (merge_strategy != "snapshot" or not primary_key):
        raise UserError("--compare-columns goes with --merge snapshot and --primary-key")
    if deleted_column and merge_strategy != "upsert":
        raise UserError("--deleted-column goes with --merge upsert")
    if fmt is not None and fmt not in inputs.FORMATS:
        raise UserError(f"--format must be one of {', '.join(inputs.FORMATS)}")
    if per_transaction < 2:
        raise UserError("--per-transaction must be at least 2 (a correction is a pair)")
    now = _now_ms() if now is None else now
    stdin: Path | None = None
    try:
        if list(files) in ([], ["-"]):
            stdin = inputs.spool_stdin(_tmp_root())
            paths, names = [stdin], ["<stdin>"]
            if fmt is None:
                raise UserError("standard input needs --format csv|jsonl|parquet")
        else:
            paths = inputs.resolve(files)
            names = [str(p) for p in paths]
        options = [merge_strategy, list(primary_key), list(compare_columns or []), event_time_column,
                   deleted_column, fmt]
        content = inputs.content_hash(paths, *options)
        identity = name or f"sha256:{content}"
        _ensure(settings, topic, partitions)
        writer = _TopicWriter(settings, topic)  # fences every other ingest into the topic
        try:
            result = _ingest_fenced(settings, topic, writer, paths, names, identity, content,
                                    merge_strategy=merge_strategy, primary_key=primary_key,
                                    compare_columns=compare_columns, event_time_column=event_time_column,
                                    deleted_column=deleted_column, fmt=fmt, per_transaction=per_transaction,
                                    now=now)
        finally:
            writer.close()
    finally:
        if stdin is not None:
            with contextlib.suppress(OSError):
                os.unlink(stdin)
    result.seconds = time.monotonic() - started
    return result


def _ingest_fenced(settings: Mapping[str, Any], topic: str, writer: _TopicWriter, paths: list[Path],
                   names: list[str], identity: str, content: str, *, merge_strategy: str,
                   primary_key: Sequence[str], compare_columns: Sequence[str] | None,
                   event_time_column: str | None, deleted_column: str | None, fmt: str | None,
                   per_transaction: int, now: int) -> IngestResult:
    result = IngestResult(identity)
    previous = _last_record(settings, topic, identity)
    if previous is not None and previous.get("content_sha256") != content:
        state = "committed" if previous.get("status") == "done" else "begun"
        raise UserError(f"ingest {identity!r} into {topic!r} was {state} with other input "
                        f"(sha256 {previous.get('content_sha256')}); nothing written: give this input another --name")
    if previous is not None and previous.get("status") == "done":
        result.already = True
        result.changes.update(previous.get("changes", {}))
        return result
    skipped = 0
    if previous is not None and merge_strategy != "snapshot":
        skipped = int(previous.get("input_rows") or 0)
        result.resumed_at = skipped
    result.changes.update((previous or {}).get("changes", {}))
    with live_rows(settings, topic, primary_key) as (live, result.fold), LocalTable(_tmp_root()) as scratch, \
            tempfile.TemporaryFile(dir=_tmp_root()) as spool:
        rows: Iterator[merge.InputRow] = inputs.read_rows(
            paths, fmt, now=now, event_time_column=event_time_column, deleted_column=deleted_column,
            tombstones=merge_strategy == "upsert", names=names)
        rows = itertools.islice(rows, skipped, None)
        if merge_strategy == "snapshot":
            changes = merge.snapshot(live, rows, scratch, now=now, compare_columns=compare_columns)
        elif merge_strategy == "ledger":
            changes = merge.ledger(live, rows, scratch, result.conflicts, skipped=skipped)
        elif merge_strategy == "upsert":
            changes = merge.upsert(live, rows, scratch, skipped=skipped)
        else:
            changes = merge.append(primary_key, rows, skipped=skipped)
        # the whole input is read, checked and encoded before anything is written
        codec = JsonlCodec()
        encode, pack = codec.encode, _SPOOLED.pack
        for change in changes:
            value = encode(ChangelogEvent(change.op, change.row, change.event_time))
            after = -1 if change.after is None else change.after
            spool.write(pack(int(change.op), after, len(change.group), len(value)))
            spool.write(change.group)
            spool.write(value)
        spool.seek(0)
        record = {"ingest": identity, "content_sha256": content, "merge": merge_strategy,
                  "primary_key": list(primary_key), "status": "partial", "input_rows": skipped}
        batch: list[tuple[bytes, bytes]] = []
        ops: Counter[int] = Counter()
        size, unpack, read = _SPOOLED.size, _SPOOLED.unpack, spool.read
        correct_from = int(Op.CORRECT_FROM)
        while header := read(size):
            op, after, key_length, value_length = unpack(header)
            batch.append((read(key_length), read(value_length)))
            ops[op] += 1
            if after >= 0:
                record["input_rows"] = after
            if len(batch) >= per_transaction and op != correct_from:
                _commit(writer, batch, ops, record, result, identity, done=False)
                batch, ops = [], Counter()
        _commit(writer, batch, ops, record, result, identity, done=True)
    return result


def _commit(writer: _TopicWriter, batch: list[tuple[bytes, bytes]], ops: Counter[int], record: dict[str, Any],
            result: IngestResult, identity: str, *, done: bool) -> None:
    written = Counter({Op(op).code: n for op, n in ops.items()})
    total = result.changes + written
    body = {**record, "status": "done" if done else "partial", "changes": dict(total), "committed_at": _now_ms()}
    writer.write_encoded(batch, record=body, record_key=identity.encode())
    result.changes = total
    result.transactions += 1


# Corrections and retractions by key ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyedChange:
    """What `correct` or `retract` wrote: the old row and the new one (None: retracted)."""

    old: Row
    new: Row | None


class NoLiveRow(UserError):
    """The key has no live row in the topic: nothing to correct or retract."""


def _key_group(primary_key: Sequence[str], key: Mapping[str, Any]) -> bytes:
    if not primary_key:
        raise UserError("--primary-key needs at least one column")
    extra = sorted(set(key) - set(primary_key))
    missing = [c for c in primary_key if key.get(c) is None]
    if extra or missing:
        raise UserError(f"--key must give exactly the primary-key columns {list(primary_key)} "
                        f"(missing or null: {missing}, not in the primary key: {extra})")
    group = group_of(key, primary_key)
    assert group is not None
    return group


def _the_live_row(settings: Mapping[str, Any], topic: str, primary_key: Sequence[str],
                  group: bytes) -> Row:
    with live_rows(settings, topic, primary_key) as (live, _report):
        copies = live.copies(group)
    if not copies:
        raise NoLiveRow(f"{topic!r} has no live row for key {group.decode()}; nothing written")
    if len(copies) > 1:
        raise merge.TopicNotKeyed(f"{topic!r} has {len(copies)} live rows for key {group.decode()}: "
                                  "which one to change is ambiguous; nothing written")
    return copies[0]


def correct(settings: Mapping[str, Any], topic: str, primary_key: Sequence[str], key: Mapping[str, Any],
            changes: Mapping[str, Any], *, event_time: int | None = None) -> KeyedChange | None:
    """Set the columns `changes` in the live row of `key`: write `-C` with the exact old
    row and `+C` with the new one, in one transaction. None when the row already has
    those values (nothing written). Raises NoLiveRow when the key has no live row."""
    group = _key_group(primary_key, key)
    touched = sorted(set(changes) & set(primary_key))
    if touched:
        raise UserError(f"--set cannot change primary-key columns {touched} (retract the row and ingest the new one)")
    if not changes:
        raise UserError("--set needs at least one column")
    partitions_of(settings, topic)  # the topic must exist
    writer = _TopicWriter(settings, topic)
    try:
        old = _the_live_row(settings, topic, primary_key, group)
        new = {**old, **changes}
        if canonical_row(new) == canonical_row(old):
            return None
        stamp = _now_ms() if event_time is None else event_time
        writer.write([Change(Op.CORRECT_FROM, old, stamp, group), Change(Op.CORRECT_TO, new, stamp, group)])
    finally:
        writer.close()
    return KeyedChange(old, new)


def retract(settings: Mapping[str, Any], topic: str, primary_key: Sequence[str], key: Mapping[str, Any], *,
            event_time: int | None = None) -> KeyedChange:
    """Retract the live row of `key`: write `-R` with the exact old row. Raises NoLiveRow
    when the key has no live row."""
    group = _key_group(primary_key, key)
    partitions_of(settings, topic)
    writer = _TopicWriter(settings, topic)
    try:
        old = _the_live_row(settings, topic, primary_key, group)
        stamp = _now_ms() if event_time is None else event_time
        writer.write([Change(Op.RETRACT, old, stamp, group)])
    finally:
        writer.close()
    return KeyedChange(old, None)
