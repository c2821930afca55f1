//! A windowed view's core, whichever its window: tumble and hop (`WindowCore`, the
//! grouped core over rows per window) or session (`SessionCore`), behind the one
//! interface the Python class (`refold_native.WindowCore`) offers.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::{SessionCore, WindowCore, WindowOut};
use crate::core::{Fail, ReadOut, RestoreFail};

pub enum Windowed {
    Fixed(WindowCore),
    Session(SessionCore),
}

macro_rules! each {
    ($self:expr, $core:ident => $call:expr) => {
        match $self {
            Windowed::Fixed($core) => $call,
            Windowed::Session($core) => $call,
        }
    };
}

impl Windowed {
    pub fn restore(&mut self, py: Python<'_>, records: &Bound<'_, PyAny>) -> Result<(), RestoreFail> {
        each!(self, core => core.restore(py, records))
    }

    pub fn touched(&mut self, units: &Bound<'_, PyAny>) -> Result<Vec<Vec<u8>>, Fail> {
        each!(self, core => core.touched(units))
    }

    pub fn read(&mut self, parts: &Bound<'_, PyAny>, check: Option<&[String]>) -> Result<Option<ReadOut>, Fail> {
        each!(self, core => core.read(parts, check))
    }

    pub fn apply_read<'py>(&mut self, py: Python<'py>) -> Result<(WindowOut<'py>, Vec<Vec<u32>>), Fail> {
        each!(self, core => core.apply_read(py))
    }

    pub fn apply_batch<'py>(&mut self, py: Python<'py>, units: &Bound<'py, PyAny>) -> Result<WindowOut<'py>, Fail> {
        each!(self, core => core.apply_batch(py, units))
    }

    pub fn view<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        each!(self, core => core.view(py))
    }

    /// Whether view and delta records carry cause headers (`outputs.provenance`).
    pub fn set_provenance(&mut self, on: bool) {
        match self {
            Windowed::Fixed(core) => core.set_provenance(on),
            Windowed::Session(core) => core.provenance = on,
        }
    }

    pub fn len(&self) -> usize {
        each!(self, core => core.len())
    }
}
