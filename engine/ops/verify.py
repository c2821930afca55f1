"""Checks a pipeline's committed outputs against the reference reducer.

Like Kafka's EosTestDriver: read the input and every output with
read_committed, recompute the expected view changelog with the pure-Python
reference, and list every anomaly (a missing, extra, duplicated or different
record), and the Delta Lake and Iceberg tables the pipeline materializes into
the same way. Used by the tests, `make chaos` and the benchmarks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from refold.codecs import source_decoder
from refold.codecs.base import BadRecord
from refold.codecs.upsert import upsert_decoder
from refold.config import Pipeline
from refold.errors import RecordError
from refold.kafka.io import partitions_of, read_to_end
from refold.model.changelog import Op
from refold.model.forms import RETRACT_FORM
from refold.ops.explain import output_key_of
from refold.plan import (
    co_partitioned,
    exchanged,
    message_key,
    ranked_globally,
    stage2_shards,
    view_key,
    view_partitioning,
)
from refold.recovery.layout import settle_layout
from refold.reduce import SourceEvent, ViewChange
from refold.reduce.values import key_bytes
from refold.reference import (
    ReferenceResult,
    TableRecord,
    fold_changelog,
    fold_deltas,
    merge_partitions,
    reference_changelog,
    reference_table,
)
from refold.runtime.batch import InputRecord
from refold.runtime.exchange import shard_of
from refold.runtime.tables import is_table, table_item


@dataclass
class Report:
    events: int = 0
    view_records: int = 0
    delta_records: int = 0
    table_rows: int = 0  # rows of the lakehouse tables compared (view and delta tables)
    dead_letters: int = 0
    anomalies: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.anomalies

    def add(self, text: str) -> None:
        if len(self.anomalies) < 50:
            self.anomalies.append(text)
        elif len(self.anomalies) == 50:
            self.anomalies.append("… more anomalies left out")


def read_source(pipeline: Pipeline, settings: Mapping[str, Any]) -> tuple[dict[int, list[SourceEvent]], int]:
    """The decodable input events per partition, with their tags; and the count of bad ones."""
    decoder = source_decoder(pipeline)
    partitions: dict[int, list[SourceEvent]] = {}
    bad = 0
    for msg in read_to_end(settings, pipeline.source.topic):
        partition, offset = msg.partition() or 0, msg.offset() or 0
        (events,) = decoder.decode_records([msg.value()], [offset], topic=msg.topic(), partition=partition)
        if isinstance(events, RecordError):
            bad += 1
            continue
        _kind, ts = msg.timestamp()
        for event in events:  # a Debezium update is a -C/+C pair of one record
            event_time = event.event_time if event.event_time is not None else ts
            partitions.setdefault(partition, []).append(
                SourceEvent(event.op, dict(event.row), (event_time, partition, offset))
            )
    return partitions, bad


def read_table_source(
    pipeline: Pipeline, settings: Mapping[str, Any]
) -> tuple[dict[int, list[TableRecord]], int]:
    """A table source's records (upsert, Debezium) per partition, in offset order, with
    their tags; and the count of bad ones (Debezium tombstones are neither)."""
    upserts = None if pipeline.source.format == "debezium-json" else upsert_decoder(
        pipeline.source.format, pipeline.source.schema_path, message_key(pipeline))
    partitions: dict[int, list[TableRecord]] = {}
    bad = 0
    for msg in read_to_end(settings, pipeline.source.topic):
        partition = msg.partition() or 0
        try:
            item = table_item(upserts, InputRecord(partition, msg.offset() or 0, msg.key(), msg.value(),
                                                   msg.timestamp()[1]))
        except BadRecord:
            bad += 1
            continue
        if item is not None:
            partitions.setdefault(partition, []).append((item.key, item.kind, item.row, item.before, item.tag))
    return partitions, bad


def output_key(pipeline: Pipeline, row: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(row[c] for c in output_key_of(pipeline))


def read_view_changes(pipeline: Pipeline, settings: Mapping[str, Any],
                      placed: dict[tuple[Any, ...], set[int]] | None = None) -> list[ViewChange]:
    """The committed view changelog (form `changelog` or `retract`) as ViewChanges,
    partition after partition, each in offset order; `placed`, when given, gets the
    partitions each output key's records lie in.

    Not in the order the reader returns them: it interleaves partitions wherever a
    fetch ends, which can put another partition's record between a `-C` and its `+C`
    (adjacent within their own partition: the order the contract promises)."""
    assert pipeline.outputs.view is not None
    partitions: dict[int, list[ViewChange]] = {}
    for msg in read_to_end(settings, pipeline.outputs.view.topic):
        record = orjson.loads(msg.value() or b"null")
        op = Op.parse(record.pop("op"))
        change = ViewChange(op, output_key(pipeline, record), record)
        partitions.setdefault(msg.partition() or 0, []).append(change)
        if placed is not None:
            placed.setdefault(change.key, set()).add(msg.partition() or 0)
    return [change for partition in sorted(partitions) for change in partitions[partition]]


def read_upsert_view(pipeline: Pipeline, settings: Mapping[str, Any]) -> dict[bytes, dict[str, Any]]:
    """An upsert-form view topic folded: message key → latest row (tombstones delete)."""
    assert pipeline.outputs.view is not None
    table: dict[bytes, dict[str, Any]] = {}
    for msg in read_to_end(settings, pipeline.outputs.view.topic):
        key, value = msg.key() or b"", msg.value()
        if value is None:
            table.pop(key, None)
        else:
            table[key] = orjson.loads(value)
    return table


def fold_delta_topic(pipeline: Pipeline, settings: Mapping[str, Any], report: Report) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The committed delta records folded (`fold_deltas`), counted into the report as
    they are read: a million of them parsed and held at once took gigabytes."""
    assert pipeline.outputs.delta is not None

    def rows() -> Iterator[dict[str, Any]]:
        for message in read_to_end(settings, pipeline.outputs.delta.topic):
            report.delta_records += 1
            yield orjson.loads(message.value() or b"null")

    return fold_deltas(pipeline.view, rows())


