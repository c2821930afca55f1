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

# the view changes of each unit, with the event time of the unit's first event
UnitChanges = tuple[list[ViewChange], int]


class Renderer:
    """Encodes a batch's view changes and delta rows into Kafka records (key, value)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.view_spec = pipeline.outputs.view
        self.delta_spec = pipeline.outputs.delta
        window = pipeline.view.window
        # a delta's message key: the output key (a tumble or hop window's view key and bounds)
        self.key_columns = [*pipeline.view.key, *(("window_start", "window_end") if window is not None else ())]
        self.view_encoder, self.delta_encoder = output_encoders(pipeline)

    def view(self, changes: Sequence[UnitChanges]) -> list[tuple[bytes, bytes | None, int | None]]:
        """(key, value or None for a tombstone, event time or None) per view record;
        nothing when the pipeline has no view output."""
        spec = self.view_spec
        if spec is None:
            return []
        form = spec.form
        if spec.emit == "per_batch":
            flat = compact_changes([c for unit_changes, _ in changes for c in unit_changes])
            if form == "retract":
                flat = _retractions_first(flat)
            timed: Iterable[tuple[ViewChange, int | None]] = ((c, None) for c in flat)
        elif form == "retract":
            timed = ((c, ts) for unit_changes, ts in changes for c in _retractions_first(unit_changes))
        else:
            timed = ((c, ts) for unit_changes, ts in changes for c in unit_changes)
        encode = self.view_encoder.encode
        records: list[tuple[bytes, bytes | None, int | None]] = []
        key_json: dict[tuple[Any, ...], bytes] = {}
        for change, ts in timed:
            key = key_json.get(change.key)
            if key is None:
                key = key_json[change.key] = change.key_json()
            if form == "upsert":
                if change.op is Op.CORRECT_FROM:
                    continue
                value = None if change.op is Op.RETRACT else encode(change.row)
            else:
                value = encode(change.row, RETRACT_FORM[change.op] if form == "retract" else change.op)
            records.append((key, value, ts))
        return records

    def deltas(self, rows: Sequence[dict[str, Any]]) -> list[tuple[bytes, bytes]]:
        """(key, value) per delta row; nothing when the pipeline has no delta output."""
        if self.delta_spec is None:
            return []
        key_columns = self.key_columns
        encode = self.delta_encoder.encode
        return [(jsonbytes.dumps({k: row[k] for k in key_columns}), encode(row)) for row in rows]


def _retractions_first(changes: list[ViewChange]) -> list[ViewChange]:
    """One unit's changes with its `-R`/`-C` before its `+A`/`+C`, each side in its order."""
    if len(changes) < 2:
        return changes
    return [c for c in changes if not c.op.adds] + [c for c in changes if c.op.adds]
