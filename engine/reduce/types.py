"""The reducers' value types: the events in, the view changes out, the refusal, and
`ViewReducer`, the contract both reducers keep (the package docstring says who calls
what, and when)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any, NamedTuple, Protocol

from refold.model import jsonbytes
from refold.model.changelog import Op

Tag = tuple[int, int, int]  # (event_time, partition, offset)
Number = int | Fraction
Cause = tuple[int, int]  # the input event an output record came of: (partition, offset) of the source topic


def cause_of(tag: Tag) -> Cause:
    """The cause an event's tag names: its source partition and offset."""
    return tag[1], tag[2]


class SourceEvent(NamedTuple):
    """One decoded input event with the tag that orders it (a named tuple: one is
    made per input event, and a tuple is several times cheaper to make than a
    frozen dataclass)."""

    op: Op
    row: dict[str, Any]
    tag: Tag


class ViewChange(NamedTuple):
    """One record of the view changelog: an op, the output key and the view row."""

    op: Op
    key: tuple[Any, ...]
    row: dict[str, Any]
    key_names: tuple[str, ...] = ()

    def key_json(self) -> bytes:
        """The Kafka message key: a JSON object of the key columns."""
        return jsonbytes.dumps(dict(zip(self.key_names, self.key, strict=True)))


class Changes(list[ViewChange]):
    """One unit's view changes (a list, equal to a plain list of the same changes) with
    their provenance: `cause`, the unit's cause (its first event's: a correction pair
    names its `-C`), and `retracts`, one per change, the cause of the output record a
    `-R`/`-C` takes back (None for `+A`/`+C`, and where it is unknown)."""

    __slots__ = ("cause", "retracts")

    def __init__(self, cause: Cause | None = None) -> None:
        super().__init__()
        self.cause = cause
        self.retracts: list[Cause | None] = []


class DeltaRows(list[dict[str, Any]]):
    """A batch's delta rows (a list) with, per row, its cause: the last input event of
    the batch that contributed to its key."""

    __slots__ = ("causes",)

    def __init__(self) -> None:
        super().__init__()
        self.causes: list[Cause | None] = []


class Rejected(Exception):
    """A unit was refused; the reducer's state is exactly as before the call."""

    def __init__(
        self, reason: str, index: int, detail: str | None = None, *, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(f"{reason} (event {index} of the unit)" + (f": {detail}" if detail else ""))
        self.reason = reason
        self.index = index
        self.detail = detail
        self.headers = headers  # a windowed view's late event: its window and the watermark, as headers


class ViewReducer(Protocol):
    """A view's reducer, as the batch processor drives it: `apply` per unit in input
    order, `take_deltas` and `take_state_changes` once per batch (inside its
    transaction), `restore` with the latest `P.state` records of the keys a batch is
    about to touch (`state_key`) and does not hold yet."""

    def apply(self, unit: Sequence[SourceEvent]) -> list[ViewChange]:
        """Apply one unit; return its view records in order. Raises Rejected, changing nothing."""
        ...

    def take_deltas(self) -> list[dict[str, Any]]:
        """Delta rows of the keys touched since the last call, ordered by key; then reset."""
        ...

    def take_state_changes(self) -> list[tuple[bytes, bytes | None]]:
        """`P.state` records (key, value or None = tombstone) for state touched since the last call."""
        ...

    def state_key(self, event: SourceEvent) -> tuple[Any, ...] | None:
        """The view key (a Top-N's group) whose state `apply` reads for this event; None
        when `apply` refuses the event without reading any."""
        ...

    def restore(self, records: Iterable[tuple[bytes, bytes]]) -> None:
        """Hold the keys these records are of (the latest value of every `P.state` record
        of each such key), replacing what was held of them; other keys stay."""
        ...

    def view(self) -> dict[tuple[Any, ...], dict[str, Any]]:
        """The current view rows by output key."""
        ...
