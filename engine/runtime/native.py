"""The native reduction core: `refold_native` (Rust, built from `native/` by `make setup`).

A `GroupedCore` holds a grouped view's keys in Rust and does in one call per batch
what `GroupedReducer.apply` (per unit), `Renderer.view`, `take_deltas` +
`Renderer.deltas` and `take_state_changes` do in Python, byte for byte (the
differential tests in tests/test_native_core.py hold it to that); a `TopNCore` does
the same for a Top-N view's groups (`TopNReducer`, tests/test_native_topn.py). It runs the views
and outputs it was built for (`why_not`); for a value outside what it handles (a
float in a summed column, a float or boolean view key, an integer past 64 bits...) it
raises `Unsupported` before the batch commits anything, and the shard runs that batch
and the rest of its life in Python, from its store (`refold.runtime.shard`).

`spark.core` chooses: `auto` (the default) the native core where it runs the view,
`native` the same but a view it cannot run is a configuration error, `python` never.
Without a built `refold_native` the engine runs in Python as before.

For a `jsonl` changelog without `view.where` the core also reads the batch's records
(`read_batch`: decode, message-key check, pairing, merge, as `UnitReader.read`), with no
Python object per event, when every record is clean; a batch with anything Python would
dead-letter or read otherwise goes through `UnitReader` as before (core/read.rs).

A `WindowCore` runs a windowed grouped view with a tumble, hop or session window, and a
Top-N per tumble or hop window (emit `per_event` or `final`), as `WindowedReducer` does
(tests/test_native_windows.py): its refusals carry a fifth item, their headers (a
`late` event's window and the watermark).

A `JoinCore` is a drop-in for `JoinReducer` (`join_reducer` picks one by `spark.core`):
the same methods, records, state records and refusals (tests/test_native_join.py), and
`apply_batch` for a batch's units of both sides in one call. For a value outside what it
holds it raises `Unsupported` before the unit changes anything; the shard then goes on
with a `JoinReducer` from its store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from refold.config import JoinSpec, Pipeline
from refold.errors import ConfigError
from refold.model.reasons import Reason
from refold.plan import RIGHT_PARTITIONS
from refold.recovery.records import PendingRecord
from refold.reduce.join import JoinReducer
from refold.runtime.batch import (
    DeadLetters,
    InputRecord,
    Outgoing,
    UnitReader,
    held_over,
    partitions,
)
from refold.runtime.shards import ranked_globally
from refold.runtime.tables import is_table, joins_a_table

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
    if ranked_globally(pipeline):
        return "a global Top-N in shards ranks its shards' rows in Python (refold.runtime.tops)"
    if is_table(pipeline):
        return "upsert and Debezium sources reduce in Python"
    return _outputs_refusal(pipeline)


def _outputs_refusal(pipeline: Pipeline) -> str | None:
    """Why the native core cannot write the pipeline's outputs (None: it can)."""
    outputs = pipeline.outputs
    if outputs.materialize:
        return "materializations read the view changes in Python"
    # (`emit: final` is a windowed view's: config.py refuses it elsewhere)
    if outputs.view is not None and (outputs.view.format != "jsonl" or outputs.view.emit == "per_batch"):
        return "the native core writes the view output as JSON, emit: per_event or final"
    if outputs.delta is not None and outputs.delta.format != "jsonl":
        return "the native core writes the delta output as JSON"
    return None


def core_of(pipeline: Pipeline) -> str:
    """Which core reduces the pipeline's view, and why not the native one (`refold explain`)."""
    if pipeline.spark.core == "python":
        return "Python (spark.core: python)"
    reason = why_not(pipeline)
    return "the native core (refold_native)" if reason is None else f"Python ({reason})"


def join_cores_of(pipeline: Pipeline) -> str:
    """Which cores join a join pipeline's sources and reduce the grouped view over them
    (`refold explain`)."""
    if pipeline.spark.core == "python":
        return "Python (spark.core: python)"
    if refold_native is None:
        return "Python (the native core (refold_native) is not built: `make setup` builds it from native/)"
    said = ["Python for the join (a table source joins in Python)" if joins_a_table(pipeline) else "the native join core"]
    if pipeline.view.key:
        reason = _outputs_refusal(pipeline)
        said.append("the native core for the grouped view over it" if reason is None
                    else f"Python for the grouped view over it ({reason})")
    return ", ".join(said)


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
    form = outputs.view.form if outputs.view is not None else None
    if view.window is not None:
        window = view.window
        session = {"gap": window.gap_ms} if window.kind == "session" else {}  # (a gap makes session windows)
        top: dict[str, Any] = {}
        if view.top_n is not None:  # a windowed Top-N: per `partition_by` and window
            top_n = view.top_n
            columns = None if top_n.columns is None else list(top_n.columns)
            top["top_n"] = (top_n.n, list(top_n.order_by.items()), list(top_n.partition_by), columns)
        core = refold_native.WindowCore(
            list(view.key),
            [(name, spec.agg, spec.column) for name, spec in view.columns.items()],
            form,
            outputs.delta is not None,
            window.time,
            window.size_ms,
            window.slide_ms,
            window.lateness_ms,
            **session,
            emit_final=outputs.view is not None and outputs.view.emit == "final",
            **top,
        )
    elif view.top_n is not None:
        top_n = view.top_n
        columns = None if top_n.columns is None else list(top_n.columns)
        core = refold_native.TopNCore(top_n.n, list(top_n.order_by.items()), list(top_n.partition_by), columns, form)
    else:
        return _grouped_core(pipeline)
    core.provenance = outputs.provenance  # cause headers on its view and delta records
    return core


