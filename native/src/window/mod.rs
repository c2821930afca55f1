//! Windowed grouped views (refold.reduce.windowed `WindowedReducer`, tumble and hop):
//! the grouped core (`crate::core`) wrapped over rows with `window_start` and
//! `window_end` added, keyed by the view key and the window, as the Python reducer
//! wraps `GroupedReducer`; the shard's watermark, closing windows, and the `late` and
//! `bad event time` refusals, byte for byte as Python makes them.
//!
//! Per unit, in Python's order: the view's own key checks for every event, then every
//! event's time (`time`), then per event the late check and its windows (integer
//! window arithmetic, the bounds written once per window); the wrapped core applies
//! the expanded unit; the windows it now holds are queued to close by their end; the
//! watermark moves on and closes what ends at or before it (the key is forgotten, its
//! `P.state` records become tombstones at the batch's end).

mod kinds;
mod session;
mod time;

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use rustc_hash::FxHashSet;

use crate::core::{
    read_units, refused_records, reject, touched_or_none, units_of, BatchOut, Cause, Core, Ev, Fail, Form, Fp, KeyColumns,
    push_view_records, Plan, ReadOut, Rejected, RestoreFail, UnitRecords,
};
use crate::topn::{Closed, TopN, TopPlan};
use crate::json::{write_int, write_str};
use crate::statecodec::{self, KEY_SUMMARY};
use crate::value::{Unsup, Value};

pub use self::kinds::Windowed;
pub use self::session::SessionCore;
pub use self::time::{parse_iso, time_text};
use self::time::{event_time_of, EventTime};

/// The `P.state` record of a windowed view's shard's largest applied event time.
const WATERMARK_KEY: &[u8] = b"[\"wm\"]";
const START: &str = "window_start";
const END: &str = "window_end";
pub const BAD_TIME: &str = "bad event time";
pub const LATE: &str = "late";

/// A late event's headers: (name, value) pairs.
pub type Headers = Vec<(&'static str, String)>;

/// A windowed Top-N's spec (`top_n`): n, `order_by` (column, direction), `partition_by`
/// (without the window's bounds), `columns`.
pub struct TopSpec {
    pub n: usize,
    pub order_by: Vec<(String, String)>,
    pub partition_by: Vec<String>,
    pub columns: Option<Vec<String>>,
}

/// What a window's rows are reduced by, keyed by the view key and the window: the
/// grouped core, or a Top-N's groups (`partition_by` and the window). (One per view:
/// its size does not matter.)
#[allow(clippy::large_enum_variant)]
enum Inner {
    Grouped(Core),
    Top(TopN),
}

impl Inner {
    fn holds(&self, kj: &[u8]) -> bool {
        match self {
            Inner::Grouped(core) => core.holds(kj),
            Inner::Top(top) => top.holds(kj),
        }
    }
}

/// What a window's spec says (`WindowSpec`): its time column, size and slide (a tumble:
/// slide = size), lateness (None: windows never close).
pub struct WindowPlan {
    pub time: String,
    pub size: i64,
    pub slide: i64,
    pub lateness: Option<i64>,
    /// `emit: final`: a unit's records are the windows its watermark advance closed
    pub emit_final: bool,
}

pub struct WindowCore {
    inner: Inner,
    /// the view's own key checks (`checks.view_key`: the key without the window)
    checks: KeyColumns,
    form: Option<Form>,
    window: WindowPlan,
    time_shown: String,
    /// the largest event time applied (the watermark + lateness)
    max_time: Option<i64>,
    max_changed: bool,
    /// windows that may close: (end, key JSON), least first
    closing: BinaryHeap<Reverse<(i64, Box<[u8]>)>>,
    open: FxHashSet<Box<[u8]>>,
    /// the batch's closed windows: key JSON and its live rows' fingerprints
    closed: Vec<(Box<[u8]>, Vec<Fp>)>,
    /// the headers of the last `late` refusal
    headers: Option<Headers>,
    prepared: Option<Vec<Vec<Ev>>>,
    converted: Option<(Py<PyAny>, Vec<Vec<Ev>>)>,
    // a unit's scratch, kept for its capacity: its events' times, its events per
    // window and the event each came of, the windows to close (end, key JSON)
    times: Vec<(i64, bool)>,
    expanded: Vec<Ev>,
    origin: Vec<usize>,
    windows: Vec<(i64, Box<[u8]>)>,
    /// `emit: final`: the key JSON of each record `advance` wrote, in order
    finals: Vec<Box<[u8]>>,
    /// `emit: final` of a Top-N: the groups a unit's advance closed
    closed_groups: Vec<Closed>,
}

/// One batch out: `BatchOut` and, per refusal, its headers.
pub struct WindowOut<'py> {
    pub out: BatchOut<'py>,
    pub headers: Vec<Headers>,
}

