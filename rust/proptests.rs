//! Property tests of the scheduler + KV cache invariants under random operation sequences
//! (add / step / abort with tiny block pools, so preemption and eviction happen often), of
//! overlapped (async) scheduling with failed steps rolled back and grammar-gated requests, and
//! of the detokenizer's stop strings against a reference.

use proptest::prelude::*;

use crate::scheduler::{NewRequest, Scheduler, SchedulerConfig};

const EOS: i64 = 2;

#[derive(Debug, Clone)]
enum Op {
    /// Add a request whose prompt starts with one of a few shared prefixes (so prefix-cache
    /// hits, shared blocks and eviction all occur).
    Add {
        prefix: u8,
        len: usize,
        max_tokens: i64,
        priority: i64,
        min_tokens: i64,
    },
    /// schedule() + update_from_output() with these sampled tokens (cycled); EOS among them.
    Step { tokens: Vec<i64> },
    /// Abort the i-th live request (mod the count), or an unknown id.
    Abort { index: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..4, 1usize..40, 1i64..24, -2i64..3, 0i64..3).prop_map(|(prefix, len, max_tokens, priority, min_tokens)| {
            Op::Add { prefix, len, max_tokens, priority, min_tokens: min_tokens.min(max_tokens) }
        }),
        6 => prop::collection::vec(prop_oneof![8 => 3i64..50, 1 => Just(EOS)], 1..8).prop_map(|tokens| Op::Step { tokens }),
        1 => (0usize..16).prop_map(|index| Op::Abort { index }),
    ]
}

#[derive(Debug, Clone)]
struct Cfg {
    num_blocks: i64,
    block_size: i64,
    max_num_seqs: i64,
    budget: i64,
    caching: bool,
    policy: &'static str,
    /// Concurrent partial prefills: (max_num_partial_prefills, max_long_partial_prefills, threshold).
    partial: Option<(usize, usize, usize)>,
}

fn cfg() -> impl Strategy<Value = Cfg> {
    (
        6i64..40,
        prop_oneof![Just(1i64), Just(2), Just(4), Just(16)],
        1i64..6,
        1i64..48,
        any::<bool>(),
        any::<bool>(),
        prop::option::of((2usize..5, 1usize..3, 1usize..40)),
    )
        .prop_map(
            |(num_blocks, block_size, max_num_seqs, budget, caching, prio, partial)| Cfg {
                num_blocks,
                block_size,
                max_num_seqs,
                budget,
                caching,
                policy: if prio { "priority" } else { "fcfs" },
                partial,
            },
        )
}

fn prompt(prefix: u8, len: usize, serial: usize) -> Vec<u32> {
    (0..len)
        .map(|i| {
            if i < 24 {
                1000 + prefix as u32 * 100 + i as u32
            } else {
                5000 + serial as u32
            }
        })
        .collect()
}

/// Stands in for the paged KV cache: what each slot holds, as a digest of the token prefix
/// whose K/V was written there. A slot's K/V depends on every token up to its position.
type KvShadow = std::collections::HashMap<i64, u64>;

fn prefix_digests(tokens: &[u32]) -> Vec<u64> {
    let mut h = 0xcbf29ce484222325u64;
    tokens
        .iter()
        .map(|&t| {
            h = (h ^ t as u64).wrapping_mul(0x100000001b3).rotate_left(17);
            h
        })
        .collect()
}

