//! The grouped reduction itself, without Python objects in its state:
//! `refold.reduce.grouped.GroupedReducer` (apply, take_deltas, take_state_changes,
//! restore, view) and the JSON rendering of `refold.runtime.render.Renderer` with
//! the `JsonRows` encoder (emit `per_event`).
//!
//! Each part names the Python it mirrors. The state per view key is the Python
//! reducer's: live rows by fingerprint (copies, tags, kept values), the row count,
//! exact sums (i128 here: no floats are summed), non-null counts, a sorted multiset
//! per `min`/`max`/`set` column, and the live copies ordered by (tag, fingerprint).

use std::collections::BTreeMap;

use blake2::digest::consts::U16;
use blake2::{Blake2b, Digest};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use rustc_hash::{FxBuildHasher, FxHashMap, FxHashSet};

/// hashbrown's map (for `entry_ref`: one lookup, no key copy when the key is held).
type Map<K, V> = hashbrown::HashMap<K, V, FxBuildHasher>;

/// A view key's JSON (`key_bytes`) as a map key: most are short, and held inline they
/// cost no pointer to follow on a lookup.
#[derive(Clone)]
enum KeyBytes {
    Inline(u8, [u8; 30]),
    Heap(Box<[u8]>),
}

impl KeyBytes {
    fn as_slice(&self) -> &[u8] {
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

use crate::json::{write_i128, write_int, write_str};
use crate::statecodec::{self, DecodeError, Tag, KEY_SUMMARY, LIVE_ROW};
use crate::value::{int_of, kind, str_of, value_of, write_py_dict, Kind, Scalar, Unsup, Value};

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

fn reject(reason: &'static str, index: usize, detail: Option<String>) -> Fail {
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

// ------------------------------------------------------------------------------------
// The plan: `_Plan`, compiled once from the view's columns

/// How one view column reads a key's running values (`_Plan._reader`,
/// `_running_reader`) and a batch's contributions (`_Plan._delta_reader`).
#[derive(Clone, Copy, Debug)]
enum Agg {
    Sum { sum: usize },
    CountRows,
    Count { nn: usize },
    Avg { sum: usize, nn: usize },
    Min { ms: usize },
    Max { ms: usize },
    Set { ms: usize },
    /// first (`last` false) or last / last_write_wins
    ByTag { last: bool, kept: usize, slot: usize },
}

/// Where an output object's entry takes its value from.
#[derive(Clone, Copy, Debug)]
enum Src {
    Op,
    Key(usize),
    Count,
    Col(usize),
}

/// An output object's entries in their order: `"name":` and the source of its value.
/// Built as Python builds the dict (a name set again keeps its first place).
type Layout = Vec<(Vec<u8>, Src)>;

fn layout(entries: Vec<(String, Src)>) -> (Layout, Vec<String>) {
    let mut names: Vec<String> = Vec::new();
    let mut srcs: Vec<Src> = Vec::new();
    for (name, src) in entries {
        match names.iter().position(|n| *n == name) {
            Some(at) => srcs[at] = src,
            None => {
                names.push(name);
                srcs.push(src);
            }
        }
    }
    let out = names
        .iter()
        .zip(srcs)
        .map(|(name, src)| {
            let mut prefix = Vec::new();
            write_str(&mut prefix, name);
            prefix.push(b':');
            (prefix, src)
        })
        .collect();
    (out, names)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Form {
    Changelog,
    Retract,
    Upsert,
}

pub struct Plan {
    key_names: Vec<Py<PyString>>,
    missing_detail: Vec<String>,
    aggs: Vec<Agg>,
    sum_columns: Vec<Py<PyString>>,
    sum_names: Vec<String>,
    sum_detail: Vec<String>,
    nonnull_columns: Vec<Py<PyString>>,
    nonnull_names: Vec<String>,
    multiset_columns: Vec<Py<PyString>>,
    multiset_detail: Vec<String>,
    kept: Vec<Py<PyString>>,
    multiset_index: Vec<usize>,
    tag_index: Vec<usize>,
    needs_tags: bool,
    form: Option<Form>,
    delta: bool,
    message_key: Layout,
    view_row: Layout,
    view_row_names: Vec<String>,
    view_op_row: Layout,
    delta_row: Layout,
    delta_key: Layout,
}

impl Plan {
    pub fn new(
        py: Python<'_>,
        key_columns: Vec<String>,
        columns: Vec<(String, String, String)>,
        view_form: Option<String>,
        delta: bool,
    ) -> PyResult<Plan> {
        use pyo3::exceptions::PyValueError;
        let intern = |name: &str| PyString::intern(py, name).unbind();
        let repr = |name: &str| -> PyResult<String> { Ok(PyString::new(py, name).repr()?.to_str()?.to_owned()) };
        let form = match view_form.as_deref() {
            None => None,
            Some("changelog") => Some(Form::Changelog),
            Some("retract") => Some(Form::Retract),
            Some("upsert") => Some(Form::Upsert),
            Some(other) => return Err(PyValueError::new_err(format!("unknown view form {other:?}"))),
        };
        let mut sums: Vec<String> = Vec::new();
        let mut nonnull: Vec<String> = Vec::new();
        let mut multisets: Vec<String> = Vec::new();
        let mut tagged: Vec<String> = Vec::new();
        let mut names: Vec<&str> = Vec::new();
        for (name, agg, column) in &columns {
            if names.contains(&name.as_str()) {
                return Err(PyValueError::new_err(format!("column {name:?} is named twice")));
            }
            names.push(name);
            if column == "*" && agg != "count" {
                return Err(PyValueError::new_err(format!("column {name:?}: only count may use '*'")));
            }
            let push = |list: &mut Vec<String>| {
                if !list.contains(column) {
                    list.push(column.clone());
                }
            };
            match agg.as_str() {
                "sum" => push(&mut sums),
                "avg" => {
                    push(&mut sums);
                    push(&mut nonnull);
                }
                "count" => {
                    if column != "*" {
                        push(&mut nonnull)
                    }
                }
                "min" | "max" | "set" => push(&mut multisets),
                "first" | "last" | "last_write_wins" => push(&mut tagged),
                other => return Err(PyValueError::new_err(format!("unknown aggregation {other:?}"))),
            }
        }
        let mut kept: Vec<String> = Vec::new();
        for column in multisets.iter().chain(&tagged) {
            if !kept.contains(column) {
                kept.push(column.clone());
            }
        }
        let at = |list: &[String], column: &str| list.iter().position(|c| c == column).unwrap();
        let aggs = columns
            .iter()
            .map(|(_, agg, column)| match agg.as_str() {
                "sum" => Agg::Sum { sum: at(&sums, column) },
                "count" if column == "*" => Agg::CountRows,
                "count" => Agg::Count { nn: at(&nonnull, column) },
                "avg" => Agg::Avg { sum: at(&sums, column), nn: at(&nonnull, column) },
                "min" => Agg::Min { ms: at(&multisets, column) },
                "max" => Agg::Max { ms: at(&multisets, column) },
                "set" => Agg::Set { ms: at(&multisets, column) },
                other => Agg::ByTag { last: other != "first", kept: at(&kept, column), slot: at(&tagged, column) },
            })
            .collect();
        let keys: Vec<(String, Src)> = key_columns.iter().enumerate().map(|(i, k)| (k.clone(), Src::Key(i))).collect();
        let cols: Vec<(String, Src)> = columns.iter().enumerate().map(|(i, c)| (c.0.clone(), Src::Col(i))).collect();
        let (message_key, _) = layout(keys.clone());
        let (view_row, view_row_names) = layout(keys.iter().chain(&cols).cloned().collect());
        let (view_op_row, _) =
            layout(std::iter::once(("op".to_string(), Src::Op)).chain(keys.iter().cloned()).chain(cols.iter().cloned()).collect());
        let (delta_row, delta_names) = layout(
            keys.iter().cloned().chain(std::iter::once(("_count".to_string(), Src::Count))).chain(cols.iter().cloned()).collect(),
        );
        // Renderer.deltas: {k: row[k] for k in key_columns}
        let (delta_key, _) = layout(
            key_columns
                .iter()
                .map(|k| {
                    let at = delta_names.iter().position(|n| n == k).unwrap();
                    (k.clone(), delta_row[at].1)
                })
                .collect(),
        );
        Ok(Plan {
            key_names: key_columns.iter().map(|k| intern(k)).collect(),
            missing_detail: key_columns.iter().map(|k| Ok(format!("key column {} is missing", repr(k)?))).collect::<PyResult<_>>()?,
            aggs,
            sum_columns: sums.iter().map(|c| intern(c)).collect(),
            sum_detail: sums.iter().map(|c| Ok(format!("{} is not a number", repr(c)?))).collect::<PyResult<_>>()?,
            sum_names: sums,
            nonnull_columns: nonnull.iter().map(|c| intern(c)).collect(),
            nonnull_names: nonnull,
            multiset_columns: multisets.iter().map(|c| intern(c)).collect(),
            multiset_detail: multisets
                .iter()
                .map(|c| Ok(format!("{} holds a list or an object", repr(c)?)))
                .collect::<PyResult<_>>()?,
            multiset_index: multisets.iter().map(|c| at(&kept, c)).collect(),
            tag_index: tagged.iter().map(|c| at(&kept, c)).collect(),
            needs_tags: !tagged.is_empty(),
            kept: kept.iter().map(|c| intern(c)).collect(),
            form,
            delta,
            message_key,
            view_row,
            view_row_names,
            view_op_row,
            delta_row,
            delta_key,
        })
    }
}

// ------------------------------------------------------------------------------------
// State: `_Row`, `_Key`, `_Delta`

/// `_Row`: the live copies of one distinct row under one key.
struct Row {
    count: i64,
    /// ascending; only when a reduction orders by tag
    tags: Option<Vec<Tag>>,
    /// the kept columns' values (of the first copy); only when a reduction needs them
    vals: Option<Box<[Value]>>,
}

/// `_Key`: one view key's live rows, running values and current view row.
struct KeyState {
    /// where the key's `Touched` is in the batch, NO_SLOT before the batch touches it
    slot: u32,
    rows: FxHashMap<Fp, Row>,
    total: i64,
    sums: Vec<i128>,
    nonnull: Vec<i64>,
    /// `_Multiset`s: value → copies, in `value_order`
    multisets: Vec<BTreeMap<Scalar, i64>>,
    /// `order`: the live copies by (tag, fingerprint), with their multiplicity
    order: BTreeMap<(Tag, Fp), u32>,
    /// the view row's column values (the key columns' are in the key's JSON)
    view: Option<Vec<Value>>,
}

impl KeyState {
    fn new(plan: &Plan) -> KeyState {
        KeyState {
            slot: NO_SLOT,
            rows: FxHashMap::default(),
            total: 0,
            sums: vec![0; plan.sum_columns.len()],
            nonnull: vec![0; plan.nonnull_columns.len()],
            multisets: vec![BTreeMap::new(); plan.multiset_columns.len()],
            order: BTreeMap::new(),
            view: None,
        }
    }
}

/// The batch's contributions (`_deltas`, `_dirty_keys`, `_dirty_rows`): one slot per
/// key the batch touched, in the order it first did, and what each unit added to or
/// took from a slot, side by side for all keys (sorted by slot at the batch's end).
#[derive(Default)]
struct Batch {
    /// the key's JSON and its `_Delta.total`, by slot
    keys: Vec<(KeyBytes, i64)>,
    /// the slots of keys, for a key that ended and came back within the batch
    slots: Map<KeyBytes, u32>,
    /// `_Delta.sums` (slot * sum columns + column) and `_Delta.nonnull`
    sums: Vec<i128>,
    nonnull: Vec<i64>,
    /// `_Delta.multisets`: (slot, multiset column, value, +1 or -1)
    values: Vec<(u32, u32, Scalar, i64)>,
    /// `_Delta.contribs`: (slot, tag column, tag, value, sign)
    contribs: Vec<(u32, u32, Tag, Value, i64)>,
    /// `_dirty_rows`: (slot, fingerprint)
    rows: Vec<(u32, Fp)>,
}

/// Where each slot's items are in a vector sorted by slot: `starts[slot]..starts[slot + 1]`.
fn slot_starts(slots: usize, mut slot_of: impl Iterator<Item = u32>) -> Vec<usize> {
    let mut starts = vec![0usize; slots + 1];
    let mut at = 0usize;
    let mut next = slot_of.next();
    for (slot, start) in starts.iter_mut().enumerate() {
        *start = at;
        while next == Some(slot as u32) {
            at += 1;
            next = slot_of.next();
        }
    }
    starts
}

/// An event read and checked (`_checked`): its op, key, fingerprint and what the sums
/// and non-null counts read off its row.
struct Checked<'py> {
    adds: bool,
    key: Vec<u8>,
    fp: Fp,
    row: Bound<'py, PyDict>,
    tag: Tag,
    sums: Vec<Option<i64>>,
    nonnull: Vec<bool>,
}

/// What `apply_batch` hands back: the refusals, and the records as Python tuples —
/// view (key, value or None, event time), delta (key, value), state (key, value or None).
pub struct BatchOut<'py> {
    pub rejected: Vec<(usize, Rejected)>,
    pub view: Vec<Bound<'py, PyAny>>,
    pub delta: Vec<Bound<'py, PyAny>>,
    pub state: Vec<Bound<'py, PyAny>>,
}

/// A unit's view records before they are ordered: (adds, message key, value or None).
type UnitRecords<'py> = Vec<(bool, Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)>;

fn bytes<'py>(py: Python<'py>, data: &[u8]) -> Bound<'py, PyAny> {
    PyBytes::new(py, data).into_any()
}

