//! The plan: `_Plan` of refold.reduce.grouped, compiled once from the view's columns —
//! which running values a key keeps (sums, non-null counts, multisets, kept columns),
//! how each view column reads them, and the layout of every output object
//! (`refold.runtime.render.Renderer`: message keys, view rows, delta rows).

use pyo3::prelude::*;
use pyo3::types::PyString;

use super::apply::KeyColumns;
use crate::json::write_str;

/// How one view column reads a key's running values (`_Plan._reader`,
/// `_running_reader`) and a batch's contributions (`_Plan._delta_reader`).
#[derive(Clone, Copy, Debug)]
pub(super) enum Agg {
    Sum { sum: usize },
    CountRows,
    Count { nn: usize },
    Avg { sum: usize, nn: usize },
    Min { ms: usize },
    Max { ms: usize },
    Set { ms: usize },
    /// first (`last` false) or last / last_write_wins
    ByTag { last: bool, kept: usize, slot: usize },
}

/// Where an output object's entry takes its value from.
#[derive(Clone, Copy, Debug)]
pub(super) enum Src {
    Op,
    Key(usize),
    Count,
    Col(usize),
}

/// An output object's entries in their order: `"name":` and the source of its value.
/// Built as Python builds the dict (a name set again keeps its first place).
pub(super) type Layout = Vec<(Vec<u8>, Src)>;

