//! `GroupedReducer.restore` of refold.reduce.grouped: a view's keys back from their
//! `P.state` records (refold.reduce.statecodec), live rows and key summaries.

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use rustc_hash::FxHashSet;

use super::state::{KeyState, Row};
use super::{key_json, Core, Fail, KeyBytes, KeyPart};
use crate::statecodec::{self, DecodeError, KEY_SUMMARY, LIVE_ROW};
use crate::value::{Scalar, Unsup, Value};

impl Core {
    /// `GroupedReducer.restore`: hold the keys these records are of, replacing what
    /// was held of them.
    pub fn restore(&mut self, py: Python<'_>, records: &Bound<'_, PyAny>) -> Result<(), RestoreFail> {
        let plan = &self.plan;
        let mut restored: FxHashSet<Vec<u8>> = FxHashSet::default();
        for item in records.try_iter().map_err(Fail::Py)? {
            let item = item.map_err(Fail::Py)?;
            let not_bytes = || Fail::Unsup(Unsup::new("a state record that is not (bytes, bytes)"));
            let (record_key, value): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract().map_err(|_| not_bytes())?;
            let record_key = record_key.cast::<PyBytes>().map_err(|_| not_bytes())?.as_bytes();
            let value = value.cast::<PyBytes>().map_err(|_| not_bytes())?.as_bytes();
            let record = statecodec::decode_state(value)?;
            let Value::List(key_values) = &record.key else {
                return Err(Unsup::new("a state record's key that is not a list").into());
            };
            let parts = key_values
                .iter()
                .map(|v| match v {
                    Value::Int(n) => Ok(KeyPart::Int(*n)),
                    Value::Str(s) => Ok(KeyPart::Str(s.clone())),
                    _ => Err(Unsup::new("a state record's key value that is not a str or an int")),
                })
                .collect::<Result<Vec<_>, _>>()?;
            let kj = key_json(&parts);
            if restored.insert(kj.clone()) {
                self.keys.insert(KeyBytes::from(kj.as_slice()), KeyState::new(plan));
            }
            let state = self.keys.get_mut(kj.as_slice()).unwrap();
            let bad = || Unsup::new("a key summary the core does not read");
            if record.kind == KEY_SUMMARY {
                state.total = record.count;
                let Some(Value::Dict(values)) = &record.values else { return Err(bad().into()) };
                let field = |name: &str| values.iter().find(|(n, _)| &**n == name).map(|(_, v)| v);
                let (Some(Value::Dict(s)), Some(Value::Dict(nn))) = (field("s"), field("nn")) else {
                    return Err(bad().into());
                };
                for (column, entry) in s {
                    let slot = plan.sum_names.iter().position(|c| **c == **column).ok_or_else(bad)?;
                    let Value::List(pair) = entry else { return Err(bad().into()) };
                    let [Value::Str(total), Value::Int(0)] = pair.as_slice() else {
                        return Err(Unsup::new("a key summary with a float sum").into());
                    };
                    let digits = total.strip_prefix('-').unwrap_or(total);
                    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                        return Err(bad().into());
                    }
                    state.sums[slot] = total.parse::<i128>().map_err(|_| bad())?;
                }
                for (column, n) in nn {
                    let slot = plan.nonnull_names.iter().position(|c| **c == **column).ok_or_else(bad)?;
                    let Value::Int(n) = n else { return Err(bad().into()) };
                    state.nonnull[slot] = *n;
                }
                // the cause of the key's view record (absent in state written before causes were kept)
                state.cause = match field("c") {
                    None => None,
                    Some(Value::List(pair)) => match pair.as_slice() {
                        [Value::Int(partition), Value::Int(offset)] => Some((*partition, *offset)),
                        _ => return Err(bad().into()),
                    },
                    Some(_) => return Err(bad().into()),
                };
                continue;
            }
            if record.kind != LIVE_ROW {
                return Err(Unsup::new("a state record of another kind than a view key's").into());
            }
            let fp = statecodec::row_fingerprint(record_key)?;
            let vals = match record.values {
                None => None,
                Some(Value::List(vals)) if vals.len() == plan.kept.len() => Some(vals.into_boxed_slice()),
                Some(_) => return Err(Unsup::new("a live row's values that are not the kept columns").into()),
            };
            let count = record.count;
            if let Some(vals) = &vals {
                for (slot, &index) in plan.multiset_index.iter().enumerate() {
                    if let Some(value) = Scalar::of(&vals[index])? {
                        let counts = &mut state.multisets[slot];
                        let now = counts.get(&value).copied().unwrap_or(0) + count;
                        if now != 0 {
                            counts.insert(value, now);
                        } else {
                            counts.remove(&value);
                        }
                    }
                }
            }
            let tags = if plan.needs_tags {
                for tag in &record.tags {
                    *state.order.entry((*tag, fp)).or_insert(0) += 1;
                }
                Some(record.tags)
            } else {
                None
            };
            state.rows.insert(fp, Row { count, tags, vals });
        }
        for kj in restored {
            let state = self.keys.get_mut(kj.as_slice()).unwrap();
            if state.total == 0 {
                self.keys.remove(kj.as_slice());
            } else {
                state.view = Some(Self::view_row(plan, state)?);
            }
        }
        let _ = py;
        Ok(())
    }
}

/// Why `restore` stopped: ValueError (not a state record) or as `Fail`.
pub enum RestoreFail {
    NotState(String),
    Fail(Fail),
}

impl From<Fail> for RestoreFail {
    fn from(err: Fail) -> Self {
        RestoreFail::Fail(err)
    }
}

impl From<Unsup> for RestoreFail {
    fn from(err: Unsup) -> Self {
        RestoreFail::Fail(Fail::Unsup(err))
    }
}

impl From<DecodeError> for RestoreFail {
    fn from(err: DecodeError) -> Self {
        match err {
            DecodeError::NotState(why) => RestoreFail::NotState(why),
            DecodeError::Unsupported(why) => RestoreFail::Fail(Fail::Unsup(Unsup(why))),
        }
    }
}
