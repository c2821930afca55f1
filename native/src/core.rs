//! The grouped reduction itself, without Python objects in its state:
//! `refold.reduce.grouped.GroupedReducer` (apply, take_deltas, take_state_changes,
//! restore, view) and the JSON rendering of `refold.runtime.render.Renderer` with
//! the `JsonRows` encoder (emit `per_event`).
//!
//! Each part names the Python it mirrors. The state per view key is the Python
//! reducer's: live rows by fingerprint (copies, tags, kept values), the row count,
//! exact sums (i128 here: no floats are summed), non-null counts, a sorted multiset
//! per `min`/`max`/`set` column, and the live copies ordered by (tag, fingerprint).
//!
//! The parts, one module each:
//! - `plan`: `_Plan`, the layout of a view's columns, compiled once
//! - `state`: the per-key state (`_Row`, `_Key`, the batch's `_Delta`s) and its
//!   updates (`_add`, `_remove`, `_account`, `_view_row`)
//! - `apply`: `apply_units`, the unit and event checks, `touched`
//! - `read`: a `jsonl` batch's records into units (`UnitReader.read`), when it can
//! - `render`: the view, delta and state records (`Renderer.view`, `Renderer.deltas`,
//!   `take_state_changes`)
//! - `restore`: `GroupedReducer.restore` from `P.state` records
//! - `route`, `routed`: stage 1 of a re-grouping view (`RouteValidator`) and stage 2's
//!   reader of what it routed (`ExchangeReader`)
//!
//! This module holds what they share: the refusals and failures, view keys as JSON,
//! and `Core` itself with `GroupedReducer.view()`.

mod apply;
mod plan;
mod read;
mod render;
mod restore;
mod route;
mod routed;
mod state;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};
use rustc_hash::FxBuildHasher;

use crate::json::{write_int, write_str};
use crate::value::{Unsup, Value};

pub use self::apply::Ev;
pub use self::plan::Plan;
pub use self::route::Router;
use self::plan::Src;
pub use self::restore::RestoreFail;
// what the Top-N core (crate::topn) shares with this one: events in, key checks and
// row identity, the reader of a clean batch, the output form, the refusals
pub(crate) use self::apply::{fingerprint, live_fingerprint, units_of, BatchOut, KeyColumns, UnitRecords, push_view_records};
pub(crate) use self::plan::Form;
pub(crate) use self::read::{read_units, refused_records, touched_or_none, ReadOut};
pub(crate) use self::routed::routed_units;
use self::state::{Batch, KeyState};

/// hashbrown's map (for `entry_ref`: one lookup, no key copy when the key is held).
pub(crate) type Map<K, V> = hashbrown::HashMap<K, V, FxBuildHasher>;

/// A view key's JSON (`key_bytes`) as a map key: most are short, and held inline they
/// cost no pointer to follow on a lookup.
#[derive(Clone)]
pub(crate) enum KeyBytes {
    Inline(u8, [u8; 30]),
    Heap(Box<[u8]>),
}

impl KeyBytes {
    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            KeyBytes::Inline(len, data) => &data[..*len as usize],
            KeyBytes::Heap(data) => data,
        }
    }
}

impl From<&[u8]> for KeyBytes {
    fn from(data: &[u8]) -> Self {
        if data.len() <= 30 {
            let mut inline = [0u8; 30];
            inline[..data.len()].copy_from_slice(data);
            KeyBytes::Inline(data.len() as u8, inline)
        } else {
            KeyBytes::Heap(data.into())
        }
    }
}

impl std::borrow::Borrow<[u8]> for KeyBytes {
    fn borrow(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::hash::Hash for KeyBytes {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state)
    }
}