/// One engine step, checking what schedule() promised, and that every K/V position a request
/// attends to (cached prefix included) holds exactly its own tokens' K/V.
fn step(s: &mut Scheduler, c: &Cfg, tokens: &[i64], live: &mut Vec<String>, kv: &mut KvShadow) {
    let out = s.schedule();
    let a = &out.arrays;
    let bs = c.block_size;
    let digests: Vec<Vec<u64>> = out
        .req_ids
        .iter()
        .map(|id| prefix_digests(&s.request_tokens(id)))
        .collect();
    // The runner writes every scheduled token's K/V before any attention reads...
    for (r, d) in digests.iter().enumerate() {
        for t in a.query_start_loc[r]..a.query_start_loc[r + 1] {
            kv.insert(
                a.slot_mapping[t as usize],
                d[a.positions[t as usize] as usize],
            );
        }
    }
    // ...then each request reads its seq_len positions through its block table.
    for (r, d) in digests.iter().enumerate() {
        let row = &a.block_table[r * a.max_blocks..(r + 1) * a.max_blocks];
        for p in 0..a.seq_lens[r] as i64 {
            let slot = row[(p / bs) as usize] as i64 * bs + p % bs;
            assert_eq!(
                kv.get(&slot),
                Some(&d[p as usize]),
                "request {} reads wrong K/V at {p}",
                out.req_ids.get(r)
            );
        }
    }
    assert!(out.num_tokens <= c.budget as usize, "token budget exceeded");
    assert!(
        out.req_ids.len() <= c.max_num_seqs as usize,
        "max_num_seqs exceeded"
    );
    assert_eq!(a.input_ids.len(), out.num_tokens);
    assert_eq!(
        a.query_start_loc.last().copied(),
        Some(out.num_tokens as i32)
    );
    for (r, id) in out.req_ids.iter().enumerate() {
        let blocks = s.request_block_ids(id).unwrap();
        for t in a.query_start_loc[r]..a.query_start_loc[r + 1] {
            let slot = a.slot_mapping[t as usize];
            let pos = a.positions[t as usize];
            assert_eq!(
                slot / bs,
                blocks[(pos / bs) as usize] as i64,
                "slot outside the request's block"
            );
        }
        assert!(a.num_scheduled_tokens[r] >= 1);
    }
    s.check_invariants();
    let sampled: Vec<i64> = (0..out.req_ids.len())
        .map(|i| tokens[i % tokens.len()])
        .collect();
    let outs = s.update_from_output(&sampled, None).unwrap();
    for o in outs.rows() {
        if o.finish_reason.is_some() {
            live.retain(|x| **x != *o.request_id);
        }
    }
    s.check_invariants();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_under_random_operations(c in cfg(), ops in prop::collection::vec(op(), 1..60)) {
        let mut config = SchedulerConfig::from_signed(
            c.num_blocks, c.block_size, 128, c.max_num_seqs, c.budget, c.caching, c.policy, &[EOS],
        ).unwrap();
        if let Some((max_prefills, max_long, threshold)) = c.partial {
            config = config.with_long_prefill_token_threshold(threshold).with_partial_prefills(max_prefills, max_long).unwrap();
        }
        let mut s = Scheduler::new(config, None).unwrap();
        let mut kv = KvShadow::new();
        let mut live: Vec<String> = Vec::new();
        for (serial, op) in ops.iter().enumerate() {
            match op {
                Op::Add { prefix, len, max_tokens, priority, min_tokens } => {
                    let id = format!("r{serial}");
                    let mut r = NewRequest::new(id.clone(), prompt(*prefix, *len, serial), *max_tokens);
                    r.detokenize = false;
                    r.priority = *priority;
                    r.min_tokens = *min_tokens;
                    // Prompts too long for a tiny cache are rejected; that must change nothing.
                    let before = s.num_unfinished_requests();
                    match s.add_request(r) {
                        Ok(_) => live.push(id),
                        Err(_) => prop_assert_eq!(s.num_unfinished_requests(), before),
                    }
                }
                Op::Step { tokens } => step(&mut s, &c, tokens, &mut live, &mut kv),
                Op::Abort { index } => {
                    let id = if live.is_empty() { "unknown".to_string() } else { live.remove(index % live.len()) };
                    s.abort_requests(&[id]);
                }
            }
            s.check_invariants();
        }
        // Liveness: with no new work, everything finishes (no request waits forever).
        let mut steps = 0;
        while s.has_unfinished_requests() {
            step(&mut s, &c, &[7, 8, 9], &mut live, &mut kv);
            steps += 1;
            prop_assert!(steps < 5000, "requests never finished: {} left", s.num_unfinished_requests());
        }
        prop_assert_eq!(s.num_free_blocks(), c.num_blocks as usize - 1, "blocks leaked");
    }

    #[test]
    fn abort_everything_frees_everything(c in cfg(), ops in prop::collection::vec(op(), 1..40)) {
        let config = SchedulerConfig::from_signed(
            c.num_blocks, c.block_size, 128, c.max_num_seqs, c.budget, c.caching, c.policy, &[EOS],
        ).unwrap();
        let mut s = Scheduler::new(config, None).unwrap();
        let mut kv = KvShadow::new();
        let mut live = Vec::new();
        for (serial, op) in ops.iter().enumerate() {
            match op {
                Op::Add { prefix, len, max_tokens, .. } => {
                    let id = format!("r{serial}");
                    let mut r = NewRequest::new(id.clone(), prompt(*prefix, *len, serial), *max_tokens);
                    r.detokenize = false;
                    if s.add_request(r).is_ok() {
                        live.push(id);
                    }
                }
                Op::Step { tokens } => step(&mut s, &c, tokens, &mut live, &mut kv),
                Op::Abort { .. } => {}
            }
        }
        s.abort_requests(&live);
        s.check_invariants();
        prop_assert!(!s.has_unfinished_requests());
        prop_assert_eq!(s.num_free_blocks(), c.num_blocks as usize - 1);
        let st = s.stats();
        prop_assert_eq!(st.kv_cache_usage, 0.0);
    }
}

// ---- overlapped (async) scheduling, rollback, grammar gating ---------------------------------

/// One operation of an engine driving the scheduler with async scheduling.
#[derive(Debug, Clone)]
enum AsyncOp {
    Add {
        prefix: u8,
        len: usize,
        max_tokens: i64,
        wait_for_grammar: bool,
    },
    /// schedule_step(keep_in_flight = true): the next step is decided while the previous one is
    /// still computing.
    ScheduleAhead,
    /// schedule_step(keep_in_flight = false): a synchronous step (rolls back anything in flight).
    Schedule,
    /// update_from_output for the oldest undelivered step, with these tokens (cycled).
    Update {
        tokens: Vec<i64>,
    },
    /// The model step failed: the scheduled steps never get an update (the next schedule rolls
    /// them back).
    Fail,
    Abort {
        index: usize,
    },
    GrammarReady {
        index: usize,
    },
}

fn async_op() -> impl Strategy<Value = AsyncOp> {
    prop_oneof![
        3 => (0u8..4, 1usize..40, 1i64..24, prop::bool::weighted(0.25)).prop_map(
            |(prefix, len, max_tokens, wait_for_grammar)| AsyncOp::Add { prefix, len, max_tokens, wait_for_grammar }
        ),
        4 => Just(AsyncOp::ScheduleAhead),
        2 => Just(AsyncOp::Schedule),
        6 => prop::collection::vec(prop_oneof![8 => 3i64..50, 1 => Just(EOS)], 1..8)
            .prop_map(|tokens| AsyncOp::Update { tokens }),
        1 => Just(AsyncOp::Fail),
        1 => (0usize..16).prop_map(|index| AsyncOp::Abort { index }),
        1 => (0usize..16).prop_map(|index| AsyncOp::GrammarReady { index }),
    ]
}

