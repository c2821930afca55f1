//! The equi-join of two changelogs (refold.reduce.join, `JoinReducer`), byte for byte:
//! per join key each side's live rows as a multiset (fingerprint of the whole row →
//! copies, the columns the output takes), the same joined records in the same order,
//! the same `P.state` records (`["j",key,"l"|"r",fp]`, `LIVE_ROW` values
//! `{"s":"l"|"r","r":row}`) and the same refusals.
//!
//! Each side's live rows of a join key keep their insertion order (as Python's dict
//! does): a joined row's first copy in a unit decides how a nested object in it is
//! written, and that copy comes of the first matching live row.
//!
//! `py.rs` is the Python class, `JoinCore`.

pub mod py;

use crate::core::{fingerprint, reject, Fail, Fp, Map, Rejected, KEY_TOO_LARGE, NOT_LIVE, SCHEMA_MISMATCH};
use crate::statecodec::{decode_state, state_value, DecodeError, LIVE_ROW};
use crate::json::write_str;
use crate::value::{row_get, write_dict, Row, Value};

/// `MAX_KEY_CHARS` of refold.reduce.values.
const MAX_KEY_CHARS: usize = 64 * 1024;
const SIDE_NAMES: [&str; 2] = ["l", "r"];

/// `JoinSpec` as the reducer reads it.
pub struct JoinPlan {
    /// the join columns of each side, pair by pair
    pub on: [Vec<Box<str>>; 2],
    /// (output column, side, the side's column), in output order
    pub outputs: Vec<(Box<str>, usize, Box<str>)>,
    /// the output key's columns, as indexes into `outputs`
    pub key: Vec<usize>,
    /// whether each side is outer (left: the left side; full: both)
    pub outer: [bool; 2],
    /// the columns of each side a live row keeps, first use first
    kept: [Vec<Box<str>>; 2],
    /// the output columns by name (as `canonical_row` sorts them): (index, `"name":`)
    canonical: Vec<(usize, Vec<u8>)>,
}

impl JoinPlan {
    pub fn new(on: [Vec<String>; 2], outputs: Vec<(String, usize, String)>, key: Vec<String>, kind: &str) -> Result<Self, String> {
        let outer = match kind {
            "inner" => [false, false],
            "left" => [true, false],
            "full" => [true, true],
            other => return Err(format!("a join's type is inner, left or full, not {other:?}")),
        };
        if on[0].is_empty() || on[0].len() != on[1].len() {
            return Err("a join needs as many join columns on each side, at least one".into());
        }
        if outputs.iter().any(|(_, side, _)| *side > 1) {
            return Err("an output column's side is 0 (left) or 1 (right)".into());
        }
        let mut kept: [Vec<Box<str>>; 2] = [Vec::new(), Vec::new()];
        for (_, side, column) in &outputs {
            if !kept[*side].iter().any(|c| **c == **column) {
                kept[*side].push(column.as_str().into());
            }
        }
        let key = key
            .iter()
            .map(|name| outputs.iter().position(|(n, _, _)| n == name).ok_or_else(|| format!("key column {name:?} is not an output column")))
            .collect::<Result<Vec<_>, _>>()?;
        let mut canonical: Vec<(usize, Vec<u8>)> = outputs
            .iter()
            .enumerate()
            .map(|(at, (name, _, _))| {
                let mut json = Vec::new();
                write_str(&mut json, name);
                json.push(b':');
                (at, json)
            })
            .collect();
        canonical.sort_by(|a, b| outputs[a.0].0.as_bytes().cmp(outputs[b.0].0.as_bytes()));
        let [left, right] = on;
        Ok(JoinPlan {
            on: [boxed(left), boxed(right)],
            outputs: outputs.into_iter().map(|(n, s, c)| (n.into(), s, c.into())).collect(),
            key,
            outer,
            kept,
            canonical,
        })
    }
}

