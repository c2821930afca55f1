//! The trace index's record of a batch (`refold.runtime.traceindex.build_entry`), byte
//! for byte: the view keys' blake2b-64 hashes (little-endian), sorted, each with its
//! records' positions in the batch; one pass over the batch's view records, no Python
//! object made per record.

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
    let mut keys: Vec<Bound<'py, PyBytes>> = Vec::with_capacity(view.len());
    for record in view.iter() {
        keys.push(record.cast::<PyTuple>()?.get_item(0)?.cast_into::<PyBytes>()?);
    }
    let mut groups: FxHashMap<&[u8], Vec<u32>> = FxHashMap::default();
    for (index, key) in keys.iter().enumerate() {
        groups.entry(key.as_bytes()).or_default().push(index as u32);
    }
    let mut hashed: Vec<(u64, Vec<u32>)> = groups.into_iter().map(|(key, at)| (key_hash(key), at)).collect();
    hashed.sort_unstable();
    let n = keys.len();
    let k = hashed.len();
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
    for (hash, _) in &hashed {
        out.extend_from_slice(&hash.to_le_bytes());
    }
    let mut start: u32 = 0;
    out.extend_from_slice(&start.to_le_bytes());
    for (_, at) in &hashed {
        start += at.len() as u32;
        out.extend_from_slice(&start.to_le_bytes());
    }
    for (_, at) in &hashed {
        for position in at {
            out.extend_from_slice(&position.to_le_bytes());
        }
    }
    Ok(PyBytes::new(py, &out))
}