/// The engine's view: live requests, which of them wait for their grammar, the scheduled steps
/// not yet updated (their request ids, in batch order), and every request's tokens so far.
#[derive(Default)]
struct Engine {
    /// A model step failed: its steps get no update, and the next schedule is synchronous
    /// (which rolls them back).
    failed: bool,
    live: Vec<String>,
    gated: std::collections::HashSet<String>,
    in_flight: std::collections::VecDeque<Vec<String>>,
    outputs: std::collections::HashMap<String, Vec<u32>>,
    slots: std::collections::HashMap<String, usize>,
}

impl Engine {
    fn schedule(&mut self, s: &mut Scheduler, keep_in_flight: bool) {
        let after_failure = std::mem::take(&mut self.failed);
        let keep_in_flight = keep_in_flight && !after_failure;
        if !keep_in_flight || self.in_flight.len() >= 2 {
            self.in_flight.clear(); // rolled back by the scheduler
        }
        let out = s.schedule_step(keep_in_flight);
        for (i, id) in out.req_ids.iter().enumerate() {
            assert!(
                !self.gated.contains(id),
                "request {id} scheduled before its grammar is ready"
            );
            assert_eq!(
                out.req_slots[i] as usize, self.slots[id],
                "slot of {id} changed"
            );
        }
        assert_eq!(out.req_ids.len(), out.req_slots.len());
        s.check_invariants();
        if !out.req_ids.is_empty() {
            self.in_flight
                .push_back(out.req_ids.iter().map(str::to_string).collect());
        }
    }

