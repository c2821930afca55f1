//! `refold_native`: Refold's native reduction core (see README.md).
//!
//! - `json`: JSON bytes as orjson writes and reads them
//! - `value`: column values, read off Python objects; `value_order`
//! - `statecodec`: `P.state` records (refold.reduce.statecodec)
//! - `core`: the grouped reduction and its rendering (refold.reduce.grouped,
//!   refold.runtime.render), the reader of a clean `jsonl` batch (refold.runtime.batch)
//!   and stage 1 of a re-grouping view (refold.runtime.exchange)
//!
//! - `topn`: the Top-N reduction and its rendering (refold.reduce.topn)
//!
//! - `window`: windowed grouped views, tumble and hop (refold.reduce.windowed)
//!
//! - `join`: equi-joins of two changelogs (refold.reduce.join), its class `JoinCore`
//!
//! This file is the Python interface: `GroupedCore`, `TopNCore`, `WindowCore` and
//! `Unsupported`.

mod core;
mod join;
mod json;
mod statecodec;
mod topn;
// the trace index (refold.runtime.traceindex)
mod traceindex;
mod value;
mod window;

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PyTuple};

use crate::core::{CauseNames, Core, Fail, Plan, RestoreFail, Router};
use crate::topn::{TopN, TopPlan};
use crate::window::{Headers, SessionCore, TopSpec, WindowCore as FixedCore, WindowOut, WindowPlan, Windowed};

// the cores' allocator: each new view key, window and row is a few small allocations
// (its state, its rows' map, its key's JSON), which mimalloc serves at about half
// glibc malloc's CPU (the windowed hot path: one new key per event)
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

create_exception!(
    refold_native,
    Unsupported,
    PyException,
    "An input the native core does not handle: reduce this batch (and on) in Python."
);

fn restore_error(fail: RestoreFail) -> PyErr {
    match fail {
        RestoreFail::NotState(why) => PyValueError::new_err(format!("not a state record: {why}")),
        RestoreFail::Fail(fail) => raise(fail),
    }
}

fn raise(fail: Fail) -> PyErr {
    match fail {
        Fail::Unsup(why) => Unsupported::new_err(why.0),
        Fail::Py(err) => err,
        // a refusal is data, never raised: only a bug would get here
        Fail::Reject(r) => Unsupported::new_err(format!("unexpected refusal: {}", r.reason)),
    }
}

/// A grouped view's reducer and renderer in one (see the module's README).
#[pyclass(module = "refold_native")]
struct GroupedCore {
    core: Core,
    /// stage 1 of a re-grouping view: this core counts rows per message key, the router
    /// checks and routes by the view's key (`route_with`)
    router: Option<Router>,
    /// a join's batch `read_join` read, each unit with its side, waiting for `join_kept`
    join_units: Option<Vec<(usize, Vec<crate::core::Ev>)>>,
}

#[pymethods]
impl GroupedCore {
    #[new]
    #[pyo3(signature = (key_columns, columns, view_form, delta))]
    fn new(
        py: Python<'_>,
        key_columns: Vec<String>,
        columns: Vec<(String, String, String)>,
        view_form: Option<String>,
        delta: bool,
    ) -> PyResult<Self> {
        if key_columns.is_empty() {
            return Err(PyValueError::new_err("a grouped view needs at least one key column"));
        }
        Ok(GroupedCore {
            core: Core::new(Plan::new(py, key_columns, columns, view_form, delta)?),
            router: None,
            join_units: None,
        })
    }

    /// `GroupedReducer.restore(records)`: (record key, value) pairs of `P.state`.
    fn restore(&mut self, py: Python<'_>, records: &Bound<'_, PyAny>) -> PyResult<()> {
        self.core.restore(py, records).map_err(restore_error)
    }

