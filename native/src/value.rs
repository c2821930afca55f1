//! Column values as the core holds them, and how they are read off Python objects:
//! what `refold.reduce.values` does with Python values (row identity by canonical
//! bytes, `value_order`, the scalar checks), for the values the core supports.
//!
//! Supported: None, bool, int (64-bit), finite float, str (valid UTF-8: no lone
//! surrogates), list, tuple, dict with str keys, nested — each of *exactly* that type
//! (a subclass goes to orjson's own rules in Python: `Unsupported` here).

use std::cmp::Ordering;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::json::{write_float, write_int, write_str};

/// Why the core cannot do what Python does with some input (becomes `Unsupported`).
#[derive(Debug)]
pub struct Unsup(pub String);

impl Unsup {
    pub fn new(what: impl Into<String>) -> Self {
        Unsup(what.into())
    }
}

/// orjson's default recursion limit is 255 levels; the core stops well before.
const MAX_DEPTH: usize = 200;

/// A JSON-like value (a row's column value, a view or delta column).
#[derive(Clone, Debug)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Box<str>),
    List(Vec<Value>),
    /// a tuple: written as an array, given back to Python as a tuple
    Tuple(Vec<Value>),
    /// a dict, in its insertion order
    Dict(Vec<(Box<str>, Value)>),
}

impl Value {
    /// Append `orjson.dumps(value)` (with `sort`: `option=OPT_SORT_KEYS`, nested dicts too).
    pub fn write(&self, out: &mut Vec<u8>, sort: bool) {
        match self {
            Value::Null => out.extend_from_slice(b"null"),
            Value::Bool(true) => out.extend_from_slice(b"true"),
            Value::Bool(false) => out.extend_from_slice(b"false"),
            Value::Int(n) => write_int(out, *n),
            Value::Float(x) => write_float(out, *x),
            Value::Str(s) => write_str(out, s),
            Value::List(items) | Value::Tuple(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    item.write(out, sort);
                }
                out.push(b']');
            }
            Value::Dict(entries) => {
                if sort && entries.len() > 1 {
                    let mut sorted: Vec<&(Box<str>, Value)> = entries.iter().collect();
                    sorted.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
                    write_entries(out, sorted, sort);
                } else {
                    write_entries(out, entries, sort);
                }
            }
        }
    }

    /// Equal canonical bytes (`same_row` for one column): sorted-key JSON equality, so
    /// `1` and `1.0` differ, dicts compare whatever their order, lists and tuples alike.
    pub fn canon_eq(&self, other: &Value) -> bool {
        match (self, other) {
            (Value::Null, Value::Null) => true,
            (Value::Bool(a), Value::Bool(b)) => a == b,
            (Value::Int(a), Value::Int(b)) => a == b,
            // the shortest digits are one-to-one with the float's bits (-0.0 is not 0.0)
            (Value::Float(a), Value::Float(b)) => a.to_bits() == b.to_bits(),
            (Value::Str(a), Value::Str(b)) => a == b,
            (Value::List(a) | Value::Tuple(a), Value::List(b) | Value::Tuple(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.canon_eq(y))
            }
            (Value::Dict(a), Value::Dict(b)) => {
                a.len() == b.len()
                    && a.iter().all(|(name, x)| match b.iter().find(|(n, _)| n == name) {
                        Some((_, y)) => x.canon_eq(y),
                        None => false,
                    })
            }
            _ => false,
        }
    }

    /// The Python object (lists as lists, tuples as tuples, dicts in their order).
    pub fn to_py<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(match self {
            Value::Null => py.None().into_bound(py),
            Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
            Value::Int(n) => n.into_pyobject(py)?.into_any(),
            Value::Float(x) => PyFloat::new(py, *x).into_any(),
            Value::Str(s) => PyString::new(py, s).into_any(),
            Value::List(items) => {
                let objs = items.iter().map(|v| v.to_py(py)).collect::<PyResult<Vec<_>>>()?;
                PyList::new(py, objs)?.into_any()
            }
            Value::Tuple(items) => {
                let objs = items.iter().map(|v| v.to_py(py)).collect::<PyResult<Vec<_>>>()?;
                PyTuple::new(py, objs)?.into_any()
            }
            Value::Dict(entries) => {
                let dict = PyDict::new(py);
                for (name, value) in entries {
                    dict.set_item(&**name, value.to_py(py)?)?;
                }
                dict.into_any()
            }
        })
    }
}