    fn update(&mut self, s: &mut Scheduler, tokens: &[i64]) {
        if self.failed {
            return;
        }
        let Some(step) = self.in_flight.pop_front() else {
            // Nothing in flight: an update of an empty step is a no-op.
            assert!(s.update_from_output(&[], None).unwrap().is_empty());
            return;
        };
        let sampled: Vec<i64> = (0..step.len()).map(|i| tokens[i % tokens.len()]).collect();
        let outs = s.update_from_output(&sampled, None).unwrap();
        for row in outs.rows() {
            assert!(
                step.iter().any(|id| **id == *row.request_id),
                "row for a request not in the step"
            );
            assert_eq!(row.slot, self.slots[&*row.request_id]);
            assert_eq!(row.new_token_ids.len(), 1);
            let out = self.outputs.entry(row.request_id.to_string()).or_default();
            out.extend(&row.new_token_ids);
            assert_eq!(
                out.len(),
                row.num_output_tokens,
                "tokens lost or duplicated"
            );
            if row.finish_reason.is_some() {
                self.live.retain(|x| **x != *row.request_id);
            }
        }
        s.check_invariants();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Async scheduling interleaved with updates, failed steps (rollback), aborts, preemption
    /// under a tiny KV cache and grammar gating: the invariants hold after every operation, no
    /// token is lost or duplicated, a gated request is never scheduled before grammar_ready
    /// and then is, and when all finish no block is leaked.
    #[test]
    fn overlapped_scheduling_keeps_the_invariants(c in cfg(), ops in prop::collection::vec(async_op(), 1..80)) {
        let config = SchedulerConfig::from_signed(
            c.num_blocks, c.block_size, 128, c.max_num_seqs, c.budget, c.caching, c.policy, &[EOS],
        ).unwrap();
        let mut s = Scheduler::new(config, None).unwrap();
        let mut e = Engine::default();
        for (serial, op) in ops.iter().enumerate() {
            match op {
                AsyncOp::Add { prefix, len, max_tokens, wait_for_grammar } => {
                    let id = format!("r{serial}");
                    let mut r = NewRequest::new(id.clone(), prompt(*prefix, *len, serial), *max_tokens);
                    r.detokenize = false;
                    r.wait_for_grammar = *wait_for_grammar;
                    if let Ok(slot) = s.add_request(r) {
                        prop_assert!(e.slots.values().all(|&x| x != slot || !e.live.iter().any(|l| e.slots[l] == slot)),
                            "slot {} given to two live requests", slot);
                        e.slots.insert(id.clone(), slot);
                        if *wait_for_grammar {
                            e.gated.insert(id.clone());
                        }
                        e.live.push(id);
                    }
                }
                AsyncOp::ScheduleAhead => e.schedule(&mut s, true),
                AsyncOp::Schedule => e.schedule(&mut s, false),
                AsyncOp::Update { tokens } => e.update(&mut s, tokens),
                AsyncOp::Fail => {
                    e.in_flight.clear();
                    e.failed = true;
                }
                AsyncOp::Abort { index } => {
                    if !e.live.is_empty() {
                        let id = e.live.remove(index % e.live.len());
                        let outs = s.abort_requests(&[id.as_str()]);
                        prop_assert_eq!(outs.len(), 1);
                        prop_assert_eq!(outs.slots[0] as usize, e.slots[&id]);
                        e.gated.remove(&id);
                    }
                }
                AsyncOp::GrammarReady { index } => {
                    let gated: Vec<String> = e.gated.iter().cloned().collect();
                    if !gated.is_empty() {
                        let id = &gated[index % gated.len()];
                        s.grammar_ready(&[id.as_str()]);
                        e.gated.remove(id);
                    }
                }
            }
            s.check_invariants();
        }
        // Release every grammar, then drain synchronously: everything finishes, nothing leaks.
        let gated: Vec<String> = e.gated.drain().collect();
        s.grammar_ready(&gated);
        let mut steps = 0;
        while s.has_unfinished_requests() {
            e.schedule(&mut s, false);
            e.update(&mut s, &[7, 8, 9]);
            steps += 1;
            prop_assert!(steps < 5000, "requests never finished: {} left", s.num_unfinished_requests());
        }
        prop_assert!(e.live.is_empty());
        prop_assert_eq!(s.num_free_blocks(), c.num_blocks as usize - 1, "blocks leaked");
    }

    /// A step scheduled and never updated is rolled back by the next schedule(): the same
    /// tokens are scheduled again (same input ids and positions), and nothing leaks.
    #[test]
    fn an_undelivered_step_is_rolled_back_and_rescheduled(
        c in cfg(),
        lens in prop::collection::vec((0u8..4, 1usize..40, 1i64..24), 1..6),
        warmup in 0usize..6,
        ahead in any::<bool>(),
    ) {
        let config = SchedulerConfig::from_signed(
            c.num_blocks, c.block_size, 128, c.max_num_seqs, c.budget, c.caching, c.policy, &[EOS],
        ).unwrap();
        let mut s = Scheduler::new(config, None).unwrap();
        for (i, &(prefix, len, max_tokens)) in lens.iter().enumerate() {
            let mut r = NewRequest::new(format!("r{i}"), prompt(prefix, len, i), max_tokens);
            r.detokenize = false;
            let _ = s.add_request(r);
        }
        for _ in 0..warmup {
            let out = s.schedule();
            s.update_from_output(&vec![7; out.req_ids.len()], None).unwrap();
        }
        let free_before = s.num_free_blocks();
        let first = s.schedule();
        let mut preempted: Vec<String> = first.preempted_req_ids.iter().map(|x| x.to_string()).collect();
        if ahead {
            // A second step decided ahead, also never delivered.
            let next = s.schedule_step(true);
            preempted.extend(next.preempted_req_ids.iter().map(|x| x.to_string()));
        }
        s.check_invariants();
        let again = s.schedule();
        s.check_invariants();
        preempted.extend(again.preempted_req_ids.iter().map(|x| x.to_string()));
        // The same requests are scheduled again from the same positions (unless preemption in
        // the tiny cache sent one back to recompute from the start).
        for (i, id) in again.req_ids.iter().enumerate() {
            if preempted.iter().any(|p| p == id) {
                continue;
            }
            if let Some(j) = first.req_ids.iter().position(|x| x == id) {
                let a = &again.arrays;
                let f = &first.arrays;
                // Back to where it was; further back only if it had adopted a block computed
                // in the failed step itself (a same-step prefix hit, whose K/V was never
                // written).
                if c.caching {
                    prop_assert!(a.num_computed_tokens[i] <= f.num_computed_tokens[j], "{} not rolled back", id);
                } else {
                    prop_assert_eq!(a.num_computed_tokens[i], f.num_computed_tokens[j], "{} not rolled back", id);
                }
                // The same token at every position scheduled both times.
                let tokens_at = |arr: &crate::batch::BatchArrays, r: usize| -> std::collections::HashMap<i64, i64> {
                    let (lo, hi) = (arr.query_start_loc[r] as usize, arr.query_start_loc[r + 1] as usize);
                    (lo..hi).map(|t| (arr.positions[t], arr.input_ids[t])).collect()
                };
                let (ta, tf) = (tokens_at(a, i), tokens_at(f, j));
                for (pos, tok) in &ta {
                    if let Some(t) = tf.get(pos) {
                        prop_assert_eq!(t, tok, "{} position {}", id, pos);
                    }
                }
            }
        }
        if first.req_ids.is_empty() {
            prop_assert_eq!(s.num_free_blocks(), free_before);
        }
        s.update_from_output(&vec![7; again.req_ids.len()], None).unwrap();
        let mut steps = 0;
        while s.has_unfinished_requests() {
            let out = s.schedule();
            s.update_from_output(&vec![8; out.req_ids.len()], None).unwrap();
            s.check_invariants();
            steps += 1;
            prop_assert!(steps < 5000);
        }
        prop_assert_eq!(s.num_free_blocks(), c.num_blocks as usize - 1, "blocks leaked");
    }

    /// Grammar gating: a request added with wait_for_grammar is never scheduled (others run)
    /// until grammar_ready names it; then it is scheduled and finishes.
    #[test]
    fn a_gated_request_waits_for_its_grammar_and_only_for_it(
        gated_at in 0usize..4,
        n in 2usize..5,
        wait_steps in 0usize..8,
        async_steps in any::<bool>(),
    ) {
        let config = SchedulerConfig::from_signed(64, 4, 128, 8, 64, true, "fcfs", &[EOS]).unwrap();
        let mut s = Scheduler::new(config, None).unwrap();
        let gated_at = gated_at % n;
        for i in 0..n {
            let mut r = NewRequest::new(format!("r{i}"), prompt(i as u8, 6, i), 4);
            r.detokenize = false;
            r.wait_for_grammar = i == gated_at;
            s.add_request(r).unwrap();
        }
        let gated = format!("r{gated_at}");
        let mut in_flight = 0;
        for _ in 0..wait_steps {
            let out = s.schedule_step(async_steps);
            prop_assert!(out.req_ids.iter().all(|id| id != gated), "gated request scheduled");
            if !out.req_ids.is_empty() {
                in_flight += 1;
            }
            while in_flight > usize::from(async_steps) {
                s.update_from_output(&vec![7; s_in_flight_len(&s)], None).unwrap();
                in_flight -= 1;
            }
            s.check_invariants();
        }
        prop_assert!(s.request_status(&gated).is_some());
        s.grammar_ready(&[gated.as_str()]);
        let mut scheduled = false;
        let mut steps = 0;
        while s.has_unfinished_requests() {
            let out = s.schedule();
            scheduled |= out.req_ids.iter().any(|id| id == gated);
            s.update_from_output(&vec![7; out.req_ids.len()], None).unwrap();
            s.check_invariants();
            steps += 1;
            prop_assert!(steps < 1000);
        }
        prop_assert!(scheduled, "the gated request never ran after grammar_ready");
        prop_assert_eq!(s.num_free_blocks(), 63);
    }
}

/// Entries of the oldest undelivered step (what update_from_output expects).
fn s_in_flight_len(s: &Scheduler) -> usize {
    s.oldest_in_flight_len()
}

// ---- the detokenizer's stop strings against a reference -------------------------------------

/// Tokens of the test tokenizer (detokenizer::tests::tiny_byte_level_json): ids 0..=255 are
/// single bytes, 256 is "ab", 257 is " hello".
fn detok_token() -> impl Strategy<Value = u32> {
    prop_oneof![
        6 => prop::sample::select(vec![b'a', b'b', b'c', b'S', b'T', b' ', b'#']).prop_map(u32::from),
        1 => prop::sample::select(vec![0xC3u8, 0xA9, 0xE6, 0x97, 0xA5, 0xFF]).prop_map(u32::from),
        1 => Just(256u32),
        1 => Just(257u32),
    ]
}

fn stop_string() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop::sample::select(vec!["a", "b", "c", "S", "T", " ", "é", "#", "h"]),
        1..5,
    )
    .prop_map(|parts| parts.concat())
}

