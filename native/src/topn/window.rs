//! What a windowed Top-N (crate::window, `WindowedReducer` with `top_n`) needs of the
//! groups it wraps: one unit at a time, each window's group closed by its key JSON,
//! and a closed group's places as `emit: final` writes them (`_close`).

use pyo3::prelude::*;

use super::render::Change;
use super::{Group, TopN};
use crate::core::{Cause, Ev, Fail, KeyBytes};

/// A closed window's group, kept until its `+A`s are written.
pub struct Closed {
    kj: Vec<u8>,
    group: Group,
}

impl TopN {
    /// Whether a group (its JSON) is held.
    pub(crate) fn holds(&self, kj: &[u8]) -> bool {
        self.groups.contains_key(kj)
    }

    /// The JSON of every group held.
    pub(crate) fn group_jsons(&self) -> impl Iterator<Item = &[u8]> {
        self.groups.keys().map(KeyBytes::as_slice)
    }

    /// One unit (`TopNReducer.apply`): refused as a whole, or applied with its view
    /// records into `view` (`emit`: with `emit: final` the unit writes none, its places'
    /// causes kept all the same); the event time of its first event.
    pub(crate) fn apply_one<'py>(&mut self, py: Python<'py>, events: &mut [Ev], cause: Cause, emit: bool,
                                 view: &mut Vec<Bound<'py, PyAny>>) -> Result<i64, Fail> {
        let mut changes: Vec<Change> = Vec::new();
        self.written.clear();
        self.cause = cause;
        let ts = self.apply_unit(events, &mut changes)?;
        if emit {
            let cause = if self.provenance { Some(cause) } else { None };
            self.plan.records(py, ts, cause, &mut changes, &self.written, view)?;
        }
        Ok(ts)
    }

    /// `_close` of a window's group: forgotten, its rows' and its `[group]` records
    /// tombstoned at the batch's end; the group, for its `+A`s, or None when it was not
    /// held.
    pub(crate) fn close_group(&mut self, kj: &[u8]) -> Option<Closed> {
        let group = self.groups.remove(kj)?;
        for fp in group.rows.keys() {
            self.dirty.insert((KeyBytes::from(kj), *fp));
        }
        self.dirty_causes.insert(KeyBytes::from(kj));
        Some(Closed { kj: kj.to_vec(), group })
    }

    /// `emit: final`: the closed groups' places as `+A`s (`ViewChange(APPEND, (*group,
    /// place), row)`), ordered by their output keys' JSON, named by the unit's cause.
    pub(crate) fn final_records<'py>(&mut self, py: Python<'py>, closed: &[Closed], ts: i64, cause: Cause,
                                     view: &mut Vec<Bound<'py, PyAny>>) -> PyResult<()> {
        let mut changes: Vec<Change> = Vec::new();
        self.written.clear();
        for (g, Closed { group, .. }) in closed.iter().enumerate() {
            for out in &group.top {
                self.plan.diff(&mut self.scratch, &mut self.written, &group.parts, g as u32, None, Some(out), &mut changes);
            }
        }
        if closed.len() > 1 {
            changes.sort_by_cached_key(|change| change.order(&closed[change.group as usize].kj)); // stable
        }
        let cause = if self.provenance { Some(cause) } else { None };
        self.plan.records(py, ts, cause, &mut changes, &self.written, view)
    }

    /// `take_state_changes`.
    pub(crate) fn state_records<'py>(&mut self, py: Python<'py>) -> Result<Vec<Bound<'py, PyAny>>, Fail> {
        self.take_state_changes(py)
    }
}
