//! `JoinCore`: the Python face of the native join, a drop-in for `JoinReducer` where a
//! shard calls it (`state_key`, `apply`, `take_deltas`, `take_state_changes`, `restore`,
//! `held`), and `apply_batch` for a whole batch's units of both sides in one call.
//!
//! `apply` returns `ViewChange`s and raises `Rejected` exactly as `JoinReducer.apply`;
//! a value the core does not hold (an integer past 64 bits, a float that is not finite,
//! a string with a lone surrogate, a type JSON has not) raises `Unsupported` before the
//! unit changes anything.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple, PyType};

use super::{Event, Join, JoinPlan, Joined, Record};
use crate::core::{Ev, Fail, Map, Rejected};
use crate::statecodec::{DecodeError, Tag};
use crate::value::{value_of, Row, Unsup, Value};
use crate::{collector_paused, Unsupported};

/// `join_units`' refusals (each with its unit's records) and the view's units it made.
type JoinedUnits = (Vec<(Vec<u32>, Rejected)>, Vec<Vec<Ev>>);

#[pyclass(module = "refold_native")]
pub struct JoinCore {
    join: Join,
    /// `Op.APPEND`, `Op.RETRACT`, `Op.CORRECT_FROM`, `Op.CORRECT_TO`
    ops: Vec<Py<PyAny>>,
    view_change: Py<PyAny>,
    /// the output columns' names, in output order
    out_names: Vec<Py<PyString>>,
    /// the same names for a joined row read as a grouped view's `Row` (`join_events`)
    row_names: Vec<Box<str>>,
    rejected: Py<PyAny>,
    key_names: Py<PyTuple>,
}

#[pymethods]
impl JoinCore {
    /// `on`: the join columns of the left and the right side, pair by pair; `outputs`:
    /// `JoinSpec.outputs`, (output column, side 0/1, the side's column); `key`:
    /// `JoinSpec.output_key`; `kind`: inner, left or full.
    #[new]
    fn new(py: Python<'_>, on: (Vec<String>, Vec<String>), outputs: Vec<(String, usize, String)>, key: Vec<String>, kind: String) -> PyResult<Self> {
        let key_names = PyTuple::new(py, &key)?.unbind();
        let outputs_names: Vec<String> = outputs.iter().map(|(name, _, _)| name.clone()).collect();
        let plan = JoinPlan::new([on.0, on.1], outputs, key, &kind).map_err(PyValueError::new_err)?;
        let op = py.import("refold.model.changelog")?.getattr("Op")?;
        let ops = (0..4u8).map(|code| op.call1((code,)).map(Bound::unbind)).collect::<PyResult<Vec<_>>>()?;
        let types = py.import("refold.reduce.types")?;
        let view_change = types.getattr("ViewChange")?;
        if !view_change.cast::<PyType>()?.is_subclass_of::<PyTuple>()? || view_change.getattr("__slots__")?.len()? != 0 {
            return Err(PyValueError::new_err("ViewChange is not a NamedTuple"));
        }
        Ok(JoinCore {
            join: Join::new(plan),
            ops,
            view_change: view_change.unbind(),
            out_names: outputs_names.iter().map(|n| PyString::new(py, n).unbind()).collect(),
            row_names: outputs_names.iter().map(|n| n.as_str().into()).collect(),
            rejected: types.getattr("Rejected")?.unbind(),
            key_names,
        })
    }

