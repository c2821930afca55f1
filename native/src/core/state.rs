//! State: `_Row`, `_Key`, `_Delta` of refold.reduce.grouped — one view key's live rows
//! and running values, the batch's contributions per key — and their updates: `_add`,
//! `_remove`, `_account` and `_view_row`.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use super::apply::Checked;
use super::plan::{Agg, Plan};
use super::{fits_i64, Cause, Core, Fail, Fp, KeyBytes, Map, NO_SLOT};
use crate::statecodec::Tag;
use crate::value::{row_get, Scalar, Unsup, Value};

/// `_Row`: the live copies of one distinct row under one key.
pub(super) struct Row {
    pub(super) count: i64,
    /// ascending; only when a reduction orders by tag
    pub(super) tags: Option<Vec<Tag>>,
    /// the kept columns' values (of the first copy); only when a reduction needs them
    pub(super) vals: Option<Box<[Value]>>,
}

/// `_Key`: one view key's live rows, running values and current view row.
pub(super) struct KeyState {
    /// where the key's `Touched` is in the batch, NO_SLOT before the batch touches it
    pub(super) slot: u32,
    pub(super) rows: FxHashMap<Fp, Row>,
    pub(super) total: i64,
    pub(super) sums: Vec<i128>,
    pub(super) nonnull: Vec<i64>,
    /// `_Multiset`s: value → copies, in `value_order`
    pub(super) multisets: Vec<BTreeMap<Scalar, i64>>,
    /// `order`: the live copies by (tag, fingerprint), with their multiplicity
    pub(super) order: BTreeMap<(Tag, Fp), u32>,
    /// the view row's column values (the key columns' are in the key's JSON)
    pub(super) view: Option<Vec<Value>>,
    /// the cause of the view record that wrote `view` (None: unknown)
    pub(super) cause: Option<Cause>,
}

impl KeyState {
    pub(super) fn new(plan: &Plan) -> KeyState {
        KeyState {
            slot: NO_SLOT,
            rows: FxHashMap::default(),
            total: 0,
            sums: vec![0; plan.sum_names.len()],
            nonnull: vec![0; plan.nonnull_names.len()],
            multisets: vec![BTreeMap::new(); plan.multiset_names.len()],
            order: BTreeMap::new(),
            view: None,
            cause: None,
        }
    }
}

/// The batch's contributions (`_deltas`, `_dirty_keys`, `_dirty_rows`): one slot per
/// key the batch touched, in the order it first did, and what each unit added to or
/// took from a slot, side by side for all keys (sorted by slot at the batch's end).
#[derive(Default)]
pub(super) struct Batch {
    /// the key's JSON and its `_Delta.total`, by slot
    pub(super) keys: Vec<(KeyBytes, i64)>,
    /// the slots of the keys that ended within the batch, for one that comes back
    pub(super) ended: Map<KeyBytes, u32>,
    /// `_Delta.sums` (slot * sum columns + column) and `_Delta.nonnull`
    pub(super) sums: Vec<i128>,
    pub(super) nonnull: Vec<i64>,
    /// `_Delta.multisets`: (slot, multiset column, value, +1 or -1)
    pub(super) values: Vec<(u32, u32, Scalar, i64)>,
    /// `_Delta.contribs`: (slot, tag column, tag, value, sign)
    pub(super) contribs: Vec<(u32, u32, Tag, Value, i64)>,
    /// `_dirty_rows`: (slot, fingerprint)
    pub(super) rows: Vec<(u32, Fp)>,
    /// `_Delta.cause` by slot: the batch's last unit that touched the key
    pub(super) causes: Vec<Cause>,
    /// the cause of the unit being applied
    pub(super) cause: Cause,
}

impl Batch {
    /// Empty for the next batch, its room kept.
    pub(super) fn clear(&mut self) {
        self.keys.clear();
        self.ended.clear();
        self.sums.clear();
        self.nonnull.clear();
        self.values.clear();
        self.contribs.clear();
        self.rows.clear();
        self.causes.clear();
    }
}

/// Where each slot's items are in a vector sorted by slot: `starts[slot]..starts[slot + 1]`.
pub(super) fn slot_starts(slots: usize, mut slot_of: impl Iterator<Item = u32>) -> Vec<usize> {
    let mut starts = vec![0usize; slots + 1];
    let mut at = 0usize;
    let mut next = slot_of.next();
    for (slot, start) in starts.iter_mut().enumerate() {
        *start = at;
        while next == Some(slot as u32) {
            at += 1;
            next = slot_of.next();
        }
    }
    starts
}

impl Core {
    /// `_add`: one more copy of the event's row under its key.
    pub(super) fn add(&mut self, c: &Checked<'_>) -> Result<(), Fail> {
        let plan = &self.plan;
        let state = self.keys.entry_ref(c.key.as_slice()).or_insert_with(|| KeyState::new(plan));
        if !state.rows.contains_key(&c.fp) {
            let vals = if plan.kept.is_empty() {
                None
            } else {
                Some(plan.kept.iter().map(|name| row_get(c.row, name).cloned().unwrap_or(Value::Null)).collect())
            };
            state.rows.insert(c.fp, Row { count: 0, tags: plan.needs_tags.then(Vec::new), vals });
        }
        let entry = state.rows.get_mut(&c.fp).unwrap();
        entry.count += 1;
        if let Some(tags) = entry.tags.as_mut() {
            tags.push(c.tag);
            if tags.len() > 1 && tags[tags.len() - 2] > c.tag {
                tags.sort();
            }
        }
        state.total += 1;
        let vals = entry.vals.take();
        let result = Self::account(plan, &mut self.batch, state, c, vals.as_deref(), c.tag, 1);
        state.rows.get_mut(&c.fp).unwrap().vals = vals;
        result
    }

