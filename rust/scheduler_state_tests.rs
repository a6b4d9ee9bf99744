//! The scheduler with a hybrid model's recurrent states (state_snapshots.rs): chunks cut on the
//! snapshot grid, saves where a step ends on it, hits only where a snapshot was kept, and
//! rollbacks that preempt (no state holds what a failed step took in).

use super::*;

const BS: usize = 4;
const GRID: usize = 8;

fn sched(snapshot_slots: usize, prefix_caching: bool) -> Scheduler {
    let cfg = SchedulerConfig::from_signed(64, BS as i64, 256, 8, 64, prefix_caching, "fcfs", &[2])
        .unwrap()
        .with_recurrent_states(if prefix_caching { GRID } else { 0 }, snapshot_slots)
        .unwrap();
    Scheduler::new(cfg, None).unwrap()
}

fn req(id: &str, prompt: Vec<u32>, max_tokens: i64) -> NewRequest {
    let mut r = NewRequest::new(id, prompt, max_tokens);
    r.detokenize = false;
    r
}

fn step(s: &mut Scheduler) -> SchedulerOutput {
    let out = s.schedule();
    s.update_from_output(&vec![7; out.req_ids.len()], None)
        .unwrap();
    s.check_invariants();
    out
}

#[test]
fn a_prompt_stops_at_its_last_grid_boundary_and_the_state_there_is_saved() {
    let mut s = sched(4, true);
    s.add_request(req("a", (100..121).collect(), 8)).unwrap();
    let first = step(&mut s);
    assert_eq!(
        first.num_tokens, 16,
        "21 tokens: cut at 16, the last multiple of 8"
    );
    assert_eq!(first.state_saves.len(), 1);
    assert_eq!(first.state_saves[0].0, 0);
    assert!(first.state_restores.is_empty());
    let second = step(&mut s);
    assert_eq!(second.num_tokens, 5);
    assert!(second.state_saves.is_empty(), "21 is off the grid");
    // Decodes: the step computing the 24th token ends on the grid (22 + 2 sampled tokens).
    let third = step(&mut s);
    assert!(third.state_saves.is_empty());
    let mut saved_at = Vec::new();
    for _ in 0..4 {
        let out = step(&mut s);
        if !out.state_saves.is_empty() {
            saved_at.push(out.arrays.seq_lens[0]);
        }
    }
    assert_eq!(saved_at, vec![24]);
}

#[test]
fn a_later_request_resumes_from_the_snapshot_not_from_the_longer_kv_hit() {
    let mut s = sched(4, true);
    let shared: Vec<u32> = (100..120).collect();
    s.add_request(req("a", [shared.clone(), vec![1]].concat(), 1))
        .unwrap();
    let saved = step(&mut s).state_saves[0].1;
    step(&mut s); // a's last 5 tokens; it finishes
    s.add_request(req("b", [shared, vec![3, 4, 5]].concat(), 1))
        .unwrap();
    let out = step(&mut s);
    // Five blocks (20 tokens) of b are cached, but the state is kept only after 16.
    assert_eq!(out.arrays.num_computed_tokens, vec![16]);
    assert_eq!(out.state_restores, vec![(0, saved)]);
    assert_eq!(out.num_tokens, 7);
    assert_eq!(s.state_snapshots().unwrap().num_restored, 1);
}

#[test]
fn without_a_snapshot_there_is_no_hit() {
    let mut s = sched(1, true);
    s.add_request(req("a", (100..121).collect(), 1)).unwrap();
    step(&mut s);
    step(&mut s);
    // One slot: c's prompt saves its own state at 16, evicting a's.
    s.add_request(req("c", (300..317).collect(), 1)).unwrap();
    step(&mut s);
    step(&mut s);
    s.add_request(req("b", (100..121).collect(), 1)).unwrap();
    let out = step(&mut s);
    assert_eq!(
        out.arrays.num_computed_tokens,
        vec![0],
        "a's K/V blocks are cached, its state is not"
    );
    assert!(out.state_restores.is_empty());
}

