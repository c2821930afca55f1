"""A table source (`form: upsert`, `debezium-json`) as a side of a join
(`refold.runtime.joins`): its records read as `TableItem`s, as a view's table source
reads them (`refold.runtime.tables`), each a unit of its own in the join's merged batch.

The shard makes each record's events as it joins, against its key's last row (a new
key `+A`, a changed row `-C`/`+C`, an unchanged one nothing, a tombstone or a
delete `-R`), so a customer overwritten in an upsert topic moves the customer's orders
to its new row. The last rows live in the shard's store and `P.state` partition as a
table view's (`["u",…]` records), their keys numbered by side (`["l", …]`, `["r", …]`)
so the two sides' keys stay apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from refold.config import Pipeline
from refold.model.changelog import Op
from refold.reduce import SourceEvent
from refold.runtime.batch import DeadLetters, InputRecord, Outgoing, Unit
from refold.runtime.shards import KeyCheck
from refold.runtime.tables import TableItem, TableReader

SIDE_NAMES = ("l", "r")


class TableSide:
    """One table side's reader: the batch's `TableItem`s (keys numbered by side), each
    a unit of one placeholder event carrying its tag (what the merge orders by)."""

    def __init__(self, side: Pipeline, number: int, letters: DeadLetters, keys: KeyCheck | None) -> None:
        self.reader = TableReader(side, letters, keys)
        self.name = SIDE_NAMES[number]
        self.items: dict[InputRecord, TableItem] = {}  # the batch's, by record

    def read(self, records: Sequence[InputRecord], out: Outgoing) -> list[Unit]:
        self.items = {}
        units: list[Unit] = []
        for item in self.reader.read(records, out):
            if item.key is not None:
                item = item._replace(key=(self.name, *item.key))
            self.items[item.record] = item
            placeholder: Any = SourceEvent(Op.APPEND, item.row or item.before or {}, item.tag)
            units.append(((placeholder, item.record),))
        return units


__all__ = ["TableSide"]
