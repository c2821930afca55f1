//! `P.state` records as `refold.reduce.statecodec` writes and reads them: Avro binary
//! values of `schemas/avro/state.avsc` (kind, key JSON, count, values JSON or null,
//! tags) and their record keys (`[key]`, `[key,"<fingerprint hex>"]`).

use crate::json::{self, ReadError};
use crate::value::{Unsup, Value};

pub type Tag = (i64, i64, i64);

/// The record kinds (Avro enum indexes).
pub const KEY_SUMMARY: i64 = 0;
pub const LIVE_ROW: i64 = 1;

/// `_long`: Avro int/long, zig-zag then base-128 varint, low groups first.
pub fn write_long(out: &mut Vec<u8>, value: i64) {
    let mut n = ((value << 1) ^ (value >> 63)) as u64;
    while n > 0x7f {
        out.push((n & 0x7f) as u8 | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// `_string`: the length, then the bytes.
pub fn write_bytes(out: &mut Vec<u8>, data: &[u8]) {
    write_long(out, data.len() as i64);
    out.extend_from_slice(data);
}

/// Append `state_value(kind, key_json, count, values, tags)`, `values_json` the bytes
/// of `orjson.dumps(values)` (None: a null `values`).
pub fn state_value(out: &mut Vec<u8>, kind: i64, key_json: &[u8], count: i64, values_json: Option<&[u8]>, tags: &[Tag]) {
    write_long(out, kind);
    write_bytes(out, key_json);
    write_long(out, count);
    match values_json {
        None => out.push(0),
        Some(json) => {
            out.push(2);
            write_bytes(out, json);
        }
    }
    if !tags.is_empty() {
        write_long(out, tags.len() as i64);
        for &(event_time, partition, offset) in tags {
            write_long(out, event_time);
            write_long(out, partition);
            write_long(out, offset);
        }
    }
    out.push(0);
}

/// Append the `[key]` summary of a view whose records' causes it keeps (a session
/// view's key: its sessions in time order; a Top-N group: its places): the
/// `KEY_SUMMARY` value `{"c": [[partition, offset] or null, ...]}`, its count the
/// causes'. `json` is scratch.
pub fn causes_summary(out: &mut Vec<u8>, json: &mut Vec<u8>, key_json: &[u8], causes: &[Option<(i64, i64)>]) {
    json.clear();
    json.extend_from_slice(b"{\"c\":[");
    for (i, cause) in causes.iter().enumerate() {
        if i > 0 {
            json.push(b',');
        }
        match cause {
            Some((partition, offset)) => {
                json.push(b'[');
                json::write_int(json, *partition);
                json.push(b',');
                json::write_int(json, *offset);
                json.push(b']');
            }
            None => json.extend_from_slice(b"null"),
        }
    }
    json.extend_from_slice(b"]}");
    state_value(out, KEY_SUMMARY, key_json, causes.len() as i64, Some(json), &[]);
}

/// The causes a `[key]` summary (`causes_summary`) holds, from its decoded values;
/// Unsupported, naming `what` ("a Top-N group's summary"), when they are not its form.
pub fn read_causes(values: &Option<Value>, what: &str) -> Result<Vec<Option<(i64, i64)>>, Unsup> {
    let bad = || Unsup::new(format!("{what} the core does not read"));
    let Some(Value::Dict(values)) = values else { return Err(bad()) };
    let Some((_, Value::List(list))) = values.iter().find(|(n, _)| &**n == "c") else { return Err(bad()) };
    let mut known = Vec::with_capacity(list.len());
    for item in list {
        known.push(match item {
            Value::Null => None,
            Value::List(pair) => match pair.as_slice() {
                [Value::Int(partition), Value::Int(offset)] => Some((*partition, *offset)),
                _ => return Err(bad()),
            },
            _ => return Err(bad()),
        });
    }
    Ok(known)
}

/// Append `summary_key(key_json)`: `[key]`.
pub fn summary_key(out: &mut Vec<u8>, key_json: &[u8]) {
    out.push(b'[');
    out.extend_from_slice(key_json);
    out.push(b']');
}

/// Append `row_key(key_json, fp)`: `[key,"<fp hex>"]`.
pub fn row_key(out: &mut Vec<u8>, key_json: &[u8], fp: &[u8; 16]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'[');
    out.extend_from_slice(key_json);
    out.extend_from_slice(b",\"");
    for b in fp {
        out.push(HEX[(b >> 4) as usize]);
        out.push(HEX[(b & 0xf) as usize]);
    }
    out.extend_from_slice(b"\"]");
}

/// Why a record did not decode: not a state record (ValueError, as `decode_state`
/// raises), or one the core does not handle (Unsupported).
pub enum DecodeError {
    NotState(String),
    Unsupported(String),
}

impl From<ReadError> for DecodeError {
    fn from(err: ReadError) -> Self {
        match err {
            ReadError::Invalid(why) => DecodeError::NotState(why),
            ReadError::Unsupported(why) => DecodeError::Unsupported(why),
        }
    }
}

impl From<Unsup> for DecodeError {
    fn from(err: Unsup) -> Self {
        DecodeError::Unsupported(err.0)
    }
}

/// `decode_state(data)`, its JSON fields parsed.
pub struct StateRecord {
    pub kind: i64,
    pub key: Value,
    pub count: i64,
    pub values: Option<Value>,
    pub tags: Vec<Tag>,
}

/// `_read_long`: the Avro long at `pos` and the position after it.
fn read_long(data: &[u8], pos: &mut usize) -> Result<i64, DecodeError> {
    let mut n: u64 = 0;
    let mut shift = 0u32;
    loop {
        let Some(&byte) = data.get(*pos) else {
            return Err(DecodeError::NotState("truncated".into()));
        };
        *pos += 1;
        if shift >= 64 || (shift == 63 && (byte & 0x7f) > 1) {
            return Err(DecodeError::Unsupported("a state record's number past 64 bits".into()));
        }
        n |= ((byte & 0x7f) as u64) << shift;
        shift += 7;
        if byte & 0x80 == 0 {
            break;
        }
    }
    Ok(((n >> 1) as i64) ^ -((n & 1) as i64))
}

fn read_slice<'a>(data: &'a [u8], pos: &mut usize) -> Result<&'a [u8], DecodeError> {
    let size = read_long(data, pos)?;
    if size < 0 || *pos + size as usize > data.len() {
        return Err(DecodeError::NotState("a length past the end".into()));
    }
    let slice = &data[*pos..*pos + size as usize];
    *pos += size as usize;
    Ok(slice)
}