/// Text of complete characters decoded from `bytes` (an incomplete trailing sequence waits;
/// invalid bytes are U+FFFD, as a lossy decode of the whole text writes them).
fn decoded_so_far(bytes: &[u8]) -> String {
    let mut cut = bytes.len();
    for back in 1..=3.min(bytes.len()) {
        let tail = &bytes[bytes.len() - back..];
        if matches!(std::str::from_utf8(tail), Err(e) if e.valid_up_to() == 0 && e.error_len().is_none())
        {
            cut = bytes.len() - back;
            break;
        }
    }
    String::from_utf8_lossy(&bytes[..cut]).into_owned()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Streaming with stop strings equals the reference: the request stops at the first token
    /// after which some stop string occurs in the decoded text, at its earliest occurrence (the
    /// first in the list on a tie), the output is the text before it (with it when
    /// include_stop_str_in_output), and every prefix streamed is a prefix of that output.
    #[test]
    fn stop_strings_match_a_reference(
        tokens in prop::collection::vec(detok_token(), 1..40),
        stops in prop::collection::vec(stop_string(), 1..7),
        include in any::<bool>(),
    ) {
        use crate::detokenizer::{tests::tiny_byte_level_json, IncrementalDetokenizer, TokenizerInfo};
        let info = std::sync::Arc::new(TokenizerInfo::from_json(&tiny_byte_level_json()).unwrap());
        let mut d = IncrementalDetokenizer::new(info, true, stops.clone(), include).unwrap();
        let token_bytes = |t: u32| -> Vec<u8> {
            match t {
                256 => b"ab".to_vec(),
                257 => b" hello".to_vec(),
                b => vec![b as u8],
            }
        };
        // Reference.
        let mut bytes = Vec::new();
        let mut expected: Option<(usize, usize, String)> = None; // (token index, stop, output)
        for (k, &t) in tokens.iter().enumerate() {
            bytes.extend(token_bytes(t));
            let text = decoded_so_far(&bytes);
            let mut best: Option<(usize, usize)> = None;
            for (i, s) in stops.iter().enumerate() {
                if let Some(pos) = text.find(s.as_str()) {
                    if best.is_none_or(|(_, b)| pos < b) {
                        best = Some((i, pos));
                    }
                }
            }
            if let Some((i, pos)) = best {
                let end = if include { pos + stops[i].len() } else { pos };
                expected = Some((k, i, text[..end].to_string()));
                break;
            }
        }
        let final_text = match &expected {
            Some((_, _, out)) => out.clone(),
            None => String::from_utf8_lossy(&bytes).into_owned(),
        };
        // The detokenizer, streaming into one buffer as the scheduler does.
        let mut streamed = String::new();
        let mut fired = None;
        for (k, &t) in tokens.iter().enumerate() {
            if let Some(i) = d.step_into(t, true, &mut streamed) {
                fired = Some((k, i));
                break;
            }
            prop_assert!(final_text.starts_with(&streamed), "streamed {:?} is not a prefix of {:?}", streamed, final_text);
        }
        if fired.is_none() {
            d.flush_into(&mut streamed);
        }
        prop_assert_eq!(fired, expected.as_ref().map(|(k, i, _)| (*k, *i)));
        prop_assert_eq!(streamed, final_text);
    }
}

// ---- speculative decoding: drafts, variable accepted runs, rollback ---------------------------

#[derive(Debug, Clone)]
enum SpecOp {
    /// A prompt with a repeating pattern, so n-gram lookup proposes drafts.
    Add {
        period: u8,
        len: usize,
        max_tokens: i64,
        allow_drafts: bool,
    },
    /// schedule() + an update where request i accepts `accept[i % len]` of its drafts (capped)
    /// and adds one token of `tokens` (cycled).
    Step {
        tokens: Vec<i64>,
        accept: Vec<usize>,
    },
    /// schedule() whose model step fails: no update (the next schedule rolls it back).
    Fail,
    Abort {
        index: usize,
    },
}

fn spec_op() -> impl Strategy<Value = SpecOp> {
    prop_oneof![
        3 => (1u8..5, 1usize..40, 1i64..30, prop::bool::weighted(0.85)).prop_map(
            |(period, len, max_tokens, allow_drafts)| SpecOp::Add { period, len, max_tokens, allow_drafts }
        ),
        8 => (
            prop::collection::vec(prop_oneof![10 => 1000i64..1004, 3 => 3i64..50, 1 => Just(EOS)], 1..6),
            prop::collection::vec(0usize..6, 1..5),
        ).prop_map(|(tokens, accept)| SpecOp::Step { tokens, accept }),
        1 => Just(SpecOp::Fail),
        1 => (0usize..16).prop_map(|index| SpecOp::Abort { index }),
    ]
}

/// Engine state for the speculative proptest: live requests and every request's output.
#[derive(Default)]
struct SpecEngine {
    live: Vec<String>,
    outputs: std::collections::HashMap<String, Vec<u32>>,
    kv: KvShadow,
}

