//! The records a batch makes, as JSON bytes: the output rows (`_output`), a place's
//! view changes (`diff_changes`) as `Renderer.view` writes them with the `JsonRows`
//! encoder (message key `dict(zip(key_names, key))`, value `{"op": code, **row}`, its
//! retract and upsert forms), and at the batch's end the state records
//! (`take_state_changes`: a live row's `LIVE_ROW` record, or a tombstone).

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use super::{Head, Out, TopN, TopPlan};
use crate::core::{Fail, Form};
use crate::json::write_int;
use crate::statecodec::{self, LIVE_ROW};
use crate::value::{row_get, write_canonical, write_dict, write_named, Row, Value};

/// One view change of a unit, written: its output key's `key_bytes` (the order of a
/// unit's changes across groups), whether it adds, its message key and value.
pub(super) struct Change {
    group: Vec<u8>,
    place: i64,
    adds: bool,
    key: Vec<u8>,
    value: Option<Vec<u8>>,
}

impl Change {
    /// `key_bytes((*group, place))`: the group's JSON list with the place appended.
    pub(super) fn order(&self) -> Vec<u8> {
        let mut out = self.group[..self.group.len() - 1].to_vec();
        if self.group.len() > 2 {
            out.push(b',');
        }
        write_int(&mut out, self.place);
        out.push(b']');
        out
    }
}

impl TopPlan {
    /// `_output(group, place, row)` as (name, value) entries in the dict's order: the
    /// head (`partition_by`, `place`), then the row's columns — those of `top_n.columns`
    /// the row has, when it names them — that the head does not name.
    pub(super) fn entries<'a>(&'a self, parts: &'a [Value], place: &'a Value, row: &'a Row) -> Vec<(&'a str, &'a Value)> {
        let mut out: Vec<(&str, &Value)> = Vec::with_capacity(self.head.len() + row.len());
        for (name, src) in &self.head {
            out.push((name, match *src {
                Head::Part(i) => &parts[i],
                Head::Place => place,
            }));
        }
        match &self.columns {
            Some(columns) => {
                for column in columns {
                    if let Some(value) = row_get(row, column) {
                        out.push((column, value));
                    }
                }
            }
            None => {
                for (name, value) in row {
                    if !self.head.iter().any(|(n, _)| **n == **name) {
                        out.push((name, value));
                    }
                }
            }
        }
        out
    }

    /// `diff_changes(old, new, (*group, place), key_names)` for one place, written.
    pub(super) fn diff(
        &self,
        scratch: &mut Vec<u8>,
        parts: &[Value],
        group: &[u8],
        old: Option<&Out>,
        new: Option<&Out>,
        changes: &mut Vec<Change>,
    ) {
        let Some(form) = self.form else { return }; // no view output: nothing to write
        let (place, ops): (i64, Vec<(&[u8], &Out)>) = match (old, new) {
            (None, None) => return,
            (None, Some(new)) => (new.place, vec![(b"+A", new)]),
            (Some(old), None) => (old.place, vec![(b"-R", old)]),
            (Some(old), Some(new)) => {
                if self.same_row(scratch, parts, old, new) {
                    return;
                }
                (old.place, vec![(b"-C", old), (b"+C", new)])
            }
        };
        let place_value = Value::Int(place);
        let no_row: Row = Vec::new();
        let head: Vec<(&str, &Value)> = self.entries(parts, &place_value, &no_row);
        let mut key = Vec::with_capacity(32);
        write_named(&mut key, &head);
        for (op, out) in ops {
            let adds = op[0] == b'+';
            let entries = self.entries(parts, &place_value, &out.row);
            let value = match form {
                Form::Upsert if op == b"-C" => continue, // its +C overwrites the key
                Form::Upsert if op == b"-R" => None,
                Form::Upsert => {
                    let mut value = Vec::with_capacity(64);
                    write_named(&mut value, &entries);
                    Some(value)
                }
                Form::Changelog => Some(with_op(op, &entries)),
                // RETRACT_FORM: -C → -R, +C → +A
                Form::Retract => Some(with_op(if adds { b"+A" } else { b"-R" }, &entries)),
            };
            changes.push(Change { group: group.to_vec(), place, adds, key: key.clone(), value });
        }
    }

    /// `same_row` of two output rows at one place of one group (their heads are equal).
    fn same_row(&self, scratch: &mut Vec<u8>, parts: &[Value], a: &Out, b: &Out) -> bool {
        let place = Value::Int(a.place);
        scratch.clear();
        write_canonical(scratch, &self.entries(parts, &place, &a.row));
        let split = scratch.len();
        write_canonical(scratch, &self.entries(parts, &place, &b.row));
        scratch[..split] == scratch[split..]
    }

    /// A unit's view records (key, value or None, event time) into `view`: retractions
    /// first in the retract form (`_retractions_first`).
    pub(super) fn records<'py>(
        &self,
        py: Python<'py>,
        ts: i64,
        changes: &mut [Change],
        view: &mut Vec<Bound<'py, PyAny>>,
    ) -> PyResult<()> {
        if changes.is_empty() {
            return Ok(());
        }
        if self.form == Some(Form::Retract) {
            changes.sort_by_key(|c| c.adds); // stable
        }
        let ts = ts.into_pyobject(py)?.into_any();
        for change in changes.iter() {
            let value = match &change.value {
                Some(value) => PyBytes::new(py, value).into_any(),
                None => py.None().into_bound(py),
            };
            view.push(PyTuple::new(py, [PyBytes::new(py, &change.key).into_any(), value, ts.clone()])?.into_any());
        }
        Ok(())
    }
}

