//! A batch in: `apply_units` over its units (`GroupedReducer.apply` per unit), the
//! checks of refold.reduce.grouped that refuse a unit before it changes anything
//! (`checked_key`, `_checked`, `_check_live`), and `touched` (`state_key`). The units
//! come as Python objects (`apply_batch`: refold.runtime.batch's units, each row read
//! into a `Row`) or from the core's own reader (`read`).

use blake2::digest::consts::U16;
use blake2::{Blake2b, Digest};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use rustc_hash::FxHashSet;

use super::plan::Form;
use super::{reject, Core, Fail, Fp, Rejected, KEY_TOO_LARGE, MAX_KEY_CHARS, NOT_LIVE, NULL_KEY, SCHEMA_MISMATCH};
use crate::json::{write_int, write_str};
use crate::statecodec::Tag;
use crate::value::{row_get, value_of, write_row, Row, Unsup, Value};

/// An event as the core applies it (a SourceEvent): op (0..3: `+A -R -C +C`), row,
/// tag; `record` is the input record it came from (the reader's count, 0 otherwise).
pub struct Ev {
    pub op: u8,
    pub row: Row,
    pub tag: Tag,
    pub record: u32,
}

/// An event read and checked (`_checked`): its op, key, fingerprint and what the sums
/// and non-null counts read off its row.
pub(super) struct Checked<'a> {
    pub(super) adds: bool,
    pub(super) key: Vec<u8>,
    pub(super) fp: Fp,
    pub(super) row: &'a [(Box<str>, Value)],
    pub(super) tag: Tag,
    pub(super) sums: Vec<Option<i64>>,
    pub(super) nonnull: Vec<bool>,
}

/// What `apply_batch` hands back: the refusals, and the records as Python tuples —
/// view (key, value or None, event time), delta (key, value), state (key, value or None).
pub struct BatchOut<'py> {
    pub rejected: Vec<(usize, Rejected)>,
    pub view: Vec<Bound<'py, PyAny>>,
    pub delta: Vec<Bound<'py, PyAny>>,
    pub state: Vec<Bound<'py, PyAny>>,
}

/// A unit's view records before they are ordered: (adds, message key, value or None,
/// the cause of the record it retracts).
pub(crate) type UnitRecords<'py> = Vec<(bool, Bound<'py, PyAny>, Option<Bound<'py, PyAny>>, Option<super::Cause>)>;

/// A unit's view records into `view` as (key, value, ts, headers), the retractions first in
/// the retract form (`_retractions_first`); `headers` names the unit's cause when
/// `provenance` is on, else None.
pub(crate) fn push_view_records<'py>(
    py: Python<'py>,
    view: &mut Vec<Bound<'py, PyAny>>,
    records: &UnitRecords<'py>,
    ts: i64,
    cause: super::Cause,
    provenance: bool,
    names: &super::CauseNames,
    retract: bool,
) -> PyResult<()> {
    let Ok(ts) = ts.into_pyobject(py);
    let ts = ts.into_any();
    let header = if provenance { Some(super::cause_header(py, cause, names)?) } else { None };
    let mut push = |key: &Bound<'py, PyAny>, value: &Option<Bound<'py, PyAny>>, retracts: Option<super::Cause>| -> PyResult<()> {
        let value = value.clone().unwrap_or_else(|| py.None().into_bound(py));
        let headers = match &header {
            Some(header) => super::headers(py, header, retracts, names)?,
            None => py.None().into_bound(py),
        };
        view.push(PyTuple::new(py, [key.clone(), value, ts.clone(), headers])?.into_any());
        Ok(())
    };
    if retract && records.len() > 1 {
        for (_, key, value, retracts) in records.iter().filter(|r| !r.0).chain(records.iter().filter(|r| r.0)) {
            push(key, value, *retracts)?;
        }
    } else {
        for (_, key, value, retracts) in records {
            push(key, value, *retracts)?;
        }
    }
    Ok(())
}

