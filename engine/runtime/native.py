"""The native reduction core: `refold_native` (Rust, built from `native/` by `make setup`).

A `GroupedCore` holds a grouped view's keys in Rust and does in one call per batch
what `GroupedReducer.apply` (per unit), `Renderer.view`, `take_deltas` +
`Renderer.deltas` and `take_state_changes` do in Python, byte for byte (the
differential tests in tests/test_native_core.py hold it to that). It runs the views
and outputs it was built for (`why_not`); for a value outside what it handles (a
float in a summed column, a float or boolean view key, an integer past 64 bits...) it
raises `Unsupported` before the batch commits anything, and the shard runs that batch
and the rest of its life in Python, from its store (`refold.runtime.shard`).

`spark.core` chooses: `auto` (the default) the native core where it runs the view,
`native` the same but a view it cannot run is a configuration error, `python` never.
Without a built `refold_native` the engine runs in Python as before.
"""

from __future__ import annotations

from typing import Any

from refold.config import Pipeline
from refold.errors import ConfigError
from refold.runtime.tables import is_table

try:
    import refold_native
    from refold_native import Unsupported
except ImportError:  # not built: Python does everything
    refold_native = None

    class Unsupported(Exception):  # type: ignore[no-redef]
        """What the native core raises for a value it does not handle."""


def why_not(pipeline: Pipeline) -> str | None:
    """Why the native core cannot run this pipeline's view (None: it can)."""
    if refold_native is None:
        return "the native core (refold_native) is not built: `make setup` builds it from native/"
    view, outputs = pipeline.view, pipeline.outputs
    if view.top_n is not None:
        return "Top-N views reduce in Python"
    if is_table(pipeline):
        return "upsert and Debezium sources reduce in Python"
    if outputs.materialize:
        return "materializations read the view changes in Python"
    if outputs.view is not None and (outputs.view.format != "jsonl" or outputs.view.emit != "per_event"):
        return "the native core writes the view output as JSON, emit: per_event"
    if outputs.delta is not None and outputs.delta.format != "jsonl":
        return "the native core writes the delta output as JSON"
    return None


def core_of(pipeline: Pipeline) -> str:
    """Which core reduces the pipeline's view, and why not the native one (`refold explain`)."""
    if pipeline.spark.core == "python":
        return "Python (spark.core: python)"
    reason = why_not(pipeline)
    return "the native core (refold_native)" if reason is None else f"Python ({reason})"


def native_core(pipeline: Pipeline) -> Any | None:
    """A new native core for the pipeline's view, or None when it reduces in Python.
    ConfigError when `spark.core` is `native` and the native core cannot run it."""
    setting = pipeline.spark.core
    if setting == "python":
        return None
    reason = why_not(pipeline)
    if reason is not None:
        if setting == "native":
            raise ConfigError(f"native, but {reason}", where="spark.core")
        return None
    assert refold_native is not None
    view, outputs = pipeline.view, pipeline.outputs
    return refold_native.GroupedCore(
        list(view.key),
        [(name, spec.agg, spec.column) for name, spec in view.columns.items()],
        outputs.view.form if outputs.view is not None else None,
        outputs.delta is not None,
    )


__all__ = ["Unsupported", "core_of", "native_core", "why_not"]