def same(a: Any, b: Any) -> bool:
    """Equality with a relative tolerance for floats (incremental vs recomputed sums)."""
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
            return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
        return False
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def by_key(changes: Iterable[ViewChange]) -> dict[tuple[Any, ...], list[tuple[Op, Mapping[str, Any]]]]:
    """Each key's records in order. The rows are shared, not copied: `make chaos` compares
    millions of them, and a copy held each one twice (how much that saves at full size
    was not measured)."""
    out: dict[tuple[Any, ...], list[tuple[Op, Mapping[str, Any]]]] = {}
    for change in changes:
        out.setdefault(change.key, []).append((change.op, change.row))
    return out


def verify(pipeline: Pipeline, settings: Mapping[str, Any], *, exact_order: bool | None = None,
           dead_letters: bool = False) -> Report:
    """Compare the committed outputs with the reference over the committed input.

    For a view keyed like its input messages (co-partitioned), each key's sequence of
    view records must equal the reference's record by record. For a view that
    re-groups (a view key without the message key, a Top-N), the sequence depends on
    batch boundaries (the engine merges the partitions within a batch), so the whole
    changelog is compared only when `exact_order` (one batch); the folded view
    always is. With `dead_letters` (a changelog source whose records all decode), the
    committed dead letters too: each refused event's (partition, offset, reason) once,
    exactly the reference's (a windowed view's `late` ones included).
    """
    report = Report()
    if pipeline.view.join is not None:  # the folded view against the reference join's table
        from refold.ops.verifyjoin import verify_join

        return verify_join(pipeline, settings, report)
    spec = pipeline.outputs.view
    changelog = spec is not None and spec.form in ("changelog", "retract")
    # the pipeline's layout as the engine settled it (`shards`, the view's partitioning)
    settled = settle_layout(pipeline, settings, len(partitions_of(settings, pipeline.source.topic))) \
        if changelog else pipeline
    grouping = view_key(pipeline.view)
    # a view group -> the source partition of its rows: the shard that writes a co-partitioned view's group
    by_shard = changelog and co_partitioned(settled) and view_partitioning(settled) == "shard"
    homes: dict[tuple[Any, ...], int] | None = {} if by_shard else None
    if is_table(pipeline):
        records, report.dead_letters = read_table_source(pipeline, settings)
        report.events = sum(len(v) for v in records.values())  # records here: each means 0-2 events
        expected = reference_table(pipeline.view, records)
        if homes is not None:
            for partition, items in records.items():
                _add_homes(homes, (row for _k, _kind, row, before, _t in items for row in (row, before)
                                   if row is not None), grouping, partition)
        del records
    else:
        partitions, report.dead_letters = read_source(pipeline, settings)
        report.events = sum(len(v) for v in partitions.values())
        expected = _expected(pipeline, settled, partitions)
        if dead_letters:
            _compare_dead_letters(report, pipeline, settings, _letters_of(pipeline, settled, partitions, expected))
        if homes is not None:
            for partition, events in partitions.items():
                _add_homes(homes, (event.row for event in events), grouping, partition)
        del partitions  # the input is no longer needed: free it before the outputs are read
    report.dead_letters += len(expected.rejected)
    if changelog:
        assert spec is not None
        placed: dict[tuple[Any, ...], set[int]] = {}
        actual = read_view_changes(pipeline, settings, placed)
        report.view_records = len(actual)
        _check_partitions(report, settled, homes or {}, placed)
        del homes
        want = expected.changes
        if spec.form == "retract":
            want = [ViewChange(RETRACT_FORM[c.op], c.key, c.row) for c in want]
        if spec.emit in ("per_event", "final") and (exact_order or (co_partitioned(pipeline) and not pipeline.view.is_top_n)):
            _compare_sequences(report, by_key(want), by_key(actual))
        try:
            folded = fold_changelog(actual) if spec.form == "changelog" else _fold_retract(actual)
        except ValueError as exc:
            report.add(f"the view changelog does not fold: {exc}")
        else:
            _compare_views(report, expected.view, folded, "view changelog")
    elif spec is not None:
        table = read_upsert_view(pipeline, settings)
        report.view_records = len(table)
        folded_upsert = {output_key(pipeline, row): row for row in table.values()}
        _compare_views(report, expected.view, folded_upsert, "upsert view")
    if pipeline.outputs.delta is not None:
        _compare_views(report, expected.view, fold_delta_topic(pipeline, settings, report), "folded deltas")
    _compare_tables(report, pipeline, expected.view)
    return report