    /// The key JSON (`key_bytes`) of `state_key(event)` for every event of the units.
    fn touched<'py>(&mut self, py: Python<'py>, units: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let keys = self.core.touched(units).map_err(raise)?;
        PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))
    }

    /// `UnitReader.read` of a clean `jsonl` batch (see core/read.rs): `parts` is
    /// `[(partition, [InputRecord, ...]), ...]`, `check` the message-key columns of a
    /// co-partitioned view. (touched keys, pending record indices, verified), the units
    /// kept for `apply_read`; None when the batch is not clean.
    #[pyo3(signature = (parts, check = None))]
    fn read<'py>(
        &mut self,
        py: Python<'py>,
        parts: &Bound<'py, PyAny>,
        check: Option<Vec<String>>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        read_tuple(py, self.core.read(parts, check.as_deref()).map_err(raise)?)
    }

    /// `apply_batch` of the units `read` kept: (rejected, view, delta, state), each
    /// rejection as (its unit's record indices, index, reason, detail).
    fn apply_read<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let out = collector_paused(|| self.core.apply_read(py));
        let (out, records) = out.map_err(raise)?;
        let rejected = rejections(py, out.rejected, records)?;
        batch_tuple(py, rejected, out.view, out.delta, out.state)
    }

    /// One batch: (rejected, view records, delta records, state records).
    fn apply_batch<'py>(&mut self, py: Python<'py>, units: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyTuple>> {
        let out = collector_paused(|| self.core.apply_batch(py, units));
        let out = out.map_err(raise)?;
        let rejected = unit_rejections(py, out.rejected)?;
        batch_tuple(py, rejected, out.view, out.delta, out.state)
    }

    /// A grouped view over a join, its batch joined on `join` (`JoinCore.apply_batch`'s
    /// `[(side, unit), ...]`, each unit its (event, record) pairs) without the joined
    /// records becoming Python objects: the join's refusals as (unit index, index, reason,
    /// detail); `Unsupported` as `JoinCore.apply_batch`'s. The joined records wait for
    /// `apply_read` (`touched_read`: their view keys), whose refusals name their source
    /// unit's index (once per record).
    fn join_read<'py>(
        &mut self,
        py: Python<'py>,
        join: &Bound<'py, join::py::JoinCore>,
        units: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let (rejected, events) = collector_paused(|| join.borrow_mut().join_events(units))?;
        self.core.prepare(events);
        PyList::new(py, unit_rejections(py, rejected)?)
    }

    /// A grouped view over a join (`join`) whose batch this core reads itself, as `read`
    /// reads a clean `jsonl` batch: `parts` holds both sources' partitions, the right
    /// one's numbered from `right_from`. (the state prefixes of the join keys its events
    /// read, pending record indices); the units kept for `join_kept`; None when the batch
    /// is not clean.
    fn read_join<'py>(
        &mut self,
        py: Python<'py>,
        join: &Bound<'py, join::py::JoinCore>,
        parts: &Bound<'py, PyAny>,
        right_from: i64,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        self.join_units = None;
        let Some((units, read)) = crate::core::read_units(parts, None).map_err(raise)? else { return Ok(None) };
        let units: Vec<_> = units.into_iter().map(|unit| (usize::from(unit[0].tag.1 >= right_from), unit)).collect();
        let prefixes = join.borrow().touched_prefixes(&units);
        self.join_units = Some(units);
        let touched = PyList::new(py, prefixes.iter().map(|k| PyBytes::new(py, k)))?;
        Ok(Some(PyTuple::new(py, [touched.into_any(), PyList::new(py, read.pending())?.into_any()])?))
    }

    /// The units `read_join` kept, joined on `join` (its keys loaded), their records kept
    /// for `apply_read` as `join_read` keeps them (each numbered by its source unit's
    /// first record); the join's refusals as (the unit's record indices, index, reason,
    /// detail). `Unsupported` as `join_read`'s.
    fn join_kept<'py>(&mut self, py: Python<'py>, join: &Bound<'py, join::py::JoinCore>) -> PyResult<Bound<'py, PyList>> {
        let units = self.join_units.take().unwrap_or_default();
        let (rejected, events) = collector_paused(|| join.borrow_mut().join_units(units)).map_err(raise)?;
        self.core.prepare(events);
        let (records, refusals): (Vec<_>, Vec<_>) = rejected.into_iter().map(|(records, r)| (records, (0, r))).unzip();
        PyList::new(py, rejections(py, refusals, records)?)
    }

    /// The key JSON of the view keys `join_read`'s units touch.
    fn touched_read<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let keys = self.core.prepared_touched().map_err(raise)?;
        PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))
    }

    /// `ExchangeReader.read` of stage 2's `P.repartition` records, in offset order (see
    /// core/routed.rs): the view keys they touch, the units kept for `apply_read`; None
    /// when a record is not a routed unit or a close.
    fn read_routed<'py>(&mut self, py: Python<'py>, records: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyList>>> {
        let Some(touched) = self.core.read_routed(records).map_err(raise)? else { return Ok(None) };
        Ok(Some(PyList::new(py, touched.iter().map(|k| PyBytes::new(py, k)))?))
    }

    /// Make this core (rows per message key) stage 1 of a re-grouping grouped view: its
    /// key and columns, and the number of stage-2 shards (see core/route.rs).
    fn route_with(
        &mut self,
        py: Python<'_>,
        key_columns: Vec<String>,
        columns: Vec<(String, String, String)>,
        shards: u64,
    ) -> PyResult<()> {
        if key_columns.is_empty() || shards == 0 {
            return Err(PyValueError::new_err("a routed view needs key columns and at least one shard"));
        }
        self.router = Some(Router::new(Plan::new(py, key_columns, columns, None, false)?, shards));
        Ok(())
    }

    /// Stage 1 over the units `read` kept: (rejected, routed, state), each rejection as
    /// `apply_read`'s, `routed` the (stage-2 shard, value) records in order.
    fn route_read<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let Some(router) = self.router.as_ref() else {
            return Err(PyValueError::new_err("route_read before route_with"));
        };
        let out = collector_paused(|| self.core.route_read(py, router));
        let (routed, records) = out.map_err(raise)?;
        let rejected = rejections(py, routed.out.rejected, records)?;
        let values = routed
            .routed
            .into_iter()
            .map(|(shard, value)| (shard, PyBytes::new(py, &value)).into_pyobject(py).map(|t| t.into_any()))
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, [PyList::new(py, rejected)?, PyList::new(py, values)?, PyList::new(py, routed.out.state)?])
    }

    /// `GroupedReducer.view()`: the current view rows by key tuple.
    fn view<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.core.view(py)
    }

    /// Whether view and delta records carry cause headers (`outputs.provenance`; on).
    #[setter]
    fn set_provenance(&mut self, on: bool) {
        self.core.provenance = on;
    }

    /// A grouped view over a join: its cause headers name `<topic>:<partition>:<offset>`,
    /// `left`'s or `right`'s (whose partitions the join's shards number from `right_from`).
    fn name_join_causes(&mut self, left: &str, right: &str, right_from: i64) {
        self.core.names = CauseNames::join(left, right, right_from);
    }

    fn __len__(&self) -> usize {
        self.core.len()
    }
}

