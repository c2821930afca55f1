//! The records a batch makes, as JSON bytes: the output rows (`_output`), a place's
//! view changes (`diff_changes`) as `Renderer.view` writes them with the `JsonRows`
//! encoder (message key `dict(zip(key_names, key))`, value `{"op": code, **row}`, its
//! retract and upsert forms), and at the batch's end the state records
//! (`take_state_changes`: a live row's `LIVE_ROW` record, or a tombstone).

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use super::{Head, Out, TopN, TopPlan};
use crate::core::{Cause, Fail, Form};
use crate::json::{write_int, write_str};
use crate::statecodec::{self, LIVE_ROW};
use crate::value::{row_get, write_canonical, write_dict, Row, Value};

/// One view change of a unit, written: its group (by its place among the groups the
/// unit touched) and place (for the order of a unit's changes across groups), whether
/// it adds, where its message key and value are in the unit's written bytes.
pub(super) struct Change {
    pub(super) group: u32,
    place: i64,
    adds: bool,
    key: (usize, usize),
    value: Option<(usize, usize)>,
    /// the cause of the record it takes back (a `-R`/`-C`)
    retracts: Option<Cause>,
}

impl Change {
    /// `key_bytes((*group, place))`: the group's JSON list with the place appended.
    pub(super) fn order(&self, group: &[u8]) -> Vec<u8> {
        let mut out = group[..group.len() - 1].to_vec();
        if group.len() > 2 {
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
        out.extend(self.tail(row));
        out
    }

    /// The row's columns an output row carries after its head, in order.
    fn tail<'a>(&'a self, row: &'a Row) -> impl Iterator<Item = (&'a str, &'a Value)> + 'a {
        let named = self.columns.iter().flatten().filter_map(move |c| row_get(row, c).map(|v| (c.as_str(), v)));
        let all = row.iter().filter(|(name, _)| !self.head.iter().any(|(n, _)| **n == **name)).map(|(n, v)| (&**n, v));
        let (named, all) = if self.columns.is_some() { (Some(named), None) } else { (None, Some(all)) };
        named.into_iter().flatten().chain(all.into_iter().flatten())
    }

    /// Append `JsonRows.encode(_output(group, place, row), op)`: with an op code,
    /// `{"op": code, **row}` — an output column named `op` keeps the first place with its
    /// own value; without, the bare row.
    fn write_out(&self, out: &mut Vec<u8>, code: Option<&[u8]>, parts: &[Value], place: i64, row: &Row) {
        out.push(b'{');
        let mut first = true;
        let mut sep = |out: &mut Vec<u8>| {
            if !first {
                out.push(b',');
            }
            first = false;
        };
        let skip_op = code.is_some();
        if let Some(code) = code {
            sep(out);
            out.extend_from_slice(b"\"op\":");
            match self.head_op {
                Some(at) => self.write_head(out, self.head[at].1, parts, place),
                None => match self.tail(row).find(|(name, _)| *name == "op") {
                    Some((_, value)) => value.write(out, false),
                    None => {
                        out.push(b'"');
                        out.extend_from_slice(code);
                        out.push(b'"');
                    }
                },
            }
        }
        for (name, src) in &self.head {
            if skip_op && name == "op" {
                continue;
            }
            sep(out);
            write_str(out, name);
            out.push(b':');
            self.write_head(out, *src, parts, place);
        }
        for (name, value) in self.tail(row) {
            if skip_op && name == "op" {
                continue;
            }
            sep(out);
            write_str(out, name);
            out.push(b':');
            value.write(out, false);
        }
        out.push(b'}');
    }

    fn write_head(&self, out: &mut Vec<u8>, src: Head, parts: &[Value], place: i64) {
        match src {
            Head::Part(i) => parts[i].write(out, false),
            Head::Place => write_int(out, place),
        }
    }

    /// `diff_changes(old, new, (*group, place), key_names)` for one place, written at
    /// the end of `written`; whether the place's output row changed (a record written,
    /// with a view output).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn diff(
        &self,
        scratch: &mut Vec<u8>,
        written: &mut Vec<u8>,
        parts: &[Value],
        group: u32,
        old: Option<&Out>,
        new: Option<&Out>,
        changes: &mut Vec<Change>,
    ) -> bool {
        // the place, and its one or two (op code, output row) records
        type Records<'a> = [Option<(&'a [u8], &'a Out)>; 2];
        let (place, ops): (i64, Records<'_>) = match (old, new) {
            (None, None) => return false,
            (None, Some(new)) => (new.place, [Some((b"+A", new)), None]),
            (Some(old), None) => (old.place, [Some((b"-R", old)), None]),
            (Some(old), Some(new)) => {
                if self.same_row(scratch, old, new) {
                    return false;
                }
                (old.place, [Some((b"-C", old)), Some((b"+C", new))])
            }
        };
        let Some(form) = self.form else { return true }; // no view output: nothing to write
        let retracts = old.and_then(|old| old.cause);
        let no_row: Row = Vec::new();
        let start = written.len();
        self.write_out(written, None, parts, place, &no_row);
        let key = (start, written.len());
        for (op, out) in ops.into_iter().flatten() {
            let adds = op[0] == b'+';
            let code: Option<&[u8]> = match form {
                Form::Upsert if op == b"-C" => continue, // its +C overwrites the key
                Form::Upsert if op == b"-R" => {
                    changes.push(Change { group, place, adds, key, value: None, retracts });
                    continue;
                }
                Form::Upsert => None,
                Form::Changelog => Some(op),
                // RETRACT_FORM: -C → -R, +C → +A
                Form::Retract => Some(if adds { b"+A" } else { b"-R" }),
            };
            let start = written.len();
            self.write_out(written, code, parts, place, &out.row);
            changes.push(Change { group, place, adds, key, value: Some((start, written.len())), retracts: if adds { None } else { retracts } });
        }
        true
    }

