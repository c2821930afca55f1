"""A batch's output records: the view changelog in its output form, and the deltas.

The view changelog keeps the reducer's order (input order; within one input event's
effects, output-key order), or, with `emit: per_batch`, one net change per key in key
order. Its forms (DESIGN.md §2):

- `changelog`: the changes as they are.
- `retract`: each op in its retract form (`refold.model.forms.RETRACT_FORM`), a unit's
  (with `per_batch`, a batch's) retractions before its appends, as RFC-015's retract
  stream is written: what leaves the view is retracted before what replaces it.
- `upsert`: the new row for `+A`/`+C`, a tombstone (None) for `-R`, nothing for `-C`
  (its `+C` overwrites the key).

Message keys are JSON objects of the key columns; a key's records in one batch share
their bytes.

Provenance (docs/SEMANTICS.md, "Provenance"): unless `outputs.provenance` is off, every
view and delta record carries the header `refold.cause` (the input event it came of, as
`<partition>:<offset>` of the source topic), and a `-R`/`-C` (a tombstone, a retract
form's `-R`) `refold.retracts` (the cause of the record it takes back) where known.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from refold.codecs import output_encoders
from refold.config import Pipeline
from refold.model import jsonbytes
from refold.model.changelog import Op
from refold.model.forms import RETRACT_FORM
from refold.reduce import ViewChange, compact_changes
from refold.reduce.types import Cause

# the view changes of each unit (a `refold.reduce.types.Changes` where the reducer names
# their causes), with the event time of the unit's first event
UnitChanges = tuple[list[ViewChange], int]
Headers = list[tuple[str, bytes]] | None
CAUSE = "refold.cause"
Caused = tuple[ViewChange, int | None, Cause | None, Cause | None]  # a change, its event time, cause, retracted cause
RETRACTS = "refold.retracts"


def cause_bytes(cause: Cause) -> bytes:
    """A cause as a header's value: `<partition>:<offset>`, ASCII decimal."""
    return b"%d:%d" % cause


def parse_cause(value: bytes) -> Cause:
    """A `refold.cause`/`refold.retracts` header's value back as (partition, offset)."""
    partition, _, offset = value.partition(b":")
    return int(partition), int(offset)


def _caused(changes: Sequence[UnitChanges]) -> Iterable[Caused]:
    """Each change with its unit's event time, cause and the cause it retracts."""
    for unit_changes, ts in changes:
        cause = getattr(unit_changes, "cause", None)
        retracts = getattr(unit_changes, "retracts", None)
        if retracts is None:
            for change in unit_changes:
                yield change, ts, cause, None
        else:
            yield from ((change, ts, cause, retracted) for change, retracted in zip(unit_changes, retracts, strict=True))


def _per_batch(changes: Sequence[UnitChanges]) -> list[Caused]:
    """`emit: per_batch`: `compact_changes` of the batch, each net change with the cause
    of its key's last change in the batch and, for a retraction, what its key's first
    change retracted."""
    last: dict[tuple[Any, ...], Cause | None] = {}
    first: dict[tuple[Any, ...], Cause | None] = {}
    flat = []
    for change, _ts, cause, retracted in _caused(changes):
        flat.append(change)
        last[change.key] = cause
        if change.key not in first:
            first[change.key] = retracted
    return [(c, None, last[c.key], None if c.op.adds else first[c.key]) for c in compact_changes(flat)]


class Renderer:
    """Encodes a batch's view changes and delta rows into Kafka records (key, value)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.provenance = pipeline.outputs.provenance
        self.view_spec = pipeline.outputs.view
        self.delta_spec = pipeline.outputs.delta
        window = pipeline.view.window
        # a delta's message key: the output key (a tumble or hop window's view key and bounds)
        self.key_columns = [*pipeline.view.key, *(("window_start", "window_end") if window is not None else ())]
        self.view_encoder, self.delta_encoder = output_encoders(pipeline)

    def name_cause(self, cause: Cause) -> bytes:
        """A cause as its header's value (a join's renderer names the topic too)."""
        return cause_bytes(cause)

    def letter_cause(self, letter: Any) -> bytes:
        """A dead letter's cause: its own record."""
        return cause_bytes((letter.partition, letter.offset))

    def view(self, changes: Sequence[UnitChanges]) -> list[tuple[bytes, bytes | None, int | None, Headers]]:
        """(key, value or None for a tombstone, event time or None, headers or None) per
        view record; nothing when the pipeline has no view output."""
        spec = self.view_spec
        if spec is None:
            return []
        form = spec.form
        timed: Iterable[Caused]
        if spec.emit == "per_batch":
            flat = _per_batch(changes)
            timed = _retractions_first(flat) if form == "retract" else flat
        elif form == "retract":
            timed = (c for unit in changes for c in _retractions_first(list(_caused([unit]))))
        else:
            timed = _caused(changes)
        encode = self.view_encoder.encode
        provenance = self.provenance
        records: list[tuple[bytes, bytes | None, int | None, Headers]] = []
        key_json: dict[tuple[Any, ...], bytes] = {}
        cause_header: dict[Cause, tuple[str, bytes]] = {}  # one per unit
        for change, ts, cause, retracted in timed:
            key = key_json.get(change.key)
            if key is None:
                key = key_json[change.key] = change.key_json()
            if form == "upsert":
                if change.op is Op.CORRECT_FROM:
                    continue
                value = None if change.op is Op.RETRACT else encode(change.row)
            else:
                value = encode(change.row, RETRACT_FORM[change.op] if form == "retract" else change.op)
            headers: Headers = None
            if provenance and cause is not None:
                header = cause_header.get(cause)
                if header is None:
                    header = cause_header[cause] = (CAUSE, self.name_cause(cause))
                headers = [header] if retracted is None else [header, (RETRACTS, self.name_cause(retracted))]
            records.append((key, value, ts, headers))
        return records

    def deltas(self, rows: Sequence[dict[str, Any]]) -> list[tuple[bytes, bytes, Headers]]:
        """(key, value, headers or None) per delta row; nothing when the pipeline has no
        delta output."""
        if self.delta_spec is None:
            return []
        key_columns = self.key_columns
        encode = self.delta_encoder.encode
        causes = getattr(rows, "causes", None) if self.provenance else None
        if causes is None:
            return [(jsonbytes.dumps({k: row[k] for k in key_columns}), encode(row), None) for row in rows]
        return [
            (jsonbytes.dumps({k: row[k] for k in key_columns}), encode(row),
             [(CAUSE, self.name_cause(cause))] if cause is not None else None)
            for row, cause in zip(rows, causes, strict=True)
        ]


def _retractions_first(changes: list[Caused]) -> list[Caused]:
    """One unit's changes with its `-R`/`-C` before its `+A`/`+C`, each side in its order."""
    if len(changes) < 2:
        return changes
    return [c for c in changes if not c[0].op.adds] + [c for c in changes if c[0].op.adds]