/// A Top-N view's reducer and renderer in one (see the module's README): the interface
/// of `GroupedCore` a shard uses, without deltas or routing.
#[pyclass(module = "refold_native")]
struct TopNCore {
    core: TopN,
}

#[pymethods]
impl TopNCore {
    /// `order_by` as (column, "asc" or "desc") pairs in their order; `columns`:
    /// `top_n.columns` (None: every row column).
    #[new]
    #[pyo3(signature = (n, order_by, partition_by, columns, view_form))]
    fn new(
        py: Python<'_>,
        n: usize,
        order_by: Vec<(String, String)>,
        partition_by: Vec<String>,
        columns: Option<Vec<String>>,
        view_form: Option<String>,
    ) -> PyResult<Self> {
        Ok(TopNCore { core: TopN::new(TopPlan::new(py, n, order_by, partition_by, columns, view_form)?) })
    }

    /// `TopNReducer.restore(records)`: (record key, value) pairs of `P.state`.
    fn restore(&mut self, records: &Bound<'_, PyAny>) -> PyResult<()> {
        self.core.restore(records).map_err(restore_error)
    }

    /// The group JSON (`key_bytes`) of `state_key(event)` for every event of the units.
    fn touched<'py>(&mut self, py: Python<'py>, units: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let keys = self.core.touched(units).map_err(raise)?;
        PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))
    }

    /// As `GroupedCore.read` (core/read.rs), the groups the batch touches in `touched`.
    #[pyo3(signature = (parts, check = None))]
    fn read<'py>(
        &mut self,
        py: Python<'py>,
        parts: &Bound<'py, PyAny>,
        check: Option<Vec<String>>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        read_tuple(py, self.core.read(parts, check.as_deref()).map_err(raise)?)
    }

    /// As `GroupedCore.read_routed` (core/routed.rs): a partitioned Top-N's stage 2.
    fn read_routed<'py>(&mut self, py: Python<'py>, records: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyList>>> {
        let Some(touched) = self.core.read_routed(records).map_err(raise)? else { return Ok(None) };
        Ok(Some(PyList::new(py, touched.iter().map(|k| PyBytes::new(py, k)))?))
    }

    /// `apply_batch` of the units `read` kept, as `GroupedCore.apply_read`.
    fn apply_read<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let out = collector_paused(|| self.core.apply_read(py));
        let (out, records) = out.map_err(raise)?;
        let rejected = rejections(py, out.rejected, records)?;
        batch_tuple(py, rejected, out.view, out.delta, out.state)
    }

    /// One batch: (rejected, view records, delta records (none), state records).
    fn apply_batch<'py>(&mut self, py: Python<'py>, units: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyTuple>> {
        let out = collector_paused(|| self.core.apply_batch(py, units));
        let out = out.map_err(raise)?;
        let rejected = unit_rejections(py, out.rejected)?;
        batch_tuple(py, rejected, out.view, out.delta, out.state)
    }

    /// `TopNReducer.view()`: the current output rows by (*group, place).
    fn view<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.core.view(py)
    }

    /// Whether view records carry cause headers (`outputs.provenance`; on).
    #[setter]
    fn set_provenance(&mut self, on: bool) {
        self.core.provenance = on;
    }

    fn __len__(&self) -> usize {
        self.core.len()
    }
}

