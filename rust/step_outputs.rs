//! One step's results as columns: what `update_from_output` and `abort_requests` hand back.
//!
//! One row per request with news (a new token, text, or a finish). Rows are built in the
//! scheduler's loop without touching Python; the glue (rust/py/step_outputs.rs) turns each
//! column into one numpy array or one str. A row may carry any number of tokens (speculative
//! decoding appends several; an abort none), hence the offsets.

use crate::batch::IdList;
use crate::request::{FinishReason, StopReason};

/// `finish_reasons` codes: the index into this table (`ferrox._core.FINISH_REASONS`).
/// Code 4, "error", is never produced by the core: the Python engine uses it for requests it
/// fails itself, so all finishes share one encoding.
pub const FINISH_REASONS: [Option<&str>; 6] = [
    None,
    Some("stop"),
    Some("length"),
    Some("abort"),
    Some("error"),
    Some("repetition"),
];

impl FinishReason {
    /// This reason's code in `FINISH_REASONS`.
    pub fn code(self) -> u8 {
        match self {
            FinishReason::Stop => 1,
            FinishReason::Length => 2,
            FinishReason::Abort => 3,
            FinishReason::Repetition => 5,
        }
    }
}

/// Everything about one row except its tokens and text.
#[derive(Debug, Clone, Copy)]
pub struct RowInfo<'a> {
    pub slot: usize,
    pub request_id: &'a str,
    pub finish: Option<FinishReason>,
    pub num_output_tokens: usize,
    pub num_prompt_tokens: usize,
    pub num_cached_tokens: usize,
    pub num_external_cached_tokens: usize,
}

#[derive(Debug, Clone)]
pub struct StepOutputs {
    /// The core's slot of each row's request (`add_request`'s return value).
    pub slots: Vec<i32>,
    pub req_ids: IdList,
    /// Row i's new tokens are `token_ids[token_offsets[i]..token_offsets[i + 1]]`.
    pub token_ids: Vec<i32>,
    pub token_offsets: Vec<i32>,
    /// Every row's text delta, concatenated.
    pub text: String,
    /// Row i's delta is characters (Unicode code points, as Python indexes a str)
    /// `text_offsets[i]..text_offsets[i + 1]` of `text`.
    pub text_offsets: Vec<i32>,
    /// Codes of `FINISH_REASONS` (0: still running).
    pub finish_reasons: Vec<u8>,
    /// (row, what fired) for rows that stopped on a stop token id or a stop string.
    pub stop_reasons: Vec<(usize, StopReason)>,
    pub num_output_tokens: Vec<i32>,
    pub num_prompt_tokens: Vec<i32>,
    pub num_cached_tokens: Vec<i32>,
    /// Of `num_cached_tokens`, those loaded from the host tier (vLLM's external KV transfer).
    pub num_external_cached_tokens: Vec<i32>,
}

impl Default for StepOutputs {
    fn default() -> Self {
        StepOutputsBuilder::with_capacity(0).finish()
    }
}

/// The fixed-size part of a row, kept together while rows are built (one push per row) and
/// split into columns once, by `StepOutputsBuilder::finish`.
#[derive(Debug, Clone, Copy)]
struct RowMeta {
    slot: i32,
    token_end: i32,
    text_chars_end: i32,
    num_output_tokens: i32,
    num_prompt_tokens: i32,
    num_cached_tokens: i32,
    num_external_cached_tokens: i32,
    finish: u8,
}

/// Builds a `StepOutputs` row by row: append a row's tokens (`push_token`) and text (into
/// `text_mut`), then close it with `end_row`.
pub struct StepOutputsBuilder {
    rows: Vec<RowMeta>,
    req_ids: IdList,
    token_ids: Vec<i32>,
    text: String,
    stop_reasons: Vec<(usize, StopReason)>,
    /// Byte length of `text` at the end of the last row (where the next row's text begins).
    text_bytes_done: usize,
    text_chars_done: usize,
}

impl StepOutputsBuilder {
    pub fn with_capacity(rows: usize) -> Self {
        StepOutputsBuilder {
            rows: Vec::with_capacity(rows),
            req_ids: IdList::with_capacity(rows),
            token_ids: Vec::with_capacity(rows),
            // A token's worth of text per row, with room to spare.
            text: String::with_capacity(rows * 16),
            stop_reasons: Vec::new(),
            text_bytes_done: 0,
            text_chars_done: 0,
        }
    }

    /// Where the row being built appends its text (before `end_row`).
    pub fn text_mut(&mut self) -> &mut String {
        &mut self.text
    }

    /// Appends one token to the row being built (before `end_row`).
    pub fn push_token(&mut self, token: u32) {
        // Token ids are checked to fit int32 where they enter the core (`scheduler::token_id`).
        self.token_ids.push(token as i32);
    }

    /// Closes the row whose tokens and text were just appended.
    pub fn end_row(&mut self, row: RowInfo<'_>, stop: Option<StopReason>) {
        let new_text = &self.text[self.text_bytes_done..];
        // Python indexes a str by code point; ASCII (most text) needs no counting.
        self.text_chars_done += if new_text.is_ascii() {
            new_text.len()
        } else {
            new_text.chars().count()
        };
        self.text_bytes_done = self.text.len();
        if let Some(s) = stop {
            self.stop_reasons.push((self.rows.len(), s));
        }
        self.req_ids.push(row.request_id);
        self.rows.push(RowMeta {
            slot: row.slot as i32,
            token_end: self.token_ids.len() as i32,
            text_chars_end: self.text_chars_done as i32,
            num_output_tokens: row.num_output_tokens as i32,
            num_prompt_tokens: row.num_prompt_tokens as i32,
            num_cached_tokens: row.num_cached_tokens as i32,
            num_external_cached_tokens: row.num_external_cached_tokens as i32,
            finish: row.finish.map_or(0, FinishReason::code),
        });
    }