    /// `same_row` of two output rows at one place of one group: their heads are equal,
    /// so their canonical bytes are equal when their tails' are.
    fn same_row(&self, scratch: &mut Vec<u8>, a: &Out, b: &Out) -> bool {
        if std::sync::Arc::ptr_eq(&a.row, &b.row) {
            return true;
        }
        // most rows have the same columns in the same order: then the canonical bytes are
        // equal when each column is null in both or equal (`canon_eq`) in both
        let (mut x, mut y) = (self.tail(&a.row), self.tail(&b.row));
        loop {
            match (x.next(), y.next()) {
                (None, None) => return true,
                (Some((n, v)), Some((m, w))) if n == m => {
                    if !v.canon_eq(w) {
                        return false;
                    }
                }
                _ => break, // other columns, or in another order: compare their canonical bytes
            }
        }
        scratch.clear();
        write_canonical(scratch, &self.tail(&a.row).collect::<Vec<_>>());
        let split = scratch.len();
        write_canonical(scratch, &self.tail(&b.row).collect::<Vec<_>>());
        scratch[..split] == scratch[split..]
    }

    /// A unit's view records (key, value or None, event time) into `view`: retractions
    /// first in the retract form (`_retractions_first`).
    pub(super) fn records<'py>(
        &self,
        py: Python<'py>,
        ts: i64,
        cause: Option<Cause>,
        changes: &mut [Change],
        written: &[u8],
        view: &mut Vec<Bound<'py, PyAny>>,
    ) -> PyResult<()> {
        if changes.is_empty() {
            return Ok(());
        }
        if self.form == Some(Form::Retract) {
            changes.sort_by_key(|c| c.adds); // stable
        }
        let ts = ts.into_pyobject(py)?.into_any();
        let header = match cause {
            Some(cause) => Some(crate::core::cause_header(py, cause, &crate::core::PLAIN)?),
            None => None,
        };
        for change in changes.iter() {
            let value = match change.value {
                Some((start, end)) => PyBytes::new(py, &written[start..end]).into_any(),
                None => py.None().into_bound(py),
            };
            let key = PyBytes::new(py, &written[change.key.0..change.key.1]).into_any();
            let headers = match &header {
                Some(header) => crate::core::headers(py, header, change.retracts, &crate::core::PLAIN)?,
                None => py.None().into_bound(py),
            };
            view.push(PyTuple::new(py, [key, value, ts.clone(), headers])?.into_any());
        }
        Ok(())
    }
}

impl TopN {
    /// `take_state_changes`: per row the batch changed, its `LIVE_ROW` record (the first
    /// copy's row, the live copies' tags) or a tombstone, in record-key order.
    pub(super) fn take_state_changes<'py>(&mut self, py: Python<'py>) -> Result<Vec<Bound<'py, PyAny>>, Fail> {
        // every record's key and value written side by side, then ordered by key
        let mut written: Vec<u8> = Vec::with_capacity(self.dirty.len() * 128);
        type Span = (usize, usize);
        let mut records: Vec<(Span, Option<Span>)> = Vec::with_capacity(self.dirty.len());
        let mut json = Vec::with_capacity(64);
        let mut causes: Vec<Option<Cause>> = Vec::new();
        for (kj, fp) in std::mem::take(&mut self.dirty) {
            let kj = kj.as_slice();
            let start = written.len();
            statecodec::row_key(&mut written, kj, &fp);
            let key = (start, written.len());
            let value = self.groups.get(kj).and_then(|g| g.rows.get(&fp)).map(|live| {
                json.clear();
                write_dict(&mut json, &live.row);
                let start = written.len();
                statecodec::state_value(&mut written, LIVE_ROW, kj, live.tags.len() as i64, Some(&json), &live.tags);
                (start, written.len())
            });
            records.push((key, value));
        }
        for kj in std::mem::take(&mut self.dirty_causes) {
            // `[group]`: the causes of its places' view records
            let kj = kj.as_slice();
            let start = written.len();
            statecodec::summary_key(&mut written, kj);
            let key = (start, written.len());
            let value = self.groups.get(kj).map(|group| {
                causes.clear();
                causes.extend(group.top.iter().map(|out| out.cause));
                let start = written.len();
                statecodec::causes_summary(&mut written, &mut json, kj, &causes);
                (start, written.len())
            });
            records.push((key, value));
        }
        records.sort_unstable_by(|a, b| written[a.0 .0..a.0 .1].cmp(&written[b.0 .0..b.0 .1]));
        let mut out = Vec::with_capacity(records.len());
        for (key, value) in records {
            let value = match value {
                Some((start, end)) => PyBytes::new(py, &written[start..end]).into_any(),
                None => py.None().into_bound(py),
            };
            out.push(PyTuple::new(py, [PyBytes::new(py, &written[key.0..key.1]).into_any(), value])?.into_any());
        }
        Ok(out)
    }
}