fn bound(ms: i64, text: bool) -> Option<Value> {
    if text {
        time_text(ms).map(|s| Value::Str(s.into()))
    } else {
        Some(Value::Int(ms))
    }
}

fn shown(ms: i64, text: bool) -> Result<String, Unsup> {
    if text {
        time_text(ms).ok_or_else(|| Unsup::new("a late event's window outside years 1-9999"))
    } else {
        Ok(ms.to_string())
    }
}

/// `row[name] = value` as a dict assignment: in place when present, else at the end.
fn set(row: &mut Vec<(Box<str>, Value)>, name: &str, value: Value) {
    match row.iter_mut().find(|(k, _)| &**k == name) {
        Some(entry) => entry.1 = value,
        None => row.push((name.into(), value)),
    }
}

/// The end of a window from its key's JSON (the key's last value).
fn end_of(kj: &[u8]) -> Result<i64, Unsup> {
    let not = || Unsup::new("a windowed view's state key without a window end");
    let Ok(Value::List(parts)) = crate::json::parse(kj) else { return Err(not()) };
    match parts.last() {
        Some(Value::Int(n)) => Ok(*n),
        Some(Value::Str(s)) => parse_iso(s)?.ok_or_else(not),
        _ => Err(not()),
    }
}

impl WindowCore {
    pub fn new(py: Python<'_>, key_columns: Vec<String>, columns: Vec<(String, String, String)>, view_form: Option<String>,
               delta: bool, window: WindowPlan, top: Option<TopSpec>) -> PyResult<WindowCore> {
        let form = Form::parse(view_form.as_deref())?;
        let (checks, inner) = match top {
            None => {
                let checks = Plan::new(py, key_columns.clone(), columns.clone(), None, false)?.keys;
                let mut keyed = key_columns;
                keyed.extend([START.to_owned(), END.to_owned()]);
                (checks, Inner::Grouped(Core::new(Plan::new(py, keyed, columns, view_form, delta)?)))
            }
            Some(TopSpec { n, order_by, partition_by, columns }) => {
                let order_columns: Vec<String> = order_by.iter().map(|(c, _)| c.clone()).collect();
                let checks = KeyColumns::new(py, "partition", &partition_by, &order_columns)?;
                let mut grouped = partition_by;
                grouped.extend([START.to_owned(), END.to_owned()]);
                (checks, Inner::Top(TopN::new(TopPlan::new(py, n, order_by, grouped, columns, view_form)?)))
            }
        };
        let time_shown = PyString::new(py, &window.time).repr()?.to_str()?.to_owned();
        Ok(WindowCore {
            inner,
            checks,
            form,
            window,
            time_shown,
            max_time: None,
            max_changed: false,
            closing: BinaryHeap::new(),
            open: FxHashSet::default(),
            closed: Vec::new(),
            headers: None,
            prepared: None,
            converted: None,
            times: Vec::new(),
            expanded: Vec::new(),
            origin: Vec::new(),
            windows: Vec::new(),
            finals: Vec::new(),
            closed_groups: Vec::new(),
        })
    }

    pub fn len(&self) -> usize {
        match &self.inner {
            Inner::Grouped(core) => core.len(),
            Inner::Top(top) => top.len(),
        }
    }

    pub fn set_provenance(&mut self, on: bool) {
        match &mut self.inner {
            Inner::Grouped(core) => core.provenance = on,
            Inner::Top(top) => top.provenance = on,
        }
    }