impl PartialEq for KeyBytes {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for KeyBytes {}

/// No batch slot (a key the batch has not touched yet).
const NO_SLOT: u32 = u32::MAX;

pub type Fp = [u8; 16];

/// `MAX_KEY_CHARS` of refold.reduce.values.
const MAX_KEY_CHARS: usize = 64 * 1024;

/// The Reason strings (refold.model.reasons) the reducer refuses with.
pub const NULL_KEY: &str = "null key";
pub const SCHEMA_MISMATCH: &str = "schema mismatch";
pub const KEY_TOO_LARGE: &str = "key too large";
pub const NOT_LIVE: &str = "not live";

/// `Rejected(reason, index, detail)`: the unit changes nothing.
pub struct Rejected {
    pub reason: &'static str,
    pub index: usize,
    pub detail: Option<String>,
}

/// What stops a call: a refused unit (only before anything changed), a value the
/// core does not handle, or a Python error.
pub enum Fail {
    Reject(Rejected),
    Unsup(Unsup),
    Py(PyErr),
}

impl From<Unsup> for Fail {
    fn from(err: Unsup) -> Self {
        Fail::Unsup(err)
    }
}

impl From<PyErr> for Fail {
    fn from(err: PyErr) -> Self {
        Fail::Py(err)
    }
}

pub(crate) fn reject(reason: &'static str, index: usize, detail: Option<String>) -> Fail {
    Fail::Reject(Rejected { reason, index, detail })
}

/// One value of a view key: the core keys views by str and int values only.
#[derive(Clone, Debug)]
pub enum KeyPart {
    Int(i64),
    Str(Box<str>),
}

impl KeyPart {
    fn write(&self, out: &mut Vec<u8>) {
        match self {
            KeyPart::Int(n) => write_int(out, *n),
            KeyPart::Str(s) => write_str(out, s),
        }
    }
}

/// `key_bytes(key)`: `orjson.dumps(list(key))`.
pub fn key_json(parts: &[KeyPart]) -> Vec<u8> {
    let mut out = Vec::with_capacity(24);
    out.push(b'[');
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        part.write(&mut out);
    }
    out.push(b']');
    out
}

pub struct Core {
    pub plan: Plan,
    keys: Map<KeyBytes, KeyState>,
    batch: Batch,
    scratch: Vec<u8>,
    ranges: Vec<(usize, usize)>,
    /// the units `read` made, until `apply_read`
    prepared: Option<Vec<Vec<Ev>>>,
    /// the Python units `touched` read (the list, held), until `apply_batch` of that list
    converted: Option<(Py<PyAny>, Vec<Vec<Ev>>)>,
    /// cause headers on the view and delta records (`outputs.provenance`)
    pub provenance: bool,
    /// how those headers name a cause
    pub names: CauseNames,
}

/// The input event an output record came of: (partition, offset) of the source topic.
pub type Cause = (i64, i64);

/// How a cause header names an input event: `<partition>:<offset>` (`PLAIN`,
/// refold.runtime.render.cause_bytes), or for a view over a join `<topic>:<partition>:<offset>`,
/// the right source's partitions numbered from `right_from` (refold.runtime.joins.JoinRenderer).
#[derive(Clone, Debug, Default)]
pub struct CauseNames {
    join: Option<(Vec<u8>, Vec<u8>, i64)>,
}

/// Causes named by partition and offset alone.
pub(crate) const PLAIN: CauseNames = CauseNames { join: None };

impl CauseNames {
    /// A join's names: its left and right sources' topics, the right one's partitions from `right_from`.
    pub fn join(left: &str, right: &str, right_from: i64) -> CauseNames {
        CauseNames { join: Some((left.as_bytes().to_vec(), right.as_bytes().to_vec(), right_from)) }
    }

    /// A cause as a header's value.
    pub(crate) fn bytes(&self, cause: Cause) -> Vec<u8> {
        match &self.join {
            None => format!("{}:{}", cause.0, cause.1).into_bytes(),
            Some((left, right, right_from)) => {
                let (topic, partition) =
                    if cause.0 >= *right_from { (right, cause.0 - right_from) } else { (left, cause.0) };
                let mut out = topic.clone();
                out.extend_from_slice(format!(":{}:{}", partition, cause.1).as_bytes());
                out
            }
        }
    }
}

