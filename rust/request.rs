//! One request's state: its tokens (prompt then output), how many have K/V computed, its
//! blocks and block hashes, its sampling limits, its detokenizer, and the stop checks run
//! after every sampled token.

use std::sync::Arc;

use crate::detokenizer::IncrementalDetokenizer;
use crate::kv_cache_manager::KvBlocks;
use crate::prefix_cache::{BlockHash, BlockHasher};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    /// Queued, but held back until its grammar is compiled (`grammar_ready`).
    WaitingForGrammar,
    Waiting,
    Running,
    /// Evicted from the running set to free blocks; back in the waiting queue, will recompute.
    Preempted,
    Finished(FinishReason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    Abort,
    /// The output ended in a repeating pattern (`RepetitionRule`).
    Repetition,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Repetition => "repetition",
        }
    }
}

/// What fired a 'stop' finish (EOS and a forced stop report none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    TokenId(u32),
    Str(String),
    /// A repetition rule fired (vLLM reports it as the string "repetition_detected").
    Repetition,
}

/// vLLM's `repetition_detection`: stop once the output ends in a pattern of `min_pattern..=max_pattern`
/// tokens repeated `min_count` times back to back (a model stuck in a loop). Checked after the length
/// limits, and only once min_tokens are out, as vLLM does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RepetitionRule {
    pub min_pattern: usize,
    pub max_pattern: usize,
    pub min_count: usize,
}

impl RepetitionRule {
    /// Whether `output` ends in some pattern size's `min_count` repeats. Sizes are tried from the
    /// smallest; one whose repeats would not fit in the output ends the search (larger ones fit less).
    pub fn fires(&self, output: &[u32]) -> bool {
        let n = output.len();
        for size in self.min_pattern.max(1)..=self.max_pattern {
            let span = size * self.min_count;
            if span > n {
                return false;
            }
            let tail = &output[n - size..];
            if (1..self.min_count).all(|k| &output[n - size * (k + 1)..n - size * k] == tail) {
                return true;
            }
        }
        false
    }
}

/// Limits that end generation; `max_tokens` is already clipped to the room left by the prompt.
#[derive(Debug, Clone)]
pub struct SamplingLimits {
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<u32>,
    pub include_stop_str_in_output: bool,
    pub repetition: Option<RepetitionRule>,
}

pub struct Request {
    pub id: Arc<str>,
    /// Arrival order; also tells a reused slab slot's new request from the old one.
    pub serial: u64,
    /// Bumped at each preemption: a step scheduled before it belongs to an earlier residency
    /// (its K/V is gone, its placeholders dropped), so a late update or a rollback of that step
    /// must leave the resumed request alone.
    pub residency: u32,
    pub priority: i64,
    /// Prompt tokens followed by output tokens.
    pub token_ids: Vec<u32>,
    pub num_prompt_tokens: usize,
    /// Tokens whose K/V is in the cache (or being computed in the step just scheduled).
    pub num_computed_tokens: usize,
    /// Prompt tokens served by the prefix cache when first scheduled (None before that).
    pub num_cached_tokens: Option<usize>,
    /// Of those, the tokens copied in from the prefix cache's host tier (vLLM's "external" KV).
    pub num_external_cached_tokens: usize,
    /// Tokens sampled by scheduled steps whose results have not come back yet (async
    /// scheduling: a step may be scheduled before the previous step's update_from_output).
    /// They count as tokens for scheduling; their input ids are filled in on the device.
    pub num_output_placeholders: usize,
    /// Speculative decoding may propose tokens for this request (off, e.g., while a grammar
    /// constrains it and the drafts are not checked against it).
    pub allow_drafts: bool,
    /// Prompt ranges [start, end) computed in one step each (`cut_chunk`).
    pub atomic_spans: Vec<(usize, usize)>,
    /// The LoRA adapter this request runs with (0: the base model). The scheduler caps how many
    /// distinct adapters one step may carry (`SchedulerConfig::max_loras`).
    pub lora_id: i64,
    pub limits: SamplingLimits,
    /// Names the blocks this request completes (the scheduler's hash function, the request's
    /// extra keys).
    pub hasher: BlockHasher,
    /// Hash of every full block of `token_ids`.
    pub block_hashes: Vec<BlockHash>,
    pub kv: KvBlocks,
    pub detok: Option<IncrementalDetokenizer>,
    pub status: RequestStatus,
}

/// How a request finished, and what fired a 'stop' (None for EOS, a forced stop, length).
pub type Finish = (FinishReason, Option<StopReason>);

impl Request {
    /// The tokens of a chunk [start, start + n) this step may compute: a chunk must not end inside an
    /// atomic span (Gemma 3's image tokens attend to each other both ways, so every token of an image
    /// must be in the step that computes its last one). It is cut before the span, or to nothing when it
    /// starts inside a span it cannot finish (the span waits for a step with the budget for it).
    pub fn cut_chunk(&self, start: usize, n: usize) -> usize {
        let end = start + n;
        for &(s, e) in &self.atomic_spans {
            if s < end && end < e {
                return s.saturating_sub(start);
            }
            if s >= end {
                break;
            }
        }
        n
    }

    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    pub fn num_output_tokens(&self) -> usize {
        self.token_ids.len() - self.num_prompt_tokens
    }