def _grouped_core(pipeline: Pipeline) -> Any:
    assert refold_native is not None
    view, outputs = pipeline.view, pipeline.outputs
    core = refold_native.GroupedCore(
        list(view.key),
        [(name, spec.agg, spec.column) for name, spec in view.columns.items()],
        outputs.view.form if outputs.view is not None else None,
        outputs.delta is not None,
    )
    core.provenance = outputs.provenance  # cause headers on its view and delta records
    return core


def join_view_core(pipeline: Pipeline, setting: str) -> Any | None:
    """The native `GroupedCore` of the grouped view over a join (`spark.core` = `setting`),
    its cause headers naming `<topic>:<partition>:<offset>` as `JoinRenderer`'s do; None
    when Python reduces it. ConfigError for `native` when the core cannot."""
    if setting == "python":
        return None
    reason = "the native core (refold_native) is not built" if refold_native is None else _outputs_refusal(pipeline)
    if reason is not None:
        if setting == "native":
            raise ConfigError(f"native, but {reason}", where="spark.core")
        return None
    join = pipeline.view.join
    assert join is not None
    core = _grouped_core(pipeline)
    core.name_join_causes(pipeline.sources[join.left].topic, pipeline.sources[join.right].topic, RIGHT_PARTITIONS)
    return core


def join_reducer(spec: JoinSpec, setting: str = "auto") -> Any:
    """The join's reducer for `spark.core` = `setting`: the native `JoinCore` (`auto`,
    `native`) or `JoinReducer` (`python`, or `auto` without a built core); ConfigError
    for `native` without one."""
    if setting == "python":
        return JoinReducer(spec)
    if refold_native is None:
        if setting == "native":
            raise ConfigError("native, but the native core (refold_native) is not built", where="spark.core")
        return JoinReducer(spec)
    return refold_native.JoinCore(spec.sides_on, spec.outputs, spec.output_key, spec.type)


def reads_natively(pipeline: Pipeline) -> bool:
    """Whether the native core may read the pipeline's records itself (`read_batch`)."""
    return pipeline.source.format == "jsonl" and pipeline.view.where is None and not is_table(pipeline)


class NativeRead(NamedTuple):
    """A batch the native core read: its records in the order the core counts them, the
    view keys it touches (to load), and the `-C`s held over for the checkpoint."""

    records: list[InputRecord]
    touched: set[bytes]
    pending: dict[int, PendingRecord]

    def refuse(self, refused: Sequence[tuple[Any, ...]], dead_letters: DeadLetters, out: Outgoing) -> None:
        """Dead letters for the units `apply_read` refused (their records by index)."""
        for indices, index, reason, *shown in refused:
            units = [(None, self.records[i]) for i in indices]
            dead_letters.refuse(out, units, index, Reason(reason), *refusal_shown(reason, shown))


def refusal_shown(reason: str, shown: Sequence[Any]) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """A native refusal's (detail, headers) as a dead letter shows them
    (`DeadLetters.rejected`): a windowed view's own refusals (`late`, `bad event time`,
    whose refusals carry their headers) with their detail and headers, the others' details
    left out."""
    if reason in (Reason.LATE, Reason.BAD_TIME):
        return shown[0], tuple(shown[1]) if len(shown) > 1 else ()
    return None, ()


def read_batch(core: Any, reader: UnitReader, fresh: Sequence[InputRecord],
               pending: Mapping[int, PendingRecord]) -> NativeRead | None:
    """`core.read` of the batch (its units wait in the core for `apply_read`); None when
    the core does not take it (`reader.read` does)."""
    parts, pending_out = partitions(fresh, pending)
    keys = reader.keys
    read = core.read(parts, list(keys.columns) if keys is not None else None)
    if read is None:
        return None
    touched, unpaired, verified = read
    if verified and keys is not None:
        keys.verified = True
    records = [record for _, rows in parts for record in rows]
    for index in unpaired:
        pending_out[records[index].partition] = held_over(records[index])
    return NativeRead(records, set(touched), pending_out)


__all__ = ["NativeRead", "Unsupported", "core_of", "join_reducer", "native_core", "read_batch", "reads_natively", "refusal_shown", "why_not"]
