//! Stage 1 of a re-grouping grouped view (refold.runtime.exchange's `RouteProcessor`
//! with `RouteValidator`), after the core's own reader: per unit, in order, its merge
//! key (`merge_keys`), the view's checks of each event (`GroupedReducer.view_key`: the
//! view key, its summed columns), the live rows of its message key (this core: a
//! count per message key), and the routed records of an accepted unit — one per
//! stage-2 shard it touches, `orjson.dumps([merge_key, [[t0, t1, t2, op, row], ...]])`,
//! the shard `shard_of(key_bytes(view key), M)`.

use blake2::digest::consts::U8;
use blake2::{Blake2b, Digest};
use pyo3::prelude::*;

use super::apply::{BatchOut, Ev};
use super::plan::Plan;
use super::{reject, Core, Fail, SCHEMA_MISMATCH};
use crate::json::write_int;
use crate::value::{row_get, write_dict, Value};

/// The view side of stage 1: the view's plan (its key and column checks) and M.
pub struct Router {
    view: Core,
    shards: u64,
}

impl Router {
    pub fn new(view: Plan, shards: u64) -> Router {
        Router { view: Core::new(view), shards }
    }

    /// `RouteValidator.view_keys` of a grouped view for one event: its view key's JSON,
    /// Rejected as `view_key` refuses.
    fn view_key(&self, event: &Ev, index: usize) -> Result<Vec<u8>, Fail> {
        let key = self.view.checked_key(&event.row, index)?;
        let plan = &self.view.plan;
        for (i, name) in plan.sum_names.iter().enumerate() {
            match row_get(&event.row, name) {
                None | Some(Value::Null | Value::Int(_) | Value::Float(_)) => {}
                Some(_) => return Err(reject(SCHEMA_MISMATCH, index, Some(plan.sum_detail[i].clone()))),
            }
        }
        Ok(key)
    }

    /// `shard_of(key_json, M)`: blake2b-64 of the key's JSON, big-endian, mod M.
    fn shard_of(&self, key: &[u8]) -> u64 {
        let mut hasher = Blake2b::<U8>::new();
        hasher.update(key);
        let digest: [u8; 8] = hasher.finalize().into();
        u64::from_be_bytes(digest) % self.shards
    }
}

/// Stage 1's batch: the refusals (by unit), the routed records in order, and the
/// message keys' `P.rows` records.
pub struct Routed<'py> {
    pub out: BatchOut<'py>,
    pub routed: Vec<(u64, Vec<u8>)>,
}

fn write_tag(out: &mut Vec<u8>, tag: (i64, i64, i64)) {
    write_int(out, tag.0);
    out.push(b',');
    write_int(out, tag.1);
    out.push(b',');
    write_int(out, tag.2);
}

impl Core {
    /// Stage 1 over the units `read` kept (see the module); the refusals name their
    /// records by index as `apply_read`'s do.
    pub fn route_read<'py>(&mut self, py: Python<'py>, router: &Router) -> Result<(Routed<'py>, Vec<Vec<u32>>), Fail> {
        let units = self.prepared.take().unwrap_or_default();
        let mut rejected = Vec::new();
        let mut kept: Vec<usize> = Vec::with_capacity(units.len());
        let mut keys: Vec<Vec<Vec<u8>>> = Vec::with_capacity(units.len());
        let mut merge_keys = Vec::with_capacity(units.len());
        let mut greatest: Option<(i64, i64, i64)> = None;
        for (at, unit) in units.iter().enumerate() {
            let first = unit[0].tag;
            if greatest.is_none_or(|g| first > g) {
                greatest = Some(first);
            }
            merge_keys.push(greatest.unwrap());
            let checked: Result<Vec<Vec<u8>>, Fail> =
                unit.iter().enumerate().map(|(index, event)| router.view_key(event, index)).collect();
            match checked {
                Ok(unit_keys) => {
                    kept.push(at);
                    keys.push(unit_keys);
                }
                Err(Fail::Reject(r)) => rejected.push((at, r)),
                Err(other) => return Err(other),
            }
        }
        // the message keys' live rows, over the units the view accepts; each refusal
        // with its unit's records
        let mut records: Vec<Vec<u32>> =
            rejected.iter().map(|(at, _)| units[*at].iter().map(|e| e.record).collect()).collect();
        let mut units = units;
        let kept_units: Vec<Vec<Ev>> = kept.iter().map(|&at| std::mem::take(&mut units[at])).collect();
        let mut out = self.apply_units(py, &kept_units)?;
        let mut refused_by_rows = vec![false; kept_units.len()];
        for (unit, r) in out.rejected.drain(..) {
            refused_by_rows[unit] = true;
            records.push(kept_units[unit].iter().map(|e| e.record).collect());
            rejected.push((kept[unit], r));
        }
        let mut routed = Vec::new();
        let mut by_shard: Vec<(u64, Vec<u8>)> = Vec::new();
        for (i, unit) in kept_units.iter().enumerate() {
            if refused_by_rows[i] {
                continue;
            }
            by_shard.clear();
            for (event, key) in unit.iter().zip(&keys[i]) {
                let shard = router.shard_of(key);
                let at = match by_shard.iter().position(|(s, _)| *s == shard) {
                    Some(at) => {
                        by_shard[at].1.push(b',');
                        at
                    }
                    None => {
                        by_shard.push((shard, Vec::with_capacity(128)));
                        by_shard.len() - 1
                    }
                };
                let buf = &mut by_shard[at].1;
                buf.push(b'[');
                write_tag(buf, event.tag);
                buf.push(b',');
                write_int(buf, event.op as i64);
                buf.push(b',');
                write_dict(buf, &event.row);
                buf.push(b']');
            }
            let merge_key = merge_keys[kept[i]];
            for (shard, events) in by_shard.drain(..) {
                let mut value = Vec::with_capacity(events.len() + 40);
                value.extend_from_slice(b"[[");
                write_tag(&mut value, merge_key);
                value.extend_from_slice(b"],[");
                value.extend_from_slice(&events);
                value.extend_from_slice(b"]]");
                routed.push((shard, value));
            }
        }
        // refusals in unit order, as `apply_read` gives them
        let mut refusals: Vec<_> = rejected.into_iter().zip(records).collect();
        refusals.sort_by_key(|((at, _), _)| *at);
        let (rejected, records): (Vec<_>, Vec<_>) = refusals.into_iter().unzip();
        out.rejected = rejected;
        Ok((Routed { out, routed }, records))
    }
}