impl SpecEngine {
    /// One step, checking the arrays (drafts after the last token, logits at every verify
    /// position) and the K/V every request reads, then feeding a variable accepted run.
    fn step(
        &mut self,
        s: &mut Scheduler,
        c: &Cfg,
        k: usize,
        tokens: &[i64],
        accept: &[usize],
        fail: bool,
    ) {
        let out = s.schedule();
        let a = &out.arrays;
        let bs = c.block_size;
        let n = out.req_ids.len();
        assert_eq!(a.logits_start_loc.len(), n + 1);
        assert_eq!(a.num_draft_tokens.len(), n);
        let mut draft_off = 0;
        let mut seqs = Vec::with_capacity(n);
        for (r, id) in out.req_ids.iter().enumerate() {
            let d = a.num_draft_tokens[r] as usize;
            assert!(d <= k);
            let drafts = &a.draft_token_ids[draft_off..draft_off + d];
            draft_off += d;
            let (lo, hi) = (
                a.query_start_loc[r] as usize,
                a.query_start_loc[r + 1] as usize,
            );
            // Logits at the last 1 + d positions; the drafts are the last d input ids.
            let li = &a.logits_indices
                [a.logits_start_loc[r] as usize..a.logits_start_loc[r + 1] as usize];
            assert_eq!(
                li,
                &((hi - 1 - d) as i64..hi as i64).collect::<Vec<_>>()[..]
            );
            assert_eq!(&a.input_ids[hi - d..hi], drafts);
            if d > 0 {
                assert_eq!(hi - lo, 1 + d, "drafts only ride on a decode");
                assert!(a.sample_mask[r]);
            }
            let mut seq = s.request_tokens(id);
            seq.extend(drafts.iter().map(|&t| t as u32));
            seqs.push(seq);
        }
        assert_eq!(draft_off, a.draft_token_ids.len());
        assert!(out.num_tokens <= c.budget as usize, "token budget exceeded");
        let digests: Vec<Vec<u64>> = seqs.iter().map(|t| prefix_digests(t)).collect();
        if !fail {
            for (r, d) in digests.iter().enumerate() {
                for t in a.query_start_loc[r]..a.query_start_loc[r + 1] {
                    self.kv.insert(
                        a.slot_mapping[t as usize],
                        d[a.positions[t as usize] as usize],
                    );
                }
            }
        }
        // A failed step writes nothing here and reads nothing: the steps after it check that
        // nothing they read depends on it.
        for (r, d) in digests.iter().enumerate().filter(|_| !fail) {
            let row = &a.block_table[r * a.max_blocks..(r + 1) * a.max_blocks];
            for p in 0..a.seq_lens[r] as i64 {
                let slot = row[(p / bs) as usize] as i64 * bs + p % bs;
                assert_eq!(
                    self.kv.get(&slot),
                    Some(&d[p as usize]),
                    "request {} reads wrong K/V at {p}",
                    out.req_ids.get(r)
                );
            }
        }
        s.check_invariants();
        if fail {
            return;
        }
        // The verifier's answer: an accepted prefix of the drafts plus one token of its own.
        let mut flat = Vec::new();
        let mut counts = Vec::with_capacity(n);
        let mut given: Vec<Vec<u32>> = Vec::with_capacity(n);
        let mut draft_off = 0;
        for r in 0..n {
            let d = a.num_draft_tokens[r] as usize;
            let drafts = &a.draft_token_ids[draft_off..draft_off + d];
            draft_off += d;
            let acc = accept[r % accept.len()].min(d);
            let mut run: Vec<i64> = drafts[..acc].to_vec();
            run.push(tokens[r % tokens.len()]);
            counts.push(run.len() as i32);
            given.push(run.iter().map(|&t| t as u32).collect());
            flat.extend(run);
        }
        let before = s.stats();
        let outs = s
            .update_from_output_counts(&flat, Some(&counts), None)
            .unwrap();
        let after = s.stats();
        for row in outs.rows() {
            let r = out
                .req_ids
                .iter()
                .position(|x| x == &*row.request_id)
                .expect("row of the step");
            assert!(a.sample_mask[r]);
            // The row carries the accepted run, cut where a stop fired.
            assert!(
                given[r].starts_with(&row.new_token_ids),
                "row tokens not a prefix of the run"
            );
            if row.finish_reason.is_none() {
                assert_eq!(row.new_token_ids, given[r]);
            }
            let o = self.outputs.entry(row.request_id.to_string()).or_default();
            o.extend(&row.new_token_ids);
            assert_eq!(o.len(), row.num_output_tokens, "tokens lost or duplicated");
            if row.finish_reason.is_some() {
                self.live.retain(|x| **x != *row.request_id);
            }
        }
        assert!(
            after.num_accepted_tokens - before.num_accepted_tokens
                <= after.num_draft_tokens - before.num_draft_tokens
        );
        assert_eq!(
            after.num_accepted_tokens_per_pos.iter().sum::<u64>(),
            after.num_accepted_tokens
        );
        s.check_invariants();
    }
}

