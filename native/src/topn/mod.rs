//! The Top-N reduction: `refold.reduce.topn.TopNReducer` (apply, take_state_changes,
//! restore, view) and its rendering by `refold.runtime.render.Renderer` with the
//! `JsonRows` encoder (emit `per_event`), byte for byte, as `crate::core` does for a
//! grouped view. It shares that core's events in (`units_of`, the reader of a clean
//! `jsonl` batch), key checks, row fingerprints, refusals and JSON writers.
//!
//! The state per `partition_by` group is the Python reducer's `_Group`: its live rows
//! by fingerprint (the first copy's row and the live copies' tags), their copies
//! ranked, and the output rows at places 1..n with their rows' fingerprints.
//!
//! - `rank`: the sort key and the ranking (`_sort_key`, `Sorted`)
//! - `apply`: `TopNReducer.apply` per unit, the refusals, the view records
//! - `render`: output rows (`_output`), message keys, view and state records
//! - `restore`: `TopNReducer.restore` from `P.state` records

mod apply;
mod rank;
mod render;
mod restore;
mod window;

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use rustc_hash::{FxHashMap, FxHashSet};

use crate::core::{read_units, refused_records, routed_units, touched_or_none, units_of, BatchOut, Cause, Ev, Fail, Form, Fp, KeyBytes, KeyColumns, Map, ReadOut};
use crate::statecodec::Tag;
use crate::value::{Row, Value};

use self::rank::{Ranked, SortKey};
pub use self::window::Closed;

/// Where a message key's and an output row's leading entries take their value: a
/// `partition_by` value or the place (`dict(zip(key_names, key))`, `_output`'s head).
#[derive(Clone, Copy)]
enum Head {
    Part(usize),
    Place,
}

/// The view's spec, compiled once.
pub struct TopPlan {
    n: usize,
    /// `partition_by`, with the order columns checked as scalars (`view_key`)
    keys: KeyColumns,
    order_columns: Vec<String>,
    /// per order column: `desc`
    desc: Vec<bool>,
    /// the leading entries of message keys and output rows: `partition_by` then
    /// `place`, a name set again keeping its first place and taking the later value
    head: Vec<(String, Head)>,
    /// where `op` is in the head, if it is (`partition_by` names it)
    head_op: Option<usize>,
    /// `top_n.columns` less the head's names, or None: every row column but those
    columns: Option<Vec<String>>,
    form: Option<Form>,
}

impl TopPlan {
    pub fn new(
        py: Python<'_>,
        n: usize,
        order_by: Vec<(String, String)>,
        partition_by: Vec<String>,
        columns: Option<Vec<String>>,
        view_form: Option<String>,
    ) -> PyResult<TopPlan> {
        use pyo3::exceptions::PyValueError;
        if n == 0 || order_by.is_empty() {
            return Err(PyValueError::new_err("a Top-N view needs n >= 1 and an order column"));
        }
        let form = Form::parse(view_form.as_deref())?;
        let mut desc = Vec::with_capacity(order_by.len());
        for (column, direction) in &order_by {
            desc.push(match direction.as_str() {
                "asc" => false,
                "desc" => true,
                other => return Err(PyValueError::new_err(format!("column {column:?}: unknown direction {other:?}"))),
            });
        }
        let order_columns: Vec<String> = order_by.into_iter().map(|(c, _)| c).collect();
        let mut head: Vec<(String, Head)> = Vec::new();
        let named = partition_by.iter().enumerate().map(|(i, c)| (c.clone(), Head::Part(i)));
        for (name, src) in named.chain(std::iter::once(("place".to_string(), Head::Place))) {
            match head.iter_mut().find(|(n, _)| *n == name) {
                Some(entry) => entry.1 = src,
                None => head.push((name, src)),
            }
        }
        let columns = columns.map(|cs| cs.into_iter().filter(|c| !head.iter().any(|(n, _)| n == c)).collect());
        let head_op = head.iter().position(|(n, _)| n == "op");
        Ok(TopPlan {
            n,
            keys: KeyColumns::new(py, "partition", &partition_by, &order_columns)?,
            order_columns,
            desc,
            head,
            head_op,
            columns,
            form,
        })
    }
}

/// One live row of a group: the first copy's row (its output and state value), the
/// live copies' tags ascending, its sort key.
struct Live {
    row: Arc<Row>,
    tags: Vec<Tag>,
    key: SortKey,
}

/// An output row: its place, and the row it was made of (the head comes from the group).
#[derive(Clone)]
struct Out {
    place: i64,
    row: Arc<Row>,
    /// the cause of the view record that wrote it (None: unknown)
    cause: Option<Cause>,
}

/// `_Group`: one group's live rows, ranked, and its current output.
struct Group {
    /// the `partition_by` values (from the group's key JSON)
    parts: Vec<Value>,
    ranked: Ranked,
    rows: FxHashMap<Fp, Live>,
    top: Vec<Out>,
    fps: Vec<Fp>,
}