fn pair<'py>(py: Python<'py>, a: Bound<'py, PyAny>, b: Option<Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
    let b = b.unwrap_or_else(|| py.None().into_bound(py));
    Ok(PyTuple::new(py, [a, b])?.into_any())
}

pub struct Core {
    pub plan: Plan,
    keys: Map<KeyBytes, KeyState>,
    batch: Batch,
    scratch: Vec<u8>,
    ranges: Vec<(usize, usize)>,
}

fn blake2b16(data: &[u8]) -> Fp {
    let mut hasher = Blake2b::<U16>::new();
    hasher.update(data);
    hasher.finalize().into()
}

/// The items of a tuple or a list (a unit, an item, an event).
fn seq_items<'py>(obj: &Bound<'py, PyAny>, what: &str) -> Result<Vec<Bound<'py, PyAny>>, Fail> {
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return Ok(tuple.iter().collect());
    }
    if let Ok(list) = obj.cast::<PyList>() {
        return Ok(list.iter().collect());
    }
    Err(Fail::Unsup(Unsup(format!("{what} that is not a tuple or a list"))))
}

fn seq_get<'py>(obj: &Bound<'py, PyAny>, index: usize, what: &str) -> Result<Bound<'py, PyAny>, Fail> {
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        if index < tuple.len() {
            return Ok(tuple.get_item(index)?);
        }
    } else if let Ok(list) = obj.cast::<PyList>() {
        if index < list.len() {
            return Ok(list.get_item(index)?);
        }
    }
    Err(Fail::Unsup(Unsup(format!("{what} that is not a tuple or a list of the expected size"))))
}

