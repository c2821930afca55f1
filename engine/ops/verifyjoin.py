"""`verify` of a join pipeline: its committed view against the reference join.

A join's output changelog depends on how its batches interleaved the two sources, so
the check is of the table the changelog folds into, which does not: the committed view
records folded (a join's rows as a multiset; a grouped view over the join as one row
per key) must equal the reference's table over both sources' committed events
(`refold.reference_joins`, and `refold.reference` for the grouped view over its rows).
Each side's events are read and paired per partition as the engine reads them, and
merged by tag, the right source's partitions after the left's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import orjson

from refold.config import Pipeline
from refold.kafka.io import read_to_end
from refold.model import jsonbytes
from refold.model.changelog import Op
from refold.plan import RIGHT_PARTITIONS
from refold.reduce import SourceEvent
from refold.reference import merge_partitions, reference_changelog
from refold.reference_joins import reference_join


def verify_join(pipeline: Pipeline, settings: Mapping[str, Any], report: Any) -> Any:
    """Fill `report` (a `refold.ops.verify.Report`): events read, view records, anomalies."""
    from refold.ops.verify import read_source

    join = pipeline.view.join
    assert join is not None
    partitions: dict[int, list[SourceEvent]] = {}
    for side, name in enumerate((join.left, join.right)):
        side_pipeline = pipeline.model_copy(update={"source": pipeline.sources[name]})
        read, bad = read_source(side_pipeline, settings)
        report.dead_letters += bad
        for partition, events in read.items():
            shift = RIGHT_PARTITIONS * side
            partitions[partition + shift] = [e._replace(tag=(e.tag[0], e.tag[1] + shift, e.tag[2])) for e in events]
            report.events += len(events)
    units = [(1 if unit[0].tag[1] >= RIGHT_PARTITIONS else 0, unit) for unit in merge_partitions(partitions)]
    joined = reference_join(join, units)
    spec = pipeline.outputs.view
    if spec is None or spec.form not in ("changelog", "retract"):
        report.add("verify of a join reads its view output in the changelog or retract form")
        return report
    got: Counter[bytes] = Counter()
    rows: dict[bytes, bytes] = {}
    for message in read_to_end(settings, spec.topic):
        report.view_records += 1
        record = orjson.loads(message.value())
        op = record.pop("op")
        adds = op in ("+A", "+C") if spec.form == "changelog" else op == "+A"
        row = jsonbytes.dumps(record, option=orjson.OPT_SORT_KEYS)
        if pipeline.view.key:
            key = message.key() or b""
            if adds:
                rows[key] = row
            elif op == "-R":
                rows.pop(key, None)
        else:
            got[row] += 1 if adds else -1
    if pipeline.view.key:
        view = pipeline.view.model_copy(update={"join": None, "sql": None})
        grouped = reference_changelog(view, [[SourceEvent(Op.APPEND, row, (0, 0, n))]
                                             for n, row in enumerate(joined.rows)])
        expected = Counter(jsonbytes.dumps(row, option=orjson.OPT_SORT_KEYS) for row in grouped.view.values())
        got = Counter(rows.values())
    else:
        expected = Counter(jsonbytes.dumps(row, option=orjson.OPT_SORT_KEYS) for row in joined.rows)
        got = +got
    for row in sorted((expected - got).keys()):
        report.add(f"view: missing {row.decode()} ({(expected - got)[row]} copies)")
    for row in sorted((got - expected).keys()):
        report.add(f"view: extra {row.decode()} ({(got - expected)[row]} copies)")
    return report