fn spec_prompt(period: u8, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| 1000 + (i % period as usize) as u32)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// N-gram speculation with random accepted lengths, failed steps, aborts and preemption
    /// in tiny caches: the arrays are consistent, every request reads only its own tokens' K/V
    /// (rejected drafts' K/V is never read as valid), no token is lost or duplicated, the
    /// invariants hold after every operation, and when everything finishes no block leaks.
    #[test]
    fn speculation_with_variable_accepted_runs_keeps_the_invariants(
        c in cfg(),
        k in 1usize..5,
        min_n in 1i64..3,
        extra_n in 0i64..3,
        ops in prop::collection::vec(spec_op(), 1..60),
    ) {
        let spec = crate::speculative::SpeculativeConfig::from_signed(k as i64, "ngram", min_n, min_n + extra_n).unwrap();
        let config = SchedulerConfig::from_signed(
            c.num_blocks, c.block_size, 128, c.max_num_seqs, c.budget, c.caching, c.policy, &[EOS],
        ).unwrap().with_speculation(spec);
        let mut s = Scheduler::new(config, None).unwrap();
        let mut e = SpecEngine::default();
        for (serial, op) in ops.iter().enumerate() {
            match op {
                SpecOp::Add { period, len, max_tokens, allow_drafts } => {
                    let id = format!("r{serial}");
                    let mut r = NewRequest::new(id.clone(), spec_prompt(*period, *len), *max_tokens);
                    r.detokenize = false;
                    r.allow_drafts = *allow_drafts;
                    if s.add_request(r).is_ok() {
                        e.live.push(id);
                    }
                }
                SpecOp::Step { tokens, accept } => e.step(&mut s, &c, k, tokens, accept, false),
                SpecOp::Fail => e.step(&mut s, &c, k, &[7], &[0], true),
                SpecOp::Abort { index } => {
                    if !e.live.is_empty() {
                        let id = e.live.remove(index % e.live.len());
                        s.abort_requests(&[id.as_str()]);
                    }
                }
            }
            s.check_invariants();
        }
        let mut steps = 0;
        while s.has_unfinished_requests() {
            e.step(&mut s, &c, k, &[1000, 1001, 1002], &[5, 1, 0], false);
            steps += 1;
            prop_assert!(steps < 5000, "requests never finished: {} left", s.num_unfinished_requests());
        }
        prop_assert!(e.live.is_empty());
        prop_assert_eq!(s.num_free_blocks(), c.num_blocks as usize - 1, "blocks leaked");
    }
}

#[derive(Debug, Clone)]
enum AsyncSpecOp {
    Add {
        period: u8,
        len: usize,
        max_tokens: i64,
    },
    ScheduleAhead,
    Schedule,
    Update {
        token: i64,
        accept: usize,
    },
    Fail,
    Abort {
        index: usize,
    },
}

fn async_spec_op() -> impl Strategy<Value = AsyncSpecOp> {
    prop_oneof![
        3 => (1u8..5, 1usize..30, 1i64..24).prop_map(|(period, len, max_tokens)| AsyncSpecOp::Add { period, len, max_tokens }),
        4 => Just(AsyncSpecOp::ScheduleAhead),
        2 => Just(AsyncSpecOp::Schedule),
        6 => (prop_oneof![4 => 1000i64..1004, 1 => 3i64..50, 1 => Just(EOS)], 0usize..5)
            .prop_map(|(token, accept)| AsyncSpecOp::Update { token, accept }),
        1 => Just(AsyncSpecOp::Fail),
        1 => (0usize..16).prop_map(|index| AsyncSpecOp::Abort { index }),
    ]
}

/// A row of a step the simulated device has run: its request, its drafts, what it produced
/// (accepted drafts then its own token; empty for a row that samples nothing).
#[derive(Debug, Clone)]
struct RanRow {
    id: String,
    drafts: Vec<i64>,
    produced: Vec<i64>,
}