fn boxed(names: Vec<String>) -> Vec<Box<str>> {
    names.into_iter().map(Into::into).collect()
}

/// The live copies of one distinct row of a side under one join key.
struct Live {
    fp: Fp,
    count: i64,
    row: Row,
}

/// One side's live rows under one join key, in insertion order, and their copies.
#[derive(Default)]
struct Rows {
    rows: Vec<Live>,
    total: i64,
}

impl Rows {
    fn get(&self, fp: &Fp) -> Option<&Live> {
        self.rows.iter().find(|live| live.fp == *fp)
    }
}

/// One event of a unit: its op (0 `+A`, 1 `-R`, 2 `-C`, 3 `+C`) and its row.
pub struct Event {
    pub op: u8,
    pub row: Row,
}

impl Event {
    fn adds(&self) -> bool {
        self.op == 0 || self.op == 3
    }
}

/// A joined record: `+A` 0, `-R` 1, `-C` 2, `+C` 3, and the joined row in output order.
pub type Record = (u8, Joined);

/// A joined row's values, in output order (`JoinPlan.outputs` names them).
pub type Joined = Vec<Value>;

/// Where an event's row is held: its join key's `key_bytes`, whether a part of it is
/// null (it matches nothing), the row's fingerprint.
struct Keyed<'a> {
    kb: &'a [u8],
    null: bool,
    fp: Fp,
}

/// A joined row's copies, each as (identity, row).
type Copies = Vec<(Vec<u8>, Joined)>;

/// A unit's net change being counted: the joined rows by identity, first seen first.
#[derive(Default)]
struct Net {
    at: Map<Vec<u8>, usize>,
    rows: Vec<(Vec<u8>, Joined, i64)>,
}

pub struct Join {
    pub plan: JoinPlan,
    sides: [Map<Vec<u8>, Rows>; 2],
    dirty: Map<(u8, Vec<u8>, Fp), ()>,
    scratch: Vec<u8>,
}

impl Join {
    pub fn new(plan: JoinPlan) -> Self {
        Join { plan, sides: [Map::default(), Map::default()], dirty: Map::default(), scratch: Vec::new() }
    }

    /// `join_key(side, row, index)` as its `key_bytes`, and whether a part is null;
    /// Rejected as `key_problem` refuses.
    pub fn join_key(&self, side: usize, row: &[(Box<str>, Value)], index: usize) -> Result<(Vec<u8>, bool), Fail> {
        let mut chars = 0usize;
        let mut null = false;
        let mut out = Vec::with_capacity(24);
        out.push(b'[');
        for (i, column) in self.plan.on[side].iter().enumerate() {
            let part = row_get(row, column).unwrap_or(&Value::Null);
            match part {
                Value::Null => null = true,
                Value::Str(s) => chars += s.chars().count(),
                Value::List(_) | Value::Tuple(_) | Value::Dict(_) => {
                    return Err(reject(SCHEMA_MISMATCH, index, Some("a key column holds a list or an object".into())));
                }
                _ => {}
            }
            if i > 0 {
                out.push(b',');
            }
            part.write(&mut out, false);
        }
        out.push(b']');
        if chars > MAX_KEY_CHARS {
            return Err(reject(KEY_TOO_LARGE, index, Some(format!("{chars} characters, at most {MAX_KEY_CHARS}"))));
        }
        Ok((out, null))
    }