/// `decode_state(data)`.
pub fn decode_state(data: &[u8]) -> Result<StateRecord, DecodeError> {
    let mut pos = 0usize;
    let kind = read_long(data, &mut pos)?;
    let key = json::parse(read_slice(data, &mut pos)?)?;
    let count = read_long(data, &mut pos)?;
    let branch = read_long(data, &mut pos)?;
    let values = if branch != 0 { Some(json::parse(read_slice(data, &mut pos)?)?) } else { None };
    let mut tags = Vec::new();
    let mut block = read_long(data, &mut pos)?;
    while block != 0 {
        if block < 0 {
            block = -block;
            read_long(data, &mut pos)?;
        }
        for _ in 0..block {
            let event_time = read_long(data, &mut pos)?;
            let partition = read_long(data, &mut pos)?;
            let offset = read_long(data, &mut pos)?;
            tags.push((event_time, partition, offset));
        }
        block = read_long(data, &mut pos)?;
    }
    if pos != data.len() || !(0..=2).contains(&kind) || !(0..=1).contains(&branch) {
        return Err(DecodeError::NotState("not a state record".into()));
    }
    Ok(StateRecord { kind, key, count, values, tags })
}

/// `row_fingerprint(record_key)`: the fingerprint a live row's record key names.
pub fn row_fingerprint(record_key: &[u8]) -> Result<[u8; 16], DecodeError> {
    let bad = || DecodeError::Unsupported("a live row's record key that is not [key, fingerprint]".into());
    let parsed = json::parse(record_key).map_err(|_| bad())?;
    let Value::List(items) = parsed else { return Err(bad()) };
    let Some(Value::Str(hex)) = items.get(1) else { return Err(bad()) };
    let hex = hex.as_bytes();
    if hex.len() != 32 {
        return Err(bad());
    }
    let mut fp = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let text = std::str::from_utf8(pair).map_err(|_| bad())?;
        if !pair.iter().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        fp[i] = u8::from_str_radix(text, 16).map_err(|_| bad())?;
    }
    Ok(fp)
}
