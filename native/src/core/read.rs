//! A batch's records in, for a `jsonl` changelog: `UnitReader.read` of
//! refold.runtime.batch — decode (`JsonlCodec`), the message-key check of a
//! co-partitioned view (`KeyCheck.matches`), `-C`/`+C` pairing (`Pairing`), and the
//! merge of the partitions' units by the tag of their first event (`heapq.merge`) —
//! for the records it reads as Python does, without a Python object per event.
//!
//! It takes a batch only when every record is *clean*: a JSON object with a valid
//! `op`, an integer or absent `event_time`, values the core holds, a message key that
//! matches (where checked), every `-C` followed by its `+C`. Anything else (a record
//! Python dead-letters, a value it would read otherwise, an ISO `event_time`...) and it
//! takes nothing: `read` answers None and the batch goes through the Python reader as
//! before. So it needs to be exact only on what it takes; what Python refuses, Python
//! refuses.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use super::apply::Ev;
use super::{Core, Fail};
use crate::json;
use crate::statecodec::Tag;
use crate::value::{row_get, within_depth, Row, Value};

/// What `read` found besides the units it keeps for `apply_read`.
pub struct ReadOut {
    /// the view keys (JSON) its events touch, each once
    pub touched: Vec<Vec<u8>>,
    /// the records (by their place in the batch) of the `-C`s at the end of their
    /// partitions, held over for their `+C`
    pending: Vec<u32>,
    /// whether a message key was checked and matched (`KeyCheck.verified`)
    pub verified: bool,
}

impl ReadOut {
    pub fn pending(&self) -> &[u32] {
        &self.pending
    }
}

/// One input record's fields (`InputRecord`: partition, offset, key, value, timestamp).
pub(super) struct Record<'a> {
    partition: i64,
    offset: i64,
    key: Option<&'a [u8]>,
    pub(super) value: &'a [u8],
    timestamp: i64,
}

/// An `InputRecord`'s fields; None when one is not what the engine hands over (a null
/// value included: Python dead-letters it).
pub(super) fn record_of<'a>(record: &'a Bound<'_, PyAny>) -> Option<Record<'a>> {
    let tuple = record.cast::<PyTuple>().ok()?;
    if tuple.len() != 5 {
        return None;
    }
    let int = |i: usize| tuple.get_borrowed_item(i).ok()?.extract::<i64>().ok();
    let bytes = |i: usize| -> Option<Option<&'a [u8]>> {
        let item = tuple.get_borrowed_item(i).ok()?;
        if item.is_none() {
            return Some(None);
        }
        let bytes = item.cast::<PyBytes>().ok()?;
        let data = bytes.as_bytes();
        // SAFETY: the bytes object is held by the record (a tuple), which the caller holds
        // for 'a; bytes objects are immutable
        Some(Some(unsafe { std::slice::from_raw_parts(data.as_ptr(), data.len()) }))
    };
    Some(Record { partition: int(0)?, offset: int(1)?, key: bytes(2)?, value: bytes(3)??, timestamp: int(4)? })
}

/// `JsonlCodec._events_of` and `_source_event` of a clean record: op, row, tag.
fn decode(record: &Record<'_>, index: u32) -> Option<Ev> {
    let Ok(Value::Dict(mut row)) = json::parse(record.value) else { return None };
    let op = match take(&mut row, "op")? {
        Value::Str(code) => match &*code {
            "+A" | "0" => 0,
            "-R" | "1" => 1,
            "-C" | "2" => 2,
            "+C" | "3" => 3,
            _ => return None,
        },
        Value::Int(n @ 0..=3) => n as u8,
        _ => return None,
    };
    let event_time = match take(&mut row, "event_time") {
        None | Some(Value::Null) => record.timestamp,
        Some(Value::Int(ms)) => ms,
        Some(_) => return None, // an ISO string, or an error: Python reads it
    };
    take(&mut row, "offset");
    take(&mut row, "system_time");
    if !row.iter().all(|(_, v)| within_depth(v, 1)) {
        return None;
    }
    let tag: Tag = (event_time, record.partition, record.offset);
    Some(Ev { op, row, tag, record: index })
}

