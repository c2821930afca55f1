"""Shards: which input partitions each of a view's tasks covers (DESIGN.md §1, §3).

Which layout a view runs in is the plan's (`refold.plan`); here are its shards at work.
A view is **co-partitioned** with its source when the message-key columns
(`source.key`, by default the view key) are a subset of the view-key columns (for a
Top-N, `partition_by`): each view key's events then all lie in one partition, and the
view runs one shard per source partition (shard p covers partition p). Any other view
(a view key without some message-key column, a global Top-N) runs as one shard, shard
0, that covers every partition and merges them (`event_time`, partition, offset).

Each shard has its own transaction (`P-<writer>-<shard>`), its own state (`P.state`
partition = shard) and its own checkpoint record (key `<writer>/<shard>`).

`KeyCheck` checks that a co-partitioned view's messages are keyed as Refold keys them
(the JSON object of the `source.key` columns): the first record of a run keyed
otherwise stops the engine with a `UserError` before anything commits; a later one is
a dead letter (`key mismatch`). Debezium's keys are its own (the table's key, with or
without its `schema`/`payload` envelope): only a run's first record is checked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from refold.config import Pipeline
from refold.errors import UserError
from refold.plan import (
    RIGHT_PARTITIONS,
    by_partition,
    checkpoint_key,
    co_partitioned,
    exchanged,
    message_key,
    ranked_globally,
    shard_writer,
    stage2_shards,
    view_key,
)

# (the plan's rules, asked here by the shards' callers)
__all__ = ["KeyCheck", "Shard", "ShardPlan", "by_partition", "check_state_partitions", "checkpoint_key",
           "co_partitioned", "describe_key", "exchanged", "message_key", "plan_shards", "ranked_globally",
           "shard_writer", "stage2_shards", "view_key"]


@dataclass(frozen=True, slots=True)
class Shard:
    """One task of a view: its number and the source partitions it covers (None: all)."""

    index: int
    partitions: frozenset[int] | None

    def covers(self, partition: int) -> bool:
        return self.partitions is None or partition in self.partitions


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """How a view splits into shards (see the module's docstring)."""

    co_partitioned: bool

    def shard_of(self, partition: int) -> int:
        """(A join's right source's partition p, numbered RIGHT_PARTITIONS + p, is shard p's.)"""
        return partition % RIGHT_PARTITIONS if self.co_partitioned else 0

    def shard(self, index: int) -> Shard:
        if self.co_partitioned:
            return Shard(index, frozenset({index}))
        if index != 0:
            raise UserError(f"a view that re-groups partitions runs as one shard (0), not shard {index}")
        return Shard(0, None)

    def shards(self, partitions: Iterable[int]) -> list[Shard]:
        """The shards that cover `partitions` (the source's), in shard order."""
        return [self.shard(index) for index in sorted({self.shard_of(p) for p in partitions} | {0})]

    def split(self, records: Sequence[Any]) -> dict[int, list[Any]]:
        """Records (anything with a `partition`) by shard, each shard's in their order."""
        if not self.co_partitioned:
            return {0: list(records)} if records else {}
        by_shard: dict[int, list[Any]] = {}
        for record in records:
            by_shard.setdefault(record.partition % RIGHT_PARTITIONS, []).append(record)
        return by_shard


def plan_shards(pipeline: Pipeline) -> ShardPlan:
    """How the first stage's shards cover the source's partitions (`refold.plan.by_partition`)."""
    return ShardPlan(by_partition(pipeline))


def check_state_partitions(pipeline: Pipeline, state_partitions: int, index: int) -> None:
    """UserError unless `P.state` has a partition for shard `index` (its state goes there)."""
    if index >= state_partitions:
        raise UserError(
            f"{pipeline.state_topic} has {state_partitions} partitions, and pipeline "
            f"{pipeline.pipeline!r} runs shard {index} (one per partition of "
            f"{pipeline.source.topic!r}), whose state goes to partition {index}: add partitions to "
            f"{pipeline.state_topic} (kafka-topics --alter --partitions N) to at least the source's, "
            "or start the pipeline under a new name; Refold does not repartition its state"
        )


class KeyCheck:
    """Checks message keys against the rows of a co-partitioned view (see the module's
    docstring). One per run, shared by its shards: `verified` once a record matched."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.topic = pipeline.source.topic
        self.columns = message_key(pipeline)
        self.enabled = by_partition(pipeline)
        # Debezium's keys are not Refold's bytes: comparing them means parsing each one
        self.every_record = pipeline.source.format != "debezium-json"
        self.verified = False
        self._single = self.columns[0] if len(self.columns) == 1 else None
        # message key bytes -> its key columns' values (`_object_values`; None:
        # not such an object): most keys come again, and a lookup costs less than a dumps
        self._parsed: dict[bytes, tuple[Any, ...] | None] = {}

    def matches(self, key: bytes | None, row: Mapping[str, Any]) -> bool:
        """Whether the message key is the JSON object of the row's key columns (a row
        with a missing or null key column passes: the reducer dead-letters it). Raises
        UserError for the first record of a run keyed otherwise."""
        if not self.enabled or (self.verified and not self.every_record):
            return True
        if self._single is not None:  # most views: one key column
            value = row.get(self._single)
            if value is None:
                return True
            values: tuple[Any, ...] = (value,)
        else:
            values = tuple(row.get(column) for column in self.columns)
            if None in values:
                return True
        if key is not None and self._key_values(key) == values:
            self.verified = True
            return True
        if not self.verified:
            raise UserError(
                f"source.key: the messages of topic {self.topic!r} are keyed {describe_key(key)}, not by the "
                f"JSON object of the columns {list(self.columns)} (as `refold produce --key "
                f"{','.join(self.columns)}` keys them); set source.key to the columns the messages are keyed "
                "by (a view whose key does not include them all runs as one shard)"
            )
        return False

    def _key_values(self, key: bytes) -> tuple[Any, ...] | None:
        """The values of the key columns in a message key that is a JSON object of exactly
        those columns (any spacing or field order, or in a Debezium `schema`/`payload`
        envelope; compared as Python compares them), else None. Remembered per key bytes."""
        try:
            return self._parsed[key]
        except KeyError:
            pass
        if len(self._parsed) >= _KEYS_REMEMBERED:
            self._parsed.clear()
        values = self._parsed[key] = _object_values(key, self.columns)
        return values


_KEYS_REMEMBERED = 200_000  # message keys a run's check keeps parsed (then it starts again)


def _object_values(key: bytes, columns: Sequence[str]) -> tuple[Any, ...] | None:
    """The values of `columns` when `key` is a JSON object of exactly them (or such an
    object in a Debezium `schema`/`payload` envelope); None otherwise."""
    try:
        parsed = orjson.loads(key)
    except orjson.JSONDecodeError:
        return None
    if isinstance(parsed, dict) and set(parsed) == {"schema", "payload"}:
        parsed = parsed["payload"]
    if not isinstance(parsed, dict) or len(parsed) != len(columns) or any(c not in parsed for c in columns):
        return None
    return tuple(parsed[c] for c in columns)


def describe_key(key: bytes | None) -> str:
    """How one message is keyed, for a message: its JSON object's field names, or what
    else it is."""
    if key is None:
        return "by nothing (a null key)"
    try:
        parsed = orjson.loads(key)
    except orjson.JSONDecodeError:
        return f"by bytes that are not JSON ({key[:40]!r}): not a JSON object"
    if isinstance(parsed, dict):
        return f"by a JSON object of the fields {sorted(parsed)}"
    return f"by JSON that is not a JSON object ({key[:40].decode(errors='replace')})"