    /// The columns.
    pub fn finish(self) -> StepOutputs {
        let rows = &self.rows;
        let column = |f: fn(&RowMeta) -> i32| rows.iter().map(f).collect::<Vec<i32>>();
        let offsets = |f: fn(&RowMeta) -> i32| {
            std::iter::once(0)
                .chain(rows.iter().map(f))
                .collect::<Vec<i32>>()
        };
        StepOutputs {
            slots: column(|r| r.slot),
            token_offsets: offsets(|r| r.token_end),
            text_offsets: offsets(|r| r.text_chars_end),
            finish_reasons: rows.iter().map(|r| r.finish).collect(),
            num_output_tokens: column(|r| r.num_output_tokens),
            num_prompt_tokens: column(|r| r.num_prompt_tokens),
            num_cached_tokens: column(|r| r.num_cached_tokens),
            num_external_cached_tokens: column(|r| r.num_external_cached_tokens),
            req_ids: self.req_ids,
            token_ids: self.token_ids,
            text: self.text,
            stop_reasons: self.stop_reasons,
        }
    }
}

impl StepOutputs {
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Row i's new tokens.
    pub fn row_tokens(&self, i: usize) -> &[i32] {
        &self.token_ids[self.token_offsets[i] as usize..self.token_offsets[i + 1] as usize]
    }

    /// Row i's text delta (tests and debugging; by characters, so O(text)).
    pub fn row_text(&self, i: usize) -> String {
        let (lo, hi) = (
            self.text_offsets[i] as usize,
            self.text_offsets[i + 1] as usize,
        );
        self.text.chars().skip(lo).take(hi - lo).collect()
    }

    pub fn finish_reason(&self, i: usize) -> Option<FinishReason> {
        match self.finish_reasons[i] {
            1 => Some(FinishReason::Stop),
            2 => Some(FinishReason::Length),
            3 => Some(FinishReason::Abort),
            5 => Some(FinishReason::Repetition),
            _ => None,
        }
    }

    pub fn stop_reason(&self, i: usize) -> Option<&StopReason> {
        self.stop_reasons
            .iter()
            .find(|(r, _)| *r == i)
            .map(|(_, s)| s)
    }
}

/// One row as a plain struct (tests).
#[cfg(test)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub slot: usize,
    pub request_id: std::sync::Arc<str>,
    pub new_token_ids: Vec<u32>,
    pub text_delta: String,
    pub finish_reason: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
    pub num_output_tokens: usize,
    pub num_prompt_tokens: usize,
    pub num_cached_tokens: usize,
}

#[cfg(test)]
impl StepOutputs {
    pub fn rows(&self) -> Vec<Row> {
        (0..self.len())
            .map(|i| Row {
                slot: self.slots[i] as usize,
                request_id: self.req_ids.get(i).into(),
                new_token_ids: self.row_tokens(i).iter().map(|&t| t as u32).collect(),
                text_delta: self.row_text(i),
                finish_reason: self.finish_reason(i),
                stop_reason: self.stop_reason(i).cloned(),
                num_output_tokens: self.num_output_tokens[i] as usize,
                num_prompt_tokens: self.num_prompt_tokens[i] as usize,
                num_cached_tokens: self.num_cached_tokens[i] as usize,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_with_variable_tokens_and_multibyte_text() {
        let row = |slot, id, finish| RowInfo {
            slot,
            request_id: id,
            finish,
            num_output_tokens: 1,
            num_prompt_tokens: 2,
            num_cached_tokens: 0,
            num_external_cached_tokens: 0,
        };
        let mut o = StepOutputsBuilder::with_capacity(3);
        o.push_token(7);
        o.text_mut().push_str("héllo");
        o.end_row(row(4, "a", None), None);
        o.end_row(row(0, "b", Some(FinishReason::Abort)), None);
        o.push_token(8);
        o.push_token(9);
        o.text_mut().push_str("🦀 x");
        o.end_row(
            row(2, "c", Some(FinishReason::Stop)),
            Some(StopReason::TokenId(9)),
        );
        let o = o.finish();
        assert_eq!(o.len(), 3);
        assert_eq!(o.slots, vec![4, 0, 2]);
        assert_eq!(o.token_offsets, vec![0, 1, 1, 3]);
        assert_eq!(o.text_offsets, vec![0, 5, 5, 8]);
        assert_eq!(
            (o.row_text(0), o.row_text(1), o.row_text(2)),
            ("héllo".into(), "".into(), "🦀 x".into())
        );
        assert_eq!(o.row_tokens(2), &[8, 9]);
        assert_eq!(o.finish_reasons, vec![0, 3, 1]);
        assert_eq!(o.stop_reason(2), Some(&StopReason::TokenId(9)));
        assert_eq!(o.stop_reason(1), None);
        assert_eq!(FINISH_REASONS[o.finish_reasons[1] as usize], Some("abort"));
    }
}