/// A row as the core reads it: its columns in their order (a dict's entries).
pub type Row = Vec<(Box<str>, Value)>;

/// `row.get(name)`.
pub fn row_get<'a>(row: &'a [(Box<str>, Value)], name: &str) -> Option<&'a Value> {
    row.iter().find(|(n, _)| &**n == name).map(|(_, v)| v)
}

/// Append a row's JSON with its names sorted, nested dicts' too (`orjson.dumps(row,
/// option=OPT_SORT_KEYS)`); `skip_null`: without its null columns (`canonical_row`).
pub fn write_row(out: &mut Vec<u8>, row: &[(Box<str>, Value)], skip_null: bool) {
    let mut named: Vec<&(Box<str>, Value)> =
        row.iter().filter(|(_, v)| !(skip_null && matches!(v, Value::Null))).collect();
    named.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    write_entries(out, named, true);
}

/// Append a row's JSON in its column order (`orjson.dumps(row)`).
pub fn write_dict(out: &mut Vec<u8>, row: &[(Box<str>, Value)]) {
    write_entries(out, row, false);
}

/// Append `{"name":value,...}` of the entries in the order given (`sort`: nested dicts'
/// names sorted).
fn write_entries<'a>(out: &mut Vec<u8>, entries: impl IntoIterator<Item = &'a (Box<str>, Value)>, sort: bool) {
    out.push(b'{');
    for (i, (name, value)) in entries.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_str(out, name);
        out.push(b':');
        value.write(out, sort);
    }
    out.push(b'}');
}

/// Whether a row's value nests no deeper than `value_of` reads (a row's columns are at
/// depth 1).
pub fn within_depth(value: &Value, depth: usize) -> bool {
    if depth > MAX_DEPTH {
        return false;
    }
    match value {
        Value::List(items) | Value::Tuple(items) => items.iter().all(|v| within_depth(v, depth + 1)),
        Value::Dict(entries) => entries.iter().all(|(_, v)| within_depth(v, depth + 1)),
        _ => true,
    }
}

/// The kind of a Python object, by its exact type (as `type(x) is ...` in Python).
pub enum Kind<'a, 'py> {
    None,
    Bool(bool),
    Int(&'a Bound<'py, PyAny>),
    Float(f64),
    Str(&'a Bound<'py, PyAny>),
    List,
    Tuple,
    Dict,
    Other,
}

pub fn kind<'a, 'py>(obj: &'a Bound<'py, PyAny>) -> Kind<'a, 'py> {
    if obj.is_none() {
        Kind::None
    } else if obj.is_exact_instance_of::<PyString>() {
        Kind::Str(obj)
    } else if obj.is_exact_instance_of::<PyInt>() {
        Kind::Int(obj)
    } else if obj.is_exact_instance_of::<PyFloat>() {
        Kind::Float(obj.cast::<PyFloat>().map(|f| f.value()).unwrap_or(f64::NAN))
    } else if obj.is_exact_instance_of::<PyBool>() {
        Kind::Bool(obj.is_truthy().unwrap_or(false))
    } else if obj.is_exact_instance_of::<PyList>() {
        Kind::List
    } else if obj.is_exact_instance_of::<PyDict>() {
        Kind::Dict
    } else if obj.is_exact_instance_of::<PyTuple>() {
        Kind::Tuple
    } else {
        Kind::Other
    }
}

