//! A batch in: `TopNReducer.apply` per unit — the unit's checks, which refuse it before
//! it changes anything (`view_key`, the live-copy count), its copies added to and
//! taken from their groups' rankings, then each touched group's places from the first
//! rank the unit moved (`_retop`) against the places before — and the unit's view
//! records (`diff_changes`, `Renderer.view`).

use std::sync::Arc;

use pyo3::prelude::*;

use super::rank::{sort_key, Entry};
use super::render::Change;
use super::{Group, Live, Out, TopN};
use crate::core::{fingerprint, live_fingerprint, reject, BatchOut, Ev, Fail, Fp, KeyBytes, NOT_LIVE};
use crate::value::Unsup;

/// An event checked: its op, its group's JSON, its row's fingerprint.
struct Checked {
    adds: bool,
    key: Vec<u8>,
    fp: Fp,
}

impl TopN {
    /// The unit's events checked (`view_key`, fingerprints: for a removal, the one the
    /// group holds the row under), then every removal matched to a live copy, counting
    /// the unit's own earlier events; Rejected at the first that fails.
    fn checked(&mut self, events: &[Ev]) -> Result<Vec<Checked>, Fail> {
        let mut prepared = Vec::with_capacity(events.len());
        for (index, event) in events.iter().enumerate() {
            let key = self.plan.keys.checked_key(&event.row, index)?;
            let adds = event.op == 0 || event.op == 3;
            let mut fp = fingerprint(&mut self.scratch, &event.row);
            if !adds {
                if let Some(group) = self.groups.get(key.as_slice()) {
                    fp = live_fingerprint(&mut self.scratch, &event.row, fp, |fp| group.rows.contains_key(fp));
                }
            }
            prepared.push(Checked { adds, key, fp });
        }
        let mut pending: Vec<(&[u8], Fp, i64)> = Vec::new();
        for (index, c) in prepared.iter().enumerate() {
            let at = pending.iter().position(|(k, f, _)| *k == c.key.as_slice() && *f == c.fp);
            let have = match at {
                Some(at) => pending[at].2,
                None => self
                    .groups
                    .get(c.key.as_slice())
                    .and_then(|g| g.rows.get(&c.fp))
                    .map_or(0, |live| live.tags.len() as i64),
            };
            let now = have + if c.adds { 1 } else { -1 };
            if now < 0 {
                return Err(reject(NOT_LIVE, index, None));
            }
            match at {
                Some(at) => pending[at].2 = now,
                None => pending.push((&c.key, c.fp, now)),
            }
        }
        Ok(prepared)
    }