impl Group {
    fn new(kj: &[u8]) -> Group {
        let Ok(Value::List(parts)) = crate::json::parse(kj) else { unreachable!("a group's key JSON") };
        Group { parts, ranked: Ranked::default(), rows: FxHashMap::default(), top: Vec::new(), fps: Vec::new() }
    }
}

pub struct TopN {
    plan: TopPlan,
    groups: Map<KeyBytes, Group>,
    /// `_dirty`: (group key JSON, fingerprint) of the rows changed since the last batch
    dirty: FxHashSet<(KeyBytes, Fp)>,
    /// `_dirty_causes`: the groups whose places' causes changed since the last batch
    dirty_causes: FxHashSet<KeyBytes>,
    /// the cause of the unit being applied
    cause: Cause,
    /// cause headers on the view records (`outputs.provenance`)
    pub provenance: bool,
    scratch: Vec<u8>,
    /// a unit's view records, written side by side (`render::Change` says where)
    written: Vec<u8>,
    /// the units `read` made, until `apply_read`
    prepared: Option<Vec<Vec<Ev>>>,
    /// the Python units `touched` read (the list, held), until `apply_batch` of that list
    converted: Option<(Py<PyAny>, Vec<Vec<Ev>>)>,
}

impl TopN {
    pub fn new(plan: TopPlan) -> TopN {
        TopN {
            plan,
            groups: Map::default(),
            dirty: FxHashSet::default(),
            dirty_causes: FxHashSet::default(),
            cause: (0, 0),
            provenance: true,
            scratch: Vec::new(),
            written: Vec::new(),
            prepared: None,
            converted: None,
        }
    }

    /// The groups held (`len(TopNReducer.groups)`).
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// `state_key` over every event: the group JSON of those with a group, each once;
    /// the units wait for `apply_batch` of the same list.
    pub fn touched(&mut self, units: &Bound<'_, PyAny>) -> Result<Vec<Vec<u8>>, Fail> {
        let converted = units_of(units)?;
        let keys = self.plan.keys.touched_of(&converted)?;
        self.converted = Some((units.clone().unbind(), converted));
        Ok(keys)
    }

    /// One batch of Python units: (refusals, view records, no delta records, state records).
    pub fn apply_batch<'py>(&mut self, py: Python<'py>, units: &Bound<'py, PyAny>) -> Result<BatchOut<'py>, Fail> {
        let mut units = match self.converted.take() {
            Some((list, converted)) if list.bind(py).is(units) => converted,
            _ => units_of(units)?,
        };
        self.apply_units(py, &mut units)
    }

    /// `read_units` of a clean `jsonl` batch, kept for `apply_read`; its groups in `touched`.
    pub fn read(&mut self, parts: &Bound<'_, PyAny>, check: Option<&[String]>) -> Result<Option<ReadOut>, Fail> {
        self.prepared = None;
        let Some((units, mut out)) = read_units(parts, check)? else { return Ok(None) };
        let Some(touched) = touched_or_none(self.plan.keys.touched_of(&units))? else { return Ok(None) };
        out.touched = touched;
        self.prepared = Some(units);
        Ok(Some(out))
    }

    /// `routed_units` of stage 2's records (core/routed.rs), kept for `apply_read`; the
    /// groups they touch.
    pub fn read_routed(&mut self, records: &Bound<'_, PyAny>) -> Result<Option<Vec<Vec<u8>>>, Fail> {
        self.prepared = None;
        let Some(units) = routed_units(records)? else { return Ok(None) };
        let Some(touched) = touched_or_none(self.plan.keys.touched_of(&units))? else { return Ok(None) };
        self.prepared = Some(units);
        Ok(Some(touched))
    }

    /// `apply_units` over what `read` kept; each refusal names its unit's records.
    pub fn apply_read<'py>(&mut self, py: Python<'py>) -> Result<(BatchOut<'py>, Vec<Vec<u32>>), Fail> {
        let mut units = self.prepared.take().unwrap_or_default();
        let out = self.apply_units(py, &mut units)?;
        let records = refused_records(&units, &out.rejected);
        Ok((out, records))
    }

    /// `TopNReducer.view()`: {(*group, place): output row dict}.
    pub fn view<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for group in self.groups.values() {
            for row in &group.top {
                let mut key = group.parts.iter().map(|p| p.to_py(py)).collect::<PyResult<Vec<_>>>()?;
                key.push(row.place.into_pyobject(py)?.into_any());
                let dict = PyDict::new(py);
                let place = Value::Int(row.place);
                for (name, value) in self.plan.entries(&group.parts, &place, &row.row) {
                    dict.set_item(name, value.to_py(py)?)?;
                }
                out.set_item(PyTuple::new(py, key)?, dict)?;
            }
        }
        Ok(out)
    }
}
