//! A session view's core restored from its `P.state` records, and its view as Python
//! objects (`WindowedReducer.restore`, `view`).

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};
use rustc_hash::FxHashMap;

use super::super::time::{event_time_of, EventTime};
use super::super::WATERMARK_KEY;
use super::{KeySessions, Member, SessionCore};
use crate::core::{Cause, Fail, RestoreFail};
use crate::statecodec::{self, KEY_SUMMARY, LIVE_ROW};
use crate::value::Value;

impl SessionCore {
    /// `restore`: the watermark's record, the live rows' (`LIVE_ROW`) records and each
    /// key's sessions' causes (`[key]`, absent in state written before they were kept).
    pub fn restore(&mut self, _py: Python<'_>, records: &Bound<'_, PyAny>) -> Result<(), RestoreFail> {
        let not = |why: &str| RestoreFail::NotState(why.to_owned());
        let mut touched: Vec<Box<[u8]>> = Vec::new();
        let mut causes: FxHashMap<Box<[u8]>, Vec<Option<Cause>>> = FxHashMap::default();
        for item in records.try_iter().map_err(Fail::Py)? {
            let item = item.map_err(Fail::Py)?;
            let key = item.get_item(0).map_err(Fail::Py)?;
            let value = item.get_item(1).map_err(Fail::Py)?;
            let (Ok(key), Ok(value)) = (key.cast::<PyBytes>(), value.cast::<PyBytes>()) else {
                return Err(not("a record that is not bytes"));
            };
            let (key, value) = (key.as_bytes(), value.as_bytes());
            let record = statecodec::decode_state(value)?;
            if key == WATERMARK_KEY {
                self.max_time = Some(record.count);
                continue;
            }
            if record.kind == KEY_SUMMARY {
                let known = statecodec::read_causes(&record.values, "a session key's summary")?;
                let mut kj = Vec::new();
                record.key.write(&mut kj, false);
                causes.insert(kj.into(), known);
                continue;
            }
            if record.kind != LIVE_ROW {
                continue;
            }
            let (Value::List(parts), Some(Value::Dict(row))) = (&record.key, record.values) else {
                return Err(not("a live row without its key or row"));
            };
            let mut kj = Vec::new();
            record.key.write(&mut kj, false);
            let fp = statecodec::row_fingerprint(key)?;
            let EventTime::At(t, text) = event_time_of(&row, &self.time, &self.time_shown).map_err(Fail::Unsup)? else {
                return Err(not("a session row without its time"));
            };
            let kj: Box<[u8]> = kj.into();
            let sessions = self.sessions.entry(kj.clone()).or_insert_with(|| KeySessions {
                parts: parts.clone(),
                rows: FxHashMap::default(),
                out: Vec::new(),
            });
            self.seq += 1;
            sessions.rows.insert(fp, Member { fp, row, tags: record.tags, t, text, seq: self.seq });
            if !touched.contains(&kj) {
                touched.push(kj);
            }
        }
        for kj in touched {
            self.resession(&kj, &[], &[])?;
            if let (Some(known), Some(sessions)) = (causes.get(&kj), self.sessions.get_mut(&kj)) {
                for (session, cause) in sessions.out.iter_mut().zip(known) {
                    session.cause = *cause;
                }
            }
        }
        Ok(())
    }

    /// `view()`: {(*key, window_start): row} of every open session.
    pub fn view<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for sessions in self.sessions.values() {
            for session in &sessions.out {
                let Ok(Value::List(parts)) = crate::json::parse(&session.out_key) else { unreachable!("an output key's JSON") };
                let key = PyTuple::new(py, parts.iter().map(|p| p.to_py(py)).collect::<PyResult<Vec<_>>>()?)?;
                let row = PyDict::new(py);
                for (name, value) in &session.row {
                    row.set_item(&**name, value.to_py(py)?)?;
                }
                out.set_item(key, row)?;
            }
        }
        Ok(out)
    }
}