    /// `_remove`: one copy less (the latest by tag).
    pub(super) fn remove(&mut self, c: &Checked<'_>) -> Result<(), Fail> {
        let plan = &self.plan;
        let state = self.keys.get_mut(c.key.as_slice()).expect("a live row's key");
        let entry = state.rows.get_mut(&c.fp).expect("a live row");
        let tag = match entry.tags.as_mut() {
            Some(tags) => tags.pop().unwrap_or((0, 0, 0)),
            None => (0, 0, 0),
        };
        entry.count -= 1;
        let vals = if entry.count == 0 {
            state.rows.remove(&c.fp).unwrap().vals
        } else {
            entry.vals.take()
        };
        state.total -= 1;
        let result = Self::account(plan, &mut self.batch, state, c, vals.as_deref(), tag, -1);
        if let Some(entry) = state.rows.get_mut(&c.fp) {
            entry.vals = vals;
        }
        result
    }

    /// `_account`: fold one copy of a row in (+1) or out (-1) of the running values and
    /// of the batch's delta; mark the key and the row dirty.
    fn account(
        plan: &Plan,
        batch: &mut Batch,
        state: &mut KeyState,
        c: &Checked<'_>,
        vals: Option<&[Value]>,
        tag: Tag,
        sign: i64,
    ) -> Result<(), Fail> {
        if state.slot == NO_SLOT {
            // a new slot, unless the key ended earlier in the batch and came back
            state.slot = match batch.ended.get(c.key.as_slice()) {
                Some(&slot) => slot,
                None => {
                    let Batch { keys, sums, nonnull, causes, .. } = &mut *batch;
                    keys.push((KeyBytes::from(c.key.as_slice()), 0));
                    causes.push((0, 0));
                    sums.resize(sums.len() + plan.sum_names.len(), 0);
                    nonnull.resize(nonnull.len() + plan.nonnull_names.len(), 0);
                    (keys.len() - 1) as u32
                }
            };
        }
        let at = state.slot;
        batch.rows.push((at, c.fp));
        batch.keys[at as usize].1 += sign;
        batch.causes[at as usize] = batch.cause;
        let base = at as usize * plan.sum_names.len();
        for (slot, value) in c.sums.iter().enumerate() {
            if let Some(n) = value {
                let n = sign as i128 * *n as i128;
                state.sums[slot] += n;
                batch.sums[base + slot] += n;
            }
        }
        let base = at as usize * plan.nonnull_names.len();
        for (slot, present) in c.nonnull.iter().enumerate() {
            if *present {
                state.nonnull[slot] += sign;
                batch.nonnull[base + slot] += sign;
            }
        }
        let Some(vals) = vals else { return Ok(()) };
        for (slot, &index) in plan.multiset_index.iter().enumerate() {
            let Some(value) = Scalar::of(&vals[index])? else { continue };
            let counts = &mut state.multisets[slot];
            let now = counts.get(&value).copied().unwrap_or(0) + sign;
            if now != 0 {
                match counts.get_mut(&value) {
                    Some(n) => *n = now,
                    None => {
                        counts.insert(value.clone(), now);
                    }
                }
            } else {
                counts.remove(&value);
            }
            batch.values.push((at, slot as u32, value, sign));
        }
        if plan.needs_tags {
            let item = (tag, c.fp);
            if sign > 0 {
                *state.order.entry(item).or_insert(0) += 1;
            } else if let Some(n) = state.order.get_mut(&item) {
                *n -= 1;
                if *n == 0 {
                    state.order.remove(&item);
                }
            }
            for (slot, &index) in plan.tag_index.iter().enumerate() {
                batch.contribs.push((at, slot as u32, tag, vals[index].clone(), sign));
            }
        }
        Ok(())
    }

    /// `_view_row`: the key's view columns off its running values.
    pub(super) fn view_row(plan: &Plan, state: &KeyState) -> Result<Vec<Value>, Unsup> {
        let mut row = Vec::with_capacity(plan.aggs.len());
        for agg in &plan.aggs {
            row.push(match *agg {
                Agg::Sum { sum } => Value::Int(fits_i64(state.sums[sum])?),
                Agg::CountRows => Value::Int(state.total),
                Agg::Count { nn } => Value::Int(state.nonnull[nn]),
                Agg::Avg { sum, nn } => {
                    let n = state.nonnull[nn];
                    if n == 0 {
                        Value::Null
                    } else {
                        // float(Fraction(sum) / n): one correctly rounded division when
                        // both are exact as floats
                        let s = state.sums[sum];
                        const EXACT: i128 = 1 << 53;
                        if s.abs() >= EXACT || (n as i128).abs() >= EXACT {
                            return Err(Unsup::new("an average of a sum past 2**53"));
                        }
                        Value::Float(s as f64 / n as f64)
                    }
                }
                Agg::Min { ms } => state.multisets[ms].keys().next().map_or(Value::Null, Scalar::value),
                Agg::Max { ms } => state.multisets[ms].keys().next_back().map_or(Value::Null, Scalar::value),
                Agg::Set { ms } => Value::List(
                    state.multisets[ms]
                        .iter()
                        .map(|(v, n)| Value::List(vec![v.value(), Value::Int(*n)]))
                        .collect(),
                ),
                Agg::ByTag { last, kept, .. } => {
                    let found = if last { state.order.keys().next_back() } else { state.order.keys().next() };
                    let Some((_, fp)) = found else { return Err(Unsup::new("a key without live copies")) };
                    match state.rows.get(fp).and_then(|r| r.vals.as_ref()) {
                        Some(vals) => vals[kept].clone(),
                        None => return Err(Unsup::new("a key's live copies out of step")),
                    }
                }
            });
        }
        Ok(row)
    }
}
