//! `TopNReducer.restore` of refold.reduce.topn: groups back from their rows' `P.state`
//! records (refold.reduce.statecodec's `LIVE_ROW`s), ranked again, their output rows
//! made again from the top.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use rustc_hash::FxHashSet;

use super::rank::{sort_key, Entry};
use super::{Group, Live, TopN};
use crate::core::{key_json, Fail, Fp, KeyBytes, KeyPart, RestoreFail};
use crate::statecodec::{self, KEY_SUMMARY, LIVE_ROW};
use crate::value::{Unsup, Value};

impl TopN {
    /// `TopNReducer.restore`: hold the groups these records are of (every row of each),
    /// replacing what was held of them; other groups stay as they are.
    pub fn restore(&mut self, records: &Bound<'_, PyAny>) -> Result<(), RestoreFail> {
        let mut restored: FxHashSet<Vec<u8>> = FxHashSet::default();
        let mut causes: rustc_hash::FxHashMap<Vec<u8>, Vec<Option<crate::core::Cause>>> = Default::default();
        for item in records.try_iter().map_err(Fail::Py)? {
            let item = item.map_err(Fail::Py)?;
            let not_bytes = || Fail::Unsup(Unsup::new("a state record that is not (bytes, bytes)"));
            let (record_key, value): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract().map_err(|_| not_bytes())?;
            let record_key = record_key.cast::<PyBytes>().map_err(|_| not_bytes())?.as_bytes();
            let value = value.cast::<PyBytes>().map_err(|_| not_bytes())?.as_bytes();
            let record = statecodec::decode_state(value)?;
            let kj = group_json(&record.key)?;
            if record.kind == KEY_SUMMARY {
                // the causes of its places (absent in state written before causes were kept)
                let known = statecodec::read_causes(&record.values, "a Top-N group's summary")?;
                if restored.insert(kj.clone()) {
                    self.groups.insert(KeyBytes::from(kj.as_slice()), Group::new(&kj));
                }
                causes.insert(kj, known);
                continue;
            }
            if record.kind != LIVE_ROW {
                return Err(Unsup::new("a state record of another kind than a Top-N's live row").into());
            }
            let Some(Value::Dict(row)) = record.values else {
                return Err(Unsup::new("a live row's values that are not a row").into());
            };
            if record.tags.is_empty() || record.tags.windows(2).any(|w| w[0] > w[1]) {
                // (Python would hold a row no removal finds, or sort its tags at the next copy)
                return Err(Unsup::new("a live row without live copies, or with its tags out of order").into());
            }
            if restored.insert(kj.clone()) {
                self.groups.insert(KeyBytes::from(kj.as_slice()), Group::new(&kj));
            }
            let group = self.groups.get_mut(kj.as_slice()).expect("restored above");
            let fp = statecodec::row_fingerprint(record_key)?;
            let key = sort_key(&self.plan.order_columns, &row)?;
            if group.rows.contains_key(&fp) {
                return Err(Unsup::new("a live row's record twice").into());
            }
            for tag in &record.tags {
                group.ranked.add(&self.plan.desc, Entry { key: key.clone(), tag: *tag, fp })?;
            }
            group.rows.insert(fp, Live { row: Arc::new(row), tags: record.tags, key });
        }
        for kj in restored {
            let group = self.groups.get_mut(kj.as_slice()).expect("restored above");
            if group.rows.is_empty() {
                // (only its causes came: the group is gone)
                self.groups.remove(kj.as_slice());
                continue;
            }
            let known = causes.remove(&kj).unwrap_or_default();
            let fps: Vec<Fp> = group.ranked.fps_from(0).take(self.plan.n).collect();
            group.top = fps
                .iter()
                .enumerate()
                .map(|(at, fp)| super::Out {
                    place: at as i64 + 1,
                    row: group.rows[fp].row.clone(),
                    cause: known.get(at).copied().flatten(),
                })
                .collect();
            group.fps = fps;
        }
        Ok(())
    }
}

/// A state record's group (`record["key"]`) as its JSON: a list of str and int values.
fn group_json(key: &Value) -> Result<Vec<u8>, Unsup> {
    let Value::List(values) = key else { return Err(Unsup::new("a state record's key that is not a list")) };
    let parts = values
        .iter()
        .map(|v| match v {
            Value::Int(n) => Ok(KeyPart::Int(*n)),
            Value::Str(s) => Ok(KeyPart::Str(s.clone())),
            _ => Err(Unsup::new("a state record's key value that is not a str or an int")),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(key_json(&parts))
}
