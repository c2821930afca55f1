"""The stream forms of DESIGN.md §1, on `ChangelogEvent`s.

- **changelog**: all four ops; a `-C` is immediately followed by its `+C`.
- **retract**: `+A`/`-R` only: `RETRACT_FORM` maps each op to its retract form
  (`-C`→`-R`, `+C`→`+A`), which keeps the multiset of live rows.
- **Debezium** envelopes: `from_debezium`.

(The upsert form, key → latest row with a tombstone for a delete, is written by the
engine's renderer, `refold.runtime.render`.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from refold.model.changelog import ChangelogEvent, Op

RETRACT_FORM: Mapping[Op, Op] = {
    Op.APPEND: Op.APPEND,
    Op.RETRACT: Op.RETRACT,
    Op.CORRECT_FROM: Op.RETRACT,
    Op.CORRECT_TO: Op.APPEND,
}


def from_debezium(envelope: Mapping[str, Any] | None) -> list[ChangelogEvent]:
    """The changelog events of one Debezium change event (its value, JSON-decoded),
    with or without the top-level `payload` wrapper of the JSON converter's
    `schemas.enable=true`:

    - `c` (create), `r` (snapshot read) → `+A` after
    - `u` (update) → `-C` before, `+C` after
    - `d` (delete) → `-R` before
    - `None` or `{"payload": null}` (the tombstone Debezium writes after a delete)
      → no events

    `event_time` is the envelope's `ts_ms` (else `source.ts_ms`). Raises ValueError
    for another op (e.g. `t` truncate, `m` message) naming it, and for a missing
    `before`/`after` the op needs (an update or delete without `before` needs the
    source table to log full old rows, e.g. PostgreSQL `REPLICA IDENTITY FULL`).
    """
    if envelope is None:
        return []
    payload = envelope.get("payload")
    if payload is None and "payload" in envelope and "op" not in envelope:
        return []  # the tombstone, wrapped: {"schema": ..., "payload": null}
    body: Mapping[str, Any] = payload if isinstance(payload, Mapping) and "op" in payload else envelope
    op = body.get("op")
    event_time = debezium_time(body)
    if op in ("c", "r"):
        return [ChangelogEvent(Op.APPEND, _image(body, "after", op), event_time)]
    if op == "u":
        return [
            ChangelogEvent(Op.CORRECT_FROM, _image(body, "before", op), event_time),
            ChangelogEvent(Op.CORRECT_TO, _image(body, "after", op), event_time),
        ]
    if op == "d":
        return [ChangelogEvent(Op.RETRACT, _image(body, "before", op), event_time)]
    if op is None:
        raise ValueError("not a Debezium change event: no 'op' field")
    raise ValueError(f"unsupported Debezium op {op!r} (only c, r, u, d carry row changes)")


def _image(body: Mapping[str, Any], which: str, op: str) -> dict[str, Any]:
    image = body.get(which)
    if not isinstance(image, Mapping):
        hint = " (the source must log full old rows, e.g. REPLICA IDENTITY FULL)" if which == "before" else ""
        raise ValueError(f"Debezium op {op!r} without its {which!r} row{hint}")
    return dict(image)


def debezium_time(body: Mapping[str, Any]) -> int | None:
    ts = body.get("ts_ms")
    if ts is None:
        source = body.get("source")
        if isinstance(source, Mapping):
            ts = source.get("ts_ms")
    if ts is None:
        return None
    if not isinstance(ts, int) or isinstance(ts, bool):
        raise ValueError(f"Debezium ts_ms must be an integer, got {ts!r}")
    return ts
