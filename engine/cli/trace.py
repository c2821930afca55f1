"""`refold trace PIPELINE.yaml`: why a view row is what it is, and what an input event
changed, from the cause headers (docs/provenance.md).

- `--key '{…}'`: the view key's records in the view topic, oldest first, each with the
  input event its `refold.cause` names (fetched from the source topic: its op, row,
  offset) and the cause of the record a `-C`/`-R` takes back (`refold.retracts`).
- `--input TOPIC:PARTITION:OFFSET`: every view, delta and dead-letter record whose
  `refold.cause` is that event.

How it searches: through the trace index `P.trace` (refold.runtime.traceindex, read by
refold.cli.traceread) when the pipeline has one — `--key` fetches only the view records
the index names, `--input` reads only the view records of the batches that consumed the
event — and by a scan of the view topic's partitions for what the index does not cover
(a pipeline with no index, or a partition's records no index record names), bounded by
`--since`/`--until` (offsets, per partition), reading message keys and headers. The
delta and dead-letter topics, which several shards write, are read from the input
event's record timestamp on (less `CLOCK_SKEW_MS`). Each cause is one fetch from its
source topic (a join's causes name the topic: `<topic>:<partition>:<offset>`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import orjson
from confluent_kafka import Consumer, Message, TopicPartition

from refold.cli import traceread
from refold.config import Pipeline
from refold.errors import UserError
from refold.kafka.io import consumer_config, partitions_of, read_to_end
from refold.model import jsonbytes
from refold.plan import RIGHT_PARTITIONS, trace_topic
from refold.recovery.records import view_partitioning
from refold.runtime.render import CAUSE, RETRACTS
from refold.runtime.shards import exchanged

Note = Callable[[str], None]
# the delta and dead-letter records an event caused are written by the engine after it read
# the event, stamped with the engine's clock: read from the event's timestamp less this on
CLOCK_SKEW_MS = 5 * 60_000


def output_key_names(pipeline: Pipeline) -> list[str]:
    """The view output's key columns, in the order its message keys write them."""
    view = pipeline.view
    if view.join is not None and not view.key:  # (a join's rows; a grouped view over one: its key)
        return view.join.output_key
    if view.top_n is not None:
        return [*view.top_n.partition_by, "place"]
    return [*view.key, *(("window_start", "window_end") if view.window is not None else ())]


def view_message_key(pipeline: Pipeline, key: dict[str, Any]) -> bytes:
    """The message key of the view records of `key` (a JSON object of the key columns)."""
    names = output_key_names(pipeline)
    missing = [name for name in names if name not in key]
    extra = [name for name in key if name not in names]
    if missing or extra:
        raise UserError(f"--key names the view's key columns {names}: "
                        + (f"missing {missing}" if missing else f"not a key column: {extra}"))
    return jsonbytes.dumps({name: key[name] for name in names})


def parse_input(text: str) -> tuple[str, int, int]:
    """TOPIC:PARTITION:OFFSET (a topic may hold `:`: the last two fields are numbers)."""
    topic, _, rest = text.rpartition(":")
    topic, _, partition = topic.rpartition(":")
    try:
        return topic, int(partition), int(rest)
    except ValueError:
        raise UserError(f"--input {text!r}: write TOPIC:PARTITION:OFFSET") from None


def cause_place(header: bytes, source: str) -> tuple[str, int, int]:
    """A cause header's input event as (topic, partition, offset): `<partition>:<offset>`
    is an event of `source`, a join's `<topic>:<partition>:<offset>` names its topic."""
    head, _, offset = header.rpartition(b":")
    topic, _, partition = head.rpartition(b":")
    return (topic.decode() if topic else source), int(partition), int(offset)


def join_topics(pipeline: Pipeline) -> tuple[str, str] | None:
    """A join's source topics, left then right (None: not a join)."""
    join = pipeline.view.join
    return None if join is None else (pipeline.sources[join.left].topic, pipeline.sources[join.right].topic)