/// A Python int as i64, or Unsupported.
pub fn int_of(obj: &Bound<'_, PyAny>) -> Result<i64, Unsup> {
    obj.extract::<i64>().map_err(|_| Unsup::new("an integer past 64 bits"))
}

/// A Python str as UTF-8, or Unsupported (lone surrogates).
pub fn str_of<'a>(obj: &'a Bound<'_, PyAny>) -> Result<&'a str, Unsup> {
    // SAFETY-free: the caller checked the exact type
    let s = unsafe { obj.cast_unchecked::<PyString>() };
    s.to_str().map_err(|_| Unsup::new("a string with a lone surrogate"))
}

pub fn finite(x: f64) -> Result<f64, Unsup> {
    if x.is_finite() {
        Ok(x)
    } else {
        Err(Unsup::new("a float that is not finite"))
    }
}

/// A Python value as a `Value` (orjson's view of it), or Unsupported.
pub fn value_of(obj: &Bound<'_, PyAny>, depth: usize) -> Result<Value, Unsup> {
    if depth > MAX_DEPTH {
        return Err(Unsup::new("a value nested too deep"));
    }
    Ok(match kind(obj) {
        Kind::None => Value::Null,
        Kind::Bool(b) => Value::Bool(b),
        Kind::Int(o) => Value::Int(int_of(o)?),
        Kind::Float(x) => Value::Float(finite(x)?),
        Kind::Str(o) => Value::Str(str_of(o)?.into()),
        Kind::List => {
            let list = unsafe { obj.cast_unchecked::<PyList>() };
            let mut items = Vec::with_capacity(list.len());
            for item in list.iter() {
                items.push(value_of(&item, depth + 1)?);
            }
            Value::List(items)
        }
        Kind::Tuple => {
            let tuple = unsafe { obj.cast_unchecked::<PyTuple>() };
            let mut items = Vec::with_capacity(tuple.len());
            for item in tuple.iter() {
                items.push(value_of(&item, depth + 1)?);
            }
            Value::Tuple(items)
        }
        Kind::Dict => {
            let dict = unsafe { obj.cast_unchecked::<PyDict>() };
            let mut entries = Vec::with_capacity(dict.len());
            for (name, value) in dict.iter() {
                if !name.is_exact_instance_of::<PyString>() {
                    return Err(Unsup::new("a dict key that is not a str"));
                }
                entries.push((str_of(&name)?.into(), value_of(&value, depth + 1)?));
            }
            Value::Dict(entries)
        }
        Kind::Other => {
            let name = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
            return Err(Unsup(format!("a value of type {name}")));
        }
    })
}

// ------------------------------------------------------------------------------------
// Values in `value_order`: of min / max / set columns, and of Top-N order columns

/// A scalar column value in `value_order` (SEMANTICS.md): numbers by value (an int and
/// a float compared exactly, as Python compares them), then strings, then booleans
/// (`orjson.dumps`: false before true).
///
/// A `min`/`max`/`set` column holds an int, a float with a fractional part, or a str
/// (`Scalar::of`: a bool or an integral float would merge with an equal int in Python's
/// dict of counts); a Top-N order column holds any of them (`Scalar::ordered`: Python
/// only compares them there).
#[derive(Clone, Debug)]
pub enum Scalar {
    Int(i64),
    Float(f64),
    Str(Box<str>),
    Bool(bool),
}

impl Scalar {
    /// The scalar of a kept value (None for a null, which no multiset holds).
    pub fn of(value: &Value) -> Result<Option<Scalar>, Unsup> {
        Ok(Some(match value {
            Value::Null => return Ok(None),
            Value::Int(n) => Scalar::Int(*n),
            Value::Float(x) => {
                if *x == x.trunc() {
                    return Err(Unsup::new("an integral float in a min, max or set column"));
                }
                Scalar::Float(*x)
            }
            Value::Str(s) => Scalar::Str(s.clone()),
            Value::Bool(_) => return Err(Unsup::new("a boolean in a min, max or set column")),
            _ => return Err(Unsup::new("a list or an object in a min, max or set column")),
        }))
    }