/// A unit's events (item[0] of each item), into `events`.
fn unit_events<'py>(unit: &Bound<'py, PyAny>, events: &mut Vec<Bound<'py, PyAny>>) -> Result<(), Fail> {
    if let Ok(tuple) = unit.cast::<PyTuple>() {
        for item in tuple.iter() {
            events.push(seq_get(&item, 0, "an item")?);
        }
    } else if let Ok(list) = unit.cast::<PyList>() {
        for item in list.iter() {
            events.push(seq_get(&item, 0, "an item")?);
        }
    } else {
        return Err(Fail::Unsup(Unsup::new("a unit that is not a tuple or a list")));
    }
    if events.is_empty() {
        return Err(Fail::Unsup(Unsup::new("an empty unit")));
    }
    Ok(())
}

/// A SourceEvent's (op, row, tag).
fn event_parts<'py>(event: &Bound<'py, PyAny>) -> Result<(i64, Bound<'py, PyDict>, Tag), Fail> {
    let op = seq_get(event, 0, "an event")?;
    let row = seq_get(event, 1, "an event")?;
    let tag = seq_get(event, 2, "an event")?;
    let op: i64 = op.extract().map_err(|_| Unsup::new("an op that is not an Op"))?;
    if !(0..=3).contains(&op) {
        return Err(Fail::Unsup(Unsup::new("an op out of range")));
    }
    let row = row.cast_exact::<PyDict>().map_err(|_| Unsup::new("a row that is not a dict"))?.clone();
    let tag = if let Ok(t) = tag.extract::<(i64, i64, i64)>() {
        t
    } else {
        let items = seq_items(&tag, "a tag")?;
        if items.len() != 3 {
            return Err(Fail::Unsup(Unsup::new("a tag that is not 3 integers")));
        }
        let one = |o: &Bound<'_, PyAny>| o.extract::<i64>().map_err(|_| Unsup::new("a tag that is not 3 integers"));
        (one(&items[0])?, one(&items[1])?, one(&items[2])?)
    };
    Ok((op, row, tag))
}

fn fits_i64(n: i128) -> Result<i64, Unsup> {
    i64::try_from(n).map_err(|_| Unsup::new("a sum past 64 bits"))
}