class Fetcher:
    """Single records of a source topic by (partition, offset), read_committed; those
    `prefetch` named first come from one pass (traceread.fetch_offsets)."""

    def __init__(self, settings: dict[str, Any], topic: str) -> None:
        self.topic = topic
        self.settings = settings
        self.consumer = Consumer(consumer_config(settings, **traceread.SMALL_FETCHES))
        self.consumer.list_topics(topic, timeout=30)  # its leaders first (a first poll that looks them up waits long)
        self.fetched: dict[tuple[int, int], Message] = {}

    def prefetch(self, places: list[tuple[int, int]]) -> None:
        """The records at these (partition, offset), read in one pass per partition."""
        wanted: dict[int, set[int]] = {}
        for partition, offset in places:
            wanted.setdefault(partition, set()).add(offset)
        for partition, offsets in sorted(wanted.items()):
            for msg in traceread.fetch_offsets(self.settings, self.topic, partition, sorted(offsets), consumer=self.consumer):
                self.fetched[(partition, msg.offset())] = msg

    def fetch(self, partition: int, offset: int, timeout: float = 30.0) -> Message | None:
        if (partition, offset) in self.fetched:
            return self.fetched[(partition, offset)]
        self.consumer.assign([TopicPartition(self.topic, partition, offset)])
        while True:
            msg = self.consumer.poll(timeout)
            if msg is None:
                return None
            if msg.error():
                return None  # (end of partition: the record is gone or not committed)
            at = msg.offset()
            if at is not None and at >= offset:
                return msg if at == offset else None

    def close(self) -> None:
        self.consumer.close()


class Causes:
    """The input events cause headers name, one `Fetcher` per source topic (a join's two)."""

    def __init__(self, settings: dict[str, Any], source: str) -> None:
        self.settings = settings
        self.source = source
        self.fetchers: dict[str, Fetcher] = {}

    def fetcher(self, topic: str) -> Fetcher:
        if topic not in self.fetchers:
            self.fetchers[topic] = Fetcher(self.settings, topic)
        return self.fetchers[topic]

    def prefetch(self, headers: list[bytes]) -> None:
        by_topic: dict[str, list[tuple[int, int]]] = {}
        for header in headers:
            topic, partition, offset = cause_place(header, self.source)
            by_topic.setdefault(topic, []).append((partition, offset))
        for topic, places in sorted(by_topic.items()):
            self.fetcher(topic).prefetch(places)

    def event(self, header: bytes | None) -> dict[str, Any] | None:
        if header is None:
            return None
        topic, partition, offset = cause_place(header, self.source)
        found: dict[str, Any] = {"topic": topic, "partition": partition, "offset": offset}
        msg = self.fetcher(topic).fetch(partition, offset)
        if msg is not None:
            found["op"], found["row"] = _op_row(msg.value())
            found["timestamp"] = msg.timestamp()[1]
        return found

    def close(self) -> None:
        for fetcher in self.fetchers.values():
            fetcher.close()


def _headers(msg: Message) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    for header in msg.headers() or []:
        name, value = header[0], header[1]
        if isinstance(value, bytes):
            found[name] = value
        elif isinstance(value, str):
            found[name] = value.encode()
    return found


def _scan(settings: dict[str, Any], topic: str, since: int | None, until: int | None,
          only: list[int] | None = None) -> Iterator[Message]:
    start = {p: since for p in partitions_of(settings, topic)} if since is not None else None
    for msg in read_to_end(settings, topic, start=start, only=only, timeout=traceread.SCAN_SECONDS):
        if until is None or msg.offset() < until:
            yield msg


def _op_row(value: bytes | None) -> tuple[str, Any]:
    """A record's op and row (an upsert form's tombstone: `-R` with no row)."""
    if value is None:
        return "-R", None
    try:
        row = orjson.loads(value)
    except orjson.JSONDecodeError:
        return "?", None
    if isinstance(row, dict):
        op = row.pop("op", "+A")
        return op if isinstance(op, str) else str(op), row
    return "?", row


def _record(kind: str, msg: Message, causes: Causes | None) -> dict[str, Any]:
    headers = _headers(msg)
    op, row = _op_row(msg.value())
    out: dict[str, Any] = {"output": kind, "topic": msg.topic(), "partition": msg.partition(), "offset": msg.offset(),
                           "op": op, "key": orjson.loads(key) if (key := msg.key()) else None, "row": row}
    if causes is not None:
        out["cause"] = causes.event(headers.get(CAUSE))
        if RETRACTS in headers:
            out["retracts"] = causes.event(headers[RETRACTS])
    else:
        out["cause"] = headers.get(CAUSE, b"").decode() or None
    return out