    /// `apply(side, unit)`: the unit's joined records in order; Rejected (nothing
    /// changed) when it retracts a row the side does not hold. `next(i)` reads the
    /// unit's event `i` (None past its end), so an event after a refused one is never read.
    pub fn apply(&mut self, side: usize, mut next: impl FnMut(usize) -> Result<Option<Event>, Fail>) -> Result<Vec<Record>, Fail> {
        let mut prepared: Vec<(Event, Vec<u8>, bool, Fp)> = Vec::with_capacity(2);
        let mut pending: Vec<(usize, i64)> = Vec::new(); // (index into prepared, copies after it)
        let mut index = 0;
        while let Some(event) = next(index)? {
            let (kb, null) = self.join_key(side, &event.row, index)?;
            let fp = fingerprint(&mut self.scratch, &event.row);
            let have = match pending.iter().rev().find(|(at, _)| prepared[*at].1 == kb && prepared[*at].3 == fp) {
                Some((_, copies)) => *copies,
                None => self.sides[side].get(&kb).and_then(|rows| rows.get(&fp)).map_or(0, |live| live.count),
            };
            let step = if event.adds() { 1 } else { -1 };
            if have + step < 0 {
                return Err(Fail::Reject(Rejected { reason: NOT_LIVE, index, detail: None }));
            }
            pending.push((prepared.len(), have + step));
            prepared.push((event, kb, null, fp));
            index += 1;
        }
        let paired = prepared.len() == 2 && prepared[0].0.op == 2;
        let mut net = Net::default();
        for (event, kb, null, fp) in prepared {
            self.event(side, Keyed { kb: &kb, null, fp }, event, &mut net);
        }
        Ok(self.changes(net, paired))
    }

    fn event(&mut self, side: usize, at: Keyed<'_>, event: Event, net: &mut Net) {
        let Keyed { kb, null, fp } = at;
        let sign = if event.adds() { 1 } else { -1 };
        let row = event.row;
        let other = 1 - side;
        let total = self.sides[side].get(kb).map_or(0, |rows| rows.total);
        let matches = if null { None } else { self.sides[other].get(kb).filter(|rows| !rows.rows.is_empty()) };
        if let Some(matches) = matches {
            for live in &matches.rows {
                emit(&self.plan, &mut self.scratch, side, Some(&row), Some(&live.row), sign * live.count, net);
            }
            // the other side's rows lose their null-padded row on this side's first
            // copy, and get it back when its last goes
            if self.plan.outer[other] && total + sign.min(0) == 0 {
                for live in &matches.rows {
                    emit(&self.plan, &mut self.scratch, other, Some(&live.row), None, -sign * live.count, net);
                }
            }
        } else if self.plan.outer[side] {
            emit(&self.plan, &mut self.scratch, side, Some(&row), None, sign, net);
        }
        self.store(side, kb, fp, row, sign);
    }

    fn store(&mut self, side: usize, kb: &[u8], fp: Fp, row: Row, sign: i64) {
        let kept = &self.plan.kept[side];
        let rows = match self.sides[side].entry_ref(kb) {
            hashbrown::hash_map::EntryRef::Occupied(e) => e.into_mut(),
            hashbrown::hash_map::EntryRef::Vacant(e) => e.insert(Rows::default()),
        };
        let at = match rows.rows.iter().position(|live| live.fp == fp) {
            Some(at) => at,
            None => {
                let mut row = row;
                let taken: Row = kept
                    .iter()
                    .filter_map(|c| row.iter().position(|(n, _)| n == c).map(|i| (c.clone(), std::mem::replace(&mut row[i].1, Value::Null))))
                    .collect();
                rows.rows.push(Live { fp, count: 0, row: taken });
                rows.rows.len() - 1
            }
        };
        rows.rows[at].count += sign;
        rows.total += sign;
        if rows.rows[at].count == 0 {
            rows.rows.remove(at);
        }
        if rows.rows.is_empty() {
            self.sides[side].remove(kb);
        }
        self.dirty.insert((side as u8, kb.to_vec(), fp), ());
    }