/// A windowed Top-N's `top_n`: (n, order_by, partition_by, columns), as `TopNCore` takes them.
type TopNArgs = (usize, Vec<(String, String)>, Vec<String>, Option<Vec<String>>);

/// A windowed view's reducer and renderer in one (a grouped view per tumble, hop or
/// session window; a Top-N per tumble or hop window): the interface of `GroupedCore` a
/// shard uses, each refusal with a fifth item, its headers (a `late` event's window and
/// the watermark).
#[pyclass(module = "refold_native")]
struct WindowCore {
    core: Windowed,
}

#[pymethods]
impl WindowCore {
    /// `size`, `slide` (a tumble: = size) and `lateness` (None: windows never close) in
    /// milliseconds; `time` the event-time column; a `gap` makes session windows (size
    /// and slide unused); `emit_final`: the view output's `emit: final` (records only as
    /// windows close); `top_n` (n, order_by, partition_by, columns) makes a windowed Top-N.
    #[new]
    #[pyo3(signature = (key_columns, columns, view_form, delta, time, size, slide, lateness, gap = None, emit_final = false, top_n = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        key_columns: Vec<String>,
        columns: Vec<(String, String, String)>,
        view_form: Option<String>,
        delta: bool,
        time: String,
        size: i64,
        slide: i64,
        lateness: Option<i64>,
        gap: Option<i64>,
        emit_final: bool,
        top_n: Option<TopNArgs>,
    ) -> PyResult<Self> {
        if let Some((n, order_by, partition_by, top_columns)) = top_n {
            // a windowed Top-N (tumble, hop): (n, order_by, partition_by, columns) as `TopNCore`'s
            if gap.is_some() || size <= 0 || slide <= 0 || slide > size || lateness.is_some_and(|l| l < 0) {
                return Err(PyValueError::new_err("a windowed Top-N needs a tumble or hop window: 0 < slide <= size"));
            }
            let window = WindowPlan { time, size, slide, lateness, emit_final };
            let top = TopSpec { n, order_by, partition_by, columns: top_columns };
            return Ok(WindowCore { core: Windowed::Fixed(FixedCore::new(py, key_columns, columns, view_form, delta, window, Some(top))?) });
        }
        if key_columns.is_empty() {
            return Err(PyValueError::new_err("a grouped view needs at least one key column"));
        }
        if lateness.is_some_and(|l| l < 0) {
            return Err(PyValueError::new_err("a window needs a lateness of at least 0"));
        }
        if let Some(gap) = gap {
            if gap <= 0 {
                return Err(PyValueError::new_err("a session window needs a gap above 0"));
            }
            let core = SessionCore::new(py, key_columns, columns, view_form, time, gap, lateness, emit_final)?;
            return Ok(WindowCore { core: Windowed::Session(core) });
        }
        if size <= 0 || slide <= 0 || slide > size {
            return Err(PyValueError::new_err("a window needs 0 < slide <= size"));
        }
        let window = WindowPlan { time, size, slide, lateness, emit_final };
        Ok(WindowCore { core: Windowed::Fixed(FixedCore::new(py, key_columns, columns, view_form, delta, window, None)?) })
    }

    /// `WindowedReducer.restore(records)`: the watermark's record and every view record.
    fn restore(&mut self, py: Python<'_>, records: &Bound<'_, PyAny>) -> PyResult<()> {
        self.core.restore(py, records).map_err(restore_error)
    }

    /// The view key JSON of every event of the units (the shard holds all windows).
    fn touched<'py>(&mut self, py: Python<'py>, units: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let keys = self.core.touched(units).map_err(raise)?;
        PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))
    }

    /// As `GroupedCore.read` (core/read.rs).
    #[pyo3(signature = (parts, check = None))]
    fn read<'py>(
        &mut self,
        py: Python<'py>,
        parts: &Bound<'py, PyAny>,
        check: Option<Vec<String>>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        read_tuple(py, self.core.read(parts, check.as_deref()).map_err(raise)?)
    }

    /// As `GroupedCore.apply_read`, each rejection with its headers.
    fn apply_read<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let out = collector_paused(|| self.core.apply_read(py));
        let (WindowOut { out, headers }, records) = out.map_err(raise)?;
        let rejected = rejections(py, out.rejected, records)?;
        batch_tuple(py, with_headers(py, rejected, headers)?, out.view, out.delta, out.state)
    }

    /// As `GroupedCore.apply_batch`, each rejection with its headers.
    fn apply_batch<'py>(&mut self, py: Python<'py>, units: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyTuple>> {
        let out = collector_paused(|| self.core.apply_batch(py, units));
        let WindowOut { out, headers } = out.map_err(raise)?;
        let rejected = unit_rejections(py, out.rejected)?;
        batch_tuple(py, with_headers(py, rejected, headers)?, out.view, out.delta, out.state)
    }

    /// `WindowedReducer.view()`: the current view rows by (*key, window_start, window_end).
    fn view<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.core.view(py)
    }

    /// Whether view and delta records carry cause headers (`outputs.provenance`; on).
    #[setter]
    fn set_provenance(&mut self, on: bool) {
        self.core.set_provenance(on);
    }

    fn __len__(&self) -> usize {
        self.core.len()
    }
}