def _expected(pipeline: Pipeline, settled: Pipeline, partitions: dict[int, list[SourceEvent]]) -> ReferenceResult:
    """The reference over the input. A windowed view's watermark is its shard's: for a
    co-partitioned one, the reference runs per source partition."""
    view, emit = pipeline.view, pipeline.outputs.view.emit if pipeline.outputs.view is not None else "per_event"
    if view.window is None or not co_partitioned(settled):
        return reference_changelog(view, merge_partitions(partitions), emit if view.window is not None else "per_event")
    result = ReferenceResult()
    first = 0  # the index of the partition's first unit among every partition's, one after the other
    for partition in sorted(partitions):
        units = merge_partitions({partition: partitions[partition]})
        part = reference_changelog(view, units, emit)
        result.changes += part.changes
        result.view.update(part.view)
        result.rejected += [(first + index, reason) for index, reason in part.rejected]
        result.dead_letters += [(first + index, position, reason) for index, position, reason in part.dead_letters]
        first += len(units)
    return result


def _letters_of(pipeline: Pipeline, settled: Pipeline, partitions: dict[int, list[SourceEvent]],
                expected: ReferenceResult) -> list[tuple[int, int, str]]:
    """The reference's dead letters as (partition, offset, reason), from the units
    `_expected` gave the reference (one partition's at a time for a co-partitioned
    windowed view)."""
    if pipeline.view.window is None or not co_partitioned(settled):
        units = merge_partitions(partitions)
    else:
        units = [unit for partition in sorted(partitions) for unit in merge_partitions({partition: partitions[partition]})]
    letters = []
    for index, position, reason in expected.dead_letters:
        tag = units[index][position].tag
        letters.append((int(tag[1]), int(tag[2]), reason))
    return letters


def _compare_dead_letters(report: Report, pipeline: Pipeline, settings: Mapping[str, Any],
                          want: list[tuple[int, int, str]]) -> None:
    """The committed dead letters against the reference's: none missing, none extra,
    none twice."""
    from collections import Counter

    from refold.recovery.records import decode_dead_letter

    got: Counter[tuple[int, int, str]] = Counter()
    for message in read_to_end(settings, pipeline.dlq_topic):
        letter = decode_dead_letter(message.value())
        got[(letter.partition, letter.offset, letter.reason)] += 1
    wanted = Counter(want)
    for letter in sorted(set(got) | set(wanted)):
        if got[letter] != wanted[letter]:
            partition, offset, reason = letter
            report.add(f"dead letter {reason!r} of partition {partition} offset {offset}: "
                       f"written {got[letter]} times, the reference {wanted[letter]}")


