//! Stage 2's reader of a re-grouping view (grouped, or a Top-N by `partition_by`):
//! `ExchangeReader.read` of
//! refold.runtime.exchange for the `P.repartition` records it reads as Python does,
//! without a Python object per event.
//!
//! Stage 1 writes each accepted unit's events for a shard as one record,
//! `[merge_key, [[t0, t1, t2, op, row], ...]]` (core/route.rs or `RouteValidator`), and
//! the driver closes each batch with `{"close": [run, seq]}`. Between two closes lies a
//! segment: its units, each source partition's in the order stage 1 committed them,
//! the partitions merged by merge key (`_merged`). The segments follow each other.
//!
//! As the source reader does (core/read.rs), it takes a batch only when every record is
//! one of those two shapes with values the core holds; otherwise `read_routed` answers
//! None and `ExchangeReader` reads the batch in Python.

use std::collections::BTreeMap;

use pyo3::prelude::*;

use super::apply::Ev;
use super::read::{merge_by, record_of, touched_or_none};
use super::{Core, Fail};
use crate::json;
use crate::statecodec::Tag;
use crate::value::{within_depth, Value};

/// One segment's units by source partition, each with its merge key, as read.
type Segment = BTreeMap<i64, Vec<(Tag, Vec<Ev>)>>;

/// A JSON array's items, or None.
fn items(value: Value) -> Option<Vec<Value>> {
    match value {
        Value::List(items) => Some(items),
        _ => None,
    }
}

/// An array of three integers (a tag, a merge key).
fn tag_of(value: Value) -> Option<Tag> {
    match items(value)?.as_slice() {
        [Value::Int(t), Value::Int(p), Value::Int(o)] => Some((*t, *p, *o)),
        _ => None,
    }
}

/// `[t0, t1, t2, op, row]`: the event `SourceEvent(Op(op), row, (t0, t1, t2))`.
fn event_of(value: Value, record: u32) -> Option<Ev> {
    let mut fields = items(value)?;
    if fields.len() != 5 {
        return None;
    }
    let row = match fields.pop()? {
        Value::Dict(row) if row.iter().all(|(_, v)| within_depth(v, 1)) => row,
        _ => return None,
    };
    let op = match fields.pop()? {
        Value::Int(op @ 0..=3) => op as u8,
        _ => return None,
    };
    let tag = tag_of(Value::List(fields))?;
    Some(Ev { op, row, tag, record })
}

/// A routed record's value: its merge key and its unit (None: not that shape, or empty).
fn unit_of(data: &[u8], record: u32) -> Option<(Tag, Vec<Ev>)> {
    let mut parts = items(json::parse(data).ok()?)?;
    if parts.len() != 2 {
        return None; // a global Top-N's records carry the unit's id: LocalTops reads those
    }
    let events = items(parts.pop()?)?;
    let merge_key = tag_of(parts.pop()?)?;
    let unit = events.into_iter().map(|event| event_of(event, record)).collect::<Option<Vec<Ev>>>()?;
    (!unit.is_empty()).then_some((merge_key, unit))
}

/// Whether a value is a close record, `{"close": [run, seq]}`.
fn is_close(data: &[u8]) -> bool {
    matches!(json::parse(data), Ok(Value::Dict(entries)) if entries.iter().any(|(name, _)| &**name == "close"))
}

/// `ExchangeReader.read` of stage 2's records, given in offset order: the units in the
/// order stage 2 applies them, each event naming its record by its place in `records`;
/// None when a record is not what stage 1 or the driver writes (see the module).
pub(crate) fn routed_units(records: &Bound<'_, PyAny>) -> Result<Option<Vec<Vec<Ev>>>, Fail> {
    let mut units: Vec<Vec<Ev>> = Vec::new();
    let mut segment = Segment::new();
    for (index, object) in records.try_iter()?.enumerate() {
        let object = object?;
        let Some(record) = record_of(&object) else { return Ok(None) };
        let Ok(index) = u32::try_from(index) else { return Ok(None) };
        if record.value.first() == Some(&b'{') {
            if !is_close(record.value) {
                return Ok(None);
            }
            units.extend(merge_by(std::mem::take(&mut segment).into_values().collect()));
            continue;
        }
        let Some((merge_key, unit)) = unit_of(record.value, index) else { return Ok(None) };
        segment.entry(merge_key.1).or_default().push((merge_key, unit));
    }
    units.extend(merge_by(segment.into_values().collect()));
    Ok(Some(units))
}

impl Core {
    /// `routed_units`, kept in the core for `apply_read`; the view keys (JSON) they touch,
    /// each once (None: a record or a value the core does not take).
    pub fn read_routed(&mut self, records: &Bound<'_, PyAny>) -> Result<Option<Vec<Vec<u8>>>, Fail> {
        self.prepared = None;
        let Some(units) = routed_units(records)? else { return Ok(None) };
        let Some(touched) = touched_or_none(self.touched_of(&units))? else { return Ok(None) };
        self.prepared = Some(units);
        Ok(Some(touched))
    }
}
