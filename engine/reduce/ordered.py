"""A sorted list of distinct items that stays a plain Python list while it is small.

A view key's live rows in tag order, its distinct values of a `min`/`max`/`set`
column and a Top-N group's ranked rows are kept sorted. Most keys hold a handful of
items, and `sortedcontainers` costs more to make and to use at that size than it
saves (measured: `SortedList()` ~1 µs, `add` ~1.7 µs, a `SortedKeyList` of two
values ~11 µs; a list with `bisect` ~0.1 µs an insert). So the items are a list,
kept sorted with `bisect`, until there are more than `LIMIT` of them; then a
`SortedList` (or `SortedKeyList` under a key function) takes over for good, which
keeps a key with millions of live rows at O(log n) an insert.

Both forms hold the same items in the same order, so what a reader sees does not
depend on which one is in use (`tests/test_ordered.py`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from sortedcontainers import SortedKeyList, SortedList

from refold.reduce.values import value_order

LIMIT = 512  # items kept in a plain list; sortedcontainers' own sublists hold ~1,000


class Sorted:
    """Distinct items sorted by `key` (by the items themselves when None)."""

    __slots__ = ("_items", "_key")

    def __init__(self, items: Iterable[Any] = (), key: Callable[[Any], Any] | None = None) -> None:
        self._key = key
        ordered = sorted(items, key=key)
        self._items: list[Any] | SortedList = ordered if len(ordered) <= LIMIT else self._large(ordered)

    def _large(self, items: Iterable[Any]) -> SortedList:
        return SortedList(items) if self._key is None else SortedKeyList(items, key=self._key)

    def add(self, item: Any) -> int:
        """Add `item` (not held yet); returns its index among the items."""
        items = self._items
        if not isinstance(items, list):
            at = items.bisect_left(item)
            items.add(item)
            return int(at)
        key = self._key
        at = bisect_right(items, item) if key is None else bisect_right(items, key(item), key=key)
        items.insert(at, item)
        if len(items) > LIMIT:
            self._items = self._large(items)
        return at

    def remove(self, item: Any) -> int:
        """Remove `item`; returns the index it had. ValueError when it is not held (as
        sortedcontainers does)."""
        items = self._items
        if not isinstance(items, list):
            at = items.index(item)
            del items[at]
            return int(at)
        key = self._key
        if key is None:
            at = bisect_left(items, item)
            if at < len(items) and items[at] == item:
                del items[at]
                return at
        else:
            wanted = key(item)
            at = bisect_left(items, wanted, key=key)
            while at < len(items) and key(items[at]) == wanted:
                if items[at] == item:
                    del items[at]
                    return at
                at += 1
        raise ValueError(f"{item!r} is not held")

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __repr__(self) -> str:
        return f"Sorted({list(self._items)!r})"


class Multiset:
    """One column's live values and their copies, in `value_order` (min, max, set).

    Most keys hold one distinct value, so the sorted index of the values is made only
    when a second one arrives: a sorted container costs more to make than to use."""

    __slots__ = ("counts", "ordered")

    def __init__(self) -> None:
        self.counts: dict[Any, int] = {}
        self.ordered: Sorted | None = None

    def change(self, value: Any, copies: int) -> None:
        counts = self.counts
        count = counts.get(value, 0) + copies
        if count:
            if value not in counts:
                if self.ordered is not None:
                    self.ordered.add(value)
                elif counts:
                    self.ordered = Sorted(counts, key=value_order)
                    self.ordered.add(value)
            counts[value] = count
        else:
            del counts[value]
            if self.ordered is not None:
                self.ordered.remove(value)

    def __bool__(self) -> bool:
        return bool(self.counts)

    def values(self) -> Iterable[Any]:
        """The distinct values, smallest first."""
        return self.ordered if self.ordered is not None else self.counts

    def extreme(self, last: bool) -> Any:
        """The smallest (or, when `last`, the largest) value; None when empty."""
        if not self.counts:
            return None
        if self.ordered is not None:
            return self.ordered[-1 if last else 0]
        return next(iter(self.counts))
