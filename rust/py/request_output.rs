use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

use crate::request::StopReason;
use crate::scheduler::RequestOutput;

/// What one request produced in one step.
#[pyclass(name = "RequestOutput", module = "ferrox._core", frozen)]
pub struct PyRequestOutput {
    request_id: Arc<str>,
    new_token_ids: Vec<u32>,
    text_delta: String,
    finish_reason: Option<&'static str>,
    stop_reason: Option<StopReason>,
    num_output_tokens: usize,
    num_prompt_tokens: usize,
    num_cached_tokens: usize,
}

impl From<RequestOutput> for PyRequestOutput {
    fn from(o: RequestOutput) -> Self {
        PyRequestOutput {
            request_id: o.request_id,
            new_token_ids: o.new_token_ids,
            text_delta: o.text_delta,
            finish_reason: o.finish_reason.map(|f| f.as_str()),
            stop_reason: o.stop_reason,
            num_output_tokens: o.num_output_tokens,
            num_prompt_tokens: o.num_prompt_tokens,
            num_cached_tokens: o.num_cached_tokens,
        }
    }
}

#[pymethods]
impl PyRequestOutput {
    #[getter]
    fn request_id(&self) -> &str {
        &self.request_id
    }
    #[getter]
    fn new_token_ids(&self) -> Vec<u32> {
        self.new_token_ids.clone()
    }
    #[getter]
    fn text_delta(&self) -> &str {
        &self.text_delta
    }
    #[getter]
    fn finished(&self) -> bool {
        self.finish_reason.is_some()
    }
    #[getter]
    fn finish_reason(&self) -> Option<&'static str> {
        self.finish_reason
    }
    #[getter]
    fn stop_reason(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match &self.stop_reason {
            None => Ok(py.None()),
            Some(StopReason::TokenId(t)) => t.into_py_any(py),
            Some(StopReason::Str(s)) => s.into_py_any(py),
        }
    }
    #[getter]
    fn num_output_tokens(&self) -> usize {
        self.num_output_tokens
    }
    #[getter]
    fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
    }
    #[getter]
    fn num_cached_tokens(&self) -> usize {
        self.num_cached_tokens
    }
    fn __repr__(&self) -> String {
        let finish = self
            .finish_reason
            .map_or("None".to_string(), |f| format!("{f:?}"));
        let stop = match &self.stop_reason {
            None => "None".to_string(),
            Some(StopReason::TokenId(t)) => t.to_string(),
            Some(StopReason::Str(s)) => format!("{s:?}"),
        };
        format!(
            "RequestOutput(request_id={:?}, new_token_ids={:?}, text_delta={:?}, finish_reason={finish}, stop_reason={stop})",
            &*self.request_id, self.new_token_ids, self.text_delta
        )
    }
}