    /// The unit's records from its net change (docs/SEMANTICS.md, Joins: their order).
    fn changes(&self, net: Net, paired: bool) -> Vec<Record> {
        if net.rows.len() == 1 {
            let (_, row, copies) = net.rows.into_iter().next().unwrap_or_default();
            let op = if copies > 0 { 0 } else { 1 };
            return (0..copies.unsigned_abs()).map(|_| (op, row.clone())).collect();
        }
        // output key JSON -> (rows gone, rows come), each (identity, row) per copy
        let mut keys: Vec<(Vec<u8>, Copies, Copies)> = Vec::new();
        let mut at: Map<Vec<u8>, usize> = Map::default();
        for (identity, row, copies) in net.rows {
            if copies == 0 {
                continue;
            }
            let mut order = Vec::with_capacity(24);
            order.push(b'[');
            for (i, &k) in self.plan.key.iter().enumerate() {
                if i > 0 {
                    order.push(b',');
                }
                row[k].write(&mut order, false);
            }
            order.push(b']');
            let slot = match at.entry(order) {
                hashbrown::hash_map::Entry::Occupied(e) => *e.get(),
                hashbrown::hash_map::Entry::Vacant(e) => {
                    keys.push((e.key().clone(), Vec::new(), Vec::new()));
                    *e.insert(keys.len() - 1)
                }
            };
            let into = if copies > 0 { &mut keys[slot].2 } else { &mut keys[slot].1 };
            for _ in 0..copies.unsigned_abs() {
                into.push((identity.clone(), row.clone()));
            }
        }
        keys.sort_by(|a, b| a.0.cmp(&b.0));
        let mut out = Vec::new();
        for (_, mut olds, mut news) in keys {
            olds.sort_by(|a, b| a.0.cmp(&b.0));
            news.sort_by(|a, b| a.0.cmp(&b.0));
            let pairs = if paired { olds.len().min(news.len()) } else { 0 };
            let mut olds = olds.into_iter();
            let mut news = news.into_iter();
            for _ in 0..pairs {
                out.push((2, olds.next().map(|o| o.1).unwrap_or_default()));
                out.push((3, news.next().map(|n| n.1).unwrap_or_default()));
            }
            out.extend(olds.map(|(_, row)| (1, row)));
            out.extend(news.map(|(_, row)| (0, row)));
        }
        out
    }

    /// `take_state_changes()`: (record key, value or None), by record key.
    pub fn take_state_changes(&mut self) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        let mut records = Vec::with_capacity(self.dirty.len());
        for ((side, kb, fp), ()) in self.dirty.drain() {
            let mut record_key = Vec::with_capacity(kb.len() + 48);
            record_key.extend_from_slice(b"[\"j\",");
            record_key.extend_from_slice(&kb);
            record_key.extend_from_slice(if side == 0 { b",\"l\",\"" } else { b",\"r\",\"" });
            push_hex(&mut record_key, &fp);
            record_key.extend_from_slice(b"\"]");
            let live = self.sides[side as usize].get(&kb).and_then(|rows| rows.get(&fp));
            let value = live.map(|live| {
                let mut values = Vec::with_capacity(64);
                values.extend_from_slice(if side == 0 { b"{\"s\":\"l\",\"r\":" } else { b"{\"s\":\"r\",\"r\":" });
                write_dict(&mut values, &live.row);
                values.push(b'}');
                let mut out = Vec::with_capacity(values.len() + kb.len() + 8);
                state_value(&mut out, LIVE_ROW, &kb, live.count, Some(&values), &[]);
                out
            });
            records.push((record_key, value));
        }
        records.sort_by(|a, b| a.0.cmp(&b.0));
        records
    }

    /// `restore(records)`: hold the join keys these records are of (every record of
    /// each), replacing what was held of them.
    pub fn restore(&mut self, records: impl IntoIterator<Item = (Vec<u8>, Vec<u8>)>) -> Result<(), DecodeError> {
        let mut restored: Map<Vec<u8>, ()> = Map::default();
        for (record_key, value) in records {
            let record = decode_state(&value)?;
            let Value::List(parts) = record.key else {
                return Err(DecodeError::NotState("a join record's key is not a list".into()));
            };
            let mut kb = Vec::new();
            Value::List(parts).write(&mut kb, false);
            let (side, row) = side_row(record.values)?;
            if restored.insert(kb.clone(), ()).is_none() {
                self.sides[0].remove(&kb);
                self.sides[1].remove(&kb);
            }
            let fp = record_fp(&record_key)?;
            let rows = self.sides[side].entry(kb).or_default();
            // as Python's dict: a second record of a row replaces it in place
            match rows.rows.iter_mut().find(|live| live.fp == fp) {
                Some(live) => {
                    live.count = record.count;
                    live.row = row;
                }
                None => rows.rows.push(Live { fp, count: record.count, row }),
            }
            rows.total += record.count;
        }
        Ok(())
    }

    /// `held()`: the join keys held in memory.
    pub fn held(&self) -> usize {
        self.sides[0].len() + self.sides[1].keys().filter(|kb| !self.sides[0].contains_key(*kb)).count()
    }
}