    /// `JoinReducer.state_key(side, event)`: the join key whose state `apply` reads for
    /// the event, None when it is refused anyway.
    fn state_key<'py>(&self, py: Python<'py>, side: usize, event: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let row = event.get_item(1)?;
        let row = row.cast::<PyDict>()?;
        let mut parts = Vec::new();
        let mut values: Row = Vec::new();
        for column in &self.join.plan.on[check_side(side).map_err(raise)?] {
            let part = row.get_item(&**column)?.unwrap_or_else(|| py.None().into_bound(py));
            values.push((column.clone(), value_of(&part, 1).map_err(unsupported)?));
            parts.push(part);
        }
        match self.join.join_key(side, &values, 0) {
            Ok(_) => Ok(Some(PyTuple::new(py, parts)?)),
            Err(Fail::Reject(_)) => Ok(None),
            Err(other) => Err(raise(other)),
        }
    }

    /// `JoinReducer.apply(side, unit)`: the unit's join records (`ViewChange`s) in order;
    /// `Rejected` (nothing changed) when it retracts a row the side does not hold.
    fn apply<'py>(&mut self, py: Python<'py>, side: usize, unit: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        match self.apply_unit(side, unit) {
            Ok(records) => collector_paused(|| self.changes(py, records)),
            Err(Fail::Reject(r)) => Err(PyErr::from_value(self.rejected.bind(py).call1((r.reason, r.index, r.detail))?)),
            Err(other) => Err(raise(other)),
        }
    }

    /// A batch's units of both sides, `[(side, unit), ...]`, in one call:
    /// (rejected, changes, state): each refusal as (unit index, index, reason, detail),
    /// each unit's `ViewChange`s (a refused unit's: none), and the batch's state records
    /// (`take_state_changes`). `Unsupported` leaves the units before the one it names
    /// applied: the caller goes on in Python from its store.
    fn apply_batch<'py>(&mut self, py: Python<'py>, units: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyTuple>> {
        collector_paused(|| self.batch(py, units))
    }

    /// A join has no delta output (its rows are not reduced).
    fn take_deltas<'py>(&self, py: Python<'py>) -> Bound<'py, PyList> {
        PyList::empty(py)
    }

    /// `JoinReducer.take_state_changes()`: (record key, value or None), by record key.
    fn take_state_changes<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let records = self.join.take_state_changes();
        let items = records
            .iter()
            .map(|(key, value)| {
                let value = match value {
                    Some(v) => PyBytes::new(py, v).into_any(),
                    None => py.None().into_bound(py),
                };
                PyTuple::new(py, [PyBytes::new(py, key).into_any(), value]).map(Bound::into_any)
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// `JoinReducer.restore(records)`: (record key, `P.state` value) pairs of join keys.
    fn restore(&mut self, records: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut pairs = Vec::new();
        for item in records.try_iter()? {
            let (key, value): (Vec<u8>, Vec<u8>) = item?.extract()?;
            pairs.push((key, value));
        }
        self.join.restore(pairs).map_err(|err| match err {
            DecodeError::NotState(why) => PyValueError::new_err(format!("not a join state record: {why}")),
            DecodeError::Unsupported(why) => Unsupported::new_err(why),
        })
    }

    /// `JoinReducer.held()`: the join keys held in memory.
    fn held(&self) -> usize {
        self.join.held()
    }
}

impl JoinCore {
    /// `apply_batch`'s work.
    fn batch<'py>(&mut self, py: Python<'py>, units: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyTuple>> {
        let mut rejected = Vec::new();
        let mut changes = Vec::new();
        for (number, item) in units.try_iter()?.enumerate() {
            let item = item?;
            let side: usize = item.get_item(0)?.extract()?;
            match self.apply_unit(side, &item.get_item(1)?) {
                Ok(records) => changes.push(self.changes(py, records)?.into_any()),
                Err(Fail::Reject(r)) => {
                    rejected.push((number, r.index, r.reason, r.detail).into_pyobject(py)?.into_any());
                    changes.push(PyList::empty(py).into_any());
                }
                Err(other) => return Err(raise(other)),
            }
        }
        let state = self.take_state_changes(py)?;
        PyTuple::new(py, [PyList::new(py, rejected)?.into_any(), PyList::new(py, changes)?.into_any(), state.into_any()])
    }

    /// A batch's source units, `[(side, unit), ...]` (each unit as the shard holds it:
    /// (event, record) pairs), joined, their records the grouped view's units without a
    /// Python object between: as `as_units` makes them (a `-C` with its `+C`), each event
    /// tagged with its source unit's tag and numbered (`Ev.record`) by that unit's place.
    /// Refusals as (unit number, refusal); `Unsupported` (raised) as `apply_batch`'s.
    pub(crate) fn join_events(&mut self, units: &Bound<'_, PyAny>) -> PyResult<(Vec<(usize, Rejected)>, Vec<Vec<Ev>>)> {
        let mut rejected = Vec::new();
        let mut events: Vec<Vec<Ev>> = Vec::new();
        for (number, item) in units.try_iter()?.enumerate() {
            let item = item?;
            let side: usize = item.get_item(0)?.extract()?;
            let unit = item.get_item(1)?;
            let tag: Tag = unit.get_item(0)?.get_item(0)?.get_item(2)?.extract()?;
            match self.apply_items(side, &unit, true) {
                Ok(records) => self.push_joined(&mut events, records, tag, number as u32),
                Err(Fail::Reject(r)) => rejected.push((number, r)),
                Err(other) => return Err(raise(other)),
            }
        }
        Ok((rejected, events))
    }

    /// The state prefixes (`state_prefix`: `"j",` and the join key's `key_bytes`) of the
    /// join keys the events of `units` (each with its side) read, each once; none for an
    /// event its key refuses (`state_key`'s None).
    pub(crate) fn touched_prefixes(&self, units: &[(usize, Vec<Ev>)]) -> Vec<Vec<u8>> {
        let mut seen: Map<Vec<u8>, ()> = Map::default();
        let mut prefixes = Vec::new();
        for (side, unit) in units {
            for event in unit {
                if let Ok((kb, _null)) = self.join.join_key(*side, &event.row, 0) {
                    let mut prefix = Vec::with_capacity(kb.len() + 4);
                    prefix.extend_from_slice(b"\"j\",");
                    prefix.extend_from_slice(&kb);
                    if let hashbrown::hash_map::Entry::Vacant(slot) = seen.entry(prefix) {
                        prefixes.push(slot.key().clone()); // (a key's copy only the first time it is seen)
                        slot.insert(());
                    }
                }
            }
        }
        prefixes
    }

    /// `join_events` of units the core read itself (`read_units`, each with its side):
    /// the joined records numbered (`Ev.record`) by their source unit's first record;
    /// refusals as (the unit's records, refusal).
    pub(crate) fn join_units(&mut self, units: Vec<(usize, Vec<Ev>)>) -> Result<JoinedUnits, Fail> {
        let mut rejected = Vec::new();
        let mut events: Vec<Vec<Ev>> = Vec::new();
        for (side, unit) in units {
            let records: Vec<u32> = unit.iter().map(|event| event.record).collect();
            let tag = unit[0].tag;
            let mut source = unit.into_iter();
            match self.join.apply(side, |_| Ok(source.next().map(|event| Event { op: event.op, row: event.row }))) {
                Ok(made) => self.push_joined(&mut events, made, tag, records[0]),
                Err(Fail::Reject(r)) => rejected.push((records, r)),
                Err(other) => return Err(other),
            }
        }
        Ok((rejected, events))
    }

    /// A unit's joined records as the grouped view's units (a `-C` with its `+C`), each
    /// tagged `tag` and numbered `number`.
    fn push_joined(&self, events: &mut Vec<Vec<Ev>>, records: Vec<Record>, tag: Tag, number: u32) {
        let first = events.len();
        for (op, row) in records {
            let row = self.row_names.iter().cloned().zip(row).collect();
            let event = Ev { op, row, tag, record: number };
            if op == 3 && events.len() > first {
                events.last_mut().expect("a unit before").push(event); // +C: with its -C
            } else {
                events.push(vec![event]);
            }
        }
    }

    fn apply_unit(&mut self, side: usize, unit: &Bound<'_, PyAny>) -> Result<Vec<Record>, Fail> {
        self.apply_items(side, unit, false)
    }

    /// `apply_unit` of a unit's events, or with `pairs` of its (event, record) pairs.
    fn apply_items(&mut self, side: usize, unit: &Bound<'_, PyAny>, pairs: bool) -> Result<Vec<Record>, Fail> {
        let side = check_side(side)?;
        let size = unit.len()?;
        self.join.apply(side, |index| {
            if index >= size {
                return Ok(None);
            }
            let item = unit.get_item(index)?;
            let event = if pairs { item.get_item(0)? } else { item };
            let op: u8 = event.get_item(0)?.extract()?;
            match value_of(&event.get_item(1)?, 0)? {
                Value::Dict(row) => Ok(Some(Event { op, row })),
                _ => Err(Fail::Unsup(Unsup::new("an event's row that is not a dict"))),
            }
        })
    }

    /// The records as `ViewChange(op, key, row, key names)`s.
    fn changes<'py>(&self, py: Python<'py>, records: Vec<Record>) -> PyResult<Bound<'py, PyList>> {
        let names = self.key_names.bind(py);
        let make = self.view_change.bind(py);
        let mut out = Vec::with_capacity(records.len());
        let mut last: Option<(u8, Joined, Bound<'py, PyAny>)> = None;
        for (op, row) in records {
            // copies of one joined row are one object, as `[ViewChange(...)] * copies`
            if let Some((last_op, last_row, change)) = &last {
                if *last_op == op && op < 2 && same(last_row, &row) {
                    out.push(change.clone());
                    continue;
                }
            }
            let dict = PyDict::new(py);
            let mut values = Vec::with_capacity(row.len());
            for (value, name) in row.iter().zip(&self.out_names) {
                let value = value.to_py(py)?;
                dict.set_item(name.bind(py), &value)?;
                values.push(value);
            }
            let key = PyTuple::new(py, self.join.plan.key.iter().map(|&k| &values[k]))?;
            let fields = [self.ops[op as usize].bind(py).clone(), key.into_any(), dict.into_any(), names.clone().into_any()];
            let change = view_change(py, make, fields)?;
            out.push(change.clone());
            last = Some((op, row, change));
        }
        PyList::new(py, out)
    }
}

