//! The trace index's record of a batch (`refold.runtime.traceindex.build_entry`), byte
//! for byte: the view keys' blake2b-64 hashes (little-endian), sorted, each with its
//! records' positions in the batch; one pass over the batch's view records, no Python
//! object made per record. Each record's key is hashed once per distinct bytes object
//! (the renderer gives a key's records one), then the (hash, position) pairs are sorted:
//! no map of keys to lists, which cost an allocation per key where most records have
//! a key of their own (a windowed view's).

use blake2::digest::consts::U8;
use blake2::{Blake2b, Digest};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use rustc_hash::FxHashMap;

fn key_hash(key: &[u8]) -> u64 {
    let mut hasher = Blake2b::<U8>::new();
    hasher.update(key);
    u64::from_le_bytes(hasher.finalize().into())
}

/// `build_entry(view, partition, first, batch, sources)`: `view` a list of tuples whose
/// first item is the record's message key (bytes).
#[pyfunction]
pub(crate) fn trace_entry<'py>(
    py: Python<'py>,
    view: &Bound<'py, PyList>,
    partition: i32,
    first: i64,
    batch: i64,
    sources: Vec<(i32, i64, i64)>,
) -> PyResult<Bound<'py, PyBytes>> {
    let n = view.len();
    // (hash, position): sorted, the hashes in order and each one's positions ascending
    let mut pairs: Vec<(u64, u32)> = Vec::with_capacity(n);
    let mut seen: FxHashMap<usize, u64> = FxHashMap::default();
    for (index, record) in view.iter().enumerate() {
        let key = record.cast::<PyTuple>()?.get_item(0)?.cast_into::<PyBytes>()?;
        let hash = *seen.entry(key.as_ptr() as usize).or_insert_with(|| key_hash(key.as_bytes()));
        pairs.push((hash, index as u32));
    }
    pairs.sort_unstable();
    let k = pairs.iter().enumerate().filter(|(i, (h, _))| *i == 0 || pairs[i - 1].0 != *h).count();
    let mut out: Vec<u8> = Vec::with_capacity(40 + 24 * sources.len() + 12 * k + 4 * (n + 1));
    out.push(1);
    out.extend_from_slice(&[0, 0, 0]);
    out.extend_from_slice(&partition.to_le_bytes());
    out.extend_from_slice(&first.to_le_bytes());
    out.extend_from_slice(&(n as u32).to_le_bytes());
    out.extend_from_slice(&(k as u32).to_le_bytes());
    out.extend_from_slice(&(sources.len() as u32).to_le_bytes());
    out.extend_from_slice(&batch.to_le_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    for (p, lo, hi) in &sources {
        out.extend_from_slice(&p.to_le_bytes());
        out.extend_from_slice(&[0, 0, 0, 0]);
        out.extend_from_slice(&lo.to_le_bytes());
        out.extend_from_slice(&hi.to_le_bytes());
    }
    let mut starts: Vec<u8> = Vec::with_capacity(4 * (k + 1));
    starts.extend_from_slice(&0u32.to_le_bytes());
    for (i, (hash, _)) in pairs.iter().enumerate() {
        if i + 1 == n || pairs[i + 1].0 != *hash {
            out.extend_from_slice(&hash.to_le_bytes());
            starts.extend_from_slice(&((i + 1) as u32).to_le_bytes());
        }
    }
    out.extend_from_slice(&starts);
    for (_, position) in &pairs {
        out.extend_from_slice(&position.to_le_bytes());
    }
    Ok(PyBytes::new(py, &out))
}