/// `row.pop(name)`.
fn take(row: &mut Row, name: &str) -> Option<Value> {
    let at = row.iter().position(|(n, _)| &**n == name)?;
    Some(row.remove(at).1)
}

/// `KeyCheck.matches`, for what it can tell exactly: Some(true) when the message key is
/// a JSON object of exactly the key columns holding the row's values (strings and
/// integers compared as Python compares them), Some(false) when the row has a missing
/// or null key column (not checked: the reducer refuses it), None for anything else.
fn key_matches(columns: &[String], key: Option<&[u8]>, row: &[(Box<str>, Value)]) -> Option<bool> {
    let mut values = Vec::with_capacity(columns.len());
    for column in columns {
        match row_get(row, column) {
            None | Some(Value::Null) => return Some(false),
            Some(value) => values.push(value),
        }
    }
    let Ok(Value::Dict(parsed)) = json::parse(key?) else { return None };
    let envelope = parsed.len() == 2 && row_get(&parsed, "schema").is_some() && row_get(&parsed, "payload").is_some();
    if envelope || parsed.len() != columns.len() {
        return None;
    }
    for (column, value) in columns.iter().zip(values) {
        let same = match (row_get(&parsed, column)?, value) {
            (Value::Str(a), Value::Str(b)) => a == b,
            (Value::Int(a), Value::Int(b)) => a == b,
            _ => false,
        };
        if !same {
            return None;
        }
    }
    Some(true)
}

/// A clean batch read: its units in merge order, and what else `read` tells the shard.
pub(crate) type ReadUnits = (Vec<Vec<Ev>>, ReadOut);

/// `UnitReader.read` of a batch given as `[(partition, [InputRecord, ...]), ...]`,
/// partitions in order, each one's records in offset order (its held-over `-C` first);
/// `check`: the message-key columns of a co-partitioned view. The units in merge order
/// and what else was read (its `touched` left for the core to fill: the view's keys);
/// None when the batch is not clean (see the module).
pub(crate) fn read_units(parts: &Bound<'_, PyAny>, check: Option<&[String]>) -> Result<Option<ReadUnits>, Fail> {
    let mut streams: Vec<Vec<Vec<Ev>>> = Vec::new();
    let mut pending = Vec::new();
    let mut verified = false;
    let mut index: u32 = 0;
    for part in parts.try_iter()? {
        let part = part?;
        let records = part.get_item(1)?;
        let mut units: Vec<Vec<Ev>> = Vec::with_capacity(records.len().unwrap_or(0));
        // `Pairing`: the held `-C` and its message key
        let mut held: Option<(Ev, Option<&[u8]>)> = None;
        let records: Vec<Bound<'_, PyAny>> = records.try_iter()?.collect::<PyResult<_>>()?;
        for object in &records {
            let Some(record) = record_of(object) else { return Ok(None) };
            let Some(event) = decode(&record, index) else { return Ok(None) };
            index += 1;
            if let Some(columns) = check {
                match key_matches(columns, record.key, &event.row) {
                    Some(matched) => verified |= matched,
                    None => return Ok(None),
                }
            }
            if let Some((from, key)) = held.take() {
                if event.op == 3 && key == record.key {
                    units.push(vec![from, event]);
                    continue;
                }
                return Ok(None); // a broken pair: dead letters
            }
            match event.op {
                3 => return Ok(None), // a +C without its -C
                2 => held = Some((event, record.key)),
                _ => units.push(vec![event]),
            }
        }
        if let Some((from, _)) = held {
            pending.push(from.record);
        }
        streams.push(units);
    }
    Ok(Some((merge(streams), ReadOut { touched: Vec::new(), pending, verified })))
}