impl Core {
    pub fn new(plan: Plan) -> Core {
        Core { plan, keys: Map::default(), batch: Batch::default(), scratch: Vec::new(), ranges: Vec::new() }
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    // checks ------------------------------------------------------------------------

    /// `checked_key(row, key_columns, "key", multiset_columns, index)`: the key's JSON
    /// and values, Rejected as Python refuses, Unsupported for a bool, float or
    /// 64-bit-overflowing key value (Python's dict would merge 1, 1.0 and True).
    fn checked_key(&self, py: Python<'_>, row: &Bound<'_, PyDict>, index: usize) -> Result<Vec<u8>, Fail> {
        let plan = &self.plan;
        let mut values = Vec::with_capacity(plan.key_names.len());
        for (i, name) in plan.key_names.iter().enumerate() {
            match row.get_item(name.bind(py))? {
                Some(value) => values.push(value),
                None => return Err(reject(NULL_KEY, index, Some(plan.missing_detail[i].clone()))),
            }
        }
        if values.iter().any(|v| v.is_none()) {
            return Err(reject(NULL_KEY, index, None));
        }
        // key_problem
        let mut chars = 0usize;
        for value in &values {
            match kind(value) {
                Kind::Str(s) => chars += s.len()?,
                Kind::Int(_) | Kind::Float(_) | Kind::Bool(_) => {}
                _ => return Err(reject(SCHEMA_MISMATCH, index, Some("a key column holds a list or an object".into()))),
            }
        }
        if chars > MAX_KEY_CHARS {
            return Err(reject(KEY_TOO_LARGE, index, Some(format!("{chars} characters, at most {MAX_KEY_CHARS}"))));
        }
        // scalar_problem
        for (i, name) in plan.multiset_columns.iter().enumerate() {
            if let Some(value) = row.get_item(name.bind(py))? {
                match kind(&value) {
                    Kind::None | Kind::Str(_) | Kind::Int(_) | Kind::Float(_) | Kind::Bool(_) => {}
                    _ => return Err(reject(SCHEMA_MISMATCH, index, Some(plan.multiset_detail[i].clone()))),
                }
            }
        }
        // key_bytes(key)
        let mut key = Vec::with_capacity(24);
        key.push(b'[');
        for (i, value) in values.iter().enumerate() {
            if i > 0 {
                key.push(b',');
            }
            match kind(value) {
                Kind::Str(s) => write_str(&mut key, str_of(s)?),
                Kind::Int(n) => write_int(&mut key, int_of(n)?),
                _ => return Err(Fail::Unsup(Unsup::new("a float or boolean key value"))),
            }
        }
        key.push(b']');
        Ok(key)
    }

    /// `_checked(event, index)`: the event's key and row fingerprint (for a removal,
    /// `live_fingerprint` against the key's live rows), and its summed values.
    fn checked<'py>(&mut self, py: Python<'py>, event: &Bound<'py, PyAny>, index: usize) -> Result<Checked<'py>, Fail> {
        let (op, row, tag) = event_parts(event)?;
        let adds = op == 0 || op == 3;
        let key = self.checked_key(py, &row, index)?;
        let plan = &self.plan;
        let mut sums = Vec::with_capacity(plan.sum_columns.len());
        let mut unsupported: Option<Unsup> = None;
        for (i, name) in plan.sum_columns.iter().enumerate() {
            match row.get_item(name.bind(py))? {
                None => sums.push(None),
                Some(value) => match kind(&value) {
                    Kind::None => sums.push(None),
                    Kind::Int(n) => match int_of(n) {
                        Ok(n) => sums.push(Some(n)),
                        Err(e) => {
                            unsupported.get_or_insert(e);
                            sums.push(None)
                        }
                    },
                    Kind::Float(_) => {
                        unsupported.get_or_insert(Unsup::new("a float in a summed column"));
                        sums.push(None)
                    }
                    _ => return Err(reject(SCHEMA_MISMATCH, index, Some(plan.sum_detail[i].clone()))),
                },
            }
        }
        if let Some(err) = unsupported {
            return Err(Fail::Unsup(err));
        }
        let mut nonnull = Vec::with_capacity(plan.nonnull_columns.len());
        for name in &plan.nonnull_columns {
            nonnull.push(matches!(row.get_item(name.bind(py))?, Some(v) if !v.is_none()));
        }
        // fingerprint(row): blake2b of canonical_row (sorted keys, null columns left out)
        let scratch = &mut self.scratch;
        scratch.clear();
        write_py_dict(scratch, &row, true, true, 0)?;
        let mut fp = blake2b16(scratch);
        if !adds {
            if let Some(state) = self.keys.get(key.as_slice()) {
                // live_fingerprint: state from before a null column equalled an absent one
                if !state.rows.contains_key(&fp) && row.values().iter().any(|v| v.is_none()) {
                    scratch.clear();
                    write_py_dict(scratch, &row, true, false, 0)?;
                    let legacy = blake2b16(scratch);
                    if state.rows.contains_key(&legacy) {
                        fp = legacy;
                    }
                }
            }
        }
        Ok(Checked { adds, key, fp, row, tag, sums, nonnull })
    }

    // apply ---------------------------------------------------------------------------

    /// `GroupedReducer.apply(unit)` and the unit's part of `Renderer.view`.
    fn apply_unit<'py>(
        &mut self,
        py: Python<'py>,
        events: &[Bound<'py, PyAny>],
        records: &mut UnitRecords<'py>,
    ) -> Result<i64, Fail> {
        let ts;
        if events.len() == 1 {
            // _apply_event
            let c = self.checked(py, &events[0], 0)?;
            ts = c.tag.0;
            if c.adds {
                self.add(py, &c)?;
            } else {
                let live = self.keys.get(c.key.as_slice()).is_some_and(|s| s.rows.contains_key(&c.fp));
                if !live {
                    return Err(reject(NOT_LIVE, 0, None));
                }
                self.remove(&c)?;
            }
            self.settle(py, &c.key, records)?;
        } else {
            let mut prepared = Vec::with_capacity(events.len());
            for (index, event) in events.iter().enumerate() {
                prepared.push(self.checked(py, event, index)?);
            }
            ts = prepared[0].tag.0;
            self.check_live(&prepared)?;
            let mut keys: Vec<&[u8]> = Vec::new();
            for c in &prepared {
                if !keys.contains(&c.key.as_slice()) {
                    keys.push(&c.key);
                }
                if c.adds {
                    self.add(py, c)?;
                } else {
                    self.remove(c)?;
                }
            }
            keys.sort();
            for key in keys {
                self.settle(py, key, records)?;
            }
        }
        Ok(ts)
    }

    /// `_check_live`: every removal of the unit finds a live copy, counting the unit's
    /// own earlier events.
    fn check_live(&self, prepared: &[Checked<'_>]) -> Result<(), Fail> {
        let mut pending: Vec<(&[u8], &Fp, i64)> = Vec::new();
        for (index, c) in prepared.iter().enumerate() {
            let step = if c.adds { 1 } else { -1 };
            let at = pending.iter().position(|(k, f, _)| *k == c.key.as_slice() && *f == &c.fp);
            let have = match at {
                Some(at) => pending[at].2,
                None => self
                    .keys
                    .get(c.key.as_slice())
                    .and_then(|s| s.rows.get(&c.fp))
                    .map_or(0, |entry| entry.count),
            };
            if have + step < 0 {
                return Err(reject(NOT_LIVE, index, None));
            }
            match at {
                Some(at) => pending[at].2 = have + step,
                None => pending.push((&c.key, &c.fp, have + step)),
            }
        }
        Ok(())
    }

    /// `_add`: one more copy of the event's row under its key.
    fn add(&mut self, py: Python<'_>, c: &Checked<'_>) -> Result<(), Fail> {
        let plan = &self.plan;
        let state = self.keys.entry_ref(c.key.as_slice()).or_insert_with(|| KeyState::new(plan));
        if !state.rows.contains_key(&c.fp) {
            let vals = if plan.kept.is_empty() {
                None
            } else {
                let mut vals = Vec::with_capacity(plan.kept.len());
                for name in &plan.kept {
                    vals.push(match c.row.get_item(name.bind(py))? {
                        Some(value) => value_of(&value, 0)?,
                        None => Value::Null,
                    });
                }
                Some(vals.into_boxed_slice())
            };
            state.rows.insert(c.fp, Row { count: 0, tags: plan.needs_tags.then(Vec::new), vals });
        }
        let entry = state.rows.get_mut(&c.fp).unwrap();
        entry.count += 1;
        if let Some(tags) = entry.tags.as_mut() {
            tags.push(c.tag);
            if tags.len() > 1 && tags[tags.len() - 2] > c.tag {
                tags.sort();
            }
        }
        state.total += 1;
        let vals = entry.vals.take();
        let result = Self::account(plan, &mut self.batch, state, c, vals.as_deref(), c.tag, 1);
        state.rows.get_mut(&c.fp).unwrap().vals = vals;
        result
    }

    /// `_remove`: one copy less (the latest by tag).
    fn remove(&mut self, c: &Checked<'_>) -> Result<(), Fail> {
        let plan = &self.plan;
        let state = self.keys.get_mut(c.key.as_slice()).expect("a live row's key");
        let entry = state.rows.get_mut(&c.fp).expect("a live row");
        let tag = match entry.tags.as_mut() {
            Some(tags) => tags.pop().unwrap_or((0, 0, 0)),
            None => (0, 0, 0),
        };
        entry.count -= 1;
        let vals = if entry.count == 0 {
            state.rows.remove(&c.fp).unwrap().vals
        } else {
            entry.vals.take()
        };
        state.total -= 1;
        let result = Self::account(plan, &mut self.batch, state, c, vals.as_deref(), tag, -1);
        if let Some(entry) = state.rows.get_mut(&c.fp) {
            entry.vals = vals;
        }
        result
    }

    /// `_account`: fold one copy of a row in (+1) or out (-1) of the running values and
    /// of the batch's delta; mark the key and the row dirty.
    fn account(
        plan: &Plan,
        batch: &mut Batch,
        state: &mut KeyState,
        c: &Checked<'_>,
        vals: Option<&[Value]>,
        tag: Tag,
        sign: i64,
    ) -> Result<(), Fail> {
        if state.slot == NO_SLOT {
            let Batch { keys, slots, sums, nonnull, .. } = &mut *batch;
            state.slot = *slots.entry_ref(c.key.as_slice()).or_insert_with(|| {
                keys.push((KeyBytes::from(c.key.as_slice()), 0));
                sums.resize(sums.len() + plan.sum_columns.len(), 0);
                nonnull.resize(nonnull.len() + plan.nonnull_columns.len(), 0);
                (keys.len() - 1) as u32
            });
        }
        let at = state.slot;
        batch.rows.push((at, c.fp));
        batch.keys[at as usize].1 += sign;
        let base = at as usize * plan.sum_columns.len();
        for (slot, value) in c.sums.iter().enumerate() {
            if let Some(n) = value {
                let n = sign as i128 * *n as i128;
                state.sums[slot] += n;
                batch.sums[base + slot] += n;
            }
        }
        let base = at as usize * plan.nonnull_columns.len();
        for (slot, present) in c.nonnull.iter().enumerate() {
            if *present {
                state.nonnull[slot] += sign;
                batch.nonnull[base + slot] += sign;
            }
        }
        let Some(vals) = vals else { return Ok(()) };
        for (slot, &index) in plan.multiset_index.iter().enumerate() {
            let Some(value) = Scalar::of(&vals[index])? else { continue };
            let counts = &mut state.multisets[slot];
            let now = counts.get(&value).copied().unwrap_or(0) + sign;
            if now != 0 {
                match counts.get_mut(&value) {
                    Some(n) => *n = now,
                    None => {
                        counts.insert(value.clone(), now);
                    }
                }
            } else {
                counts.remove(&value);
            }
            batch.values.push((at, slot as u32, value, sign));
        }
        if plan.needs_tags {
            let item = (tag, c.fp);
            if sign > 0 {
                *state.order.entry(item).or_insert(0) += 1;
            } else if let Some(n) = state.order.get_mut(&item) {
                *n -= 1;
                if *n == 0 {
                    state.order.remove(&item);
                }
            }
            for (slot, &index) in plan.tag_index.iter().enumerate() {
                batch.contribs.push((at, slot as u32, tag, vals[index].clone(), sign));
            }
        }
        Ok(())
    }

    /// `_view_row`: the key's view columns off its running values.
    fn view_row(plan: &Plan, state: &KeyState) -> Result<Vec<Value>, Unsup> {
        let mut row = Vec::with_capacity(plan.aggs.len());
        for agg in &plan.aggs {
            row.push(match *agg {
                Agg::Sum { sum } => Value::Int(fits_i64(state.sums[sum])?),
                Agg::CountRows => Value::Int(state.total),
                Agg::Count { nn } => Value::Int(state.nonnull[nn]),
                Agg::Avg { sum, nn } => {
                    let n = state.nonnull[nn];
                    if n == 0 {
                        Value::Null
                    } else {
                        // float(Fraction(sum) / n): one correctly rounded division when
                        // both are exact as floats
                        let s = state.sums[sum];
                        const EXACT: i128 = 1 << 53;
                        if s.abs() >= EXACT || (n as i128).abs() >= EXACT {
                            return Err(Unsup::new("an average of a sum past 2**53"));
                        }
                        Value::Float(s as f64 / n as f64)
                    }
                }
                Agg::Min { ms } => state.multisets[ms].keys().next().map_or(Value::Null, Scalar::value),
                Agg::Max { ms } => state.multisets[ms].keys().next_back().map_or(Value::Null, Scalar::value),
                Agg::Set { ms } => Value::List(
                    state.multisets[ms]
                        .iter()
                        .map(|(v, n)| Value::List(vec![v.value(), Value::Int(*n)]))
                        .collect(),
                ),
                Agg::ByTag { last, kept, .. } => {
                    let found = if last { state.order.keys().next_back() } else { state.order.keys().next() };
                    let Some((_, fp)) = found else { return Err(Unsup::new("a key without live copies")) };
                    match state.rows.get(fp).and_then(|r| r.vals.as_ref()) {
                        Some(vals) => vals[kept].clone(),
                        None => return Err(Unsup::new("a key's live copies out of step")),
                    }
                }
            });
        }
        Ok(row)
    }

    /// `_settle` + `diff_changes` + the records `Renderer.view` makes of them: after a
    /// unit, the key's new view row (or its end) against the one before the unit.
    fn settle<'py>(&mut self, py: Python<'py>, key: &[u8], records: &mut UnitRecords<'py>) -> Result<(), Fail> {
        let Core { plan, keys, scratch: buf, ranges, .. } = self;
        let hashbrown::hash_map::EntryRef::Occupied(entry) = keys.entry_ref(key) else {
            unreachable!("a settled key is held")
        };
        let (old, new);
        let mut held = None;
        if entry.get().total == 0 {
            old = entry.remove().view;
            new = None;
        } else {
            let state = entry.into_mut();
            new = Some(Self::view_row(plan, state)?);
            old = state.view.take();
            held = Some(state);
        }
        if let Some(form) = plan.form {
            let changed = match (&old, &new) {
                (None, None) => false,
                (Some(a), Some(b)) => !a.iter().zip(b).all(|(x, y)| x.canon_eq(y)),
                _ => true,
            };
            if changed {
                key_part_ranges(key, ranges);
                let parts = KeyParts(key, ranges);
                buf.clear();
                render(buf, &plan.message_key, None, parts, Cols::Values(&[]), 0);
                let message_key = bytes(py, buf);
                let mut emit = |op: &[u8], adds: bool, row: &[Value]| {
                    buf.clear();
                    let value = match form {
                        Form::Upsert => {
                            if op == b"-C" {
                                return;
                            }
                            if op == b"-R" {
                                None
                            } else {
                                render(buf, &plan.view_row, None, parts, Cols::Values(row), 0);
                                Some(bytes(py, buf))
                            }
                        }
                        Form::Changelog | Form::Retract => {
                            // RETRACT_FORM: -C → -R, +C → +A
                            let code: &[u8] = match (form, op) {
                                (Form::Retract, b"-C") => b"-R",
                                (Form::Retract, b"+C") => b"+A",
                                _ => op,
                            };
                            render(buf, &plan.view_op_row, Some(code), parts, Cols::Values(row), 0);
                            Some(bytes(py, buf))
                        }
                    };
                    records.push((adds, message_key.clone(), value));
                };
                match (&old, &new) {
                    (None, Some(b)) => emit(b"+A", true, b),
                    (Some(a), None) => emit(b"-R", false, a),
                    (Some(a), Some(b)) => {
                        emit(b"-C", false, a);
                        emit(b"+C", true, b);
                    }
                    (None, None) => {}
                }
            }
        }
        if let Some(state) = held {
            state.view = new;
        }
        Ok(())
    }

    pub fn apply_batch<'py>(&mut self, py: Python<'py>, units: &Bound<'py, PyAny>) -> Result<BatchOut<'py>, Fail> {
        let units = seq_items(units, "units")?;
        let mut out = BatchOut {
            rejected: Vec::new(),
            view: Vec::with_capacity(if self.plan.form.is_some() { units.len() * 2 } else { 0 }),
            delta: Vec::new(),
            state: Vec::new(),
        };
        let mut events: Vec<Bound<'py, PyAny>> = Vec::with_capacity(2);
        let mut records: UnitRecords<'py> = Vec::with_capacity(4);
        let retract = self.plan.form == Some(Form::Retract);
        for (unit_index, unit) in units.iter().enumerate() {
            events.clear();
            unit_events(&unit, &mut events)?;
            records.clear();
            match self.apply_unit(py, &events, &mut records) {
                Ok(ts) => {
                    if records.is_empty() {
                        continue;
                    }
                    let Ok(ts) = ts.into_pyobject(py);
                    let ts = ts.into_any();
                    let mut push = |key: &Bound<'py, PyAny>, value: &Option<Bound<'py, PyAny>>| -> PyResult<()> {
                        let value = value.clone().unwrap_or_else(|| py.None().into_bound(py));
                        out.view.push(PyTuple::new(py, [key.clone(), value, ts.clone()])?.into_any());
                        Ok(())
                    };
                    if retract && records.len() > 1 {
                        // _retractions_first
                        for (_, key, value) in records.iter().filter(|r| !r.0).chain(records.iter().filter(|r| r.0)) {
                            push(key, value)?;
                        }
                    } else {
                        for (_, key, value) in &records {
                            push(key, value)?;
                        }
                    }
                }
                Err(Fail::Reject(rejected)) => out.rejected.push((unit_index, rejected)),
                Err(other) => return Err(other),
            }
        }
        self.take_deltas(py, &mut out)?;
        Ok(out)
    }

    // batch boundaries ----------------------------------------------------------------

    /// `take_deltas` + `Renderer.deltas`, then `take_state_changes`.
    ///
    /// The state records come out in record-key order without sorting them: a key's
    /// JSON is never a proper prefix of another's, so records order by their key's JSON
    /// first; within a key, its rows (`[key,"<hex>"`, by fingerprint) come before its
    /// summary (`[key]`), as `,` sorts before `]`.
    fn take_deltas<'py>(&mut self, py: Python<'py>, out: &mut BatchOut<'py>) -> Result<(), Fail> {
        let plan = &self.plan;
        let Batch { keys: touched, sums, nonnull, mut values, mut contribs, mut rows, .. } = std::mem::take(&mut self.batch);
        let n = touched.len();
        rows.sort_unstable();
        rows.dedup();
        let row_starts = slot_starts(n, rows.iter().map(|r| r.0));
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.sort_unstable_by(|a, b| touched[*a as usize].0.as_slice().cmp(touched[*b as usize].0.as_slice()));
        out.state.reserve(n * 2);
        let (mut value_starts, mut contrib_starts) = (Vec::new(), Vec::new());
        if plan.delta {
            out.delta.reserve(n);
            // the net copies per (slot, column, value), in value_order
            values.sort_by(|a, b| (a.0, a.1, &a.2).cmp(&(b.0, b.1, &b.2)));
            values.dedup_by(|later, first| {
                let same = later.0 == first.0 && later.1 == first.1 && later.2 == first.2;
                if same {
                    first.3 += later.3;
                }
                same
            });
            value_starts = slot_starts(n, values.iter().map(|v| v.0));
            contribs.sort_by_key(|c| (c.0, c.1));
            contrib_starts = slot_starts(n, contribs.iter().map(|c| c.0));
        }
        let buf = &mut self.scratch;
        let mut json: Vec<u8> = Vec::with_capacity(64);
        let mut ranges: Vec<(usize, usize)> = Vec::with_capacity(plan.aggs.len());
        let mut part_ranges: Vec<(usize, usize)> = Vec::new();
        let (nsum, nnn) = (plan.sum_columns.len(), plan.nonnull_columns.len());
        for &at in &order {
            let at = at as usize;
            let (key, total) = (touched[at].0.as_slice(), touched[at].1);
            if plan.delta {
                let delta = DeltaOf {
                    total,
                    sums: &sums[at * nsum..(at + 1) * nsum],
                    nonnull: &nonnull[at * nnn..(at + 1) * nnn],
                    values: &values[value_starts[at]..value_starts[at + 1]],
                    contribs: &contribs[contrib_starts[at]..contrib_starts[at + 1]],
                };
                json.clear();
                ranges.clear();
                for agg in &plan.aggs {
                    let start = json.len();
                    write_delta_col(&mut json, *agg, &delta)?;
                    ranges.push((start, json.len()));
                }
                let cols = Cols::Json(&json, &ranges);
                key_part_ranges(key, &mut part_ranges);
                let parts = KeyParts(key, &part_ranges);
                buf.clear();
                render(buf, &plan.delta_key, None, parts, cols, total);
                let message_key = bytes(py, buf);
                buf.clear();
                render(buf, &plan.delta_row, None, parts, cols, total);
                out.delta.push(pair(py, message_key, Some(bytes(py, buf)))?);
            }
            // take_state_changes
            let kj: &[u8] = key;
            let state = self.keys.get_mut(kj).map(|state| {
                state.slot = NO_SLOT;
                &*state
            });
            for (_, fp) in &rows[row_starts[at]..row_starts[at + 1]] {
                let entry = state.and_then(|s| s.rows.get(fp));
                let value = match entry {
                    None => None,
                    Some(entry) => {
                        let values = entry.vals.as_ref().map(|vals| {
                            json.clear();
                            json.push(b'[');
                            for (i, v) in vals.iter().enumerate() {
                                if i > 0 {
                                    json.push(b',');
                                }
                                v.write(&mut json, false);
                            }
                            json.push(b']');
                            json.as_slice()
                        });
                        let tags: &[Tag] = entry.tags.as_deref().unwrap_or(&[]);
                        buf.clear();
                        statecodec::state_value(buf, LIVE_ROW, kj, entry.count, values, tags);
                        Some(bytes(py, buf))
                    }
                };
                buf.clear();
                statecodec::row_key(buf, kj, fp);
                out.state.push(pair(py, bytes(py, buf), value)?);
            }
            let value = match state {
                None => None,
                Some(state) => {
                    json.clear();
                    json.extend_from_slice(b"{\"s\":{");
                    for (i, name) in plan.sum_names.iter().enumerate() {
                        if i > 0 {
                            json.push(b',');
                        }
                        write_str(&mut json, name);
                        json.extend_from_slice(b":[\"");
                        write_i128(&mut json, state.sums[i]);
                        json.extend_from_slice(b"\",0]");
                    }
                    json.extend_from_slice(b"},\"nn\":{");
                    for (i, name) in plan.nonnull_names.iter().enumerate() {
                        if i > 0 {
                            json.push(b',');
                        }
                        write_str(&mut json, name);
                        json.push(b':');
                        write_int(&mut json, state.nonnull[i]);
                    }
                    json.extend_from_slice(b"}}");
                    buf.clear();
                    statecodec::state_value(buf, KEY_SUMMARY, kj, state.total, Some(&json), &[]);
                    Some(bytes(py, buf))
                }
            };
            buf.clear();
            statecodec::summary_key(buf, kj);
            out.state.push(pair(py, bytes(py, buf), value)?);
        }
        Ok(())
    }