    /// One copy of the event's row in (an add: a row new to the group is moved out of
    /// the event, which is not read again) or out (the latest copy, by tag) of its
    /// group; the rank it took or had.
    fn step(&mut self, c: &Checked, event: &mut Ev) -> Result<usize, Fail> {
        let plan = &self.plan;
        let group = self.groups.entry_ref(c.key.as_slice()).or_insert_with(|| Group::new(&c.key));
        self.dirty.insert((KeyBytes::from(c.key.as_slice()), c.fp));
        let tag = event.tag;
        if c.adds {
            let live = match group.rows.entry(c.fp) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let row = std::mem::take(&mut event.row);
                    e.insert(Live { key: sort_key(&plan.order_columns, &row)?, row: Arc::new(row), tags: Vec::new() })
                }
            };
            let at = live.tags.partition_point(|t| *t <= tag);
            live.tags.insert(at, tag);
            let entry = Entry { key: live.key.clone(), tag, fp: c.fp };
            Ok(group.ranked.add(&plan.desc, entry)?)
        } else {
            let live = group.rows.get_mut(&c.fp).expect("a live row (checked)");
            let tag = live.tags.pop().expect("a live copy (checked)");
            let entry = Entry { key: live.key.clone(), tag, fp: c.fp };
            if live.tags.is_empty() {
                group.rows.remove(&c.fp);
            }
            Ok(group.ranked.remove(&plan.desc, &entry)?)
        }
    }

    /// `TopNReducer.apply(unit)`: its view changes, in order (by output key when it
    /// touched more than one group); the event time of its first event.
    pub(super) fn apply_unit(&mut self, events: &mut [Ev], changes: &mut Vec<Change>) -> Result<i64, Fail> {
        let ts = events[0].tag.0;
        let prepared = self.checked(events)?;
        // the groups touched, in the order first touched: (an event of it, the first rank moved)
        let mut touched: Vec<(usize, usize)> = Vec::with_capacity(2);
        for (i, (c, event)) in prepared.iter().zip(events.iter_mut()).enumerate() {
            let at = self.step(c, event)?;
            match touched.iter_mut().find(|(e, _)| prepared[*e].key == c.key) {
                Some((_, first)) => *first = (*first).min(at),
                None => touched.push((i, at)),
            }
        }
        for (g, &(e, first)) in touched.iter().enumerate() {
            if first < self.plan.n {
                self.settle(&prepared[e].key, g as u32, first, changes)?;
            }
        }
        if touched.len() > 1 {
            // stable: a key's changes keep their order
            changes.sort_by_cached_key(|change| change.order(&prepared[touched[change.group as usize].0].key));
        }
        Ok(ts)
    }

    /// After a unit: the group's places from `start` on again (`_retop`), each place
    /// whose row changed as its view changes; a group left with no rows ends.
    fn settle(&mut self, key: &[u8], g: u32, start: usize, changes: &mut Vec<Change>) -> Result<(), Fail> {
        let plan = &self.plan;
        let hashbrown::hash_map::EntryRef::Occupied(mut held) = self.groups.entry_ref(key) else {
            unreachable!("a touched group is held")
        };
        let Group { parts, ranked, rows, top, fps } = held.get_mut();
        let mut at = start;
        let mut changed = false;
        for fp in ranked.fps_from(start).take(plan.n - start) {
            if at < fps.len() && fps[at] == fp {
                at += 1;
                continue; // the same row at the same place: the same output row
            }
            let new = Out { place: at as i64 + 1, row: rows[&fp].row.clone(), cause: Some(self.cause) };
            let old = if at < top.len() {
                fps[at] = fp;
                Some(std::mem::replace(&mut top[at], new.clone()))
            } else {
                fps.push(fp);
                top.push(new.clone());
                None
            };
            if plan.diff(&mut self.scratch, &mut self.written, parts, g, old.as_ref(), Some(&new), changes) {
                changed = true;
            } else if let Some(old) = &old {
                top[at].cause = old.cause; // no record written: the place's record is still the old one
            }
            at += 1;
        }
        for old in &top[at.min(top.len())..] {
            changed |= plan.diff(&mut self.scratch, &mut self.written, parts, g, Some(old), None, changes);
        }
        if changed {
            self.dirty_causes.insert(KeyBytes::from(key));
        }
        top.truncate(at);
        fps.truncate(at);
        if rows.is_empty() {
            held.remove();
        }
        Ok(())
    }

    /// One batch's units, in order: the refused ones by their index in `units`, and the
    /// view and state records (a Top-N has no deltas).
    pub(super) fn apply_units<'py>(&mut self, py: Python<'py>, units: &mut [Vec<Ev>]) -> Result<BatchOut<'py>, Fail> {
        let mut out = BatchOut { rejected: Vec::new(), view: Vec::new(), delta: Vec::new(), state: Vec::new() };
        let mut changes: Vec<Change> = Vec::with_capacity(4);
        for (unit_index, events) in units.iter_mut().enumerate() {
            if events.is_empty() {
                return Err(Fail::Unsup(Unsup::new("an empty unit")));
            }
            changes.clear();
            self.written.clear();
            let cause = (events[0].tag.1, events[0].tag.2);
            self.cause = cause;
            match self.apply_unit(events, &mut changes) {
                Ok(ts) => {
                    let cause = if self.provenance { Some(cause) } else { None };
                    self.plan.records(py, ts, cause, &mut changes, &self.written, &mut out.view)?
                }
                Err(Fail::Reject(rejected)) => out.rejected.push((unit_index, rejected)),
                Err(other) => return Err(other),
            }
        }
        out.state = self.take_state_changes(py)?;
        Ok(out)
    }
}
