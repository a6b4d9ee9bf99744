//! Property tests of the scheduler + KV cache invariants under random operation sequences
//! (add / step / abort with tiny block pools, so preemption and eviction happen often).

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
}

fn cfg() -> impl Strategy<Value = Cfg> {
    (
        6i64..40,
        prop_oneof![Just(1i64), Just(2), Just(4), Just(16)],
        1i64..6,
        1i64..48,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(num_blocks, block_size, max_num_seqs, budget, caching, prio)| Cfg {
                num_blocks,
                block_size,
                max_num_seqs,
                budget,
                caching,
                policy: if prio { "priority" } else { "fcfs" },
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
                out.req_ids[r]
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
    for o in outs {
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
        let config = SchedulerConfig::from_signed(
            c.num_blocks, c.block_size, 128, c.max_num_seqs, c.budget, c.caching, c.policy, &[EOS],
        ).unwrap();
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
                        Ok(()) => live.push(id),
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