    /// The scalar of a Top-N order column's value (None for a null, which ranks last
    /// apart from the others). A list or an object is refused before it gets here
    /// (`scalar_problem`); one read back from a state record is Unsupported.
    pub fn ordered(value: &Value) -> Result<Option<Scalar>, Unsup> {
        Ok(Some(match value {
            Value::Null => return Ok(None),
            Value::Int(n) => Scalar::Int(*n),
            Value::Float(x) => Scalar::Float(*x),
            Value::Str(s) => Scalar::Str(s.clone()),
            Value::Bool(b) => Scalar::Bool(*b),
            _ => return Err(Unsup::new("a list or an object in an order column")),
        }))
    }

    /// Append its JSON.
    pub fn write(&self, out: &mut Vec<u8>) {
        match self {
            Scalar::Int(n) => write_int(out, *n),
            Scalar::Float(x) => write_float(out, *x),
            Scalar::Str(s) => write_str(out, s),
            Scalar::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        }
    }

    pub fn value(&self) -> Value {
        match self {
            Scalar::Int(n) => Value::Int(*n),
            Scalar::Float(x) => Value::Float(*x),
            Scalar::Str(s) => Value::Str(s.clone()),
            Scalar::Bool(b) => Value::Bool(*b),
        }
    }

    /// `value_order`'s kind: numbers, strings, booleans.
    fn kind(&self) -> u8 {
        match self {
            Scalar::Int(_) | Scalar::Float(_) => 0,
            Scalar::Str(_) => 1,
            Scalar::Bool(_) => 2,
        }
    }
}

/// An int against a finite float, exactly (as Python compares them): the float's
/// integral part is an exact i64 once it is known to be within i64's range, and its
/// fractional part breaks a tie.
fn int_float(i: i64, f: f64) -> Ordering {
    const TWO_63: f64 = 9_223_372_036_854_775_808.0;
    if f >= TWO_63 {
        return Ordering::Less;
    }
    if f < -TWO_63 {
        return Ordering::Greater;
    }
    let whole = f.trunc();
    match i.cmp(&(whole as i64)) {
        Ordering::Equal => 0.0f64.partial_cmp(&(f - whole)).unwrap_or(Ordering::Equal),
        unequal => unequal,
    }
}

impl Ord for Scalar {
    fn cmp(&self, other: &Self) -> Ordering {
        match (self, other) {
            (Scalar::Int(a), Scalar::Int(b)) => a.cmp(b),
            // -0.0 equals 0.0, as in Python (floats here are finite)
            (Scalar::Float(a), Scalar::Float(b)) => a.partial_cmp(b).unwrap_or(Ordering::Equal),
            (Scalar::Int(a), Scalar::Float(b)) => int_float(*a, *b),
            (Scalar::Float(a), Scalar::Int(b)) => int_float(*b, *a).reverse(),
            (Scalar::Str(a), Scalar::Str(b)) => a.as_bytes().cmp(b.as_bytes()),
            (Scalar::Bool(a), Scalar::Bool(b)) => a.cmp(b),
            _ => self.kind().cmp(&other.kind()),
        }
    }
}

impl PartialOrd for Scalar {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Scalar {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Scalar {}

/// Append the canonical bytes (`canonical_row`) of named values: null ones left out,
/// names sorted, nested dicts' names too — what `same_row` compares.
pub fn write_canonical(out: &mut Vec<u8>, entries: &[(&str, &Value)]) {
    let mut named: Vec<&(&str, &Value)> = entries.iter().filter(|(_, v)| !matches!(v, Value::Null)).collect();
    named.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    out.push(b'{');
    for (i, (name, value)) in named.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_str(out, name);
        out.push(b':');
        value.write(out, true);
    }
    out.push(b'}');
}