/// `ViewChange(op, key, row, key_names)`, made as `tuple.__new__(ViewChange, fields)`
/// makes it (a `NamedTuple`'s own `__new__` is Python code), without a call.
fn view_change<'py>(py: Python<'py>, class: &Bound<'py, PyAny>, fields: [Bound<'py, PyAny>; 4]) -> PyResult<Bound<'py, PyAny>> {
    let class = class.cast::<PyType>()?;
    // SAFETY: `ViewChange` is a tuple subclass without slots of its own (a NamedTuple):
    // its allocator makes a tuple of 4 empty items (the collector tolerates them empty),
    // each then set once with a reference it owns
    unsafe {
        let ptr = pyo3::ffi::PyType_GenericAlloc(class.as_type_ptr(), 4);
        if ptr.is_null() {
            return Err(PyErr::fetch(py));
        }
        for (i, field) in fields.into_iter().enumerate() {
            pyo3::ffi::PyTuple_SET_ITEM(ptr, i as pyo3::ffi::Py_ssize_t, field.into_ptr());
        }
        Ok(Bound::from_owned_ptr(py, ptr))
    }
}

fn same(a: &Joined, b: &Joined) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.canon_eq(y))
}

fn check_side(side: usize) -> Result<usize, Fail> {
    if side > 1 {
        return Err(Fail::Py(PyValueError::new_err("a join's side is 0 (left) or 1 (right)")));
    }
    Ok(side)
}

fn unsupported(err: Unsup) -> PyErr {
    Unsupported::new_err(err.0)
}

fn raise(fail: Fail) -> PyErr {
    match fail {
        Fail::Unsup(why) => Unsupported::new_err(why.0),
        Fail::Py(err) => err,
        Fail::Reject(r) => Unsupported::new_err(format!("unexpected refusal: {}", r.reason)),
    }
}