    /// `state_key` over every event of the units: the key JSON of those with a key.
    pub fn touched(&self, py: Python<'_>, units: &Bound<'_, PyAny>) -> Result<Vec<Vec<u8>>, Fail> {
        let mut seen: FxHashSet<Vec<u8>> = FxHashSet::default();
        let mut out = Vec::new();
        let mut events = Vec::with_capacity(2);
        for unit in seq_items(units, "units")? {
            events.clear();
            unit_events(&unit, &mut events)?;
            for event in &events {
                let row = seq_get(event, 1, "an event")?;
                let row = row.cast_exact::<PyDict>().map_err(|_| Unsup::new("a row that is not a dict"))?;
                match self.checked_key(py, row, 0) {
                    Ok(key) => {
                        if seen.insert(key.clone()) {
                            out.push(key);
                        }
                    }
                    Err(Fail::Reject(_)) => {}
                    Err(other) => return Err(other),
                }
            }
        }
        Ok(out)
    }

    /// `GroupedReducer.restore`: hold the keys these records are of, replacing what
    /// was held of them.
    pub fn restore(&mut self, py: Python<'_>, records: &Bound<'_, PyAny>) -> Result<(), RestoreFail> {
        let plan = &self.plan;
        let mut restored: FxHashSet<Vec<u8>> = FxHashSet::default();
        for item in records.try_iter().map_err(Fail::Py)? {
            let item = item.map_err(Fail::Py)?;
            let not_bytes = || Fail::Unsup(Unsup::new("a state record that is not (bytes, bytes)"));
            let (record_key, value): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract().map_err(|_| not_bytes())?;
            let record_key = record_key.cast::<PyBytes>().map_err(|_| not_bytes())?.as_bytes();
            let value = value.cast::<PyBytes>().map_err(|_| not_bytes())?.as_bytes();
            let record = statecodec::decode_state(value)?;
            let Value::List(key_values) = &record.key else {
                return Err(Unsup::new("a state record's key that is not a list").into());
            };
            let parts = key_values
                .iter()
                .map(|v| match v {
                    Value::Int(n) => Ok(KeyPart::Int(*n)),
                    Value::Str(s) => Ok(KeyPart::Str(s.clone())),
                    _ => Err(Unsup::new("a state record's key value that is not a str or an int")),
                })
                .collect::<Result<Vec<_>, _>>()?;
            let kj = key_json(&parts);
            if restored.insert(kj.clone()) {
                self.keys.insert(KeyBytes::from(kj.as_slice()), KeyState::new(plan));
            }
            let state = self.keys.get_mut(kj.as_slice()).unwrap();
            let bad = || Unsup::new("a key summary the core does not read");
            if record.kind == KEY_SUMMARY {
                state.total = record.count;
                let Some(Value::Dict(values)) = &record.values else { return Err(bad().into()) };
                let field = |name: &str| values.iter().find(|(n, _)| &**n == name).map(|(_, v)| v);
                let (Some(Value::Dict(s)), Some(Value::Dict(nn))) = (field("s"), field("nn")) else {
                    return Err(bad().into());
                };
                for (column, entry) in s {
                    let slot = plan.sum_names.iter().position(|c| **c == **column).ok_or_else(bad)?;
                    let Value::List(pair) = entry else { return Err(bad().into()) };
                    let [Value::Str(total), Value::Int(0)] = pair.as_slice() else {
                        return Err(Unsup::new("a key summary with a float sum").into());
                    };
                    let digits = total.strip_prefix('-').unwrap_or(total);
                    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                        return Err(bad().into());
                    }
                    state.sums[slot] = total.parse::<i128>().map_err(|_| bad())?;
                }
                for (column, n) in nn {
                    let slot = plan.nonnull_names.iter().position(|c| **c == **column).ok_or_else(bad)?;
                    let Value::Int(n) = n else { return Err(bad().into()) };
                    state.nonnull[slot] = *n;
                }
                continue;
            }
            if record.kind != LIVE_ROW {
                return Err(Unsup::new("a state record of another kind than a view key's").into());
            }
            let fp = statecodec::row_fingerprint(record_key)?;
            let vals = match record.values {
                None => None,
                Some(Value::List(vals)) if vals.len() == plan.kept.len() => Some(vals.into_boxed_slice()),
                Some(_) => return Err(Unsup::new("a live row's values that are not the kept columns").into()),
            };
            let count = record.count;
            if let Some(vals) = &vals {
                for (slot, &index) in plan.multiset_index.iter().enumerate() {
                    if let Some(value) = Scalar::of(&vals[index])? {
                        let counts = &mut state.multisets[slot];
                        let now = counts.get(&value).copied().unwrap_or(0) + count;
                        if now != 0 {
                            counts.insert(value, now);
                        } else {
                            counts.remove(&value);
                        }
                    }
                }
            }
            let tags = if plan.needs_tags {
                for tag in &record.tags {
                    *state.order.entry((*tag, fp)).or_insert(0) += 1;
                }
                Some(record.tags)
            } else {
                None
            };
            state.rows.insert(fp, Row { count, tags, vals });
        }
        for kj in restored {
            let state = self.keys.get_mut(kj.as_slice()).unwrap();
            if state.total == 0 {
                self.keys.remove(kj.as_slice());
            } else {
                state.view = Some(Self::view_row(plan, state)?);
            }
        }
        let _ = py;
        Ok(())
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

/// Why `restore` stopped: ValueError (not a state record) or as `Fail`.
pub enum RestoreFail {
    NotState(String),
    Fail(Fail),
}

impl From<Fail> for RestoreFail {
    fn from(err: Fail) -> Self {
        RestoreFail::Fail(err)
    }
}

impl From<Unsup> for RestoreFail {
    fn from(err: Unsup) -> Self {
        RestoreFail::Fail(Fail::Unsup(err))
    }
}

impl From<DecodeError> for RestoreFail {
    fn from(err: DecodeError) -> Self {
        match err {
            DecodeError::NotState(why) => RestoreFail::NotState(why),
            DecodeError::Unsupported(why) => RestoreFail::Fail(Fail::Unsup(Unsup(why))),
        }
    }
}

/// Write an output object by its layout: `op` the code for `Src::Op`, `parts` the key
/// values, `cols` the columns' values, `count` the delta row's `_count`.
fn render(out: &mut Vec<u8>, layout: &Layout, op: Option<&[u8]>, parts: KeyParts<'_>, cols: Cols<'_>, count: i64) {
    out.push(b'{');
    for (i, (prefix, src)) in layout.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(prefix);
        match *src {
            Src::Op => {
                out.push(b'"');
                out.extend_from_slice(op.unwrap_or(b""));
                out.push(b'"');
            }
            Src::Key(k) => out.extend_from_slice(&parts.0[parts.1[k].0..parts.1[k].1]),
            Src::Count => write_int(out, count),
            Src::Col(c) => match cols {
                Cols::Values(values) => values[c].write(out, false),
                Cols::Json(json, ranges) => out.extend_from_slice(&json[ranges[c].0..ranges[c].1]),
            },
        }
    }
    out.push(b'}');
}

