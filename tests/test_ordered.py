"""`refold.reduce.ordered.Sorted`: the same items in the same order as a sorted model,
whether it is still a plain list or has grown into a sortedcontainers list."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refold.reduce import ordered
from refold.reduce.ordered import Sorted
from refold.reduce.values import value_order

# JSON scalars as a min/max/set column holds them (value_order orders across types)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-50, 50), st.floats(-50, 50, allow_nan=False),
                    st.text(max_size=3))
tags = st.tuples(st.integers(0, 20), st.integers(0, 3), st.integers(0, 100))


def _replay(steps: list[tuple[bool, Any]], key: Any) -> None:
    held = Sorted(key=key)
    model: dict[Any, Any] = {}  # item -> item, as distinct items (1 and 1.0 are one item)
    for add, item in steps:
        order = key or (lambda x: x)
        if add and item not in model:
            at = held.add(item)
            model[item] = item
            assert order(held[at]) == order(item)  # where it went
        elif not add:
            if item in model:
                before, gone = list(held), model.pop(item)
                at = held.remove(gone)
                assert order(before[at]) == order(gone) and [order(x) for x in held] == [
                    order(x) for x in before[:at] + before[at + 1 :]]  # where it was
            else:
                with pytest.raises(ValueError):
                    held.remove(item)
        want = sorted(model.values(), key=key)
        assert [order(x) for x in held] == [order(x) for x in want]
        assert len(held) == len(want) and bool(held) == bool(want)
        if want:
            assert (order(held[0]), order(held[-1])) == (order(want[0]), order(want[-1]))


@contextmanager
def limited(limit: int) -> Iterator[None]:
    saved, ordered.LIMIT = ordered.LIMIT, limit
    try:
        yield
    finally:
        ordered.LIMIT = saved


@pytest.mark.parametrize("limit", [3, ordered.LIMIT])
@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), tags), max_size=40))
def test_tags_stay_sorted_in_both_forms(limit: int, steps: list[tuple[bool, Any]]) -> None:
    with limited(limit):  # 3: most runs cross into SortedList
        _replay(steps, None)


@pytest.mark.parametrize("limit", [3, ordered.LIMIT])
@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), scalars), max_size=40))
def test_values_stay_in_value_order_in_both_forms(limit: int, steps: list[tuple[bool, Any]]) -> None:
    with limited(limit):  # 3: most runs cross into SortedKeyList
        _replay(steps, value_order)


def test_a_large_list_becomes_a_sortedcontainers_list() -> None:
    held = Sorted(range(ordered.LIMIT, 0, -1))
    assert type(held._items) is list and held[0] == 1
    held.add(0)
    assert type(held._items) is not list and list(held) == list(range(ordered.LIMIT + 1))
    held.remove(7)
    assert 7 not in list(held) and len(held) == ordered.LIMIT
    assert held[:3] == [0, 1, 2]
