//! A group's ranking: `_sort_key` of refold.reduce.topn and the group's `ranked`
//! (refold.reduce.ordered's `Sorted` of (sort key, tag, fingerprint)), whose `add` and
//! `remove` answer the rank an entry took or had — the first place a unit moved.
//!
//! Python keeps a plain sorted list up to 512 entries and a `SortedList` past that;
//! here the entries are kept in sorted chunks of at most `CHUNK * 2`, so that a global
//! Top-N with millions of live rows moves a chunk's worth of entries an insert, not
//! all of them. Both answer the same ranks for distinct entries (an entry equal to one
//! held is `Unsupported`: Python's two forms would rank it differently).

use std::cmp::Ordering;
use std::sync::Arc;

use crate::core::Fp;
use crate::statecodec::Tag;
use crate::value::{row_get, Scalar, Unsup, Value};

/// A row's rank by `order_by`: one value per order column, None for a null (or absent)
/// value, which ranks last in either direction.
/// (Shared by the row and each of its copies' entries.)
pub(super) type SortKey = Arc<[Option<Scalar>]>;

/// `_sort_key(row)`.
pub(super) fn sort_key(columns: &[String], row: &[(Box<str>, Value)]) -> Result<SortKey, Unsup> {
    columns.iter().map(|c| row_get(row, c).map_or(Ok(None), Scalar::ordered)).collect()
}

/// One live copy of a row in the ranking: `(sort key, tag, fp)`.
pub(super) struct Entry {
    pub(super) key: SortKey,
    pub(super) tag: Tag,
    pub(super) fp: Fp,
}

/// The order of `(sort key, tag, fp)` tuples in Python: per order column nulls last,
/// `value_order` ascending or (`desc`) reversed; then the tag, then the fingerprint.
fn compare(desc: &[bool], a: &Entry, b: &Entry) -> Ordering {
    for ((x, y), &desc) in a.key.iter().zip(b.key.iter()).zip(desc) {
        let order = match (x, y) {
            (None, None) => Ordering::Equal,
            (None, Some(_)) => Ordering::Greater,
            (Some(_), None) => Ordering::Less,
            (Some(x), Some(y)) if desc => y.cmp(x),
            (Some(x), Some(y)) => x.cmp(y),
        };
        if order != Ordering::Equal {
            return order;
        }
    }
    (a.tag, a.fp).cmp(&(b.tag, b.fp))
}

/// Entries in a chunk before it is split in two.
const CHUNK: usize = 512;

/// A group's live copies in rank order.
#[derive(Default)]
pub(super) struct Ranked {
    chunks: Vec<Vec<Entry>>,
}

impl Ranked {
    /// The chunk an entry belongs in (the first whose last entry is not below it; the
    /// last one for an entry past them all), and the entries before that chunk.
    fn chunk_of(&self, desc: &[bool], entry: &Entry) -> (usize, usize) {
        let last = self.chunks.len().saturating_sub(1);
        let at = self
            .chunks
            .partition_point(|c| compare(desc, c.last().expect("no empty chunk"), entry) == Ordering::Less)
            .min(last);
        (at, self.chunks[..at].iter().map(Vec::len).sum())
    }

    /// `Sorted.add`: the entry's rank among the entries.
    pub(super) fn add(&mut self, desc: &[bool], entry: Entry) -> Result<usize, Unsup> {
        if self.chunks.is_empty() {
            self.chunks.push(vec![entry]);
            return Ok(0);
        }
        let (c, before) = self.chunk_of(desc, &entry);
        let chunk = &mut self.chunks[c];
        let at = chunk.partition_point(|e| compare(desc, e, &entry) == Ordering::Less);
        if at < chunk.len() && compare(desc, &chunk[at], &entry) == Ordering::Equal {
            return Err(Unsup::new("a row's copy with the tag of another live copy of it"));
        }
        chunk.insert(at, entry);
        if chunk.len() > CHUNK * 2 {
            let upper = chunk.split_off(CHUNK);
            self.chunks.insert(c + 1, upper);
        }
        Ok(before + at)
    }

    /// `Sorted.remove`: the rank the entry had. Unsupported when it is not held (the
    /// core's rows and ranking would be out of step: never expected).
    pub(super) fn remove(&mut self, desc: &[bool], entry: &Entry) -> Result<usize, Unsup> {
        let missing = || Unsup::new("a live copy missing from its group's ranking");
        if self.chunks.is_empty() {
            return Err(missing());
        }
        let (c, before) = self.chunk_of(desc, entry);
        let chunk = &mut self.chunks[c];
        let at = chunk.partition_point(|e| compare(desc, e, entry) == Ordering::Less);
        if at == chunk.len() || compare(desc, &chunk[at], entry) != Ordering::Equal {
            return Err(missing());
        }
        chunk.remove(at);
        if chunk.is_empty() {
            self.chunks.remove(c);
        }
        Ok(before + at)
    }

    /// The fingerprints from rank `start` on.
    pub(super) fn fps_from(&self, start: usize) -> impl Iterator<Item = Fp> + '_ {
        let mut skip = start;
        let mut chunks = self.chunks.iter();
        let mut first: &[Entry] = &[];
        for chunk in chunks.by_ref() {
            if skip < chunk.len() {
                first = &chunk[skip..];
                break;
            }
            skip -= chunk.len();
        }
        first.iter().chain(chunks.flatten()).map(|e| e.fp)
    }
}
