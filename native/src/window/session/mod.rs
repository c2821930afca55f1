//! Session windows of a grouped view (refold.reduce.windowed, `kind == "session"`,
//! emit `per_event`), byte for byte as `WindowedReducer` makes them.
//!
//! Each view key keeps its live rows (by fingerprint: the first copy's row, its time,
//! the copies' tags, ascending); its sessions are a pure function of them: the rows by
//! time in maximal runs less than `gap` apart, each session `[earliest, latest + gap)`
//! keyed by the view key and its start, its view columns those of the grouped view over
//! its rows (`Core::values_of`). After a unit, the keys it touched are sessioned again
//! and each one's old sessions diffed against its new ones (a merge retracts the
//! sessions merged, a split by a retraction retracts the one split). The `P.state`
//! records are the live rows (`LIVE_ROW` under the view key) and the watermark's.
//! A unit's records name its cause; each session keeps the cause of its current record
//! (what a later `-C`/`-R` of it retracts), written per view key as its `[key]`
//! `KEY_SUMMARY` record (`{"c": [...]}`, the sessions in time order).
//! Closing a session forgets its rows; an event for a closed session is `late`.

mod restore;

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};
use rustc_hash::{FxHashMap, FxHashSet};

use super::time::{event_time_of, EventTime};
use super::{set, shown, time_text, Headers, WindowOut, BAD_TIME, END, LATE, START, WATERMARK_KEY};
use crate::core::{
    fingerprint, push_view_records, Cause, read_units, refused_records, reject, touched_or_none, units_of, BatchOut, Core, Ev, Fail,
    Form, Fp, KeyColumns, Plan, ReadOut, UnitRecords, NOT_LIVE,
};
use crate::json::write_str;
use crate::statecodec::{self, Tag, KEY_SUMMARY, LIVE_ROW};
use crate::value::{Row, Unsup, Value};

/// A distinct live row of a view key: its first copy's row and time, its copies' tags
/// (ascending), and when it came (Python's dict order, for ties in time).
struct Member {
    fp: Fp,
    row: Row,
    tags: Vec<Tag>,
    t: i64,
    text: bool,
    seq: u64,
}

/// One session as the view shows it: its output key's JSON (`key_bytes((*key, start))`),
/// its bounds in ms, its row, and its rows' fingerprints (by time).
#[derive(Clone)]
struct Session {
    out_key: Vec<u8>,
    start: i64,
    end: i64,
    row: Row,
    fps: Vec<Fp>,
    /// the cause of the session's current view record (None: unknown)
    cause: Option<Cause>,
}

/// `_KeySessions`: one view key's values, live rows and current sessions.
struct KeySessions {
    parts: Vec<Value>,
    rows: FxHashMap<Fp, Member>,
    out: Vec<Session>,
}

pub struct SessionCore {
    checks: KeyColumns,
    /// an empty grouped core of the unwindowed view: a session's columns
    values: Core,
    key_columns: Vec<String>,
    /// the view's columns, in the order of `values_of`'s values
    column_names: Vec<String>,
    form: Option<Form>,
    time: String,
    time_shown: String,
    gap: i64,
    lateness: Option<i64>,
    /// `emit: final`: a unit's records are the sessions its watermark advance closed
    emit_final: bool,
    sessions: FxHashMap<Box<[u8]>, KeySessions>,
    dirty: FxHashSet<(Box<[u8]>, Fp)>,
    /// keys whose sessions' causes to write (`[key]`)
    dirty_causes: FxHashSet<Box<[u8]>>,
    /// cause headers on the view records (`outputs.provenance`)
    pub provenance: bool,
    seq: u64,
    max_time: Option<i64>,
    max_changed: bool,
    /// (end, view key JSON): keys whose sessions may close, least end first
    closing: BinaryHeap<Reverse<(i64, Box<[u8]>)>>,
    headers: Option<Headers>,
    scratch: Vec<u8>,
    prepared: Option<Vec<Vec<Ev>>>,
    converted: Option<(Py<PyAny>, Vec<Vec<Ev>>)>,
}