/// The device's side of async speculation, simulated: runs a scheduled step the way the
/// runner does (placeholders filled with the step in flight's last token, each such row
/// shifted back by the drafts that step rejected), writes the K/V shadow, checks every
/// position the row attends to, and decides what each row produces.
fn run_on_device(
    s: &Scheduler,
    out: &crate::batch::SchedulerOutput,
    prev: Option<&Vec<RanRow>>,
    bs: i64,
    kv: &mut KvShadow,
    (token, accept): (i64, usize),
) -> Vec<RanRow> {
    let a = &out.arrays;
    let mut rows = Vec::new();
    let mut off = 0;
    for (r, id) in out.req_ids.iter().enumerate() {
        let d = a.num_draft_tokens[r] as usize;
        let drafts = a.draft_token_ids[off..off + d].to_vec();
        off += d;
        let (lo, hi) = (
            a.query_start_loc[r] as usize,
            a.query_start_loc[r + 1] as usize,
        );
        assert_eq!(
            &a.input_ids[hi - d..hi],
            &drafts[..],
            "drafts are the last inputs"
        );
        let mut truth = s.request_tokens(id);
        let holes = a.input_ids[lo..hi].iter().filter(|&&t| t == -1).count();
        let mut shift = 0;
        if holes > 0 {
            assert_eq!(holes, 1, "{id}: one placeholder per row");
            assert_eq!(a.input_ids[lo], -1, "{id}: the placeholder comes first");
            let p = prev
                .and_then(|p| p.iter().find(|x| x.id == id))
                .unwrap_or_else(|| panic!("{id}: placeholder without a step in flight"));
            assert!(
                !p.produced.is_empty(),
                "{id}: placeholder of a row that samples nothing"
            );
            shift = (1 + p.drafts.len() - p.produced.len()) as i64;
            truth.extend(p.produced.iter().map(|&t| t as u32));
            assert_eq!(
                a.positions[lo] - shift,
                truth.len() as i64 - 1,
                "{id}: the shifted placeholder position is its token's"
            );
        } else {
            assert!(
                a.positions[lo] as usize + (hi - lo) - d <= truth.len(),
                "{id}: inputs past the known tokens"
            );
        }
        truth.truncate((a.positions[lo] - shift) as usize + (hi - lo) - d);
        truth.extend(drafts.iter().map(|&t| t as u32));
        let digest = prefix_digests(&truth);
        let row = &a.block_table[r * a.max_blocks..(r + 1) * a.max_blocks];
        let slot_of = |p: i64| row[(p / bs) as usize] as i64 * bs + p % bs;
        for t in lo..hi {
            let p = a.positions[t] - shift;
            if shift == 0 {
                assert_eq!(a.slot_mapping[t], slot_of(p));
            }
            kv.insert(slot_of(p), digest[p as usize]);
        }
        for p in 0..a.seq_lens[r] as i64 - shift {
            assert_eq!(
                kv.get(&slot_of(p)),
                Some(&digest[p as usize]),
                "request {id} reads wrong K/V at {p} (shift {shift})"
            );
        }
        let produced = if a.sample_mask[r] {
            let n = accept.min(d);
            let mut run = drafts[..n].to_vec();
            run.push(token);
            run
        } else {
            Vec::new()
        };
        rows.push(RanRow {
            id: id.to_string(),
            drafts,
            produced,
        });
    }
    rows
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Async scheduling with n-gram drafts, the device simulated (`run_on_device`): a request
    /// is scheduled again while its drafts are in flight, at optimistic positions that the
    /// device shifts back by the rejected drafts; every position a row attends to then holds
    /// its own tokens' K/V, every produced run lands exactly once, failed steps roll back, the
    /// invariants hold after every operation, and nothing leaks.
    #[test]
    fn speculation_with_async_steps_keeps_the_invariants(
        c in cfg(),
        k in 1usize..4,
        ops in prop::collection::vec(async_spec_op(), 1..80),
    ) {
        let spec = crate::speculative::SpeculativeConfig::from_signed(k as i64, "ngram", 1, 2).unwrap();
        let config = SchedulerConfig::from_signed(
            c.num_blocks, c.block_size, 128, c.max_num_seqs, c.budget, c.caching, c.policy, &[EOS],
        ).unwrap().with_speculation(spec);
        let mut s = Scheduler::new(config, None).unwrap();
        let bs = c.block_size;
        let mut kv = KvShadow::new();
        let mut live: Vec<String> = Vec::new();
        let mut in_flight: std::collections::VecDeque<Vec<RanRow>> = Default::default();
        let mut outputs: std::collections::HashMap<String, usize> = Default::default();
        let mut failed = false;
        let mut outcome = (1000i64, 1usize);
        let update = |s: &mut Scheduler, step: Vec<RanRow>, live: &mut Vec<String>,
                      outputs: &mut std::collections::HashMap<String, usize>| {
            let mut flat = Vec::new();
            let mut counts = Vec::new();
            for row in &step {
                flat.extend_from_slice(&row.produced);
                counts.push(row.produced.len() as i32);
            }
            let outs = s.update_from_output_counts(&flat, Some(&counts), None).unwrap();
            for row in outs.rows() {
                let n = outputs.entry(row.request_id.to_string()).or_default();
                *n += row.new_token_ids.len();
                assert_eq!(*n, row.num_output_tokens, "tokens lost or duplicated");
                if row.finish_reason.is_some() {
                    live.retain(|x| **x != *row.request_id);
                }
            }
        };
        for (serial, op) in ops.iter().enumerate() {
            match op {
                AsyncSpecOp::Add { period, len, max_tokens } => {
                    let id = format!("r{serial}");
                    let mut r = NewRequest::new(id.clone(), spec_prompt(*period, *len), *max_tokens);
                    r.detokenize = false;
                    if s.add_request(r).is_ok() {
                        live.push(id);
                    }
                }
                AsyncSpecOp::ScheduleAhead | AsyncSpecOp::Schedule | AsyncSpecOp::Fail => {
                    let ahead = !matches!(op, AsyncSpecOp::Schedule) && !std::mem::take(&mut failed);
                    if !ahead || in_flight.len() >= 2 {
                        in_flight.clear();
                    }
                    let out = s.schedule_step(ahead);
                    s.check_invariants();
                    if matches!(op, AsyncSpecOp::Fail) {
                        // The launch failed: nothing ran; the next schedule rolls it back.
                        in_flight.clear();
                        failed = true;
                        continue;
                    }
                    let ran = run_on_device(&s, &out, in_flight.back(), bs, &mut kv, outcome);
                    prop_assert!(out.num_tokens <= c.budget as usize, "token budget exceeded");
                    if !ran.is_empty() {
                        in_flight.push_back(ran);
                    }
                }
                AsyncSpecOp::Update { token, accept } => {
                    outcome = (*token, *accept);
                    if failed {
                        continue;
                    }
                    match in_flight.pop_front() {
                        Some(step) => update(&mut s, step, &mut live, &mut outputs),
                        None => prop_assert!(s.update_from_output(&[], None).unwrap().is_empty()),
                    }
                }
                AsyncSpecOp::Abort { index } => {
                    if !live.is_empty() {
                        let id = live.remove(index % live.len());
                        s.abort_requests(&[id.as_str()]);
                    }
                }
            }
            s.check_invariants();
        }
        let mut steps = 0;
        while s.has_unfinished_requests() {
            let ahead = !std::mem::take(&mut failed);
            if !ahead || in_flight.len() >= 2 {
                in_flight.clear();
            }
            let out = s.schedule_step(ahead);
            let ran = run_on_device(&s, &out, in_flight.back(), bs, &mut kv, (1001, 2));
            if !ran.is_empty() {
                in_flight.push_back(ran);
            }
            if in_flight.len() == 2 || out.req_ids.is_empty() {
                if let Some(step) = in_flight.pop_front() {
                    update(&mut s, step, &mut live, &mut outputs);
                }
            }
            s.check_invariants();
            steps += 1;
            prop_assert!(steps < 5000, "requests never finished");
        }
        prop_assert!(live.is_empty());
        prop_assert_eq!(s.num_free_blocks(), c.num_blocks as usize - 1, "blocks leaked");
    }
}
