"""Why a record was refused: the one list of dead-letter reasons.

A reason is machine-stable (it is the `refold.reason` header of a `P.dlq` record,
a label of the dead-letter metric, and what `refold.reference` predicts), so a
member's value never changes; `Reason` is a `StrEnum`, so it compares equal to
its string and encodes as it.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # the bytes: codecs
    UNDECODABLE = "undecodable"
    SCHEMA_MISMATCH = "schema mismatch"
    OP_OUT_OF_RANGE = "op out of range"
    # the key
    NULL_KEY = "null key"
    KEY_TOO_LARGE = "key too large"
    KEY_MISMATCH = "key mismatch"  # the message key is not the JSON object of source.key
    # the changelog's rules: pairing and retraction
    UNPAIRED_CORRECT_FROM = "-C not immediately followed by its +C"
    UNPAIRED_AT_END = "-C at the end of the input without its +C"
    ORPHAN_CORRECT_TO = "+C without a preceding -C"
    PAIR_KEY_DIFFERS = "+C key differs from its -C key"
    CORRECTION_PAIR_REJECTED = "correction pair rejected"  # the other half of a refused pair
    NOT_LIVE = "not live"  # a retraction of a row that is not live
    BEFORE_DIFFERS = "before differs"  # a Debezium before image that is not the key's row in the view
    # windowed views (view.window)
    BAD_TIME = "bad event time"  # the window's time column is missing, null or not a time
    LATE = "late"  # the event's window closed: its end is at or before the shard's watermark
