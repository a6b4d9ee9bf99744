//! Speculative decoding settings, and drafts handed in by a draft model.
//!
//! A decode step of a request with d drafts computes 1 + d tokens: its last sampled token and
//! the d guesses after it. The runner verifies the guesses against the target model's logits
//! at those 1 + d positions and returns the accepted prefix plus one token of its own (the
//! correction at the first mismatch, or a bonus token when all were accepted), so one forward
//! pass yields 1..=d+1 tokens. The scheduler rolls the rejected drafts' K/V back.

use crate::error::{invalid, CoreResult};
use crate::scheduler::is_token_id;

/// Where drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecMethod {
    /// Prompt lookup in the core (rust/ngram.rs).
    Ngram,
    /// Only drafts handed to `schedule` (a draft model run by Python).
    DraftModel,
}

impl std::str::FromStr for SpecMethod {
    type Err = crate::error::CoreError;
    fn from_str(s: &str) -> CoreResult<Self> {
        match s {
            "ngram" => Ok(SpecMethod::Ngram),
            "draft_model" => Ok(SpecMethod::DraftModel),
            other => Err(invalid(
                "speculative_method",
                format!("must be 'ngram' or 'draft_model', got {other:?}"),
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculativeConfig {
    /// Most drafts per request per step; 0 turns speculation off.
    pub num_speculative_tokens: usize,
    pub method: SpecMethod,
    /// N-gram lengths the proposer matches (longest first).
    pub prompt_lookup_min: usize,
    pub prompt_lookup_max: usize,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        SpeculativeConfig {
            num_speculative_tokens: 0,
            method: SpecMethod::Ngram,
            prompt_lookup_min: 1,
            prompt_lookup_max: 5,
        }
    }
}

impl SpeculativeConfig {
    /// Checks values given as signed integers (as Python passes them), naming the bad field.
    pub fn from_signed(
        num_speculative_tokens: i64,
        method: &str,
        prompt_lookup_min: i64,
        prompt_lookup_max: i64,
    ) -> CoreResult<Self> {
        // Far above any useful depth (acceptance decays geometrically), and keeps the per-row
        // counts small.
        const MAX_DEPTH: i64 = 64;
        if !(0..=MAX_DEPTH).contains(&num_speculative_tokens) {
            return Err(invalid(
                "num_speculative_tokens",
                format!("must be in 0..={MAX_DEPTH}, got {num_speculative_tokens}"),
            ));
        }
        if !(1..=1024).contains(&prompt_lookup_min) {
            return Err(invalid(
                "prompt_lookup_min",
                format!("must be in 1..=1024, got {prompt_lookup_min}"),
            ));
        }
        if prompt_lookup_max < prompt_lookup_min || prompt_lookup_max > 1024 {
            return Err(invalid(
                "prompt_lookup_max",
                format!(
                    "must be in prompt_lookup_min ({prompt_lookup_min})..=1024, got {prompt_lookup_max}"
                ),
            ));
        }
        Ok(SpeculativeConfig {
            num_speculative_tokens: num_speculative_tokens as usize,
            method: method.parse()?,
            prompt_lookup_min: prompt_lookup_min as usize,
            prompt_lookup_max: prompt_lookup_max as usize,
        })
    }

    pub fn enabled(&self) -> bool {
        self.num_speculative_tokens > 0
    }
}

/// Drafts for one step from outside the core (a draft model), by scheduler slot: slot
/// `slots[i]` proposes `token_ids[offsets[i]..offsets[i + 1]]`. Checked on construction.
#[derive(Debug, Clone, Default)]
pub struct ExternalDrafts {
    slots: Vec<usize>,
    token_ids: Vec<u32>,
    offsets: Vec<usize>,
}

impl ExternalDrafts {
    pub fn new(slots: &[i64], token_ids: &[i64], offsets: &[i64]) -> CoreResult<Self> {
        if offsets.len() != slots.len() + 1 {
            return Err(invalid(
                "draft_offsets",
                format!(
                    "expected len(draft_slots) + 1 = {} entries, got {}",
                    slots.len() + 1,
                    offsets.len()
                ),
            ));
        }
        if offsets[0] != 0 || offsets[slots.len()] != token_ids.len() as i64 {
            return Err(invalid(
                "draft_offsets",
                format!(
                    "must start at 0 and end at len(draft_token_ids) = {}",
                    token_ids.len()
                ),
            ));
        }
        if offsets.windows(2).any(|w| w[1] < w[0]) {
            return Err(invalid("draft_offsets", "must be non-decreasing"));
        }
        if let Some(i) = slots
            .iter()
            .position(|&s| !(0..=i32::MAX as i64).contains(&s))
        {
            return Err(invalid(
                &format!("draft_slots[{i}]"),
                format!("slot {} is out of range", slots[i]),
            ));
        }
        if let Some(i) = token_ids.iter().position(|&t| !is_token_id(t)) {
            return Err(invalid(
                &format!("draft_token_ids[{i}]"),
                format!("token id {} is out of range (0..2^31)", token_ids[i]),
            ));
        }
        Ok(ExternalDrafts {
            slots: slots.iter().map(|&s| s as usize).collect(),
            token_ids: token_ids.iter().map(|&t| t as u32).collect(),
            offsets: offsets.iter().map(|&o| o as usize).collect(),
        })
    }

    /// Each slot's drafts, indexed by slot (None: no drafts given), for `num_slots` slots.
    /// Slots past `num_slots` name no live request and are dropped; a slot given twice keeps
    /// its last drafts.
    pub fn by_slot(&self, num_slots: usize) -> Vec<Option<&[u32]>> {
        let mut out = vec![None; num_slots];
        for (i, &slot) in self.slots.iter().enumerate() {
            if slot < num_slots {
                out[slot] = Some(&self.token_ids[self.offsets[i]..self.offsets[i + 1]]);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_checks_name_the_field() {
        assert!(SpeculativeConfig::from_signed(0, "ngram", 1, 5)
            .unwrap()
            .eq(&SpeculativeConfig::default()));
        for (args, field) in [
            ((-1, "ngram", 1, 5), "num_speculative_tokens"),
            ((65, "ngram", 1, 5), "num_speculative_tokens"),
            ((4, "eagle", 1, 5), "speculative_method"),
            ((4, "ngram", 0, 5), "prompt_lookup_min"),
            ((4, "ngram", 3, 2), "prompt_lookup_max"),
        ] {
            let e = SpeculativeConfig::from_signed(args.0, args.1, args.2, args.3).unwrap_err();
            assert!(e.to_string().starts_with(field), "{e}");
        }
    }

    #[test]
    fn external_drafts_by_slot() {
        let d = ExternalDrafts::new(&[3, 0, 9], &[5, 6, 7], &[0, 2, 2, 3]).unwrap();
        let by = d.by_slot(4);
        assert_eq!(by, vec![Some(&[][..]), None, None, Some(&[5, 6][..])]);
        assert!(ExternalDrafts::new(&[0], &[5], &[0]).is_err());
        assert!(ExternalDrafts::new(&[0], &[5], &[0, 2]).is_err());
        assert!(ExternalDrafts::new(&[0, 1], &[5, 6], &[0, 2, 1]).is_err());
        assert!(ExternalDrafts::new(&[-1], &[5], &[0, 1]).is_err());
        assert!(ExternalDrafts::new(&[0], &[-5], &[0, 1]).is_err());
    }
}

/// Speculative decoding through the scheduler: drafts in the step's arrays, variable accepted
/// runs in the update, rollback of rejected K/V, and the interaction rules.
#[cfg(test)]
mod scheduler_tests {
    use super::*;
    use crate::request::FinishReason;
    use crate::scheduler::{NewRequest, Scheduler, SchedulerConfig};

    const EOS: i64 = 2;

    fn sched(num_blocks: i64, block_size: i64, budget: i64, k: i64, method: &str) -> Scheduler {
        let spec = SpeculativeConfig::from_signed(k, method, 1, 3).unwrap();
        let cfg = SchedulerConfig::from_signed(
            num_blocks,
            block_size,
            256,
            8,
            budget,
            true,
            "fcfs",
            &[EOS],
        )
        .unwrap()
        .with_speculation(spec);
        Scheduler::new(cfg, None).unwrap()
    }

    fn req(id: &str, prompt: &[u32], max_tokens: i64) -> NewRequest {
        let mut r = NewRequest::new(id, prompt.to_vec(), max_tokens);
        r.detokenize = false;
        r
    }

    /// Prefills everything waiting and feeds `tok` to each request.
    fn prefill(s: &mut Scheduler, tok: i64) {
        let out = s.schedule();
        s.update_from_output(&vec![tok; out.req_ids.len()], None)
            .unwrap();
        s.check_invariants();
    }

    fn drafts(slots: &[i64], ids: &[i64], offsets: &[i64]) -> ExternalDrafts {
        ExternalDrafts::new(slots, ids, offsets).unwrap()
    }

    #[test]
    fn ngram_drafts_ride_in_the_step_and_partial_acceptance_rolls_back() {
        let mut s = sched(64, 4, 64, 3, "ngram");
        s.add_request(req("a", &[10, 11, 12, 13, 10, 11, 12], 20))
            .unwrap();
        prefill(&mut s, 13);
        // Tokens ...10 11 12 13: the suffix [11, 12, 13] occurred at 1..4, followed by 10 11 12.
        let out = s.schedule();
        let a = &out.arrays;
        assert_eq!(a.input_ids, vec![13, 10, 11, 12]);
        assert_eq!(a.positions, vec![7, 8, 9, 10]);
        assert_eq!(a.num_draft_tokens, vec![3]);
        assert_eq!(a.draft_token_ids, vec![10, 11, 12]);
        assert_eq!(a.logits_indices, vec![0, 1, 2, 3]);
        assert_eq!(a.logits_start_loc, vec![0, 4]);
        assert_eq!(a.seq_lens, vec![11]);
        assert_eq!(a.sample_mask, vec![true]);
        assert_eq!(out.num_tokens, 4);
        s.check_invariants();
        // The verifier accepts one draft (10) and corrects the second to 99.
        let res = s
            .update_from_output_counts(&[10, 99], Some(&[2]), None)
            .unwrap()
            .rows();
        assert_eq!(res[0].new_token_ids, vec![10, 99]);
        assert_eq!(res[0].num_output_tokens, 3);
        s.check_invariants();
        // 9 computed (7 prompt + 13 + 10), 99 is next: the rejected slots are overwritten.
        let out = s.schedule();
        assert_eq!(out.arrays.positions[0], 9);
        assert_eq!(out.arrays.input_ids[0], 99);
        assert_eq!(out.arrays.num_computed_tokens, vec![9]);
        let st = s.stats();
        assert_eq!(
            (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens),
            (1, 3, 1)
        );
        assert_eq!(st.num_accepted_tokens_per_pos, vec![1, 0, 0]);
        assert_eq!(st.num_generation_tokens, 3);
    }

    #[test]
    fn all_accepted_plus_bonus_and_a_stop_inside_the_run() {
        let mut s = sched(64, 4, 64, 3, "draft_model");
        let a = s.add_request(req("a", &[5, 6, 7], 20)).unwrap() as i64;
        let mut b = req("b", &[5, 6, 8], 20);
        b.stop_token_ids = vec![40];
        let b = s.add_request(b).unwrap() as i64;
        prefill(&mut s, 9);
        // Without drafts handed in, the draft_model method proposes nothing.
        let out = s.schedule();
        assert_eq!(out.arrays.num_draft_tokens, vec![0, 0]);
        s.update_from_output(&[20, 30], None).unwrap();
        let d = drafts(&[a, b], &[21, 22, 23, 31, 40, 32], &[0, 3, 6]);
        let out = s.schedule_with_drafts(false, Some(&d));
        assert_eq!(out.arrays.input_ids, vec![20, 21, 22, 23, 30, 31, 40, 32]);
        assert_eq!(out.arrays.logits_start_loc, vec![0, 4, 8]);
        let free_before = s.num_free_blocks();
        let res = s
            .update_from_output_counts(&[21, 22, 23, 24, 31, 40, 32, 33], Some(&[4, 4]), None)
            .unwrap()
            .rows();
        assert_eq!(res[0].new_token_ids, vec![21, 22, 23, 24]);
        assert_eq!(res[0].finish_reason, None);
        // b stops on 40, inside its accepted run: 32 and 33 are dropped.
        assert_eq!(res[1].new_token_ids, vec![31, 40]);
        assert_eq!(res[1].finish_reason, Some(FinishReason::Stop));
        assert_eq!(res[1].num_output_tokens, 4);
        assert!(s.num_free_blocks() > free_before, "b's blocks are freed");
        s.check_invariants();
        assert_eq!(s.request_tokens("a")[3..], [9, 20, 21, 22, 23, 24]);
        // All accepted: 9 computed, the bonus token 24 is next.
        let out = s.schedule();
        assert_eq!(out.arrays.positions, vec![8]);
        assert_eq!(out.arrays.input_ids, vec![24]);
    }

    #[test]
    fn drafts_respect_max_tokens_the_length_limit_and_the_budget() {
        // max_tokens 4: after 2 outputs at most 1 draft (1 accepted + 1 bonus = 4 outputs).
        let mut s = sched(64, 4, 64, 3, "draft_model");
        let slot = s.add_request(req("a", &[5, 6, 7], 4)).unwrap() as i64;
        prefill(&mut s, 9);
        let d = drafts(&[slot], &[1, 1, 1], &[0, 3]);
        assert_eq!(
            s.schedule_with_drafts(false, Some(&d))
                .arrays
                .num_draft_tokens,
            vec![2]
        );
        s.update_from_output(&[8], None).unwrap();
        assert_eq!(
            s.schedule_with_drafts(false, Some(&d))
                .arrays
                .num_draft_tokens,
            vec![1]
        );
        let res = s
            .update_from_output_counts(&[1, 3], Some(&[2]), None)
            .unwrap()
            .rows();
        assert_eq!(res[0].finish_reason, Some(FinishReason::Length));
        assert_eq!(res[0].num_output_tokens, 4);
        s.check_invariants();

        // The token budget counts drafts: 3 tokens for one decode leaves room for 2.
        let mut s = sched(64, 4, 3, 3, "draft_model");
        let slot = s.add_request(req("a", &[5, 6], 20)).unwrap() as i64;
        prefill(&mut s, 9);
        let d = drafts(&[slot], &[1, 1, 1], &[0, 3]);
        let out = s.schedule_with_drafts(false, Some(&d));
        assert_eq!((out.num_tokens, out.arrays.num_draft_tokens[0]), (3, 2));

        // The length limit (max_model_len 256 here): the KV cache holds 12 tokens in all.
        let mut s = sched(4, 4, 64, 3, "draft_model");
        let slot = s.add_request(req("a", &[5; 9], 100)).unwrap() as i64;
        prefill(&mut s, 9);
        let d = drafts(&[slot], &[1, 1, 1], &[0, 3]);
        let out = s.schedule_with_drafts(false, Some(&d));
        assert_eq!(
            out.arrays.num_draft_tokens,
            vec![1],
            "10 tokens + 1 draft + bonus = 12"
        );
        s.check_invariants();
    }

    #[test]
    fn no_room_for_drafts_means_no_drafts_not_a_preemption() {
        // 3 usable blocks of 4; a (8 tokens) and b (3) fill them after prefill + 1 token each.
        let mut s = sched(4, 4, 64, 3, "draft_model");
        let a = s.add_request(req("a", &[5; 7], 20)).unwrap() as i64;
        let b = s.add_request(req("b", &[6; 3], 20)).unwrap() as i64;
        prefill(&mut s, 9);
        assert_eq!(s.num_free_blocks(), 0);
        let d = drafts(&[a, b], &[1, 1, 1, 1, 1, 1], &[0, 3, 6]);
        let out = s.schedule_with_drafts(false, Some(&d));
        assert!(out.preempted_req_ids.is_empty());
        assert_eq!(out.arrays.num_draft_tokens, vec![0, 0]);
        s.check_invariants();
    }

    #[test]
    fn only_blocks_of_accepted_tokens_reach_the_prefix_cache() {
        for accept_all in [false, true] {
            let mut s = sched(64, 4, 64, 3, "draft_model");
            let prompt: Vec<u32> = (100..108).collect();
            let slot = s.add_request(req("a", &prompt, 20)).unwrap() as i64;
            prefill(&mut s, 50);
            // Positions 8..11 (block 2) hold 50 and the drafts 51 52 53.
            let d = drafts(&[slot], &[51, 52, 53], &[0, 3]);
            s.schedule_with_drafts(false, Some(&d));
            let (toks, n): (&[i64], i32) = if accept_all {
                (&[51, 52, 53, 54], 4)
            } else {
                (&[60], 1)
            };
            s.update_from_output_counts(toks, Some(&[n]), None).unwrap();
            s.check_invariants();
            // One more step (it caches what became full and computed), then a request whose
            // prompt is a's prompt + [50, 51, 52, 53, 7].
            let out = s.schedule();
            s.update_from_output(&vec![70; out.req_ids.len()], None)
                .unwrap();
            let mut p2 = prompt.clone();
            p2.extend([50, 51, 52, 53, 7]);
            s.add_request(req("b", &p2, 5)).unwrap();
            let out = s.schedule();
            let hit = *out.arrays.num_computed_tokens.last().unwrap();
            assert_eq!(
                hit,
                if accept_all { 12 } else { 8 },
                "accept_all={accept_all}"
            );
            s.check_invariants();
        }
    }

    #[test]
    fn abort_and_preemption_of_a_request_with_drafts_in_flight() {
        let mut s = sched(64, 4, 64, 3, "draft_model");
        let a = s.add_request(req("a", &[5, 6, 7], 20)).unwrap() as i64;
        let b = s.add_request(req("b", &[5, 6, 8], 20)).unwrap() as i64;
        prefill(&mut s, 9);
        let d = drafts(&[a, b], &[1, 2, 3, 1, 2, 3], &[0, 3, 6]);
        s.schedule_with_drafts(false, Some(&d));
        s.abort_requests(&["a"]);
        s.check_invariants();
        let res = s
            .update_from_output_counts(&[1, 2, 3, 4, 1, 5], Some(&[4, 2]), None)
            .unwrap()
            .rows();
        assert_eq!(res.len(), 1);
        assert_eq!(res[0].new_token_ids, vec![1, 5]);
        s.check_invariants();
        s.abort_requests(&["b"]);
        assert_eq!(s.num_free_blocks(), 63);
    }

    #[test]
    fn a_failed_step_with_drafts_is_rolled_back_and_rescheduled_the_same() {
        let mut s = sched(64, 4, 64, 3, "ngram");
        s.add_request(req("a", &[10, 11, 12, 13, 10, 11, 12], 20))
            .unwrap();
        prefill(&mut s, 13);
        let first = s.schedule();
        let again = s.schedule(); // no update: the model step failed
        s.check_invariants();
        assert_eq!(again.arrays.input_ids, first.arrays.input_ids);
        assert_eq!(again.arrays.positions, first.arrays.positions);
        assert_eq!(again.arrays.slot_mapping, first.arrays.slot_mapping);
        s.update_from_output_counts(&[10, 11, 12, 13], Some(&[4]), None)
            .unwrap();
        s.check_invariants();
    }

    #[test]
    fn async_steps_schedule_past_drafts_in_flight_optimistically() {
        let mut s = sched(64, 4, 64, 3, "ngram");
        // a repeats 10 11 12 13; b never repeats (no drafts).
        s.add_request(req("a", &[10, 11, 12, 13, 10, 11, 12], 20))
            .unwrap();
        s.add_request(req("b", &[5, 6, 8], 20)).unwrap();
        prefill(&mut s, 13); // a: ...10 11 12 13, b: 5 6 8 13
        let first = s.schedule_step(true);
        assert_eq!(first.arrays.num_draft_tokens, vec![3, 0]);
        assert_eq!(first.arrays.input_ids, vec![13, 10, 11, 12, 13]);
        assert_eq!(first.arrays.positions, vec![7, 8, 9, 10, 3]);
        // Decided while `first` computes: a counts as if its 3 drafts and its own token
        // (guessed 13, the next in the pattern) were in: its placeholder sits at position 11
        // and its new drafts continue the pattern after the guess. b's placeholder gets drafts
        // from the proposal over its tokens alone (none: nothing repeats).
        let second = s.schedule_step(true);
        assert_eq!(second.req_ids.iter().collect::<Vec<_>>(), vec!["a", "b"]);
        assert_eq!(second.arrays.input_ids, vec![-1, 10, 11, 12, -1]);
        assert_eq!(second.arrays.positions, vec![11, 12, 13, 14, 4]);
        assert_eq!(second.arrays.num_draft_tokens, vec![3, 0]);
        assert_eq!(second.arrays.seq_lens, vec![15, 5]);
        assert!(second.arrays.sample_mask.iter().all(|&m| m));
        s.check_invariants();
        // first: a keeps one draft (10) and corrects to 13; the runner shifted `second`'s row
        // of a back by the 2 rejected drafts (positions 9..12).
        let rows = s
            .update_from_output_counts(&[10, 13, 42], Some(&[2, 1]), None)
            .unwrap()
            .rows();
        assert_eq!(rows[0].new_token_ids, vec![10, 13]);
        s.check_invariants();
        // Decided while `second` computes: its drafts assumed `first` kept all three and its
        // own token was 13; it did not, so they are assumed rejected too, and the proposal
        // builds on the delivered tokens (...13 10 13: after 13 came 10 11 12 13; 10 guesses
        // `second`'s own token). The placeholder sits where all of `second` being accepted
        // puts it: 10 computed + 1 + 3 drafts.
        let third = s.schedule_step(true);
        assert_eq!(third.arrays.input_ids[..4], [-1, 11, 12, 13]);
        assert_eq!(third.arrays.positions[..4], [13, 14, 15, 16]);
        // second: nothing accepted for a (its drafts were built on 10 11 12).
        s.update_from_output_counts(&[77, 43], Some(&[1, 1]), None)
            .unwrap();
        s.check_invariants();
        assert_eq!(s.request_tokens("a")[7..], [13, 10, 13, 77]);
        assert_eq!(s.request_tokens("b")[3..], [13, 42, 43]);
        // third: a keeps nothing either; 7 prompt + 13 10 13 77 computed, the correction 78 is next.
        s.update_from_output_counts(&[78, 44], Some(&[1, 1]), None)
            .unwrap();
        s.check_invariants();
        let fourth = s.schedule();
        assert_eq!(fourth.arrays.positions[0], 11);
        assert_eq!(fourth.arrays.input_ids[0], 78);
        let st = s.stats();
        assert_eq!(
            (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens),
            (3, 9, 1)
        );
    }

    #[test]
    fn drafts_can_be_turned_off_per_request() {
        let mut s = sched(64, 4, 64, 3, "ngram");
        let mut r = req("g", &[10, 11, 10, 11], 20);
        r.allow_drafts = false;
        s.add_request(r).unwrap();
        s.add_request(req("x", &[10, 11, 10, 11], 20)).unwrap();
        prefill(&mut s, 10);
        assert_eq!(s.schedule().arrays.num_draft_tokens, vec![0, 2]);
    }

    #[test]
    fn bad_counts_and_tokens_that_are_not_the_drafts_are_rejected_without_effect() {
        let mut s = sched(64, 4, 64, 3, "draft_model");
        let a = s.add_request(req("a", &[5, 6, 7], 20)).unwrap() as i64;
        s.add_request(req("long", &[1; 30], 20)).unwrap();
        prefill(&mut s, 9);
        let d = drafts(&[a], &[11, 12], &[0, 2]);
        let out = s.schedule_with_drafts(false, Some(&d));
        assert_eq!(out.arrays.sample_mask.len(), 2);
        let mut err = |toks: &[i64], counts: &[i32]| {
            s.update_from_output_counts(toks, Some(counts), None)
                .unwrap_err()
                .to_string()
        };
        assert!(err(&[1, 2, 3, 4], &[4, 0]).starts_with("num_sampled_tokens[0]"));
        assert!(err(&[], &[0, 0]).starts_with("num_sampled_tokens[0]"));
        assert!(
            err(&[1, 5, 7], &[2, 0]).starts_with("sampled_token_ids"),
            "count mismatch"
        );
        assert!(err(&[7, 12], &[2, 0]).contains("must be its drafts"));
        assert!(err(&[11, -2], &[2, 0]).starts_with("sampled_token_ids[1]"));
        assert!(err(&[1], &[1]).starts_with("num_sampled_tokens"));
        s.check_invariants();
        let res = s
            .update_from_output_counts(&[11, 12, 13, 0], Some(&[3, 1]), None)
            .unwrap();
        assert_eq!(res.rows()[0].new_token_ids, vec![11, 12, 13]);
        s.check_invariants();
    }
}