def read_tables(entry: Any) -> tuple[dict[tuple[Any, ...], dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """A lakehouse materialization's view table (rows by key) and delta table (rows in
    the order written), each None when the entry has no such binding or its driver is
    not a table format Refold reads back (only `delta` and `iceberg` are)."""
    if entry.driver == "delta":
        from refold.connectors.delta import read_delta_deltas, read_delta_view

        options = {k: v.get_secret_value() for k, v in entry.storage_options.items()} or None
        return (read_delta_view(entry.path, entry.view, options) if entry.view else None,
                read_delta_deltas(entry.path, entry.delta, options) if entry.delta else None)
    if entry.driver == "iceberg":
        from refold.connectors.iceberg import read_iceberg_deltas, read_iceberg_view

        where = {"namespace": entry.namespace, "catalog": entry.catalog,
                 "properties": {k: v.get_secret_value() for k, v in entry.properties.items()}}
        uri = entry.uri.get_secret_value() if entry.uri is not None else None
        return (read_iceberg_view(entry.warehouse, entry.view, uri, **where) if entry.view else None,
                read_iceberg_deltas(entry.warehouse, entry.delta, uri, **where) if entry.delta else None)
    return None, None


def _compare_tables(report: Report, pipeline: Pipeline, want: Mapping[Any, Any]) -> None:
    """Each Delta Lake or Iceberg table the pipeline materializes into must hold the
    reference's view: the view table key by key, the delta table once folded."""
    for entry in pipeline.outputs.materialize:
        view, deltas = read_tables(entry)
        if view is not None:
            report.table_rows += len(view)
            _compare_views(report, want, view, f"{entry.materialization} table {entry.view}")
        if deltas is not None:
            report.table_rows += len(deltas)
            _compare_views(report, want, fold_deltas(pipeline.view, deltas),
                           f"{entry.materialization} table {entry.delta}, folded")


def _group_of(row: Mapping[str, Any], grouping: tuple[str, ...]) -> tuple[Any, ...]:
    return tuple(row.get(column) for column in grouping)


def _add_homes(homes: dict[tuple[Any, ...], int], rows: Iterable[Mapping[str, Any]], grouping: tuple[str, ...],
               partition: int) -> None:
    """Each row's group lives in `partition`; a row whose key is a list or an object
    is a dead letter (no group of the view), left out."""
    for row in rows:
        group = _group_of(row, grouping)
        try:
            homes[group] = partition
        except TypeError:  # unhashable: a key that is not a scalar
            continue


def _check_partitions(report: Report, pipeline: Pipeline, homes: Mapping[tuple[Any, ...], int],
                      placed: Mapping[tuple[Any, ...], set[int]]) -> None:
    """Each output key's records lie in one partition of the view topic; partitioned by
    shard (the pipeline as settled), in the partition of the one shard that writes them:
    a co-partitioned view's group's source partition (`homes`), a re-grouping view's
    stage-2 shard, else 0 (a merged view, a global Top-N's stage 3)."""
    by_shard, grouping = view_partitioning(pipeline) == "shard", len(view_key(pipeline.view))
    for key, partitions in placed.items():
        group = key[:grouping]  # (a Top-N's output key ends with the place; a windowed one's with the window)
        if not by_shard:
            want = partitions if len(partitions) == 1 else None
        elif ranked_globally(pipeline):
            want = {0}
        elif exchanged(pipeline):
            want = {shard_of(key_bytes(group), stage2_shards(pipeline))}
        else:
            want = {homes.get(group, -1) if co_partitioned(pipeline) else 0}
        if partitions != want:
            report.add(f"view key {key!r}: records in partitions {sorted(partitions)}, expected "
                       f"{'one' if want is None else sorted(want)} (the partition of the shard that writes it)")


def _fold_retract(changes: list[ViewChange]) -> dict[tuple[Any, ...], dict[str, Any]]:
    live: dict[tuple[Any, ...], dict[str, Any]] = {}
    for change in changes:
        if change.op is Op.APPEND:
            live[change.key] = dict(change.row)
        elif change.key not in live or not same(live[change.key], dict(change.row)):
            raise ValueError(f"-R of a row that is not the current one at key {change.key!r}")
        else:
            del live[change.key]
    return live


def _compare_sequences(report: Report, want: dict[Any, list[Any]], got: dict[Any, list[Any]]) -> None:
    for key in sorted(set(want) | set(got), key=repr):
        a, b = want.get(key, []), got.get(key, [])
        if len(a) != len(b) or not all(x[0] == y[0] and same(x[1], y[1]) for x, y in zip(a, b, strict=False)):
            first = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x[0] != y[0] or not same(x[1], y[1])),
                min(len(a), len(b)),
            )
            report.add(
                f"key {key!r}: {len(a)} expected records, {len(b)} committed; first difference at #{first}: "
                f"expected {a[first] if first < len(a) else None}, got {b[first] if first < len(b) else None}"
            )


def _compare_views(report: Report, want: Mapping[Any, Any], got: Mapping[Any, Any], what: str) -> None:
    for key in sorted(set(want) | set(got), key=repr):
        if key not in got:
            report.add(f"{what}: key {key!r} missing (expected {want[key]})")
        elif key not in want:
            report.add(f"{what}: key {key!r} should not exist (got {got[key]})")
        elif not same(dict(want[key]), dict(got[key])):
            report.add(f"{what}: key {key!r}: expected {want[key]}, got {got[key]}")