/// A record's headers: `[("refold.cause", cause)]`, with `("refold.retracts", its cause)` for a
/// record that takes back one whose cause is known.
pub(crate) fn headers<'py>(
    py: Python<'py>,
    cause: &Bound<'py, PyAny>,
    retracts: Option<Cause>,
    names: &CauseNames,
) -> PyResult<Bound<'py, PyAny>> {
    let list = pyo3::types::PyList::new(py, [cause.clone()])?;
    if let Some(retracted) = retracts {
        let value = pyo3::types::PyBytes::new(py, &names.bytes(retracted));
        list.append(pyo3::types::PyTuple::new(py, [pyo3::intern!(py, "refold.retracts").clone().into_any(), value.into_any()])?)?;
    }
    Ok(list.into_any())
}

/// The `("refold.cause", value)` header of a cause, made once per unit.
pub(crate) fn cause_header<'py>(py: Python<'py>, cause: Cause, names: &CauseNames) -> PyResult<Bound<'py, PyAny>> {
    let value = pyo3::types::PyBytes::new(py, &names.bytes(cause));
    Ok(pyo3::types::PyTuple::new(py, [pyo3::intern!(py, "refold.cause").clone().into_any(), value.into_any()])?.into_any())
}

fn fits_i64(n: i128) -> Result<i64, Unsup> {
    i64::try_from(n).map_err(|_| Unsup::new("a sum past 64 bits"))
}

impl Core {
    pub fn new(plan: Plan) -> Core {
        Core {
            plan,
            keys: Map::default(),
            batch: Batch::default(),
            scratch: Vec::new(),
            ranges: Vec::new(),
            prepared: None,
            converted: None,
            provenance: true,
            names: CauseNames::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    // what a windowed view (crate::window) needs of the keys it wraps

    /// Whether the core holds this key (its JSON).
    pub(crate) fn holds(&self, kj: &[u8]) -> bool {
        self.keys.contains_key(kj)
    }

    /// The JSON of every key the core holds.
    pub(crate) fn key_jsons(&self) -> impl Iterator<Item = &[u8]> {
        self.keys.keys().map(KeyBytes::as_slice)
    }

    /// Forget a key (a window that closed): the fingerprints of its live rows, whose
    /// records (and its summary's) the caller tombstones; None when it was not held.
    pub(crate) fn forget_key(&mut self, kj: &[u8]) -> Option<Vec<Fp>> {
        let state = self.keys.remove(kj)?;
        if state.slot != NO_SLOT {
            self.batch.ended.insert(KeyBytes::from(kj), state.slot);
        }
        Some(state.rows.into_keys().collect())
    }

    /// `GroupedReducer.view()`: {key tuple: view row dict}.
    pub fn view<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let names: Vec<Bound<'py, PyString>> = self.plan.view_row_names.iter().map(|n| PyString::new(py, n)).collect();
        for (kj, state) in self.keys.iter() {
            let Some(view) = &state.view else { continue };
            let Ok(Value::List(parts)) = crate::json::parse(kj.as_slice()) else { unreachable!("a key's JSON") };
            let parts = parts.iter().map(|p| p.to_py(py)).collect::<PyResult<Vec<_>>>()?;
            let key = PyTuple::new(py, &parts)?;
            let row = PyDict::new(py);
            for (name, (_, src)) in names.iter().zip(&self.plan.view_row) {
                let value = match *src {
                    Src::Key(i) => parts[i].clone(),
                    Src::Col(i) => view[i].to_py(py)?,
                    Src::Op | Src::Count => unreachable!("a view row has no op or _count"),
                };
                row.set_item(name, value)?;
            }
            out.set_item(key, row)?;
        }
        Ok(out)
    }
}
