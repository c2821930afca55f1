"""What the native cores' differential tests share (tests/test_native_core.py for
`GroupedCore`, tests/test_native_topn.py for `TopNCore`): units drawn against a model of
the live rows, the test's own account of the values a core does not hold, a view as
bytes, and a store of `P.state` records kept as a dict."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from refold_native import Unsupported

from refold.model.changelog import Op
from refold.reduce import SourceEvent
from refold.reduce.values import key_bytes

I64 = (-(2**63), 2**63 - 1)


def view_bytes(view: dict[tuple, dict]) -> dict[bytes, bytes]:
    """A view as JSON bytes (dict equality would take 1 for 1.0 and True)."""
    return {key_bytes(key): orjson.dumps(row) for key, row in view.items()}


def bad_anywhere(value: Any) -> bool:
    """A value orjson would write that the core does not hold, at any depth."""
    kind = type(value)
    if value is None or kind is bool:
        return False
    if kind is int:
        return not I64[0] <= value <= I64[1]
    if kind is float:
        return not math.isfinite(value)
    if kind is str:
        try:
            value.encode()
        except UnicodeEncodeError:
            return True
        return False
    if kind in (list, tuple):
        return any(bad_anywhere(v) for v in value)
    if kind is dict:
        return any(type(k) is not str or bad_anywhere(k) or bad_anywhere(v) for k, v in value.items())
    return True


class ChangelogSource:
    """Draws units against a model of the live rows (a retraction usually finds one).

    A subclass draws the rows (`fresh_row`, and `same_row`: an equal row written
    otherwise). `key` are the columns a correction mostly keeps (the view's key, a
    Top-N's groups); one append in `odds` copies a live row, and one correction in
    `odds` may move its row to another key."""

    odds = 5

    def __init__(self, data: st.DataObject, key: Sequence[str], unsupported: bool) -> None:
        self.data = data
        self.key = key
        self.unsupported = unsupported  # whether to draw values the core refuses at all
        self.live: list[dict[str, Any]] = []
        self.time = 1_000
        self.offset = 0

    def draw(self, strategy: st.SearchStrategy[Any]) -> Any:
        return self.data.draw(strategy)

    def tag(self) -> tuple[int, int, int]:
        self.time += self.draw(st.integers(0, 3))
        self.offset += 1
        return (self.time - self.draw(st.integers(0, 2)), self.draw(st.integers(0, 1)), self.offset)

    def fresh_row(self) -> dict[str, Any]:
        raise NotImplementedError

    def same_row(self, row: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def live_or_fresh(self) -> dict[str, Any]:
        if self.live and self.draw(st.integers(0, 9)) > 0:
            row = self.live.pop(self.draw(st.integers(0, len(self.live) - 1)))
            return self.same_row(row) if self.draw(st.booleans()) else row
        return self.fresh_row()  # most likely not live

    def unit(self) -> tuple:
        choice = self.draw(st.integers(0, 9))
        if choice < 5 or not self.live:
            row = self.fresh_row()
            if self.draw(st.integers(0, self.odds - 1)) == 0 and self.live:
                row = dict(self.live[self.draw(st.integers(0, len(self.live) - 1))])  # another copy
            self.live.append(row)
            return ((SourceEvent(Op.APPEND, row, self.tag()), None),)
        if choice < 7:
            return ((SourceEvent(Op.RETRACT, self.live_or_fresh(), self.tag()), None),)
        old = self.live_or_fresh()
        new = self.fresh_row()
        if self.draw(st.integers(0, self.odds - 1)) > 0:
            for name in self.key:  # the same key, mostly
                if name in old:
                    new[name] = old[name]
        self.live.append(new)
        tag = self.tag()
        pair = ((SourceEvent(Op.CORRECT_FROM, old, tag), None), (SourceEvent(Op.CORRECT_TO, new, tag), None))
        return pair if self.draw(st.integers(0, 6)) > 0 else [list(item) for item in pair]

    def batch(self) -> list:
        return [self.unit() for _ in range(self.draw(st.integers(1, 25)))]


def records_of(store: dict[bytes, bytes], keys: set[bytes] | None = None) -> list[tuple[bytes, bytes]]:
    """The store's records (of `keys`, as key JSON; all when None)."""
    if keys is None:
        return list(store.items())
    return [(k, v) for k, v in store.items() if key_bytes(tuple(orjson.loads(k)[0])) in keys]


def apply_records(store: dict[bytes, bytes], records: list[tuple[bytes, bytes | None]]) -> None:
    for key, value in records:
        if value is None:
            store.pop(key, None)
        else:
            store[key] = value


class Pair:
    """A native core and the Python path fed alike, with the state records each wrote.
    A subclass makes them (`fresh`: `core`, and `python` with its `reducer`) and says
    which batches hold a value the core may refuse (`unsupported`) and how many keys
    the reducer holds (`held`)."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.store: dict[bytes, bytes] = {}
        self.fresh()

    def fresh(self) -> None:
        raise NotImplementedError

    def unsupported(self, units: Sequence[Sequence[tuple[SourceEvent, Any]]]) -> bool:
        raise NotImplementedError

    def held(self) -> int:
        raise NotImplementedError

    def restore(self, keys: set[bytes] | None = None) -> None:
        """Both anew from the state records so far (of `keys`; the core's and Python's
        are equal): the same view."""
        self.fresh()
        self.core.restore(records_of(self.store, keys))
        self.python.reducer.restore(records_of(self.store, keys))
        assert view_bytes(self.core.view()) == view_bytes(self.python.reducer.view())


def check_batch(pair: Pair, units: list, restore_touched: bool) -> str:
    """One batch through both; the outputs equal byte for byte. Returns what happened."""
    try:
        touched = set(pair.core.touched(units))
    except Unsupported:
        assert pair.unsupported(units), "touched: Unsupported without an unsupported value"
        pair.restore()
        return "unsupported"
    assert touched == pair.python.touched(units)
    if restore_touched:  # as the shard loads the keys a batch touches into empty reducers
        pair.restore(touched)
    try:
        got = pair.core.apply_batch(units)
    except Unsupported:
        assert pair.unsupported(units), "Unsupported without an unsupported value in the batch"
        pair.restore()
        return "unsupported"
    want = pair.python.apply_batch(units)
    assert got[0] == want[0], "rejected"
    assert got[1] == want[1], "view records"
    assert got[2] == want[2], "delta records"
    assert got[3] == want[3], "state records"
    assert len(pair.core) == pair.held()
    assert view_bytes(pair.core.view()) == view_bytes(pair.python.reducer.view())
    apply_records(pair.store, want[3])
    return "rejected" if want[0] else "ok"


QUICK, THOROUGH = 150, 1_000  # random views per differential test: in `make test`, in `make test-slow`


def two_tiers(differential: Callable[[Any, st.DataObject], None],
              specs: st.SearchStrategy[Any]) -> tuple[Callable[..., None], Callable[..., None]]:
    """A core's differential test twice: over QUICK random views for `make test` and over
    THOROUGH for `make test-slow` (marked slow); bind them as `test_differential` and
    `test_differential_thorough`."""
    def tier(examples: int) -> Callable[..., None]:
        test = given(spec=specs, data=st.data())(differential)
        return settings(max_examples=examples, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])(test)

    return tier(QUICK), pytest.mark.slow(tier(THOROUGH))