/// A session's change: its output key's JSON, op code, whether it adds, its row, the
/// cause of the record it retracts.
type Change = (Vec<u8>, &'static [u8], bool, Row, Option<Cause>);

/// `time_value`: a bound as the row's time is written; None past years 1-9999.
fn bound(ms: i64, text: bool) -> Option<Value> {
    if text {
        time_text(ms).map(|s| Value::Str(s.into()))
    } else {
        Some(Value::Int(ms))
    }
}

impl SessionCore {
    #[allow(clippy::too_many_arguments)]
    pub fn new(py: Python<'_>, key_columns: Vec<String>, columns: Vec<(String, String, String)>, view_form: Option<String>,
               time: String, gap: i64, lateness: Option<i64>, emit_final: bool) -> PyResult<SessionCore> {
        let form = Form::parse(view_form.as_deref())?;
        let checks = Plan::new(py, key_columns.clone(), columns.clone(), None, false)?.keys;
        let column_names = columns.iter().map(|c| c.0.clone()).collect();
        let values = Core::new(Plan::new(py, key_columns.clone(), columns, None, false)?);
        let time_shown = pyo3::types::PyString::new(py, &time).repr()?.to_str()?.to_owned();
        Ok(SessionCore {
            checks,
            values,
            key_columns,
            column_names,
            form,
            time,
            time_shown,
            gap,
            lateness,
            emit_final,
            sessions: FxHashMap::default(),
            dirty: FxHashSet::default(),
            dirty_causes: FxHashSet::default(),
            provenance: true,
            seq: 0,
            max_time: None,
            max_changed: false,
            closing: BinaryHeap::new(),
            headers: None,
            scratch: Vec::new(),
            prepared: None,
            converted: None,
        })
    }

    fn watermark(&self) -> Option<i128> {
        Some(i128::from(self.max_time?) - i128::from(self.lateness?))
    }

    /// `_apply_sessions(unit)`: its view changes into `records`.
    fn apply_unit<'py>(&mut self, py: Python<'py>, events: &mut [Ev], records: &mut UnitRecords<'py>) -> Result<i64, Fail> {
        let mut keys: Vec<Box<[u8]>> = Vec::with_capacity(events.len());
        for (index, event) in events.iter().enumerate() {
            keys.push(self.checks.checked_key(&event.row, index)?.into_boxed_slice());
        }
        let mut times: Vec<(i64, bool)> = Vec::with_capacity(events.len());
        for (index, event) in events.iter().enumerate() {
            match event_time_of(&event.row, &self.time, &self.time_shown)? {
                EventTime::At(t, text) => times.push((t, text)),
                EventTime::Bad(detail) => return Err(reject(BAD_TIME, index, Some(detail))),
            }
        }
        let fps: Vec<Fp> = events.iter().map(|e| fingerprint(&mut self.scratch, &e.row)).collect();
        if let Some(wm) = self.watermark() {
            for (index, (key, &(t, text))) in keys.iter().zip(&times).enumerate() {
                let held = self.sessions.get(key).is_some_and(|s| s.out.iter().any(|o| o.start <= t && t < o.end));
                if i128::from(t) + i128::from(self.gap) <= wm && !held {
                    let end = t.checked_add(self.gap).ok_or_else(|| Unsup::new("an event time a gap from 64 bits"))?;
                    let wm = i64::try_from(wm).map_err(|_| Unsup::new("a watermark past 64 bits"))?;
                    let (s, e, w) = (shown(t, text)?, shown(end, text)?, shown(wm, text)?);
                    let detail = format!("window [{s}, {e}) closed: watermark {w}");
                    self.headers = Some(vec![("refold.window_start", s), ("refold.window_end", e), ("refold.watermark", w)]);
                    return Err(reject(LATE, index, Some(detail)));
                }
            }
        }
        // every removal finds a live copy, counting the unit's own earlier events
        let mut pending: FxHashMap<(&[u8], Fp), i64> = FxHashMap::default();
        for (index, (event, (key, fp))) in events.iter().zip(keys.iter().zip(&fps)).enumerate() {
            let have = match pending.get(&(&key[..], *fp)) {
                Some(&n) => n,
                None => self.sessions.get(key).and_then(|s| s.rows.get(fp)).map_or(0, |m| m.tags.len() as i64),
            };
            let have = have + if event.op == 0 || event.op == 3 { 1 } else { -1 };
            if have < 0 {
                return Err(reject(NOT_LIVE, index, None));
            }
            pending.insert((&key[..], *fp), have);
        }
        // the rows change; the keys touched, in the order first met
        let mut touched: Vec<&[u8]> = Vec::new();
        for ((event, key), (fp, &(t, text))) in events.iter_mut().zip(&keys).zip(fps.iter().zip(&times)) {
            if !self.sessions.contains_key(key) {
                let Ok(Value::List(parts)) = crate::json::parse(key) else { unreachable!("a key's JSON") };
                self.sessions.insert(key.clone(), KeySessions { parts, rows: FxHashMap::default(), out: Vec::new() });
            }
            if !touched.contains(&&key[..]) {
                touched.push(key);
            }
            let sessions = self.sessions.get_mut(key).expect("inserted");
            if event.op == 0 || event.op == 3 {
                let member = sessions.rows.entry(*fp).or_insert_with(|| {
                    self.seq += 1;
                    Member { fp: *fp, row: std::mem::take(&mut event.row), tags: Vec::new(), t, text, seq: self.seq }
                });
                member.tags.push(event.tag);
                member.tags.sort_unstable();
            } else {
                let member = sessions.rows.get_mut(fp).expect("checked live");
                member.tags.pop(); // the latest copy goes
                if member.tags.is_empty() {
                    sessions.rows.remove(fp);
                }
            }
            self.dirty.insert((key.clone(), *fp));
        }
        let cause = (events[0].tag.1, events[0].tag.2);
        let mut changes: Vec<Change> = Vec::new();
        for key in &touched {
            let old = self.sessions.get_mut(*key).map(|s| std::mem::take(&mut s.out)).unwrap_or_default();
            let changed: Vec<Fp> = keys.iter().zip(&fps).filter(|(k, _)| &k[..] == *key).map(|(_, fp)| *fp).collect();
            self.resession(key, &old, &changed)?;
            let new = self.sessions.get_mut(*key).map_or(&mut [][..], |s| &mut s.out[..]);
            diff(&mut changes, old, new, cause);
            self.dirty_causes.insert((*key).into());
        }
        if touched.len() > 1 {
            changes.sort_by(|a, b| a.0.cmp(&b.0)); // stable: -C before its +C
        }
        if !self.emit_final {
            self.render(py, &changes, records)?;
        }
        let latest = times.iter().map(|t| t.0).max().expect("a unit has events");
        self.advance(py, latest, records)?;
        Ok(events[0].tag.0)
    }

    /// `_resession(key)`: the key's sessions again from its live rows (into the key's
    /// `out`); a key without rows is forgotten. A session of the same rows
    /// as one of `old`, none of them `changed`, keeps its values.
    fn resession(&mut self, kj: &[u8], old: &[Session], changed: &[Fp]) -> Result<(), Fail> {
        let Some(sessions) = self.sessions.get_mut(kj) else { return Ok(()) };
        if sessions.rows.is_empty() {
            self.sessions.remove(kj);
            return Ok(());
        }
        let mut members: Vec<&Member> = sessions.rows.values().collect();
        members.sort_unstable_by_key(|m| (m.t, m.seq));
        let mut out = Vec::new();
        let mut at = 0;
        while at < members.len() {
            let mut until = at + 1;
            while until < members.len() && i128::from(members[until].t) - i128::from(members[until - 1].t) < i128::from(self.gap) {
                until += 1;
            }
            let run = &members[at..until];
            at = until;
            let fps: Vec<Fp> = run.iter().map(|m| m.fp).collect();
            if !fps.iter().any(|fp| changed.contains(fp)) {
                if let Some(session) = old.iter().find(|s| s.fps == fps) {
                    if self.lateness.is_some() {
                        self.closing.push(Reverse((session.end, kj.into())));
                    }
                    out.push(session.clone()); // its rows unchanged: all of it
                    continue;
                }
            }
            let start = run[0].t;
            let text = run.iter().take_while(|m| m.t == start).any(|m| m.text); // (a tie in time: text)
            let latest = run[run.len() - 1].t;
            let end = latest.checked_add(self.gap).ok_or_else(|| Unsup::new("a session's end past 64 bits"))?;
            let (sv, ev) = match (bound(start, text), bound(end, text)) {
                (Some(s), Some(e)) => (s, e),
                _ => (Value::Int(start), Value::Int(end)), // (within a gap of year 9999's end: in ms)
            };
            let mut out_key = Vec::with_capacity(kj.len() + 32);
            out_key.extend_from_slice(&kj[..kj.len() - 1]);
            out_key.push(b',');
            sv.write(&mut out_key, false);
            out_key.push(b']');
            let mut row: Row = self.key_columns.iter().zip(&sessions.parts).map(|(n, v)| (n.as_str().into(), v.clone())).collect();
            set(&mut row, START, sv);
            set(&mut row, END, ev);
            let copies = run.iter().flat_map(|m| m.tags.iter().map(move |tag| (m.row.as_slice(), m.fp, *tag)));
            let values = self.values.values_of(kj, copies)?;
            for (name, value) in self.column_names.iter().zip(&values) {
                set(&mut row, name, value.clone());
            }
            if self.lateness.is_some() {
                self.closing.push(Reverse((end, kj.into())));
            }
            out.push(Session { out_key, start, end, row, fps, cause: None });
        }
        sessions.out = out;
        Ok(())
    }

    /// The view records of a unit's changes (`Renderer.view`), each with what it retracts.
    fn render<'py>(&mut self, py: Python<'py>, changes: &[Change], records: &mut UnitRecords<'py>) -> PyResult<()> {
        let Some(form) = self.form else { return Ok(()) };
        let buf = &mut self.scratch;
        for (out_key, op, adds, row, retracts) in changes {
            // the message key: the view key's columns and the session's start
            let Ok(Value::List(parts)) = crate::json::parse(out_key) else { unreachable!("an output key's JSON") };
            let mut names: Row = Vec::with_capacity(parts.len());
            for (name, part) in self.key_columns.iter().map(String::as_str).chain([START]).zip(parts) {
                set(&mut names, name, part);
            }
            buf.clear();
            Value::Dict(names).write(buf, false);
            let key = PyBytes::new(py, buf).into_any();
            let value = match form {
                Form::Upsert if *op == b"-C" => continue,
                Form::Upsert if *op == b"-R" => None,
                Form::Upsert => {
                    buf.clear();
                    write_row(buf, row);
                    Some(PyBytes::new(py, buf).into_any())
                }
                Form::Changelog | Form::Retract => {
                    let code: &[u8] = match (form, *op) {
                        (Form::Retract, b"-C") => b"-R",
                        (Form::Retract, b"+C") => b"+A",
                        _ => op,
                    };
                    let mut with_op: Row = vec![("op".into(), Value::Str(std::str::from_utf8(code).expect("ascii").into()))];
                    for (name, value) in row {
                        set(&mut with_op, name, value.clone());
                    }
                    buf.clear();
                    write_row(buf, &with_op);
                    Some(PyBytes::new(py, buf).into_any())
                }
            };
            records.push((*adds, key, value, *retracts));
        }
        Ok(())
    }

    /// `_advance`: the watermark moves on; the sessions ending at or before it close
    /// (with `emit: final`, their `+A` records into `records`, by output key).
    fn advance<'py>(&mut self, py: Python<'py>, latest: i64, records: &mut UnitRecords<'py>) -> Result<(), Fail> {
        if self.max_time.is_none_or(|max| latest > max) {
            self.max_time = Some(latest);
            self.max_changed = true;
        }
        let Some(wm) = self.watermark() else { return Ok(()) };
        let mut closed: Vec<Change> = Vec::new();
        while let Some(Reverse((end, _))) = self.closing.peek() {
            if i128::from(*end) > wm {
                break;
            }
            let Reverse((_, kj)) = self.closing.pop().expect("peeked");
            self.close(&kj, wm, &mut closed)?;
        }
        closed.sort_by(|a, b| a.0.cmp(&b.0)); // (stable: a key's sessions in time order)
        self.render(py, &closed, records)?;
        Ok(())
    }

    /// `_close_sessions(key, wm)`: the key's sessions ending at or before `wm` forget
    /// their rows (tombstoned at the batch's end); with `emit: final`, each session
    /// closed as an `+A` into `closed`.
    fn close(&mut self, kj: &[u8], wm: i128, closed: &mut Vec<Change>) -> Result<(), Fail> {
        let Some(sessions) = self.sessions.get_mut(kj) else { return Ok(()) };
        let mut members: Vec<(i64, u64, Fp)> = sessions.rows.iter().map(|(fp, m)| (m.t, m.seq, *fp)).collect();
        members.sort_unstable();
        let mut ended = false;
        let mut at = 0;
        while at < members.len() {
            let mut until = at + 1;
            while until < members.len() && i128::from(members[until].0) - i128::from(members[until - 1].0) < i128::from(self.gap) {
                until += 1;
            }
            if i128::from(members[until - 1].0) + i128::from(self.gap) <= wm {
                ended = true;
                for &(_, _, fp) in &members[at..until] {
                    sessions.rows.remove(&fp);
                    self.dirty.insert((kj.into(), fp));
                }
            }
            at = until;
        }
        if ended {
            let old = std::mem::take(&mut self.sessions.get_mut(kj).expect("held").out);
            self.resession(kj, &old, &[])?; // (the sessions left keep their causes)
            self.dirty_causes.insert(kj.into());
            if self.emit_final {
                let new = self.sessions.get(kj).map_or(&[][..], |s| &s.out[..]);
                for session in old {
                    if !new.iter().any(|s| s.out_key == session.out_key) {
                        closed.push((session.out_key, b"+A", true, session.row, None));
                    }
                }
            }
        }
        Ok(())
    }

    /// One batch's units (as `WindowCore::apply_units`): no delta records.
    pub fn apply_units<'py>(&mut self, py: Python<'py>, units: &mut [Vec<Ev>]) -> Result<WindowOut<'py>, Fail> {
        let mut out = BatchOut { rejected: Vec::new(), view: Vec::new(), delta: Vec::new(), state: Vec::new() };
        let mut headers = Vec::new();
        let mut records: UnitRecords<'py> = Vec::with_capacity(4);
        let retract = self.form == Some(Form::Retract);
        for (unit_index, events) in units.iter_mut().enumerate() {
            if events.is_empty() {
                return Err(Fail::Unsup(Unsup::new("an empty unit")));
            }
            records.clear();
            let cause = (events[0].tag.1, events[0].tag.2);
            match self.apply_unit(py, events, &mut records) {
                Ok(ts) => push_view_records(py, &mut out.view, &records, ts, cause, self.provenance, &crate::core::PLAIN, retract)?,
                Err(Fail::Reject(rejected)) => {
                    headers.push(if rejected.reason == LATE { self.headers.take().unwrap_or_default() } else { Vec::new() });
                    out.rejected.push((unit_index, rejected));
                }
                Err(other) => return Err(other),
            }
        }
        self.state_changes(py, &mut out)?;
        Ok(WindowOut { out, headers })
    }

    /// `take_state_changes`: the changed live rows and the watermark, in record-key order.
    fn state_changes<'py>(&mut self, py: Python<'py>, out: &mut BatchOut<'py>) -> PyResult<()> {
        let mut records: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::with_capacity(self.dirty.len() + 1);
        let mut json = Vec::new();
        for (kj, fp) in self.dirty.drain() {
            let mut key = Vec::new();
            statecodec::row_key(&mut key, &kj, &fp);
            let value = self.sessions.get(&kj).and_then(|s| s.rows.get(&fp)).map(|m| {
                json.clear();
                write_row(&mut json, &m.row);
                let mut value = Vec::new();
                statecodec::state_value(&mut value, LIVE_ROW, &kj, m.tags.len() as i64, Some(&json), &m.tags);
                value
            });
            records.push((key, value));
        }
        for kj in self.dirty_causes.drain() {
            // `[key]`: the causes of its sessions' records, in time order
            let mut key = Vec::new();
            statecodec::summary_key(&mut key, &kj);
            let value = self.sessions.get(&kj).map(|s| {
                let causes: Vec<Option<Cause>> = s.out.iter().map(|session| session.cause).collect();
                let mut value = Vec::new();
                statecodec::causes_summary(&mut value, &mut json, &kj, &causes);
                value
            });
            records.push((key, value));
        }
        if self.max_changed {
            if let Some(max) = self.max_time {
                let mut value = Vec::new();
                statecodec::state_value(&mut value, KEY_SUMMARY, WATERMARK_KEY, max, None, &[]);
                records.push((WATERMARK_KEY.to_vec(), Some(value)));
            }
            self.max_changed = false;
        }
        records.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        for (key, value) in records {
            let value = match value {
                Some(v) => PyBytes::new(py, &v).into_any(),
                None => py.None().into_bound(py),
            };
            out.state.push(PyTuple::new(py, [PyBytes::new(py, &key).into_any(), value])?.into_any());
        }
        Ok(())
    }

    pub fn apply_batch<'py>(&mut self, py: Python<'py>, units: &Bound<'py, PyAny>) -> Result<WindowOut<'py>, Fail> {
        let mut units = match self.converted.take() {
            Some((list, converted)) if list.bind(py).is(units) => converted,
            _ => units_of(units)?,
        };
        self.apply_units(py, &mut units)
    }

    pub fn touched(&mut self, units: &Bound<'_, PyAny>) -> Result<Vec<Vec<u8>>, Fail> {
        let converted = units_of(units)?;
        let keys = self.checks.touched_of(&converted)?;
        self.converted = Some((units.clone().unbind(), converted));
        Ok(keys)
    }

    pub fn read(&mut self, parts: &Bound<'_, PyAny>, check: Option<&[String]>) -> Result<Option<ReadOut>, Fail> {
        self.prepared = None;
        let Some((units, mut out)) = read_units(parts, check)? else { return Ok(None) };
        let Some(touched) = touched_or_none(self.checks.touched_of(&units))? else { return Ok(None) };
        out.touched = touched;
        self.prepared = Some(units);
        Ok(Some(out))
    }

    pub fn apply_read<'py>(&mut self, py: Python<'py>) -> Result<(WindowOut<'py>, Vec<Vec<u32>>), Fail> {
        let mut units = self.prepared.take().unwrap_or_default();
        let out = self.apply_units(py, &mut units)?;
        let records = refused_records(&units, &out.out.rejected);
        Ok((out, records))
    }

    pub fn len(&self) -> usize {
        self.sessions.values().map(|s| s.out.len()).sum()
    }
}