pub(crate) fn blake2b16(data: &[u8]) -> Fp {
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

/// A Python unit's events (item[0] of each item) as `Ev`s: op, row (read into a `Row`:
/// Unsupported for a value the core does not hold), tag.
fn unit_of(unit: &Bound<'_, PyAny>) -> Result<Vec<Ev>, Fail> {
    let items = seq_items(unit, "a unit")?;
    if items.is_empty() {
        return Err(Fail::Unsup(Unsup::new("an empty unit")));
    }
    let mut events = Vec::with_capacity(items.len());
    for item in &items {
        let (op, row, tag) = event_parts(&seq_get(item, 0, "an item")?)?;
        let Value::Dict(row) = value_of(row.as_any(), 0)? else { unreachable!("a dict's value") };
        events.push(Ev { op: op as u8, row, tag, record: 0 });
    }
    Ok(events)
}

/// Python units (refold.runtime.batch's `Unit`s) as the core's.
pub(crate) fn units_of(units: &Bound<'_, PyAny>) -> Result<Vec<Vec<Ev>>, Fail> {
    seq_items(units, "units")?.iter().map(unit_of).collect()
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

/// The columns that key a view (a grouped view's `key`, a Top-N's `partition_by`) and
/// the scalar columns checked with them (`min`/`max`/`set` columns, order columns):
/// `checked_key(row, columns, what, scalar_columns, index)` of refold.reduce.values,
/// with its refusals' details written once.
pub(crate) struct KeyColumns {
    names: Vec<String>,
    missing_detail: Vec<String>,
    scalar_names: Vec<String>,
    scalar_detail: Vec<String>,
}

impl KeyColumns {
    /// `what` names the key columns in a refusal ("key", "partition").
    pub(crate) fn new(py: Python<'_>, what: &str, names: &[String], scalar_names: &[String]) -> PyResult<KeyColumns> {
        let repr = |name: &str| -> PyResult<String> { Ok(PyString::new(py, name).repr()?.to_str()?.to_owned()) };
        Ok(KeyColumns {
            names: names.to_vec(),
            missing_detail: names.iter().map(|k| Ok(format!("{what} column {} is missing", repr(k)?))).collect::<PyResult<_>>()?,
            scalar_names: scalar_names.to_vec(),
            scalar_detail: scalar_names
                .iter()
                .map(|c| Ok(format!("{} holds a list or an object", repr(c)?)))
                .collect::<PyResult<_>>()?,
        })
    }

    /// The key's JSON (`key_bytes`), Rejected as Python refuses, Unsupported for a bool
    /// or float key value (Python's dict would merge 1, 1.0 and True).
    pub(crate) fn checked_key(&self, row: &[(Box<str>, Value)], index: usize) -> Result<Vec<u8>, Fail> {
        let mut values: Vec<&Value> = Vec::with_capacity(self.names.len());
        for (i, name) in self.names.iter().enumerate() {
            match row_get(row, name) {
                Some(value) => values.push(value),
                None => return Err(reject(NULL_KEY, index, Some(self.missing_detail[i].clone()))),
            }
        }
        if values.iter().any(|v| matches!(v, Value::Null)) {
            return Err(reject(NULL_KEY, index, None));
        }
        // key_problem: len() counts code points, never more than the UTF-8 bytes
        let mut bytes = 0usize;
        for value in &values {
            match value {
                Value::Str(s) => bytes += s.len(),
                Value::Int(_) | Value::Float(_) | Value::Bool(_) => {}
                _ => return Err(reject(SCHEMA_MISMATCH, index, Some("a key column holds a list or an object".into()))),
            }
        }
        if bytes > MAX_KEY_CHARS {
            let chars: usize = values.iter().map(|v| if let Value::Str(s) = v { s.chars().count() } else { 0 }).sum();
            if chars > MAX_KEY_CHARS {
                return Err(reject(KEY_TOO_LARGE, index, Some(format!("{chars} characters, at most {MAX_KEY_CHARS}"))));
            }
        }
        // scalar_problem
        for (i, name) in self.scalar_names.iter().enumerate() {
            if let Some(value) = row_get(row, name) {
                match value {
                    Value::Null | Value::Str(_) | Value::Int(_) | Value::Float(_) | Value::Bool(_) => {}
                    _ => return Err(reject(SCHEMA_MISMATCH, index, Some(self.scalar_detail[i].clone()))),
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
            match value {
                Value::Str(s) => write_str(&mut key, s),
                Value::Int(n) => write_int(&mut key, *n),
                _ => return Err(Fail::Unsup(Unsup::new("a float or boolean key value"))),
            }
        }
        key.push(b']');
        Ok(key)
    }

    /// `state_key` over every event of the units: the key JSON of those with a key, each
    /// once, in the order first met.
    pub(crate) fn touched_of(&self, units: &[Vec<Ev>]) -> Result<Vec<Vec<u8>>, Fail> {
        let mut seen: FxHashSet<Vec<u8>> = FxHashSet::default();
        let mut out = Vec::new();
        for event in units.iter().flatten() {
            match self.checked_key(&event.row, 0) {
                Ok(key) => {
                    if seen.insert(key.clone()) {
                        out.push(key);
                    }
                }
                Err(Fail::Reject(_)) => {}
                Err(other) => return Err(other),
            }
        }
        Ok(out)
    }
}

/// `fingerprint(row)`: blake2b-128 of `canonical_row` (sorted keys, null columns left
/// out), written in `scratch`.
pub(crate) fn fingerprint(scratch: &mut Vec<u8>, row: &[(Box<str>, Value)]) -> Fp {
    scratch.clear();
    write_row(scratch, row, true);
    blake2b16(scratch)
}

/// `live_fingerprint`: for a removal, the fingerprint `live` holds the row under — `fp`,
/// or, for a row with null columns not held under it, the fingerprint of
/// `legacy_canonical_row` (state from before a null column equalled an absent one)
/// when `live` holds that.
pub(crate) fn live_fingerprint(scratch: &mut Vec<u8>, row: &[(Box<str>, Value)], fp: Fp, live: impl Fn(&Fp) -> bool) -> Fp {
    if live(&fp) || !row.iter().any(|(_, v)| matches!(v, Value::Null)) {
        return fp;
    }
    scratch.clear();
    write_row(scratch, row, false);
    let legacy = blake2b16(scratch);
    if live(&legacy) {
        legacy
    } else {
        fp
    }
}

impl Core {
    /// The input event the next unit's records come of (`apply_units` sets it per unit).
    pub(crate) fn set_cause(&mut self, cause: super::Cause) {
        self.batch.cause = cause;
    }

    // checks ------------------------------------------------------------------------

    /// `checked_key(row, key_columns, "key", multiset_columns, index)`.
    pub(super) fn checked_key(&self, row: &[(Box<str>, Value)], index: usize) -> Result<Vec<u8>, Fail> {
        self.plan.keys.checked_key(row, index)
    }

    /// `_checked(event, index)`: the event's key and row fingerprint (for a removal,
    /// `live_fingerprint` against the key's live rows), and its summed values.
    fn checked<'a>(&mut self, event: &'a Ev, index: usize) -> Result<Checked<'a>, Fail> {
        self.checked_row(event.row.as_slice(), event.op == 0 || event.op == 3, event.tag, index, None)
    }

    /// `_checked` of a row added (`adds`) or removed with its tag; `known`: an added
    /// row's key and fingerprint, made already.
    fn checked_row<'a>(&mut self, row: &'a [(Box<str>, Value)], adds: bool, tag: Tag, index: usize,
                       known: Option<(&[u8], Fp)>) -> Result<Checked<'a>, Fail> {
        let key = match known {
            Some((key, _)) => key.to_vec(),
            None => self.checked_key(row, index)?,
        };
        let plan = &self.plan;
        let mut sums = Vec::with_capacity(plan.sum_names.len());
        let mut unsupported: Option<Unsup> = None;
        for (i, name) in plan.sum_names.iter().enumerate() {
            match row_get(row, name) {
                None | Some(Value::Null) => sums.push(None),
                Some(Value::Int(n)) => sums.push(Some(*n)),
                Some(Value::Float(_)) => {
                    unsupported.get_or_insert(Unsup::new("a float in a summed column"));
                    sums.push(None)
                }
                Some(_) => return Err(reject(SCHEMA_MISMATCH, index, Some(plan.sum_detail[i].clone()))),
            }
        }
        if let Some(err) = unsupported {
            return Err(Fail::Unsup(err));
        }
        let nonnull = plan.nonnull_names.iter().map(|name| matches!(row_get(row, name), Some(v) if !matches!(v, Value::Null))).collect();
        if let (Some((_, fp)), true) = (known, adds) {
            return Ok(Checked { adds, key, fp, row, tag, sums, nonnull });
        }
        let mut fp = fingerprint(&mut self.scratch, row);
        if !adds {
            if let Some(state) = self.keys.get(key.as_slice()) {
                fp = live_fingerprint(&mut self.scratch, row, fp, |fp| state.rows.contains_key(fp));
            }
        }
        Ok(Checked { adds, key, fp, row, tag, sums, nonnull })
    }

    /// The view columns of one key's rows (its JSON `kj`), each (row, fingerprint, tag) a copy, as a fresh
    /// `GroupedReducer` makes them (a session's, crate::window::session): the core is
    /// empty before and after. A row Python would refuse is Unsupported (it refuses it
    /// after the session changed).
    pub(crate) fn values_of<'a>(&mut self, kj: &[u8], copies: impl Iterator<Item = (&'a [(Box<str>, Value)], Fp, Tag)>) -> Result<Vec<Value>, Fail> {
        let mut key: Option<Vec<u8>> = None;
        let mut result = Ok(());
        for (row, fp, tag) in copies {
            let added = self.checked_row(row, true, tag, 0, Some((kj, fp))).and_then(|c| {
                self.add(&c)?;
                key.get_or_insert(c.key);
                Ok(())
            });
            if let Err(err) = added {
                result = Err(err);
                break;
            }
        }
        let values = match (result, &key) {
            (Ok(()), Some(key)) => Self::view_row(&self.plan, &self.keys[key.as_slice()]).map_err(Fail::Unsup),
            (Ok(()), None) => Err(Fail::Unsup(Unsup::new("a session without rows"))),
            (Err(Fail::Reject(r)), _) => Err(Fail::Unsup(Unsup(format!("a session row Python refuses ({})", r.reason)))),
            (Err(err), _) => Err(err),
        };
        self.keys.clear();
        self.batch.clear();
        values
    }

    // apply ---------------------------------------------------------------------------

    /// `GroupedReducer.apply(unit)` and the unit's part of `Renderer.view`.
    pub(crate) fn apply_unit<'py>(&mut self, py: Python<'py>, events: &[Ev], records: &mut UnitRecords<'py>) -> Result<i64, Fail> {
        let ts;
        if events.len() == 1 {
            // _apply_event
            let c = self.checked(&events[0], 0)?;
            ts = c.tag.0;
            if c.adds {
                self.add(&c)?;
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
                prepared.push(self.checked(event, index)?);
            }
            ts = prepared[0].tag.0;
            self.check_live(&prepared)?;
            let mut keys: Vec<&[u8]> = Vec::new();
            for c in &prepared {
                if !keys.contains(&c.key.as_slice()) {
                    keys.push(&c.key);
                }
                if c.adds {
                    self.add(c)?;
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

    /// One batch's units, in order: the refused ones by their index in `units`, and the
    /// view, delta and state records.
    pub fn apply_units<'py>(&mut self, py: Python<'py>, units: &[Vec<Ev>]) -> Result<BatchOut<'py>, Fail> {
        let mut out = BatchOut {
            rejected: Vec::new(),
            view: Vec::with_capacity(if self.plan.form.is_some() { units.len() * 2 } else { 0 }),
            delta: Vec::new(),
            state: Vec::new(),
        };
        let mut records: UnitRecords<'py> = Vec::with_capacity(4);
        let retract = self.plan.form == Some(Form::Retract);
        for (unit_index, events) in units.iter().enumerate() {
            if events.is_empty() {
                return Err(Fail::Unsup(Unsup::new("an empty unit")));
            }
            records.clear();
            let cause = (events[0].tag.1, events[0].tag.2);
            self.batch.cause = cause;
            match self.apply_unit(py, events, &mut records) {
                Ok(ts) => {
                    if records.is_empty() {
                        continue;
                    }
                    push_view_records(py, &mut out.view, &records, ts, cause, self.provenance, &self.names, retract)?;
                }
                Err(Fail::Reject(rejected)) => out.rejected.push((unit_index, rejected)),
                Err(other) => return Err(other),
            }
        }
        self.take_deltas(py, &mut out)?;
        Ok(out)
    }

    /// `apply_units` over Python units (read into `Ev`s by `touched` just before, when it
    /// was given the same list).
    pub fn apply_batch<'py>(&mut self, py: Python<'py>, units: &Bound<'py, PyAny>) -> Result<BatchOut<'py>, Fail> {
        let units = match self.converted.take() {
            Some((list, converted)) if list.bind(py).is(units) => converted,
            _ => units_of(units)?,
        };
        self.apply_units(py, &units)
    }

    /// `state_key` over every event of the units: the key JSON of those with a key, each
    /// once.
    pub(super) fn touched_of(&self, units: &[Vec<Ev>]) -> Result<Vec<Vec<u8>>, Fail> {
        self.plan.keys.touched_of(units)
    }

    /// `touched_of` over Python units; their `Ev`s wait for `apply_batch` of the same
    /// list (held, so that no other list can take its place).
    pub fn touched(&mut self, units: &Bound<'_, PyAny>) -> Result<Vec<Vec<u8>>, Fail> {
        let converted = units_of(units)?;
        let keys = self.touched_of(&converted)?;
        self.converted = Some((units.clone().unbind(), converted));
        Ok(keys)
    }
}
