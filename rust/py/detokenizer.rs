use std::sync::Arc;

use pyo3::prelude::*;

use crate::detokenizer::{IncrementalDetokenizer, TokenizerInfo};
use crate::error::CoreError;

/// Standalone incremental detokenizer: the same code the scheduler runs per request.
#[pyclass(name = "Detokenizer", module = "ferrox._core")]
pub struct PyDetokenizer {
    inner: IncrementalDetokenizer,
    vocab_size: usize,
}

#[pymethods]
impl PyDetokenizer {
    #[new]
    #[pyo3(signature = (tokenizer_json, *, skip_special_tokens=true, stop=Vec::new(), include_stop_str_in_output=false))]
    fn new(
        py: Python<'_>,
        tokenizer_json: &str,
        skip_special_tokens: bool,
        stop: Vec<String>,
        include_stop_str_in_output: bool,
    ) -> PyResult<Self> {
        let info = py.detach(|| TokenizerInfo::from_json(tokenizer_json))?;
        let vocab_size = info.vocab_size();
        let inner = IncrementalDetokenizer::new(
            Arc::new(info),
            skip_special_tokens,
            stop,
            include_stop_str_in_output,
        )?;
        Ok(PyDetokenizer { inner, vocab_size })
    }

    /// Feeds one token; returns (text_delta, stop string that fired or None).
    fn step(&mut self, token_id: i64) -> PyResult<(String, Option<String>)> {
        if token_id < 0 || token_id as u64 >= self.vocab_size as u64 {
            return Err(CoreError::Tokenizer(format!(
                "token_id: {token_id} is outside the vocabulary (size {})",
                self.vocab_size
            ))
            .into());
        }
        let st = self.inner.step(token_id as u32, true);
        let stop = st
            .stop
            .map(|i| self.inner.stop_strings().get(i).to_string());
        Ok((st.delta, stop))
    }

    /// End of stream: release text held back for a possible stop string.
    fn flush(&mut self) -> String {
        self.inner.flush()
    }

    #[getter]
    fn output_text(&self) -> String {
        // This detokenizer is built keeping its text.
        self.inner.output_text().unwrap_or_default()
    }
}