def _print(record: dict[str, Any], as_json: bool, out: TextIO) -> None:
    if as_json:
        out.write(orjson.dumps(record).decode() + "\n")
        return
    line = (f"{record['output']} {record['topic']}[{record['partition']}]@{record['offset']} {record['op']} "
            f"{orjson.dumps(record['row']).decode()}")
    cause = record.get("cause")
    if isinstance(cause, dict):
        line += f"\n    cause: {cause['topic']}[{cause['partition']}]@{cause['offset']}"
        if "op" in cause:
            line += f" {cause['op']} {orjson.dumps(cause['row']).decode()}"
    elif cause:
        line += f"\n    cause: {cause}"
    else:
        line += "\n    cause: unknown (no refold.cause header)"
    retracts = record.get("retracts")
    if isinstance(retracts, dict):
        line += f"\n    retracts the record caused by {retracts['topic']}[{retracts['partition']}]@{retracts['offset']}"
        if "op" in retracts:
            line += f" {retracts['op']} {orjson.dumps(retracts['row']).decode()}"
    out.write(line + "\n")


def _in_bounds(offset: int, since: int | None, until: int | None) -> bool:
    return (since is None or offset >= since) and (until is None or offset < until)


def _scan_unindexed(settings: dict[str, Any], topic: str, coverage: traceread.Coverage, since: int | None,
                    until: int | None, note: Note, only: list[int] | None = None) -> Iterator[Message]:
    """The records of `topic`'s partitions the index does not cover, within the bounds."""
    for partition, ranges in coverage.unindexed(partitions_of(settings, topic)).items():
        if only is not None and partition not in only:
            continue
        for lo, hi in ranges:
            start = max(lo, since or 0)
            end = hi if until is None else until if hi is None else min(hi, until)
            if end is not None and end <= start:
                continue
            msgs = read_to_end(settings, topic, start={partition: start}, only=[partition],
                               timeout=traceread.SCAN_SECONDS)
            for count, msg in enumerate(msgs):
                if end is not None and msg.offset() >= end:
                    break
                if count == 0:
                    note(f"{topic}[{partition}]: offsets {start}..{'' if end is None else end - 1} are not in "
                         f"the trace index: scanning them")
                yield msg


def trace_key(pipeline: Pipeline, settings: dict[str, Any], key: dict[str, Any], *, since: int | None = None,
              until: int | None = None, note: Note = lambda _: None) -> list[dict[str, Any]]:
    """The key's view records, oldest first, each with its cause (and retracted cause)."""
    if pipeline.outputs.view is None:
        raise UserError("the pipeline has no view output to trace")
    wanted = view_message_key(pipeline, key)
    topic = pipeline.outputs.view.topic
    causes = Causes(settings, pipeline.source.topic)
    try:
        coverage = traceread.key_offsets(settings, pipeline, wanted)
        if coverage is None:
            note(f"no trace index ({trace_topic(pipeline)}): scanning {topic}")
            msgs: list[Message] = list(_scan(settings, topic, since, until))
        else:
            msgs = list(_scan_unindexed(settings, topic, coverage, since, until, note))
            for partition, offsets in sorted(coverage.wanted.items()):
                inside = sorted(o for o in offsets if _in_bounds(o, since, until))
                msgs += traceread.fetch_offsets(settings, topic, partition, inside)
        found = [msg for msg in msgs if msg.key() == wanted]
        found.sort(key=lambda msg: (msg.partition(), msg.offset()))
        causes.prefetch([value for msg in found for name, value in _headers(msg).items() if name in (CAUSE, RETRACTS)])
        return [_record("view", msg, causes) for msg in found]
    finally:
        causes.close()


def _view_by_index(pipeline: Pipeline, settings: dict[str, Any], topic: str, partitions: list[int], offset: int,
                   since: int | None, until: int | None, only: list[int] | None, note: Note) -> list[Message] | None:
    """`--input`'s view records through the index (None: no index to go by); `partitions`:
    the event's partition as the index numbers it (a join's right source's `RIGHT_PARTITIONS + p`;
    a join of a topic with itself, both)."""
    found = traceread.input_ranges(settings, pipeline, partitions, offset)
    if found is None:
        note(f"no trace index ({trace_topic(pipeline)}) to go by: scanning {topic}")
        return None
    coverage, ranges = found
    msgs = list(_scan_unindexed(settings, topic, coverage, since, until, note, only))
    for view_partition, first, end in ranges:
        lo, hi = max(first, since or 0), end if until is None else min(end, until)
        msgs += traceread.fetch_range(settings, topic, view_partition, lo, hi)
    return msgs