    pub fn is_finished(&self) -> bool {
        matches!(self.status, RequestStatus::Finished(_))
    }

    /// Appends a sampled token, extends the block hashes, detokenizes, and runs the stop checks
    /// in order: EOS / stop token ids, stop strings, `force_stop`, then the length limits. A
    /// token that stops by id is not detokenized unless include_stop_str_in_output.
    ///
    /// min_tokens (vLLM's semantics): EOS, stop ids and stop strings fire only on a token that
    /// brings the output to at least min_tokens tokens. A stop string is matched over the whole
    /// output text, so one that begins in earlier text and is completed by such a token fires
    /// (the detokenizer held its beginning back); one completed earlier never fires.
    ///
    /// The text to stream is appended to `text` (the step's text column). Returns how the
    /// request finished, if this token finished it.
    pub fn append_token(
        &mut self,
        token: u32,
        eos_token_ids: &[u32],
        block_size: usize,
        max_total_len: usize,
        force_stop: bool,
        text: &mut String,
    ) -> Option<Finish> {
        self.token_ids.push(token);
        self.hasher
            .extend(&self.token_ids, block_size, &mut self.block_hashes);
        let n_out = self.num_output_tokens();
        let stops_active = n_out >= self.limits.min_tokens;
        let mut finish = None;
        if stops_active {
            if !self.limits.ignore_eos && eos_token_ids.contains(&token) {
                finish = Some((FinishReason::Stop, None));
            } else if self.limits.stop_token_ids.contains(&token) {
                finish = Some((FinishReason::Stop, Some(StopReason::TokenId(token))));
            }
        }
        if let Some(d) = self.detok.as_mut() {
            if finish.is_none() || self.limits.include_stop_str_in_output {
                let stop = d.step_into(token, stops_active, text);
                if let (None, Some(i)) = (&finish, stop) {
                    finish = Some((
                        FinishReason::Stop,
                        Some(StopReason::Str(d.stop_strings().get(i).to_string())),
                    ));
                }
            }
        }
        if finish.is_none() && force_stop {
            finish = Some((FinishReason::Stop, None));
        }
        if finish.is_none()
            && (n_out >= self.limits.max_tokens || self.num_tokens() >= max_total_len)
        {
            finish = Some((FinishReason::Length, None));
        }
        if let (None, true, Some(rule)) = (&finish, stops_active, self.limits.repetition) {
            if rule.fires(&self.token_ids[self.num_prompt_tokens..]) {
                finish = Some((FinishReason::Repetition, Some(StopReason::Repetition)));
            }
        }
        if let Some((reason, ref stop)) = finish {
            // Text held back for a possible stop string is released, unless a stop string
            // ended the request (then the held text was the stop string itself).
            if !matches!(stop, Some(StopReason::Str(_))) {
                if let Some(d) = self.detok.as_mut() {
                    d.flush_into(text);
                }
            }
            self.status = RequestStatus::Finished(reason);
        }
        finish
    }
}

#[cfg(test)]
mod repetition_tests {
    use super::RepetitionRule;

    fn rule(min_pattern: usize, max_pattern: usize, min_count: usize) -> RepetitionRule {
        RepetitionRule {
            min_pattern,
            max_pattern,
            min_count,
        }
    }

    #[test]
    fn fires_on_a_tail_repeated_min_count_times() {
        assert!(rule(2, 3, 3).fires(&[1, 2, 3, 1, 2, 3, 1, 2, 3]));
        assert!(!rule(2, 3, 3).fires(&[1, 2, 3, 1, 2, 3])); // two repeats only
        assert!(rule(2, 5, 4).fires(&[1, 2, 1, 2, 1, 2, 1, 2]));
        assert!(rule(1, 1, 3).fires(&[9, 7, 7, 7]));
        assert!(!rule(1, 4, 3).fires(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]));
    }

    #[test]
    fn looks_only_at_the_tail_and_within_its_sizes() {
        // The repeats must end the output.
        assert!(!rule(1, 2, 3).fires(&[5, 5, 5, 1]));
        // A 3-token loop is not caught by sizes 1..=2.
        assert!(!rule(1, 2, 3).fires(&[1, 2, 3, 1, 2, 3, 1, 2, 3]));
        // Sizes below min_pattern are skipped: [.., 4, 4, 4] needs size 1.
        assert!(!rule(2, 3, 3).fires(&[1, 4, 4, 4]));
        // Once a size's repeats exceed the output the search stops.
        assert!(!rule(2, 4, 3).fires(&[1, 1, 1, 1, 1]));
    }
}