/// `_diff(old, new)`: a key's session changes, by output key, each retraction with the
/// cause of the record it takes back; a new session whose record changed now names
/// `cause`, one whose record stayed keeps its old cause.
fn diff(changes: &mut Vec<Change>, old: Vec<Session>, new: &mut [Session], cause: Cause) {
    let mut keys: Vec<Vec<u8>> = old.iter().chain(new.iter()).map(|s| s.out_key.clone()).collect();
    keys.sort_unstable();
    keys.dedup();
    for key in keys {
        let a = old.iter().find(|s| s.out_key == key);
        let b = new.iter_mut().find(|s| s.out_key == key);
        match (a, b) {
            (None, Some(b)) => {
                b.cause = Some(cause);
                changes.push((b.out_key.clone(), b"+A", true, b.row.clone(), None));
            }
            (Some(a), None) => changes.push((a.out_key.clone(), b"-R", false, a.row.clone(), a.cause)),
            (Some(a), Some(b)) => {
                let same = a.row.len() == b.row.len() && a.row.iter().zip(&b.row).all(|(x, y)| x.0 == y.0 && x.1.canon_eq(&y.1));
                if same {
                    b.cause = a.cause;
                } else {
                    b.cause = Some(cause);
                    changes.push((a.out_key.clone(), b"-C", false, a.row.clone(), a.cause));
                    changes.push((b.out_key.clone(), b"+C", true, b.row.clone(), None));
                }
            }
            (None, None) => {}
        }
    }
}

/// A row's JSON as orjson writes the dict (its insertion order).
fn write_row(out: &mut Vec<u8>, row: &[(Box<str>, Value)]) {
    out.push(b'{');
    for (i, (name, value)) in row.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_str(out, name);
        out.push(b':');
        value.write(out, false);
    }
    out.push(b'}');
}
