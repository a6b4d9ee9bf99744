//! The one error type of the core. Every variant maps to one Python exception class
//! (rust/py/errors.rs), so a caller can `except ferrox.FerroxError` or a precise subclass.
//! Each error knows the request or configuration field it is about (`param()`), so a server
//! can report it (OpenAI's `error.param`) without parsing the message.

/// Misuse of the core. Running out of KV blocks is *not* an error (it is a normal scheduling
/// outcome: the request waits or another one is preempted).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// A bad configuration value or request field. `param` is the field's name (without an
    /// element index); the message starts with the field as written, index included.
    #[error("{message}")]
    InvalidArgument { param: String, message: String },
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

impl CoreError {
    /// The request or configuration field the error is about, if any.
    pub fn param(&self) -> Option<&str> {
        match self {
            CoreError::InvalidArgument { param, .. } => Some(param),
            CoreError::DuplicateRequest(_) | CoreError::UnknownRequest(_) => Some("request_id"),
            CoreError::PromptTooLong(_) => Some("prompt_token_ids"),
            CoreError::Tokenizer(_) => None,
        }
    }
}

pub type CoreResult<T> = Result<T, CoreError>;

/// Shorthand for the most common error: `invalid("max_tokens", "must be >= 1, got 0")`, shown
/// as "max_tokens: must be >= 1, got 0". An indexed field ("stop[2]") keeps its index in the
/// message; its `param` is the bare name ("stop").
pub fn invalid(field: &str, what: impl std::fmt::Display) -> CoreError {
    let param = field.split_once('[').map_or(field, |(name, _)| name);
    CoreError::InvalidArgument {
        param: param.to_string(),
        message: format!("{field}: {what}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_names_the_bare_field() {
        let e = invalid("stop[2]", "must not be empty");
        assert_eq!(e.to_string(), "stop[2]: must not be empty");
        assert_eq!(e.param(), Some("stop"));
        assert_eq!(invalid("max_tokens", "x").param(), Some("max_tokens"));
        assert_eq!(
            CoreError::PromptTooLong("p".into()).param(),
            Some("prompt_token_ids")
        );
        assert_eq!(
            CoreError::UnknownRequest("a".into()).param(),
            Some("request_id")
        );
        assert_eq!(CoreError::Tokenizer("t".into()).param(), None);
    }
}