def trace_input(pipeline: Pipeline, settings: dict[str, Any], topic: str, partition: int, offset: int, *,
                since: int | None = None, until: int | None = None, note: Note = lambda _: None) -> list[dict[str, Any]]:
    """Every view, delta and dead-letter record that input event caused."""
    topics = join_topics(pipeline)
    indexed_as = [partition]
    if topics is not None:
        if topic not in topics:
            raise UserError(f"--input names topic {topic!r}; the join's sources are {topics[0]!r} and {topics[1]!r}")
        cause = b"%s:%d:%d" % (topic.encode(), partition, offset)
        indexed_as = [p for side, p in enumerate((partition, RIGHT_PARTITIONS + partition)) if topics[side] == topic]
    elif topic != pipeline.source.topic:
        raise UserError(f"--input names topic {topic!r}; the pipeline's source is {pipeline.source.topic!r}")
    else:
        cause = b"%d:%d" % (partition, offset)
    written = _written_after(settings, topic, partition, offset, note)
    outputs = [("view", pipeline.outputs.view.topic if pipeline.outputs.view else None),
               ("delta", pipeline.outputs.delta.topic if pipeline.outputs.delta else None),
               ("dead letter", pipeline.dlq_topic)]
    found: list[dict[str, Any]] = []
    for kind, output in outputs:
        if output is None:
            continue
        only = None
        if kind == "view" and not exchanged(pipeline) and topics is None and view_partitioning(pipeline) == "shard":
            only = [partition]  # shard = source partition: its view records are in its partition
        try:
            indexed = None
            if kind == "view":
                indexed = _view_by_index(pipeline, settings, output, indexed_as, offset, since, until, only, note)
            if indexed is not None:
                msgs = indexed
            elif kind == "view":
                msgs = list(_scan(settings, output, since, until, only))
            elif written is None:
                msgs = list(_scan(settings, output, None, None))
            else:  # what the engine wrote since the event was written
                starts = traceread.written_since(settings, output, written - CLOCK_SKEW_MS)
                msgs = list(read_to_end(settings, output, start=starts, only=list(starts),
                                        timeout=traceread.SCAN_SECONDS)) if starts else []
        except Exception:  # a dead-letter topic that does not exist yet: nothing there
            if kind == "dead letter":
                continue
            raise
        found += [_record(kind, msg, None) for msg in msgs if _headers(msg).get(CAUSE) == cause]
    return found


def _written_after(settings: dict[str, Any], topic: str, partition: int, offset: int, note: Note) -> int | None:
    """The input event's record timestamp (ms), from which on the delta and dead-letter
    topics are read (None: the event is not there to say, and they are read whole)."""
    fetcher = Fetcher(settings, topic)
    try:
        msg = fetcher.fetch(partition, offset)
    finally:
        fetcher.close()
    kind, timestamp = msg.timestamp() if msg is not None else (0, -1)
    if msg is None or kind == 0 or timestamp < 0:
        note(f"{topic}[{partition}]@{offset} is not there (or has no timestamp): scanning the delta and "
             "dead-letter topics whole")
        return None
    return int(timestamp)


def run(pipeline: Pipeline, settings: dict[str, Any], *, key: str | None, input_: str | None, since: int | None,
        until: int | None, as_json: bool, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """`refold trace`: prints the records; 0 when some were found, 1 when none."""
    def note(text: str) -> None:
        err.write(f"refold trace: {text}\n")

    if (key is None) == (input_ is None):
        raise UserError("name one of --key '{...}' and --input TOPIC:PARTITION:OFFSET")
    if key is not None:
        try:
            parsed = orjson.loads(key)
        except orjson.JSONDecodeError as exc:
            raise UserError(f"--key {key!r}: not JSON ({exc})") from None
        if not isinstance(parsed, dict):
            raise UserError(f"--key {key!r}: write a JSON object of the view's key columns")
        records = trace_key(pipeline, settings, parsed, since=since, until=until, note=note)
    else:
        assert input_ is not None
        topic, partition, offset = parse_input(input_)
        records = trace_input(pipeline, settings, topic, partition, offset, since=since, until=until, note=note)
    for record in records:
        _print(record, as_json, out)
    return 0 if records else 1
