//! The one error type of the core. Every variant maps to one Python exception class
//! (rust/py/errors.rs), so a caller can `except ferrox.FerroxError` or a precise subclass.

/// Misuse of the core. Running out of KV blocks is *not* an error (it is a normal scheduling
/// outcome: the request waits or another one is preempted).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// A bad configuration value or request field; the message names the field.
    #[error("{0}")]
    InvalidArgument(String),
    /// `add_request` with an id that is already live.
    #[error(
        "request id {0:?} is already live; request ids must be unique among unfinished requests"
    )]
    DuplicateRequest(String),
    /// An operation named a request id that the scheduler does not hold.
    #[error("unknown request id {0:?} (never added, or already finished/aborted)")]
    UnknownRequest(String),
    /// A prompt that could never be scheduled (longer than max_model_len or the whole KV cache).
    #[error("{0}")]
    PromptTooLong(String),
    /// tokenizer.json could not be parsed, or a token id is outside the vocabulary.
    #[error("{0}")]
    Tokenizer(String),
}

pub type CoreResult<T> = Result<T, CoreError>;

/// Shorthand for the most common error: `invalid("max_tokens", "must be >= 1, got 0")`.
pub fn invalid(field: &str, what: impl std::fmt::Display) -> CoreError {
    CoreError::InvalidArgument(format!("{field}: {what}"))
}
