//! PyO3 glue: one file per exposed type (each `PyX` is shown to Python as `X`). Nothing here
//! decides anything; it converts arguments, releases the GIL around core work, and builds
//! numpy arrays without per-element Python calls.

mod cpu;
mod detokenizer;
pub mod errors;
mod scheduler;
mod scheduler_output;
mod stats;
mod step_outputs;

use pyo3::prelude::*;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<scheduler_output::PySchedulerOutput>()?;
    m.add_class::<step_outputs::PyStepOutputs>()?;
    m.add(
        "FINISH_REASONS",
        pyo3::types::PyTuple::new(m.py(), crate::step_outputs::FINISH_REASONS)?,
    )?;
    m.add_class::<stats::PySchedulerStats>()?;
    m.add_class::<detokenizer::PyDetokenizer>()?;
    cpu::register(m)?;
    Ok(())
}

/// Token ids from a Python int sequence or an int64/int32 numpy array, checked to fit u32.
pub(crate) fn extract_token_ids(field: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
    let signed: Vec<i64> = if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        a.as_array().to_vec()
    } else if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        a.as_array().iter().map(|&x| x as i64).collect()
    } else if let Ok(a) = obj.cast::<numpy::PyUntypedArray>() {
        return Err(crate::error::invalid(
            field,
            format!(
                "expected a 1-D int64 or int32 array, got dtype {} with {} dims",
                a.dtype(),
                a.ndim()
            ),
        )
        .into());
    } else {
        obj.extract::<Vec<i64>>()
            .map_err(|_| PyErr::from(crate::error::invalid(field, "expected a sequence of ints")))?
    };
    // The indexed field name is built only for a bad id: formatting it for every token cost
    // more than the rest of add_request for a long prompt.
    signed
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            if crate::scheduler::is_token_id(t) {
                Ok(t as u32)
            } else {
                crate::scheduler::token_id(&format!("{field}[{i}]"), t).map_err(PyErr::from)
            }
        })
        .collect()
}