/// `JsonRows.encode(row, op)`: `{"op": code, **row}` — a row column named `op` keeps
/// the first place and its own value.
fn with_op(code: &[u8], entries: &[(&str, &Value)]) -> Vec<u8> {
    let code = Value::Str(std::str::from_utf8(code).unwrap_or("").into());
    let own = entries.iter().find(|(name, _)| *name == "op").map(|(_, v)| *v);
    let mut all: Vec<(&str, &Value)> = Vec::with_capacity(entries.len() + 1);
    all.push(("op", own.unwrap_or(&code)));
    all.extend(entries.iter().filter(|(name, _)| *name != "op"));
    let mut out = Vec::with_capacity(64);
    write_named(&mut out, &all);
    out
}

impl TopN {
    /// `take_state_changes`: per row the batch changed, its `LIVE_ROW` record (the first
    /// copy's row, the live copies' tags) or a tombstone, in record-key order.
    pub(super) fn take_state_changes<'py>(&mut self, py: Python<'py>) -> Result<Vec<Bound<'py, PyAny>>, Fail> {
        let mut records: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::with_capacity(self.dirty.len());
        let mut json = Vec::with_capacity(64);
        for (kj, fp) in std::mem::take(&mut self.dirty) {
            let mut record_key = Vec::with_capacity(kj.len() + 38);
            statecodec::row_key(&mut record_key, &kj, &fp);
            let live = self.groups.get(kj.as_slice()).and_then(|g| g.rows.get(&fp));
            let value = live.map(|live| {
                json.clear();
                write_dict(&mut json, &live.row);
                let mut value = Vec::with_capacity(json.len() + kj.len() + 16);
                statecodec::state_value(&mut value, LIVE_ROW, &kj, live.tags.len() as i64, Some(&json), &live.tags);
                value
            });
            records.push((record_key, value));
        }
        records.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let mut out = Vec::with_capacity(records.len());
        for (key, value) in records {
            let value = match value {
                Some(value) => PyBytes::new(py, &value).into_any(),
                None => py.None().into_bound(py),
            };
            out.push(PyTuple::new(py, [PyBytes::new(py, &key).into_any(), value])?.into_any());
        }
        Ok(out)
    }
}