/// A key's values as JSON: its `key_bytes` and where each value is in them.
#[derive(Clone, Copy)]
struct KeyParts<'a>(&'a [u8], &'a [(usize, usize)]);

/// Where the values are in a key's JSON list (of strings and integers only).
fn key_part_ranges(key: &[u8], ranges: &mut Vec<(usize, usize)>) {
    ranges.clear();
    let mut at = 1; // past '['
    while at < key.len() - 1 {
        let start = at;
        if key[at] == b'"' {
            at += 1;
            while key[at] != b'"' {
                at += if key[at] == b'\\' { 2 } else { 1 };
            }
            at += 1;
        } else {
            while key[at] != b',' && key[at] != b']' {
                at += 1;
            }
        }
        ranges.push((start, at));
        at += 1; // past ',' (or onto the end)
    }
}

/// The columns of an output row: as values (a view row), or written already (a delta
/// row: `json[start..end]` per column).
#[derive(Clone, Copy)]
enum Cols<'a> {
    Values(&'a [Value]),
    Json(&'a [u8], &'a [(usize, usize)]),
}

/// One key's part of the batch (`_Delta`), its vectors sorted by column then value.
struct DeltaOf<'a> {
    total: i64,
    sums: &'a [i128],
    nonnull: &'a [i64],
    values: &'a [(u32, u32, Scalar, i64)],
    contribs: &'a [(u32, u32, Tag, Value, i64)],
}