/// The keys (JSON) the units touch, as `touched_of` gives them; None when a value in them
/// is one the core does not key by (Python decides: `read` takes nothing).
pub(crate) fn touched_or_none(touched: Result<Vec<Vec<u8>>, Fail>) -> Result<Option<Vec<Vec<u8>>>, Fail> {
    match touched {
        Ok(touched) => Ok(Some(touched)),
        Err(Fail::Py(err)) => Err(Fail::Py(err)),
        Err(_) => Ok(None),
    }
}

/// The records (by their place in the batch) of each refused unit.
pub(crate) fn refused_records(units: &[Vec<Ev>], rejected: &[(usize, super::Rejected)]) -> Vec<Vec<u32>> {
    rejected.iter().map(|(unit, _)| units[*unit].iter().map(|e| e.record).collect()).collect()
}

impl Core {
    /// `read_units`, the units kept in the core for `apply_read`, their view keys in `touched`.
    pub fn read(&mut self, parts: &Bound<'_, PyAny>, check: Option<&[String]>) -> Result<Option<ReadOut>, Fail> {
        self.prepared = None;
        let Some((units, mut out)) = read_units(parts, check)? else { return Ok(None) };
        let Some(touched) = touched_or_none(self.touched_of(&units))? else { return Ok(None) };
        out.touched = touched;
        self.prepared = Some(units);
        Ok(Some(out))
    }

    /// Units made elsewhere (a join's records: `JoinCore::join_events`), kept for
    /// `apply_read` as `read` keeps its own.
    pub fn prepare(&mut self, units: Vec<Vec<Ev>>) {
        self.prepared = Some(units);
    }

    /// The view keys of the units `prepare` kept (dropped when one is not held).
    pub fn prepared_touched(&mut self) -> Result<Vec<Vec<u8>>, Fail> {
        let touched = self.touched_of(self.prepared.as_deref().unwrap_or_default());
        if touched.is_err() {
            self.prepared = None;
        }
        touched
    }

    /// `apply_units` over what `read` kept; each refusal names its unit's records.
    pub fn apply_read<'py>(&mut self, py: Python<'py>) -> Result<(super::apply::BatchOut<'py>, Vec<Vec<u32>>), Fail> {
        let units = self.prepared.take().unwrap_or_default();
        let out = self.apply_units(py, &units)?;
        let records = refused_records(&units, &out.rejected);
        Ok((out, records))
    }
}

/// `heapq.merge(*streams, key=lambda unit: unit[0][0].tag)`: again and again the stream
/// whose next unit has the least first tag (tags differ: each has its partition and
/// offset).
fn merge(streams: Vec<Vec<Vec<Ev>>>) -> Vec<Vec<Ev>> {
    merge_by(streams.into_iter().map(|units| units.into_iter().map(|unit| (unit[0].tag, unit)).collect()).collect())
}

/// `heapq.merge(*streams, key=...)` of units given with their keys: again and again the
/// stream whose next unit has the least key, the earlier stream on a tie (each stream's
/// keys only grow).
pub(super) fn merge_by(mut streams: Vec<Vec<(Tag, Vec<Ev>)>>) -> Vec<Vec<Ev>> {
    if streams.len() == 1 {
        return streams.pop().unwrap().into_iter().map(|(_, unit)| unit).collect();
    }
    let total = streams.iter().map(Vec::len).sum();
    let mut out = Vec::with_capacity(total);
    let mut next = vec![0usize; streams.len()];
    let mut heads: BinaryHeap<Reverse<(Tag, usize)>> = BinaryHeap::with_capacity(streams.len());
    for (s, stream) in streams.iter().enumerate() {
        if let Some((key, _)) = stream.first() {
            heads.push(Reverse((*key, s)));
        }
    }
    while let Some(Reverse((_, s))) = heads.pop() {
        let at = next[s];
        out.push(std::mem::take(&mut streams[s][at].1));
        next[s] = at + 1;
        if let Some((key, _)) = streams[s].get(at + 1) {
            heads.push(Reverse((*key, s)));
        }
    }
    out
}
