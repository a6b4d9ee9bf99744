//! Property test of a hybrid model's state snapshots (state_snapshots.rs) under random
//! operations: synchronous and overlapped (async) steps, failed steps, aborts and preemption
//! with a tiny KV cache and few snapshot slots. A shadow of the runner follows each step's
//! copies (restores before the forward, saves after) with "the state after request R's first L
//! tokens" in place of the states, and checks that every step continues each request from
//! exactly its own tokens: a restored snapshot must be the state after the same tokens.

use std::collections::{HashMap, VecDeque};

use proptest::prelude::*;

use crate::scheduler::{NewRequest, Scheduler, SchedulerConfig};

const EOS: i64 = 2;

#[derive(Debug, Clone)]
enum Op {
    Add {
        prefix: u8,
        len: usize,
        max_tokens: i64,
    },
    ScheduleAhead,
    Schedule,
    Update {
        token: i64,
    },
    Fail,
    Abort {
        index: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 1usize..40, 1i64..20).prop_map(|(prefix, len, max_tokens)| Op::Add { prefix, len, max_tokens }),
        4 => Just(Op::ScheduleAhead),
        2 => Just(Op::Schedule),
        // Few distinct tokens: outputs repeat, so later prompts share prefixes with earlier answers.
        6 => prop_oneof![8 => 3i64..6, 1 => Just(EOS)].prop_map(|token| Op::Update { token }),
        1 => Just(Op::Fail),
        1 => (0usize..16).prop_map(|index| Op::Abort { index }),
    ]
}

/// A state: the first `len` tokens of request `of`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct State {
    of: usize,
    len: usize,
}

#[derive(Default)]
struct Shadow {
    /// Every request's known tokens (prompt, then delivered samples), by its serial.
    tokens: Vec<Vec<u32>>,
    ids: HashMap<String, usize>,
    /// Each request's state row (None: unknown, it must start from token 0 or a restore).
    rows: HashMap<usize, State>,
    slots: HashMap<u32, State>,
    in_flight: VecDeque<Vec<usize>>,
    failed: bool,
    live: Vec<usize>,
}

impl Shadow {
    fn same_prefix(&self, a: State, b: usize) -> bool {
        let (ta, tb) = (&self.tokens[a.of], &self.tokens[b]);
        ta.len() >= a.len && tb.len() >= a.len && ta[..a.len] == tb[..a.len]
    }

    fn schedule(&mut self, s: &mut Scheduler, keep_in_flight: bool) -> Result<(), TestCaseError> {
        let after_failure = std::mem::take(&mut self.failed);
        let keep = keep_in_flight && !after_failure;
        if !keep || self.in_flight.len() >= 2 {
            self.in_flight.clear();
        }
        let out = s.schedule_step(keep);
        for id in &out.preempted_req_ids {
            self.rows.remove(&self.ids[&**id]);
        }
        let reqs: Vec<usize> = out.req_ids.iter().map(|id| self.ids[id]).collect();
        // Restores, before the forward.
        for &(i, slot) in &out.state_restores {
            let r = reqs[i as usize];
            let snap = *self
                .slots
                .get(&slot)
                .expect("a restored slot was saved before");
            prop_assert_eq!(
                snap.len,
                out.arrays.num_computed_tokens[i as usize] as usize
            );
            prop_assert!(
                self.same_prefix(snap, r),
                "restored the state of other tokens"
            );
            self.rows.insert(r, snap);
        }
        // The forward: each request continues from its own state.
        for (i, &r) in reqs.iter().enumerate() {
            let start = out.arrays.num_computed_tokens[i] as usize;
            if start > 0 {
                let state = self.rows.get(&r).copied();
                prop_assert!(
                    state.is_some(),
                    "request continues at {} from no state",
                    start
                );
                let state = state.unwrap();
                prop_assert_eq!(state.len, start);
                prop_assert!(self.same_prefix(state, r));
            }
            let n = out.arrays.num_scheduled_tokens[i] as usize;
            self.rows.insert(
                r,
                State {
                    of: r,
                    len: start + n,
                },
            );
        }
        // Saves, after it.
        for &(i, slot) in &out.state_saves {
            self.slots.insert(slot, self.rows[&reqs[i as usize]]);
        }
        s.check_invariants();
        if !reqs.is_empty() {
            self.in_flight.push_back(reqs);
        }
        Ok(())
    }

    fn update(&mut self, s: &mut Scheduler, token: i64) {
        if self.failed {
            return;
        }
        let Some(step) = self.in_flight.pop_front() else {
            return;
        };
        let outs = s
            .update_from_output(&vec![token; step.len()], None)
            .unwrap();
        for row in outs.rows() {
            let r = self.ids[&*row.request_id];
            self.tokens[r].extend(&row.new_token_ids);
            if row.finish_reason.is_some() {
                self.live.retain(|&x| x != r);
            }
        }
        s.check_invariants();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn every_step_continues_from_the_state_of_its_own_tokens(
        num_blocks in 8i64..40,
        block_size in prop_oneof![Just(1i64), Just(2), Just(4)],
        blocks_per_state in 1usize..4,
        slots in 1usize..6,
        budget in 4i64..40,
        ops in prop::collection::vec(op(), 1..90),
    ) {
        let grid = block_size as usize * blocks_per_state;
        let config = SchedulerConfig::from_signed(num_blocks, block_size, 128, 4, budget, true, "fcfs", &[EOS])
            .unwrap()
            .with_recurrent_states(grid, slots)
            .unwrap();
        let mut s = Scheduler::new(config, None).unwrap();
        let mut e = Shadow::default();
        for op in &ops {
            match op {
                Op::Add { prefix, len, max_tokens } => {
                    let serial = e.tokens.len();
                    // A shared head, then (half the time) an earlier request's tokens: a later turn.
                    let mut prompt: Vec<u32> = (0..(*len).min(12)).map(|i| 100 + *prefix as u32 * 20 + i as u32).collect();
                    if serial % 2 == 1 {
                        prompt = e.tokens[serial - 1].clone();
                    }
                    prompt.extend((0..len.saturating_sub(prompt.len()).min(6)).map(|i| 500 + i as u32));
                    if prompt.is_empty() {
                        prompt.push(7);
                    }
                    let id = format!("r{serial}");
                    let mut r = NewRequest::new(id.clone(), prompt.clone(), *max_tokens);
                    r.detokenize = false;
                    e.tokens.push(prompt);
                    e.ids.insert(id, serial);
                    if s.add_request(r).is_ok() {
                        e.live.push(serial);
                    }
                }
                Op::ScheduleAhead => e.schedule(&mut s, true)?,
                Op::Schedule => e.schedule(&mut s, false)?,
                Op::Update { token } => e.update(&mut s, *token),
                Op::Fail => {
                    e.in_flight.clear();
                    e.failed = true;
                }
                Op::Abort { index } => {
                    if !e.live.is_empty() {
                        let r = e.live.remove(index % e.live.len());
                        s.abort_requests(&[format!("r{r}").as_str()]);
                    }
                }
            }
        }
        let mut steps = 0;
        while s.has_unfinished_requests() {
            e.schedule(&mut s, false)?;
            e.update(&mut s, 4);
            steps += 1;
            prop_assert!(steps < 5000, "requests never finished");
        }
        prop_assert_eq!(s.num_free_blocks(), num_blocks as usize - 1, "blocks leaked");
        prop_assert!(s.state_snapshots().unwrap().len() <= slots);
    }
}
