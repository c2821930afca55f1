"""Python's cyclic garbage collector around a batch (docs/ENGINE.md, "The garbage
collector", says why and what it measured)."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

FULL_COLLECTION_SECONDS = 600.0
_last_full_collection = time.monotonic()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off while a batch (or a restore) runs; what survives it
    frozen (`gc.freeze()`) before the collector is on again, so later collections only
    scan what is newer than the last batch.

    Guarantees and traps: reference counting still frees frozen objects, but a frozen
    cycle waits for the full collection (everything unfrozen, collected, frozen again)
    that runs at the end of a batch once every `FULL_COLLECTION_SECONDS`; there is no
    collection after an ordinary batch. Nested uses (a restore inside a batch) are
    no-ops; so is a use while the collector is off for another reason."""
    global _last_full_collection
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        # frozen before the collector is on again: the first allocation after it would
        # otherwise start a young collection over everything the batch left
        gc.freeze()
        if time.monotonic() - _last_full_collection >= FULL_COLLECTION_SECONDS:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            _last_full_collection = time.monotonic()
        gc.enable()