#[test]
fn a_save_is_not_restored_in_the_step_that_makes_it() {
    let mut s = sched(4, true);
    s.add_request(req("a", (100..121).collect(), 1)).unwrap();
    s.add_request(req("b", (100..121).collect(), 1)).unwrap();
    let out = step(&mut s);
    // Both prefill 16 tokens from scratch: b's K/V hit would need a's state, saved after the step.
    assert_eq!(out.arrays.num_computed_tokens, vec![0, 0]);
    assert_eq!(out.state_saves.len(), 1, "one save per prefix");
    assert!(out.state_restores.is_empty());
}

#[test]
fn without_prefix_caching_chunks_are_not_cut_and_nothing_is_saved() {
    let mut s = sched(0, false);
    s.add_request(req("a", (100..121).collect(), 1)).unwrap();
    let out = step(&mut s);
    assert_eq!(out.num_tokens, 21);
    assert!(out.state_saves.is_empty() && s.state_snapshots().is_none());
}

#[test]
fn a_rolled_back_step_preempts_its_requests_and_forgets_its_saves() {
    let mut s = sched(4, true);
    s.add_request(req("a", (100..121).collect(), 4)).unwrap();
    let first = s.schedule_step(true);
    assert_eq!(first.state_saves.len(), 1);
    // The step's update never comes (its launch failed): the next schedule rolls it back.
    let out = s.schedule_step(false);
    assert_eq!(out.preempted_req_ids.len(), 1);
    assert_eq!(&*out.preempted_req_ids[0], "a");
    assert!(
        s.state_snapshots().unwrap().is_empty(),
        "the save never ran"
    );
    assert_eq!(out.num_tokens, 0, "a step that preempts admits nothing");
    s.check_invariants();
    let again = step(&mut s);
    assert_eq!(again.arrays.num_computed_tokens, vec![0]);
    assert_eq!(again.num_tokens, 16);
}

#[test]
fn the_grid_must_be_whole_blocks_and_needs_prefix_caching() {
    let base = || SchedulerConfig::from_signed(64, 4, 256, 8, 64, true, "fcfs", &[]).unwrap();
    assert!(base().with_recurrent_states(6, 4).is_err());
    assert!(base().with_recurrent_states(8, 0).is_err());
    let off = SchedulerConfig::from_signed(64, 4, 256, 8, 64, false, "fcfs", &[]).unwrap();
    assert!(off.with_recurrent_states(8, 4).is_err());
}

#[test]
fn under_async_scheduling_a_decode_save_is_keyed_once_its_last_token_arrives() {
    let mut s = sched(4, true);
    s.add_request(req("a", (100..121).collect(), 8)).unwrap();
    // The engine's order: schedule step N, then deliver step N - 1.
    let mut prev = s.schedule_step(true);
    assert_eq!(prev.num_tokens, 16);
    let mut unkeyed_at = None;
    for n in 2..=7 {
        let out = s.schedule_step(true);
        let sampled = vec![7; prev.req_ids.len()];
        s.update_from_output(&sampled, None).unwrap();
        s.check_invariants();
        if !out.state_saves.is_empty() && n > 2 {
            // The step computing position 23 ends on the grid; position 23's token is in flight.
            assert_eq!(out.arrays.seq_lens[0], 24);
            unkeyed_at = Some(n);
        }
        prev = out;
    }
    assert!(unkeyed_at.is_some());
    let snaps = s.state_snapshots().unwrap();
    assert_eq!(
        snaps.len(),
        2,
        "the prompt's save at 16 and the decode's at 24, keyed"
    );
    s.update_from_output(&[7], None).unwrap();
    // b shares a's first 24 tokens (its prompt and three sampled 7s): it resumes at 24.
    let prompt: Vec<u32> = (100..121).chain([7, 7, 7, 1, 2]).collect();
    s.add_request(req("b", prompt, 1)).unwrap();
    let out = s.schedule_step(false);
    let b = out.req_ids.iter().position(|id| id == "b").unwrap();
    assert_eq!(out.arrays.num_computed_tokens[b], 24);
    assert_eq!(out.state_restores.len(), 1);
}