/// What `read` hands back: (touched keys, pending record indices, verified), or None.
fn read_tuple<'py>(py: Python<'py>, read: Option<crate::core::ReadOut>) -> PyResult<Option<Bound<'py, PyTuple>>> {
    let Some(read) = read else { return Ok(None) };
    let touched = PyList::new(py, read.touched.iter().map(|k| PyBytes::new(py, k)))?;
    let pending = PyList::new(py, read.pending())?;
    Ok(Some(PyTuple::new(py, [touched.into_any(), pending.into_any(), PyBool::new(py, read.verified).to_owned().into_any()])?))
}

/// Each refusal tuple with its headers, a tuple of (name, value) tuples, appended.
fn with_headers<'py>(py: Python<'py>, rejected: Vec<Bound<'py, PyAny>>, headers: Vec<Headers>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    rejected
        .into_iter()
        .zip(headers)
        .map(|(r, h)| {
            let mut items: Vec<Bound<'py, PyAny>> = r.cast::<PyTuple>()?.iter().collect();
            items.push(PyTuple::new(py, h.into_iter().map(|pair| pair.into_pyobject(py).map(|t| t.into_any())).collect::<PyResult<Vec<_>>>()?)?.into_any());
            PyTuple::new(py, items).map(|t| t.into_any())
        })
        .collect()
}