/// Append one column of a delta row (`_Plan.delta_readers`).
fn write_delta_col(out: &mut Vec<u8>, agg: Agg, delta: &DeltaOf<'_>) -> Result<(), Unsup> {
    match agg {
        Agg::Sum { sum } => write_int(out, fits_i64(delta.sums[sum])?),
        Agg::CountRows => write_int(out, delta.total),
        Agg::Count { nn } => write_int(out, delta.nonnull[nn]),
        Agg::Avg { sum, nn } => {
            // {"sum": exact(sum), "count": n}
            out.extend_from_slice(b"{\"sum\":");
            write_int(out, fits_i64(delta.sums[sum])?);
            out.extend_from_slice(b",\"count\":");
            write_int(out, delta.nonnull[nn]);
            out.push(b'}');
        }
        Agg::Min { ms } | Agg::Max { ms } | Agg::Set { ms } => {
            // [[value, copies], ...] in value_order, without the values that net to 0
            out.push(b'[');
            let mut first = true;
            for (_, _, value, d) in delta.values.iter().filter(|v| v.1 as usize == ms) {
                if *d == 0 {
                    continue;
                }
                if !first {
                    out.push(b',');
                }
                first = false;
                out.push(b'[');
                value.write(out);
                out.push(b',');
                write_int(out, *d);
                out.push(b']');
            }
            out.push(b']');
        }
        Agg::ByTag { slot, .. } => {
            // [[tag, value, sign], ...] by _contribution_order: tag, the value's JSON, sign
            let contribs: Vec<(&Tag, &Value, &i64)> =
                delta.contribs.iter().filter(|c| c.1 as usize == slot).map(|c| (&c.2, &c.3, &c.4)).collect();
            let head = |out: &mut Vec<u8>, tag: &Tag| {
                out.extend_from_slice(b"[[");
                write_int(out, tag.0);
                out.push(b',');
                write_int(out, tag.1);
                out.push(b',');
                write_int(out, tag.2);
                out.extend_from_slice(b"],");
            };
            out.push(b'[');
            if contribs.len() == 1 {
                let (tag, value, d) = contribs[0];
                head(out, tag);
                value.write(out, false);
                out.push(b',');
                write_int(out, *d);
                out.push(b']');
            } else if contribs.len() > 1 {
                // the values' JSON side by side, then the contributions sorted
                let mut json = Vec::with_capacity(contribs.len() * 8);
                let mut keyed: Vec<(Tag, usize, usize, i64)> = Vec::with_capacity(contribs.len());
                for (tag, value, d) in contribs {
                    let start = json.len();
                    value.write(&mut json, false);
                    keyed.push((*tag, start, json.len(), *d));
                }
                keyed.sort_by(|a, b| (a.0, &json[a.1..a.2], a.3).cmp(&(b.0, &json[b.1..b.2], b.3)));
                for (i, (tag, start, end, d)) in keyed.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    head(out, tag);
                    out.extend_from_slice(&json[*start..*end]);
                    out.push(b',');
                    write_int(out, *d);
                    out.push(b']');
                }
            }
            out.push(b']');
        }
    }
    Ok(())
}