fn layout(entries: Vec<(String, Src)>) -> (Layout, Vec<String>) {
    let mut names: Vec<String> = Vec::new();
    let mut srcs: Vec<Src> = Vec::new();
    for (name, src) in entries {
        match names.iter().position(|n| *n == name) {
            Some(at) => srcs[at] = src,
            None => {
                names.push(name);
                srcs.push(src);
            }
        }
    }
    let out = names
        .iter()
        .zip(srcs)
        .map(|(name, src)| {
            let mut prefix = Vec::new();
            write_str(&mut prefix, name);
            prefix.push(b':');
            (prefix, src)
        })
        .collect();
    (out, names)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Form {
    Changelog,
    Retract,
    Upsert,
}

impl Form {
    /// `outputs.view.form` (None: no view output); ValueError for another name.
    pub fn parse(view_form: Option<&str>) -> PyResult<Option<Form>> {
        Ok(match view_form {
            None => None,
            Some("changelog") => Some(Form::Changelog),
            Some("retract") => Some(Form::Retract),
            Some("upsert") => Some(Form::Upsert),
            Some(other) => return Err(pyo3::exceptions::PyValueError::new_err(format!("unknown view form {other:?}"))),
        })
    }
}

pub struct Plan {
    pub(crate) keys: KeyColumns,
    pub(super) aggs: Vec<Agg>,
    pub(super) sum_names: Vec<String>,
    pub(super) sum_detail: Vec<String>,
    pub(super) nonnull_names: Vec<String>,
    pub(super) multiset_names: Vec<String>,
    pub(super) kept: Vec<String>,
    pub(super) multiset_index: Vec<usize>,
    pub(super) tag_index: Vec<usize>,
    pub(super) needs_tags: bool,
    pub(super) form: Option<Form>,
    pub(super) delta: bool,
    pub(super) message_key: Layout,
    pub(super) view_row: Layout,
    pub(super) view_row_names: Vec<String>,
    pub(super) view_op_row: Layout,
    pub(super) delta_row: Layout,
    pub(super) delta_key: Layout,
}

impl Plan {
    pub fn new(
        py: Python<'_>,
        key_columns: Vec<String>,
        columns: Vec<(String, String, String)>,
        view_form: Option<String>,
        delta: bool,
    ) -> PyResult<Plan> {
        use pyo3::exceptions::PyValueError;
        let repr = |name: &str| -> PyResult<String> { Ok(PyString::new(py, name).repr()?.to_str()?.to_owned()) };
        let form = Form::parse(view_form.as_deref())?;
        let mut sums: Vec<String> = Vec::new();
        let mut nonnull: Vec<String> = Vec::new();
        let mut multisets: Vec<String> = Vec::new();
        let mut tagged: Vec<String> = Vec::new();
        let mut names: Vec<&str> = Vec::new();
        for (name, agg, column) in &columns {
            if names.contains(&name.as_str()) {
                return Err(PyValueError::new_err(format!("column {name:?} is named twice")));
            }
            names.push(name);
            if column == "*" && agg != "count" {
                return Err(PyValueError::new_err(format!("column {name:?}: only count may use '*'")));
            }
            let push = |list: &mut Vec<String>| {
                if !list.contains(column) {
                    list.push(column.clone());
                }
            };
            match agg.as_str() {
                "sum" => push(&mut sums),
                "avg" => {
                    push(&mut sums);
                    push(&mut nonnull);
                }
                "count" => {
                    if column != "*" {
                        push(&mut nonnull)
                    }
                }
                "min" | "max" | "set" => push(&mut multisets),
                "first" | "last" | "last_write_wins" => push(&mut tagged),
                other => return Err(PyValueError::new_err(format!("unknown aggregation {other:?}"))),
            }
        }
        let mut kept: Vec<String> = Vec::new();
        for column in multisets.iter().chain(&tagged) {
            if !kept.contains(column) {
                kept.push(column.clone());
            }
        }
        let at = |list: &[String], column: &str| list.iter().position(|c| c == column).unwrap();
        let aggs = columns
            .iter()
            .map(|(_, agg, column)| match agg.as_str() {
                "sum" => Agg::Sum { sum: at(&sums, column) },
                "count" if column == "*" => Agg::CountRows,
                "count" => Agg::Count { nn: at(&nonnull, column) },
                "avg" => Agg::Avg { sum: at(&sums, column), nn: at(&nonnull, column) },
                "min" => Agg::Min { ms: at(&multisets, column) },
                "max" => Agg::Max { ms: at(&multisets, column) },
                "set" => Agg::Set { ms: at(&multisets, column) },
                other => Agg::ByTag { last: other != "first", kept: at(&kept, column), slot: at(&tagged, column) },
            })
            .collect();
        let keys: Vec<(String, Src)> = key_columns.iter().enumerate().map(|(i, k)| (k.clone(), Src::Key(i))).collect();
        let cols: Vec<(String, Src)> = columns.iter().enumerate().map(|(i, c)| (c.0.clone(), Src::Col(i))).collect();
        let (message_key, _) = layout(keys.clone());
        let (view_row, view_row_names) = layout(keys.iter().chain(&cols).cloned().collect());
        let (view_op_row, _) =
            layout(std::iter::once(("op".to_string(), Src::Op)).chain(keys.iter().cloned()).chain(cols.iter().cloned()).collect());
        let (delta_row, delta_names) = layout(
            keys.iter().cloned().chain(std::iter::once(("_count".to_string(), Src::Count))).chain(cols.iter().cloned()).collect(),
        );
        // Renderer.deltas: {k: row[k] for k in key_columns}
        let (delta_key, _) = layout(
            key_columns
                .iter()
                .map(|k| {
                    let at = delta_names.iter().position(|n| n == k).unwrap();
                    (k.clone(), delta_row[at].1)
                })
                .collect(),
        );
        Ok(Plan {
            keys: KeyColumns::new(py, "key", &key_columns, &multisets)?,
            aggs,
            sum_detail: sums.iter().map(|c| Ok(format!("{} is not a number", repr(c)?))).collect::<PyResult<_>>()?,
            sum_names: sums,
            nonnull_names: nonnull,

            multiset_index: multisets.iter().map(|c| at(&kept, c)).collect(),
            multiset_names: multisets,
            tag_index: tagged.iter().map(|c| at(&kept, c)).collect(),
            needs_tags: !tagged.is_empty(),
            kept,
            form,
            delta,
            message_key,
            view_row,
            view_row_names,
            view_op_row,
            delta_row,
            delta_key,
        })
    }
}