/// `f()` with Python's cyclic collector paused, then as it was: a batch's records are
/// tuples of bytes, ints and None, which make no cycles, and the collector would walk
/// the heap again and again while a large batch of them is made.
pub(crate) fn collector_paused<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: called with the GIL held (from a method of a pyclass)
    let was_enabled = unsafe { pyo3::ffi::PyGC_Disable() };
    let out = f();
    if was_enabled == 1 {
        unsafe { pyo3::ffi::PyGC_Enable() };
    }
    out
}

/// Refused units as (unit index, index, reason, detail).
fn unit_rejections<'py>(py: Python<'py>, rejected: Vec<(usize, crate::core::Rejected)>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    rejected
        .into_iter()
        .map(|(unit, r)| (unit, r.index, r.reason, r.detail).into_pyobject(py).map(|t| t.into_any()))
        .collect()
}

/// Refused units as (their records' indices, index, reason, detail).
fn rejections<'py>(
    py: Python<'py>,
    rejected: Vec<(usize, crate::core::Rejected)>,
    records: Vec<Vec<u32>>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    rejected
        .into_iter()
        .zip(records)
        .map(|((_, r), indices)| {
            (PyTuple::new(py, indices)?, r.index, r.reason, r.detail).into_pyobject(py).map(|t| t.into_any())
        })
        .collect()
}

/// A batch's (rejected, view, delta, state) as Python lists in a tuple.
fn batch_tuple<'py>(
    py: Python<'py>,
    rejected: Vec<Bound<'py, PyAny>>,
    view: Vec<Bound<'py, PyAny>>,
    delta: Vec<Bound<'py, PyAny>>,
    state: Vec<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(
        py,
        [PyList::new(py, rejected)?, PyList::new(py, view)?, PyList::new(py, delta)?, PyList::new(py, state)?],
    )
}

/// The core's JSON writer on a Python value, for the tests: `orjson.dumps(value)`
/// (`option=OPT_SORT_KEYS` with `sort_keys`); Unsupported where the core would be.
#[pyfunction]
#[pyo3(signature = (value, sort_keys = false))]
fn _dumps<'py>(py: Python<'py>, value: &Bound<'py, PyAny>, sort_keys: bool) -> PyResult<Bound<'py, PyBytes>> {
    let value = value::value_of(value, 0).map_err(|why| Unsupported::new_err(why.0))?;
    let mut out = Vec::new();
    value.write(&mut out, sort_keys);
    Ok(PyBytes::new(py, &out))
}

/// The core's JSON reader, for the tests: `orjson.loads(data)` of what it reads;
/// ValueError for what is not JSON, Unsupported for what the core does not hold.
#[pyfunction]
fn _loads<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    match json::parse(data) {
        Ok(value) => value.to_py(py),
        Err(json::ReadError::Invalid(why)) => Err(PyValueError::new_err(why)),
        Err(json::ReadError::Unsupported(why)) => Err(Unsupported::new_err(why)),
    }
}

#[pymodule]
fn refold_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("Unsupported", m.py().get_type::<Unsupported>())?;
    m.add_class::<GroupedCore>()?;
    m.add_class::<TopNCore>()?;
    m.add_class::<WindowCore>()?;
    // the join (join/py.rs)
    m.add_class::<join::py::JoinCore>()?;
    m.add_function(wrap_pyfunction!(_dumps, m)?)?;
    m.add_function(wrap_pyfunction!(_loads, m)?)?;
    // the trace index (refold.runtime.traceindex)
    m.add_function(wrap_pyfunction!(traceindex::trace_entry, m)?)?;
    Ok(())
}
