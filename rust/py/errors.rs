//! The Python exception tree and the one mapping from CoreError to it.
//!
//! Some classes need two bases (InvalidArgumentError is also a ValueError, UnknownRequestError
//! also a KeyError), which `create_exception!` cannot express, so the tree is defined by a few
//! lines of Python run once at module init and the classes are kept for raising.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

use crate::error::CoreError;

const TREE: &std::ffi::CStr = cr#"
class FerroxError(Exception):
    """Root of every error ferrox raises on purpose.

    `param` names the request or configuration field at fault ("max_tokens", "stop",
    "prompt_token_ids", "request_id"), or is None when the error is about no one field.
    """

    def __init__(self, message="", *, param=None):
        super().__init__(message)
        self.param = param

class InvalidArgumentError(FerroxError, ValueError):
    """A bad configuration value or request field (negative size, bad policy name, ...)."""

class DuplicateRequestError(InvalidArgumentError):
    """`add_request` with an id that is already live."""

class UnknownRequestError(FerroxError, KeyError):
    """An operation named a request id the scheduler does not hold."""

    def __str__(self):
        # KeyError's str() is the repr of its key; show the message as written.
        return str(self.args[0]) if self.args else ""

class PromptTooLongError(InvalidArgumentError):
    """A prompt (plus nothing else) that cannot fit in `max_model_len` or the whole KV cache."""

class TokenizerError(FerroxError):
    """tokenizer.json could not be parsed / a token id is outside the vocabulary."""
"#;

const NAMES: [&str; 6] = [
    "FerroxError",
    "InvalidArgumentError",
    "DuplicateRequestError",
    "UnknownRequestError",
    "PromptTooLongError",
    "TokenizerError",
];

struct Classes {
    namespace: Py<PyDict>,
    invalid_argument: Py<PyType>,
    duplicate_request: Py<PyType>,
    unknown_request: Py<PyType>,
    prompt_too_long: Py<PyType>,
    tokenizer: Py<PyType>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

/// Runs TREE once, in a namespace whose `__name__` makes the classes report `ferrox._core`.
fn classes(py: Python<'_>) -> &Classes {
    CLASSES.get_or_init(py, || {
        let ns = PyDict::new(py);
        ns.set_item("__name__", "ferrox._core").expect("namespace");
        py.run(TREE, Some(&ns), None)
            .expect("defining ferrox._core exception classes");
        let get = |name: &str| -> Py<PyType> {
            let obj = ns
                .get_item(name)
                .ok()
                .flatten()
                .expect("exception class defined by TREE");
            obj.cast_into::<PyType>().expect("a class").unbind()
        };
        Classes {
            invalid_argument: get("InvalidArgumentError"),
            duplicate_request: get("DuplicateRequestError"),
            unknown_request: get("UnknownRequestError"),
            prompt_too_long: get("PromptTooLongError"),
            tokenizer: get("TokenizerError"),
            namespace: ns.unbind(),
        }
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let ns = classes(m.py()).namespace.bind(m.py());
    for name in NAMES {
        m.add(name, ns.get_item(name)?.expect("exception class"))?;
    }
    Ok(())
}

impl From<CoreError> for PyErr {
    fn from(e: CoreError) -> PyErr {
        Python::attach(|py| {
            let c = classes(py);
            let ty = match &e {
                CoreError::InvalidArgument { .. } => &c.invalid_argument,
                CoreError::DuplicateRequest(_) => &c.duplicate_request,
                CoreError::UnknownRequest(_) => &c.unknown_request,
                CoreError::PromptTooLong(_) => &c.prompt_too_long,
                CoreError::Tokenizer(_) => &c.tokenizer,
            };
            let kwargs = PyDict::new(py);
            let made = kwargs
                .set_item("param", e.param())
                .and_then(|()| ty.bind(py).call((e.to_string(),), Some(&kwargs)));
            match made {
                Ok(exc) => PyErr::from_value(exc),
                // Constructing the exception itself failed (out of memory...): raise that.
                Err(err) => err,
            }
        })
    }
}