    pub fn view<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        match &self.inner {
            Inner::Grouped(core) => core.view(py),
            Inner::Top(top) => top.view(py),
        }
    }



    fn watermark(&self) -> Option<i128> {
        Some(i128::from(self.max_time?) - i128::from(self.window.lateness?))
    }

    /// `WindowedReducer.apply(unit)` (tumble, hop); its records into `records` (a Top-N's
    /// straight into `view`). Each event's row moves into its last window's (the others
    /// get a copy): the unit is spent, applied or refused.
    fn apply_unit<'py>(&mut self, py: Python<'py>, events: &mut [Ev], records: &mut UnitRecords<'py>,
                       view: &mut Vec<Bound<'py, PyAny>>, cause: Cause) -> Result<i64, Fail> {
        // the windows' keys are only wanted to close them
        let closes = self.window.lateness.is_some();
        let mut keys: Vec<Vec<u8>> = Vec::with_capacity(if closes { events.len() } else { 0 });
        for (index, event) in events.iter().enumerate() {
            let key = self.checks.checked_key(&event.row, index)?; // the view's own checks come first
            if closes {
                keys.push(key);
            }
        }
        let times = &mut self.times;
        times.clear();
        for (index, event) in events.iter().enumerate() {
            match event_time_of(&event.row, &self.window.time, &self.time_shown)? {
                EventTime::At(t, text) => times.push((t, text)),
                EventTime::Bad(detail) => return Err(reject(BAD_TIME, index, Some(detail))),
            }
        }
        let wm = self.watermark();
        let (size, slide) = (i128::from(self.window.size), i128::from(self.window.slide));
        let (expanded, origin, windows) = (&mut self.expanded, &mut self.origin, &mut self.windows);
        expanded.clear();
        origin.clear();
        windows.clear();
        let too_far = || Unsup::new("an event time whose windows pass 64 bits");
        for (index, (event, &(t, text))) in events.iter_mut().zip(self.times.iter()).enumerate() {
            let t = i128::from(t);
            let first = (t - size).div_euclid(slide) * slide + slide; // the earliest window holding t
            if let Some(wm) = wm {
                if first + size <= wm {
                    let wm = i64::try_from(wm).map_err(|_| too_far())?;
                    let (s, e) = (i64::try_from(first).map_err(|_| too_far())?, i64::try_from(first + size).map_err(|_| too_far())?);
                    let (s, e, w) = (shown(s, text)?, shown(e, text)?, shown(wm, text)?);
                    let detail = format!("window [{s}, {e}) closed: watermark {w}");
                    self.headers = Some(vec![("refold.window_start", s), ("refold.window_end", e), ("refold.watermark", w)]);
                    return Err(reject(LATE, index, Some(detail)));
                }
            }
            let last = t - (t - first).rem_euclid(slide); // the latest window's start
            let mut start = first;
            while start <= last {
                let s = i64::try_from(start).map_err(|_| too_far())?;
                let e = i64::try_from(start + size).map_err(|_| too_far())?;
                let (Some(sv), Some(ev)) = (bound(s, text), bound(e, text)) else {
                    return Err(reject(BAD_TIME, index, Some("its window falls outside years 1-9999".into())));
                };
                if closes {
                    // the window's key JSON: the view key's, then its bounds
                    let key = &keys[index];
                    let mut kj = Vec::with_capacity(key.len() + 48);
                    kj.extend_from_slice(&key[..key.len() - 1]);
                    for v in [&sv, &ev] {
                        kj.push(b',');
                        match v {
                            Value::Int(n) => write_int(&mut kj, *n),
                            Value::Str(x) => write_str(&mut kj, x),
                            _ => unreachable!("a bound is an int or text"),
                        }
                    }
                    kj.push(b']');
                    windows.push((e, kj.into_boxed_slice()));
                }
                let mut row = if start == last { std::mem::take(&mut event.row) } else { event.row.clone() };
                set(&mut row, START, sv);
                set(&mut row, END, ev);
                expanded.push(Ev { op: event.op, row, tag: event.tag, record: event.record });
                origin.push(index);
                start += slide;
            }
        }
        let applied = match &mut self.inner {
            Inner::Grouped(core) => core.apply_unit(py, expanded, records),
            Inner::Top(top) => top.apply_one(py, expanded, cause, !self.window.emit_final, view),
        };
        let ts = match applied {
            Ok(ts) => ts,
            Err(Fail::Reject(r)) => return Err(Fail::Reject(Rejected { index: origin[r.index], ..r })),
            Err(other) => return Err(other),
        };
        if self.window.emit_final {
            records.clear(); // (the windows' records come as they close)
        }
        if closes {
            for (end, kj) in windows.drain(..) {
                if self.inner.holds(&kj) && !self.open.contains(&kj) {
                    self.open.insert(kj.clone());
                    self.closing.push(Reverse((end, kj)));
                }
            }
        }
        let latest = self.times.iter().map(|t| t.0).max().expect("a unit has events");
        self.advance(py, latest, records, view, ts, cause)?;
        Ok(ts)
    }

    /// `_advance`: the watermark moves on; windows ending at or before it close (with
    /// `emit: final`, their `+A` records into `records`, by key).
    fn advance<'py>(&mut self, py: Python<'py>, latest: i64, records: &mut UnitRecords<'py>,
                    view: &mut Vec<Bound<'py, PyAny>>, ts: i64, cause: Cause) -> PyResult<()> {
        if self.max_time.is_none_or(|max| latest > max) {
            self.max_time = Some(latest);
            self.max_changed = true;
        }
        let Some(wm) = self.watermark() else { return Ok(()) };
        while let Some(Reverse((end, _))) = self.closing.peek() {
            if i128::from(*end) > wm {
                break;
            }
            let Reverse((_, kj)) = self.closing.pop().expect("peeked");
            self.open.remove(&kj);
            let core = match &mut self.inner {
                Inner::Grouped(core) => core,
                Inner::Top(top) => {
                    if let Some(closed) = top.close_group(&kj) {
                        if self.window.emit_final {
                            self.closed_groups.push(closed);
                        }
                    }
                    continue;
                }
            };
            if self.window.emit_final {
                let at = records.len();
                core.final_record(py, &kj, records);
                if records.len() > at {
                    self.finals.push(kj.clone());
                }
            }
            if let Some(fps) = core.forget_key(&kj) {
                self.closed.push((kj, fps));
            }
        }
        if let Inner::Top(top) = &mut self.inner {
            if !self.closed_groups.is_empty() {
                let closed = std::mem::take(&mut self.closed_groups);
                top.final_records(py, &closed, ts, cause, view)?;
            }
            return Ok(());
        }
        if self.finals.len() > 1 {
            // Python's order: by key JSON (a record per key)
            let mut order: Vec<usize> = (0..self.finals.len()).collect();
            order.sort_by(|&a, &b| self.finals[a].cmp(&self.finals[b]));
            let mut taken: Vec<Option<_>> = records.drain(..).map(Some).collect();
            records.extend(order.into_iter().map(|i| taken[i].take().expect("each once")));
        }
        self.finals.clear();
        Ok(())
    }

    /// One batch's units, as `Core::apply_units`, with each refusal's headers.
    pub fn apply_units<'py>(&mut self, py: Python<'py>, units: &mut [Vec<Ev>]) -> Result<WindowOut<'py>, Fail> {
        let mut out = BatchOut {
            rejected: Vec::new(),
            view: Vec::with_capacity(if self.form.is_some() { units.len() * 2 } else { 0 }),
            delta: Vec::new(),
            state: Vec::new(),
        };
        let mut headers = Vec::new();
        let mut records: UnitRecords<'py> = Vec::with_capacity(4);
        let retract = self.form == Some(Form::Retract);
        for (unit_index, events) in units.iter_mut().enumerate() {
            if events.is_empty() {
                return Err(Fail::Unsup(Unsup::new("an empty unit")));
            }
            records.clear();
            let cause = (events[0].tag.1, events[0].tag.2);
            if let Inner::Grouped(core) = &mut self.inner {
                core.set_cause(cause);
            }
            match self.apply_unit(py, events, &mut records, &mut out.view, cause) {
                Ok(ts) => {
                    if records.is_empty() {
                        continue;
                    }
                    let Inner::Grouped(core) = &self.inner else { unreachable!("a Top-N writes its records itself") };
                    push_view_records(py, &mut out.view, &records, ts, cause, core.provenance, &core.names, retract)?;
                }
                Err(Fail::Reject(rejected)) => {
                    headers.push(if rejected.reason == LATE { self.headers.take().unwrap_or_default() } else { Vec::new() });
                    out.rejected.push((unit_index, rejected));
                }
                Err(other) => return Err(other),
            }
        }
        match &mut self.inner {
            Inner::Grouped(core) => core.take_deltas(py, &mut out)?,
            Inner::Top(top) => out.state = top.state_records(py)?,
        }
        self.state_changes(py, &mut out)?;
        Ok(WindowOut { out, headers })
    }

    /// `take_state_changes`: the wrapped core's records, the closed windows' tombstones
    /// and the watermark's record, in record-key order.
    fn state_changes<'py>(&mut self, py: Python<'py>, out: &mut BatchOut<'py>) -> PyResult<()> {
        let mut extra: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::new();
        for (kj, fps) in std::mem::take(&mut self.closed) {
            for fp in &fps {
                let mut key = Vec::new();
                statecodec::row_key(&mut key, &kj, fp);
                extra.push((key, None));
            }
            let mut key = Vec::new();
            statecodec::summary_key(&mut key, &kj);
            extra.push((key, None));
        }
        if self.max_changed {
            if let Some(max) = self.max_time {
                let mut value = Vec::new();
                statecodec::state_value(&mut value, KEY_SUMMARY, WATERMARK_KEY, max, None, &[]);
                extra.push((WATERMARK_KEY.to_vec(), Some(value)));
            }
            self.max_changed = false;
        }
        if extra.is_empty() {
            return Ok(());
        }
        // the core's records are in record-key order already: the few others merged in,
        // of a record key both wrote the core's kept
        extra.sort_by(|a, b| a.0.cmp(&b.0));
        let record = |key: &[u8], value: Option<Vec<u8>>| -> PyResult<Bound<'py, PyAny>> {
            let value = match value {
                Some(v) => PyBytes::new(py, &v).into_any(),
                None => py.None().into_bound(py),
            };
            Ok(PyTuple::new(py, [PyBytes::new(py, key).into_any(), value])?.into_any())
        };
        let core = std::mem::take(&mut out.state);
        out.state.reserve(core.len() + extra.len());
        let mut extra = extra.into_iter().peekable();
        for written in core {
            {
                let item = written.cast::<PyTuple>()?.get_borrowed_item(0)?;
                let key = item.cast::<PyBytes>()?;
                let key = key.as_bytes();
                while let Some((k, _)) = extra.peek() {
                    if k.as_slice() > key {
                        break;
                    }
                    let (k, value) = extra.next().expect("peeked");
                    if k.as_slice() < key {
                        out.state.push(record(&k, value)?);
                    }
                }
            }
            out.state.push(written);
        }
        for (k, value) in extra {
            out.state.push(record(&k, value)?);
        }
        Ok(())
    }

    /// `apply_units` over Python units (read into `Ev`s by `touched` just before, when it
    /// was given the same list).
    pub fn apply_batch<'py>(&mut self, py: Python<'py>, units: &Bound<'py, PyAny>) -> Result<WindowOut<'py>, Fail> {
        let mut units = match self.converted.take() {
            Some((list, converted)) if list.bind(py).is(units) => converted,
            _ => units_of(units)?,
        };
        self.apply_units(py, &mut units)
    }

    /// `state_key` (the view key) of every event, each once.
    pub fn touched(&mut self, units: &Bound<'_, PyAny>) -> Result<Vec<Vec<u8>>, Fail> {
        let converted = units_of(units)?;
        let keys = self.checks.touched_of(&converted)?;
        self.converted = Some((units.clone().unbind(), converted));
        Ok(keys)
    }

    /// `read_units` of a clean `jsonl` batch, the units kept for `apply_read`.
    pub fn read(&mut self, parts: &Bound<'_, PyAny>, check: Option<&[String]>) -> Result<Option<ReadOut>, Fail> {
        self.prepared = None;
        let Some((units, mut out)) = read_units(parts, check)? else { return Ok(None) };
        let Some(touched) = touched_or_none(self.checks.touched_of(&units))? else { return Ok(None) };
        out.touched = touched;
        self.prepared = Some(units);
        Ok(Some(out))
    }

    /// `apply_units` over what `read` kept; each refusal names its unit's records.
    pub fn apply_read<'py>(&mut self, py: Python<'py>) -> Result<(WindowOut<'py>, Vec<Vec<u32>>), Fail> {
        let mut units = self.prepared.take().unwrap_or_default();
        let out = self.apply_units(py, &mut units)?;
        let records = refused_records(&units, &out.out.rejected);
        Ok((out, records))
    }

    /// `WindowedReducer.restore`: the watermark's record and every view record.
    pub fn restore(&mut self, py: Python<'_>, records: &Bound<'_, PyAny>) -> Result<(), RestoreFail> {
        let rest = PyList::empty(py);
        for item in records.try_iter().map_err(Fail::Py)? {
            let item = item.map_err(Fail::Py)?;
            let key = item.get_item(0).map_err(Fail::Py)?;
            if key.cast::<PyBytes>().is_ok_and(|k| k.as_bytes() == WATERMARK_KEY) {
                let value = item.get_item(1).map_err(Fail::Py)?;
                let value = value.cast::<PyBytes>().map_err(|_| Fail::Unsup(Unsup::new("a watermark record that is not bytes")))?;
                self.max_time = Some(statecodec::decode_state(value.as_bytes())?.count);
            } else {
                rest.append(item).map_err(Fail::Py)?;
            }
        }
        let keys: Vec<Box<[u8]>> = match &mut self.inner {
            Inner::Grouped(core) => {
                core.restore(py, rest.as_any())?;
                core.key_jsons().map(Box::from).collect()
            }
            Inner::Top(top) => {
                top.restore(rest.as_any())?;
                top.group_jsons().map(Box::from).collect()
            }
        };
        if self.window.lateness.is_some() {
            for kj in keys {
                if !self.open.contains(&kj) {
                    let end = end_of(&kj)?;
                    self.open.insert(kj.clone());
                    self.closing.push(Reverse((end, kj)));
                }
            }
        }
        Ok(())
    }
}
