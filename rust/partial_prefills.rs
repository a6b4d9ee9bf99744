//! Concurrent partial prefills: vLLM's `max_num_partial_prefills` / `max_long_partial_prefills`, with the
//! meaning their documentation (and vLLM's V0 scheduler, which enforced them) gives them.
//!
//! Why: with chunked prefill a long prompt takes the whole step budget step after step, and every
//! prompt behind it waits for its last chunk (head-of-line blocking: long-context serving's TTFT tail).
//! With `max_prefills` > 1 the budget is shared: each prompt in prefill computes at most
//! `budget / n` tokens a step, n being how many prompts could prefill together this step (at most
//! `max_prefills`); and at most `max_long` of them may be long (more than `long_threshold` tokens
//! still to compute), so a short prompt goes ahead of a long one queued before it instead of
//! waiting behind it. `max_prefills` 1 (the default) changes nothing: vLLM's V1 scheduler, which
//! ferrox's follows, does not split the budget.

/// The settings (checked by the caller: `max_long` <= `max_prefills`, a threshold when on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartialPrefillLimits {
    pub max_prefills: usize,
    pub max_long: usize,
    pub long_threshold: usize,
}

impl Default for PartialPrefillLimits {
    fn default() -> Self {
        PartialPrefillLimits {
            max_prefills: 1,
            max_long: 1,
            long_threshold: 0,
        }
    }
}

impl PartialPrefillLimits {
    pub fn enabled(&self) -> bool {
        self.max_prefills > 1
    }

    fn is_long(&self, remaining: usize) -> bool {
        remaining > self.long_threshold
    }
}

/// One step's plan: the budget a prompt in prefill may take, and the long prompts admitted so far.
#[derive(Debug, Clone, Copy)]
pub struct PartialPrefills {
    limits: PartialPrefillLimits,
    slot_budget: usize,
    long_prefills: usize,
}

impl PartialPrefills {
    /// `running`: the tokens each running request still has to compute (a prompt in prefill has
    /// more than one); `waiting`: each waiting request's uncomputed tokens, in queue order. The
    /// prompts that can prefill this step are the running ones in prefill, then the waiting ones
    /// in order up to `max_prefills`, long ones only while fewer than `max_long` are counted.
    pub fn plan(
        limits: PartialPrefillLimits,
        budget: usize,
        running: impl Iterator<Item = usize>,
        waiting: impl Iterator<Item = usize>,
    ) -> Self {
        let mut prefills = 0;
        let mut long_prefills = 0;
        for remaining in running.filter(|&r| r > 1) {
            prefills += 1;
            long_prefills += limits.is_long(remaining) as usize;
        }
        let mut waiting_long = 0;
        for remaining in waiting {
            if prefills >= limits.max_prefills {
                break;
            }
            if limits.is_long(remaining) {
                if long_prefills + waiting_long >= limits.max_long {
                    continue;
                }
                waiting_long += 1;
            }
            prefills += 1;
        }
        let sharing = prefills.clamp(1, limits.max_prefills.max(1));
        PartialPrefills {
            limits,
            slot_budget: (budget / sharing).max(1),
            long_prefills,
        }
    }

    /// The budget a request with `remaining` tokens to compute may take of the step's `budget`:
    /// its share when it is a prompt in prefill, all of it for a decode.
    pub fn chunk_budget(&self, budget: usize, remaining: usize) -> usize {
        if remaining > 1 {
            budget.min(self.slot_budget)
        } else {
            budget
        }
    }

    /// Whether a waiting request with `remaining` uncomputed tokens may start its prefill now: a
    /// long one waits while `max_long` long prompts are prefilling (the ones behind it may go).
    pub fn may_admit(&self, remaining: usize) -> bool {
        !(self.limits.is_long(remaining) && self.long_prefills >= self.limits.max_long)
    }

    pub fn admitted(&mut self, remaining: usize) {
        self.long_prefills += self.limits.is_long(remaining) as usize;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: PartialPrefillLimits = PartialPrefillLimits {
        max_prefills: 3,
        max_long: 1,
        long_threshold: 100,
    };

    #[test]
    fn the_budget_is_shared_by_the_prompts_that_can_prefill_together() {
        // Two decodes (1 token each), one prompt in prefill; two short prompts waiting: 3 share.
        let p = PartialPrefills::plan(LIMITS, 900, [1, 50, 1].into_iter(), [10, 20].into_iter());
        assert_eq!(p.chunk_budget(900, 50), 300);
        assert_eq!(
            p.chunk_budget(200, 50),
            200,
            "never more than what is left of the step"
        );
        assert_eq!(p.chunk_budget(900, 1), 900, "a decode is not a prefill");
        // Nothing else prefilling: the one prompt takes everything.
        let alone = PartialPrefills::plan(LIMITS, 900, [1].into_iter(), [5000].into_iter());
        assert_eq!(alone.chunk_budget(900, 5000), 900);
    }

    #[test]
    fn at_most_max_long_long_prompts_prefill_together() {
        // A long prompt prefilling: the waiting long one is not counted, the short one behind it is.
        let mut p = PartialPrefills::plan(LIMITS, 900, [500].into_iter(), [800, 30].into_iter());
        assert_eq!(p.chunk_budget(900, 500), 450);
        assert!(!p.may_admit(800) && p.may_admit(30) && p.may_admit(100));
        // None running: the first long one is admitted, then the next waits.
        p = PartialPrefills::plan(LIMITS, 900, std::iter::empty(), [800, 800, 30].into_iter());
        assert!(p.may_admit(800));
        p.admitted(800);
        assert!(!p.may_admit(800) && p.may_admit(30));
        assert_eq!(
            p.chunk_budget(900, 800),
            450,
            "800 and 30 share; the second 800 is not counted"
        );
    }

    #[test]
    fn counting_stops_at_max_prefills() {
        let p = PartialPrefills::plan(
            LIMITS,
            900,
            std::iter::empty(),
            [10, 10, 10, 10, 10].into_iter(),
        );
        assert_eq!(p.chunk_budget(900, 10), 300);
    }
}
