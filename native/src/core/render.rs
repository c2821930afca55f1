//! The records a batch makes, as JSON bytes (refold.runtime.render.Renderer with the
//! `JsonRows` encoder): the view records of a unit (`_settle`, `diff_changes`,
//! `Renderer.view`), and at the batch's end the delta records (`take_deltas`,
//! `Renderer.deltas`) and the state records (`take_state_changes`, in
//! refold.reduce.statecodec's form).

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use super::apply::{BatchOut, UnitRecords};
use super::plan::{Agg, Form, Layout, Src};
use super::state::{slot_starts, Batch};
use super::{fits_i64, Core, Fail, KeyBytes, NO_SLOT};
use crate::json::{write_i128, write_int, write_str};
use crate::statecodec::{self, Tag, KEY_SUMMARY, LIVE_ROW};
use crate::value::{Scalar, Unsup, Value};

fn bytes<'py>(py: Python<'py>, data: &[u8]) -> Bound<'py, PyAny> {
    PyBytes::new(py, data).into_any()
}

fn pair<'py>(py: Python<'py>, a: Bound<'py, PyAny>, b: Option<Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
    let b = b.unwrap_or_else(|| py.None().into_bound(py));
    Ok(PyTuple::new(py, [a, b])?.into_any())
}

impl Core {
    /// `_settle` + `diff_changes` + the records `Renderer.view` makes of them: after a
    /// unit, the key's new view row (or its end) against the one before the unit.
    pub(super) fn settle<'py>(
        &mut self,
        py: Python<'py>,
        key: &[u8],
        records: &mut UnitRecords<'py>,
    ) -> Result<(), Fail> {
        let Core { plan, keys, scratch: buf, ranges, batch, .. } = self;
        let hashbrown::hash_map::EntryRef::Occupied(entry) = keys.entry_ref(key) else {
            unreachable!("a settled key is held")
        };
        let (old, new, old_cause);
        let mut held = None;
        if entry.get().total == 0 {
            let state = entry.remove();
            if state.slot != NO_SLOT {
                batch.ended.insert(KeyBytes::from(key), state.slot);
            }
            (old, old_cause) = (state.view, state.cause);
            new = None;
        } else {
            let state = entry.into_mut();
            new = Some(Self::view_row(plan, state)?);
            old = state.view.take();
            old_cause = state.cause;
            held = Some(state);
        }
        // (with no view output too: the key's cause follows its view row, as Python's)
        let changed = match (&old, &new) {
            (None, None) => false,
            (Some(a), Some(b)) => !a.iter().zip(b).all(|(x, y)| x.canon_eq(y)),
            _ => true,
        };
        if let Some(form) = plan.form {
            if changed {
                key_part_ranges(key, ranges);
                let parts = KeyParts(key, ranges);
                buf.clear();
                render(buf, &plan.message_key, None, parts, Cols::Values(&[]), 0);
                let message_key = bytes(py, buf);
                let retracts = old_cause;
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
                    records.push((adds, message_key.clone(), value, if adds { None } else { retracts }));
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
            if changed {
                state.cause = Some(batch.cause);
            }
        }
        Ok(())
    }

    /// `emit: final` (a window that closes): the key's `+A` record of its view row as
    /// it stands, in the view's form, into `records`; nothing without a view output or
    /// a view row.
    pub(crate) fn final_record<'py>(&mut self, py: Python<'py>, kj: &[u8], records: &mut UnitRecords<'py>) {
        let Core { plan, keys, scratch: buf, ranges, .. } = self;
        let Some(form) = plan.form else { return };
        let Some(row) = keys.get(kj).and_then(|state| state.view.as_ref()) else { return };
        key_part_ranges(kj, ranges);
        let parts = KeyParts(kj, ranges);
        buf.clear();
        render(buf, &plan.message_key, None, parts, Cols::Values(&[]), 0);
        let message_key = bytes(py, buf);
        buf.clear();
        match form {
            Form::Upsert => render(buf, &plan.view_row, None, parts, Cols::Values(row), 0),
            Form::Changelog | Form::Retract => render(buf, &plan.view_op_row, Some(b"+A"), parts, Cols::Values(row), 0),
        }
        records.push((true, message_key, Some(bytes(py, buf)), None));
    }

    // batch boundaries ----------------------------------------------------------------

    /// `take_deltas` + `Renderer.deltas`, then `take_state_changes`.
    ///
    /// The state records come out in record-key order without sorting them: a key's
    /// JSON is never a proper prefix of another's, so records order by their key's JSON
    /// first; within a key, its rows (`[key,"<hex>"`, by fingerprint) come before its
    /// summary (`[key]`), as `,` sorts before `]`.
    pub(crate) fn take_deltas<'py>(&mut self, py: Python<'py>, out: &mut BatchOut<'py>) -> Result<(), Fail> {
        let plan = &self.plan;
        let mut batch = std::mem::take(&mut self.batch);
        let Batch { keys: touched, sums, nonnull, values, contribs, rows, causes, .. } = &mut batch;
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
        let (nsum, nnn) = (plan.sum_names.len(), plan.nonnull_names.len());
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
                let headers = if self.provenance {
                    super::headers(py, &super::cause_header(py, causes[at], &self.names)?, None, &self.names)?
                } else {
                    py.None().into_bound(py)
                };
                out.delta.push(PyTuple::new(py, [message_key, bytes(py, buf), headers])?.into_any());
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
                    json.push(b'}');
                    if let Some((partition, offset)) = state.cause {
                        json.extend_from_slice(b",\"c\":[");
                        write_int(&mut json, partition);
                        json.push(b',');
                        write_int(&mut json, offset);
                        json.push(b']');
                    }
                    json.push(b'}');
                    buf.clear();
                    statecodec::state_value(buf, KEY_SUMMARY, kj, state.total, Some(&json), &[]);
                    Some(bytes(py, buf))
                }
            };
            buf.clear();
            statecodec::summary_key(buf, kj);
            out.state.push(pair(py, bytes(py, buf), value)?);
        }
        batch.clear();
        self.batch = batch;
        Ok(())
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