/// Count `copies` of the joined row of `row` (of `side`) with `other` (None: nulls).
fn emit(plan: &JoinPlan, scratch: &mut Vec<u8>, side: usize, row: Option<&Row>, other: Option<&Row>, copies: i64, net: &mut Net) {
    let pair = if side == 0 { [row, other] } else { [other, row] };
    let out: Joined = plan
        .outputs
        .iter()
        .map(|(_, s, column)| pair[*s].and_then(|r| row_get(r, column)).cloned().unwrap_or(Value::Null))
        .collect();
    // `canonical_row(out)`: the names sorted, null columns left out
    scratch.clear();
    scratch.push(b'{');
    let mut first = true;
    for &(at, ref name) in &plan.canonical {
        if matches!(out[at], Value::Null) {
            continue;
        }
        if !first {
            scratch.push(b',');
        }
        first = false;
        scratch.extend_from_slice(name);
        out[at].write(scratch, true);
    }
    scratch.push(b'}');
    match net.at.get(scratch.as_slice()) {
        Some(&at) => net.rows[at].2 += copies,
        None => {
            net.at.insert(scratch.clone(), net.rows.len());
            net.rows.push((scratch.clone(), out, copies));
        }
    }
}

fn push_hex(out: &mut Vec<u8>, fp: &Fp) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for b in fp {
        out.push(HEX[(b >> 4) as usize]);
        out.push(HEX[(b & 0xf) as usize]);
    }
}

/// A `LIVE_ROW` record's `{"s": "l"|"r", "r": row}`.
fn side_row(values: Option<Value>) -> Result<(usize, Row), DecodeError> {
    let bad = || DecodeError::NotState("a join record's values are not {\"s\": side, \"r\": row}".into());
    let Some(Value::Dict(entries)) = values else { return Err(bad()) };
    let side = match row_get(&entries, "s") {
        Some(Value::Str(s)) => SIDE_NAMES.iter().position(|n| **n == **s).ok_or_else(bad)?,
        _ => return Err(bad()),
    };
    match entries.into_iter().find(|(n, _)| &**n == "r") {
        Some((_, Value::Dict(row))) => Ok((side, row)),
        _ => Err(bad()),
    }
}

/// The fingerprint a join record's key `["j",key,side,"<hex>"]` names.
fn record_fp(record_key: &[u8]) -> Result<Fp, DecodeError> {
    let bad = || DecodeError::NotState("a join record's key is not [\"j\", key, side, fingerprint]".into());
    let parsed = crate::json::parse(record_key).map_err(|_| bad())?;
    let Value::List(items) = parsed else { return Err(bad()) };
    let Some(Value::Str(hex)) = items.get(3) else { return Err(bad()) };
    let hex = hex.as_bytes();
    if hex.len() != 32 || !hex.iter().all(u8::is_ascii_hexdigit) {
        return Err(bad());
    }
    let mut fp = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let text = std::str::from_utf8(pair).map_err(|_| bad())?;
        fp[i] = u8::from_str_radix(text, 16).map_err(|_| bad())?;
    }
    Ok(fp)
}
