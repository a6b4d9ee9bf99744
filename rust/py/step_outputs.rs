use numpy::{Element, PyArray1};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyString};
use pyo3::IntoPyObjectExt;

use crate::request::StopReason;
use crate::step_outputs::{StepOutputs, FINISH_REASONS};

/// One step's results as columns, one row per request with news (see rust/step_outputs.rs).
///
/// The core fills plain Rust vectors with the GIL released; each column becomes a Python
/// object (one numpy array, one str, one list or dict) on its first access and the same
/// object is returned after that. Nothing is created per row, and a column nobody reads is
/// never converted.
#[pyclass(name = "StepOutputs", module = "ferrox._core", frozen)]
pub struct PyStepOutputs {
    inner: StepOutputs,
    slots: PyOnceLock<Py<PyArray1<i32>>>,
    req_ids: PyOnceLock<Py<PyList>>,
    token_ids: PyOnceLock<Py<PyArray1<i32>>>,
    token_offsets: PyOnceLock<Py<PyArray1<i32>>>,
    text: PyOnceLock<Py<PyString>>,
    text_offsets: PyOnceLock<Py<PyArray1<i32>>>,
    finish_reasons: PyOnceLock<Py<PyArray1<u8>>>,
    stop_reasons: PyOnceLock<Py<PyDict>>,
    num_output_tokens: PyOnceLock<Py<PyArray1<i32>>>,
    num_prompt_tokens: PyOnceLock<Py<PyArray1<i32>>>,
    num_cached_tokens: PyOnceLock<Py<PyArray1<i32>>>,
    num_external_cached_tokens: PyOnceLock<Py<PyArray1<i32>>>,
}

impl From<StepOutputs> for PyStepOutputs {
    fn from(inner: StepOutputs) -> Self {
        PyStepOutputs {
            inner,
            slots: PyOnceLock::new(),
            req_ids: PyOnceLock::new(),
            token_ids: PyOnceLock::new(),
            token_offsets: PyOnceLock::new(),
            text: PyOnceLock::new(),
            text_offsets: PyOnceLock::new(),
            finish_reasons: PyOnceLock::new(),
            stop_reasons: PyOnceLock::new(),
            num_output_tokens: PyOnceLock::new(),
            num_prompt_tokens: PyOnceLock::new(),
            num_cached_tokens: PyOnceLock::new(),
            num_external_cached_tokens: PyOnceLock::new(),
        }
    }
}

/// The column's numpy array, made (one copy of the vector) on first access.
fn column<T: Element>(
    py: Python<'_>,
    cell: &PyOnceLock<Py<PyArray1<T>>>,
    data: &[T],
) -> Py<PyArray1<T>> {
    cell.get_or_init(py, || PyArray1::from_slice(py, data).unbind())
        .clone_ref(py)
}

fn stop_reason_obj(py: Python<'_>, s: &StopReason) -> PyResult<Py<PyAny>> {
    match s {
        StopReason::TokenId(t) => t.into_py_any(py),
        StopReason::Str(s) => s.into_py_any(py),
        StopReason::Repetition => "repetition_detected".into_py_any(py),
    }
}

#[pymethods]
impl PyStepOutputs {
    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// [n] int32: the core's slot of each row's request (as returned by add_request).
    #[getter]
    fn slots(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        column(py, &self.slots, &self.inner.slots)
    }

    /// [n] request ids (built on first access; the same list after that).
    #[getter]
    fn req_ids(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        if let Some(l) = self.req_ids.get(py) {
            return Ok(l.clone_ref(py));
        }
        let list = PyList::new(py, self.inner.req_ids.iter())?.unbind();
        Ok(self.req_ids.get_or_init(py, || list).clone_ref(py))
    }

    /// [total] int32: every row's new tokens, row after row.
    #[getter]
    fn token_ids(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        column(py, &self.token_ids, &self.inner.token_ids)
    }

    /// [n + 1] int32: row i's tokens are token_ids[token_offsets[i]:token_offsets[i + 1]].
    #[getter]
    fn token_offsets(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        column(py, &self.token_offsets, &self.inner.token_offsets)
    }

    /// Every row's text delta, concatenated.
    #[getter]
    fn text(&self, py: Python<'_>) -> Py<PyString> {
        self.text
            .get_or_init(py, || PyString::new(py, &self.inner.text).unbind())
            .clone_ref(py)
    }

    /// [n + 1] int32, in characters: row i's delta is text[text_offsets[i]:text_offsets[i + 1]].
    #[getter]
    fn text_offsets(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        column(py, &self.text_offsets, &self.inner.text_offsets)
    }

    /// [n] uint8 codes into FINISH_REASONS (0: not finished).
    #[getter]
    fn finish_reasons(&self, py: Python<'_>) -> Py<PyArray1<u8>> {
        column(py, &self.finish_reasons, &self.inner.finish_reasons)
    }

    /// {row: stop token id or stop string} for rows that stopped on one.
    #[getter]
    fn stop_reasons(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        if let Some(d) = self.stop_reasons.get(py) {
            return Ok(d.clone_ref(py));
        }
        let d = PyDict::new(py);
        for (row, s) in &self.inner.stop_reasons {
            d.set_item(row, stop_reason_obj(py, s)?)?;
        }
        let d = d.unbind();
        Ok(self.stop_reasons.get_or_init(py, || d).clone_ref(py))
    }

    #[getter]
    fn num_output_tokens(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        column(py, &self.num_output_tokens, &self.inner.num_output_tokens)
    }

    #[getter]
    fn num_prompt_tokens(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        column(py, &self.num_prompt_tokens, &self.inner.num_prompt_tokens)
    }

    #[getter]
    fn num_cached_tokens(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        column(py, &self.num_cached_tokens, &self.inner.num_cached_tokens)
    }

    /// Of num_cached_tokens, the tokens loaded from the prefix cache's host tier (vLLM's external KV).
    #[getter]
    fn num_external_cached_tokens(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        column(
            py,
            &self.num_external_cached_tokens,
            &self.inner.num_external_cached_tokens,
        )
    }

    fn __repr__(&self) -> String {
        const SHOWN: usize = 8;
        let o = &self.inner;
        let mut rows = Vec::new();
        for i in 0..o.len().min(SHOWN) {
            let mut row = format!(
                "{:?}@{}: {:?} {:?}",
                o.req_ids.get(i),
                o.slots[i],
                o.row_tokens(i),
                o.row_text(i)
            );
            if let Some(f) = FINISH_REASONS[o.finish_reasons[i] as usize] {
                row.push_str(&format!(" {f}"));
                match o.stop_reason(i) {
                    Some(StopReason::TokenId(t)) => row.push_str(&format!(" ({t})")),
                    Some(StopReason::Str(s)) => row.push_str(&format!(" ({s:?})")),
                    Some(StopReason::Repetition) => row.push_str(" (repetition_detected)"),
                    None => {}
                }
            }
            rows.push(row);
        }
        if o.len() > SHOWN {
            rows.push(format!("... {} more", o.len() - SHOWN));
        }
        let finished = o.finish_reasons.iter().filter(|&&f| f != 0).count();
        format!(
            "StepOutputs(rows={}, tokens={}, finished={}: [{}])",
            o.len(),
            o.token_ids.len(),
            finished,
            rows.join(", ")
        )
    }
}
