//! The flat per-step arrays the model runner feeds to the model and attention backend.
//! Built in one pass over the scheduled requests, in batch order; the Python glue moves each
//! Vec into a numpy array without copying.

use std::sync::Arc;

use crate::block_pool::NULL_BLOCK;
use crate::kv_cache_manager::KvTransfers;

/// Request ids of a step's rows, copied into one buffer: reading them later never touches the
/// requests, and building the list changes no reference counts (an atomic operation per row).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct IdList {
    text: String,
    ends: Vec<u32>,
}

impl IdList {
    pub fn with_capacity(n: usize) -> Self {
        IdList {
            text: String::with_capacity(n * 16),
            ends: Vec::with_capacity(n),
        }
    }

    pub fn push(&mut self, id: &str) {
        self.text.push_str(id);
        self.ends.push(self.text.len() as u32);
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub fn get(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.text[start..self.ends[i] as usize]
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }
}

#[derive(Debug, Default, Clone)]
pub struct BatchArrays {
    pub input_ids: Vec<i64>,
    pub positions: Vec<i64>,
    pub slot_mapping: Vec<i64>,
    pub query_start_loc: Vec<i32>,
    pub num_scheduled_tokens: Vec<i32>,
    pub num_computed_tokens: Vec<i32>,
    pub seq_lens: Vec<i32>,
    /// Row-major [num_reqs, max_blocks], padded with the null block.
    pub block_table: Vec<i32>,
    pub max_blocks: usize,
    /// Flat indices (into input_ids) of the tokens whose logits the runner computes: for each
    /// request its last token, or with d drafts its last 1 + d tokens (the verify positions).
    pub logits_indices: Vec<i64>,
    /// [num_reqs + 1] request r's rows of logits_indices are logits_start_loc[r]..[r + 1].
    pub logits_start_loc: Vec<i32>,
    pub sample_mask: Vec<bool>,
    /// [num_reqs] drafts scheduled after each request's last sampled token.
    pub num_draft_tokens: Vec<i32>,
    /// Every request's drafts, batch order (also in input_ids, after each one's first token).
    pub draft_token_ids: Vec<i64>,
}

/// One scheduled request, as the batch builder sees it.
#[derive(Clone)]
pub struct BatchEntry<'a> {
    pub token_ids: &'a [u32],
    pub blocks: &'a [u32],
    pub num_computed_tokens: usize,
    pub num_new_tokens: usize,
    /// Sampled tokens not known yet (async scheduling): positions past `token_ids` get input id
    /// -1, which the runner replaces on the device with the previous step's sampled token.
    pub num_placeholders: usize,
    /// Speculative tokens scheduled after the known tokens and placeholders: they are the
    /// input ids of the last `drafts.len()` positions.
    pub drafts: &'a [u32],
}

impl BatchArrays {
    pub fn build<'a>(
        entries: impl ExactSizeIterator<Item = BatchEntry<'a>> + Clone,
        block_size: usize,
    ) -> Self {
        let (num_tokens, max_blocks) = entries.clone().fold((0, 0), |(t, b), e| {
            (t + e.num_new_tokens, b.max(e.blocks.len()))
        });
        Self::build_sized(entries, block_size, num_tokens, max_blocks)
    }

    /// `build` when the caller already knows the total of `num_new_tokens` and the longest
    /// block list (one pass over the requests fewer).
    pub fn build_sized<'a>(
        entries: impl ExactSizeIterator<Item = BatchEntry<'a>>,
        block_size: usize,
        num_tokens: usize,
        max_blocks: usize,
    ) -> Self {
        // One pass gathers the entries; each per-request column is then one exact-size collect
        // (no capacity checks per element, and the simple ones vectorize).
        let entries: Vec<BatchEntry<'a>> = entries.collect();
        fn column<'a>(entries: &[BatchEntry<'a>], f: impl Fn(&BatchEntry<'a>) -> i32) -> Vec<i32> {
            entries.iter().map(f).collect()
        }
        let num_scheduled_tokens = column(&entries, |e| e.num_new_tokens as i32);
        let num_computed_tokens = column(&entries, |e| e.num_computed_tokens as i32);
        let seq_lens = column(&entries, |e| {
            (e.num_computed_tokens + e.num_new_tokens) as i32
        });
        let mut end = 0;
        let query_start_loc: Vec<i32> = std::iter::once(0)
            .chain(num_scheduled_tokens.iter().map(|&n| {
                end += n;
                end
            }))
            .collect();
        let num_draft_tokens = column(&entries, |e| e.drafts.len() as i32);
        let total_drafts: usize = num_draft_tokens.iter().map(|&d| d as usize).sum();
        let (logits_indices, logits_start_loc, draft_token_ids) = if total_drafts == 0 {
            (
                query_start_loc[1..].iter().map(|&e| e as i64 - 1).collect(),
                (0..=entries.len() as i32).collect(),
                Vec::new(),
            )
        } else {
            // Logits at every verify position: the last 1 + d tokens of each request.
            let mut logits_indices = Vec::with_capacity(entries.len() + total_drafts);
            let mut logits_start_loc = Vec::with_capacity(entries.len() + 1);
            let mut draft_token_ids = Vec::with_capacity(total_drafts);
            logits_start_loc.push(0);
            for (e, &end) in entries.iter().zip(&query_start_loc[1..]) {
                let d = e.drafts.len() as i64;
                logits_indices.extend(end as i64 - 1 - d..end as i64);
                logits_start_loc.push(logits_indices.len() as i32);
                draft_token_ids.extend(e.drafts.iter().map(|&t| t as i64));
            }
            (logits_indices, logits_start_loc, draft_token_ids)
        };
        let sample_mask = entries
            .iter()
            .map(|e| {
                e.num_computed_tokens + e.num_new_tokens
                    == e.token_ids.len() + e.num_placeholders + e.drafts.len()
            })
            .collect();

        // Block sizes are powers of two in practice: then a position's block and offset are a
        // shift and a mask (a division costs tens of cycles, per token).
        let shift = block_size
            .is_power_of_two()
            .then(|| block_size.trailing_zeros());
        let slot_of = |e: &BatchEntry<'_>, pos: usize| -> i64 {
            let (index, offset) = match shift {
                Some(sh) => (pos >> sh, pos & (block_size - 1)),
                None => (pos / block_size, pos % block_size),
            };
            e.blocks[index] as i64 * block_size as i64 + offset as i64
        };
        // A position past the known tokens holds a draft (speculative decoding) or a
        // placeholder (async scheduling: input id -1).
        let token_at = |e: &BatchEntry<'_>, pos: usize| match e.token_ids.get(pos) {
            Some(&t) => t as i64,
            None => (pos - e.token_ids.len())
                .checked_sub(e.num_placeholders)
                .and_then(|j| e.drafts.get(j))
                .map_or(-1, |&t| t as i64),
        };
        let (input_ids, positions, slot_mapping) = if num_tokens == entries.len() {
            // All decodes (one token each): per-request columns too.
            let start = |e: &BatchEntry<'_>| e.num_computed_tokens;
            (
                entries.iter().map(|e| token_at(e, start(e))).collect(),
                entries.iter().map(|e| start(e) as i64).collect(),
                entries.iter().map(|e| slot_of(e, start(e))).collect(),
            )
        } else {
            let mut input_ids = Vec::with_capacity(num_tokens);
            let mut positions = Vec::with_capacity(num_tokens);
            let mut slot_mapping = Vec::with_capacity(num_tokens);
            for e in &entries {
                for pos in e.num_computed_tokens..e.num_computed_tokens + e.num_new_tokens {
                    input_ids.push(token_at(e, pos));
                    positions.push(pos as i64);
                    slot_mapping.push(slot_of(e, pos));
                }
            }
            (input_ids, positions, slot_mapping)
        };

        // Built as block ids (u32) with plain copies, converted to int32 once at the end.
        let mut block_table: Vec<u32> = Vec::with_capacity(entries.len() * max_blocks);
        for (r, e) in entries.iter().enumerate() {
            debug_assert_eq!(block_table.len(), r * max_blocks);
            block_table.extend_from_slice(e.blocks);
            block_table.resize((r + 1) * max_blocks, NULL_BLOCK);
        }
        BatchArrays {
            input_ids,
            positions,
            slot_mapping,
            query_start_loc,
            num_scheduled_tokens,
            num_computed_tokens,
            seq_lens,
            // Same-size element conversion: collected in place (no new allocation), and the
            // loop vectorizes; block ids fit int32 (the pool is checked to be < 2^31 blocks).
            block_table: block_table.into_iter().map(|id| id as i32).collect(),
            max_blocks,
            logits_indices,
            logits_start_loc,
            sample_mask,
            num_draft_tokens,
            draft_token_ids,
        }
    }
}

/// Everything `schedule()` decided for one step.
#[derive(Debug, Default, Clone)]
pub struct SchedulerOutput {
    /// Batch order: running requests first, then newly scheduled (new or resumed) ones.
    pub req_ids: IdList,
    /// The scheduler's slot of each request, batch order (as `req_ids`).
    pub req_slots: Vec<i32>,
    pub new_req_ids: Vec<Arc<str>>,
    pub resumed_req_ids: Vec<Arc<str>>,
    pub finished_req_ids: Vec<Arc<str>>,
    pub preempted_req_ids: Vec<Arc<str>>,
    pub num_tokens: usize,
    pub arrays: BatchArrays,
    /// Copies between the device cache and the host tier, issued before the forward.
    pub transfers: KvTransfers,
    /// A hybrid model's state snapshots (state_snapshots.rs) as (batch index, snapshot slot):
    /// copied into the request's state row before the forward, and from it after.
    pub state_restores: Vec<(u32, u32)>,
    pub state_saves: Vec<(u32, u32)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_for_a_prefill_chunk_and_a_decode() {
        let a_toks: Vec<u32> = (100..110).collect();
        let b_toks: Vec<u32> = (200..205).collect();
        let entries = vec![
            // decode: 4 computed, 1 new (the last token), blocks [3, 4] with block_size 4
            BatchEntry {
                token_ids: &b_toks,
                blocks: &[3, 4],
                num_computed_tokens: 4,
                num_new_tokens: 1,
                num_placeholders: 0,
                drafts: &[],
            },
            // prefill chunk: tokens 2..6 of 10 (2 cached), blocks [7, 8]
            BatchEntry {
                token_ids: &a_toks,
                blocks: &[7, 8],
                num_computed_tokens: 2,
                num_new_tokens: 4,
                num_placeholders: 0,
                drafts: &[],
            },
        ];
        let b = BatchArrays::build(entries.into_iter(), 4);
        assert_eq!(b.input_ids, vec![204, 102, 103, 104, 105]);
        assert_eq!(b.positions, vec![4, 2, 3, 4, 5]);
        assert_eq!(b.slot_mapping, vec![16, 30, 31, 32, 33]);
        assert_eq!(b.query_start_loc, vec![0, 1, 5]);
        assert_eq!(b.seq_lens, vec![5, 6]);
        assert_eq!(b.num_computed_tokens, vec![4, 2]);
        assert_eq!(b.block_table, vec![3, 4, 7, 8]);
        assert_eq!(b.logits_indices, vec![0, 4]);
        assert_eq!(b.sample_mask, vec![true, false]);
    }

    #[test]
    fn block_table_rows_are_padded_with_the_null_block() {
        let t: Vec<u32> = (0..9).collect();
        let entries = vec![
            BatchEntry {
                token_ids: &t[..2],
                blocks: &[5],
                num_computed_tokens: 0,
                num_new_tokens: 2,
                num_placeholders: 0,
                drafts: &[],
            },
            BatchEntry {
                token_ids: &t,
                blocks: &[1, 2, 6],
                num_computed_tokens: 0,
                num_new_tokens: 9,
                num_placeholders: 0,
                drafts: &[],
            },
        ];
        let b = BatchArrays::build(entries.into_iter(), 4);
        assert_eq!(b.max_blocks, 3);
        assert_eq!(b.block_table, vec![5, 0, 0, 1, 2, 6]);
    }

    #[test]
    fn drafts_follow_the_last_token_and_every_verify_position_gets_logits() {
        let a: Vec<u32> = (10..15).collect();
        let b: Vec<u32> = (20..23).collect();
        let entries = vec![
            // decode of a with 2 drafts: positions 4, 5, 6
            BatchEntry {
                token_ids: &a,
                blocks: &[3, 4],
                num_computed_tokens: 4,
                num_new_tokens: 3,
                num_placeholders: 0,
                drafts: &[77, 78],
            },
            // plain decode of b
            BatchEntry {
                token_ids: &b,
                blocks: &[9],
                num_computed_tokens: 2,
                num_new_tokens: 1,
                num_placeholders: 0,
                drafts: &[],
            },
        ];
        let o = BatchArrays::build(entries.into_iter(), 4);
        assert_eq!(o.input_ids, vec![14, 77, 78, 22]);
        assert_eq!(o.positions, vec![4, 5, 6, 2]);
        assert_eq!(o.slot_mapping, vec![16, 17, 18, 38]);
        assert_eq!(o.seq_lens, vec![7, 3]);
        assert_eq!(o.logits_indices, vec![0, 1, 2, 3]);
        assert_eq!(o.logits_start_loc, vec![0, 3, 4]);
        assert_eq!(o.num_draft_tokens, vec![2, 0]);
        assert_eq!(o.draft_token_ids, vec![77, 78]);
        assert_eq!(o.sample_mask, vec![true, true]);
    }

    #[test]
    fn a_placeholder_token_is_minus_one_and_sampled() {
        let t: Vec<u32> = (10..15).collect();
        let entries = vec![BatchEntry {
            token_ids: &t,
            blocks: &[3, 4],
            num_computed_tokens: 5,
            num_new_tokens: 1,
            num_placeholders: 1,
            drafts: &[],
        }];
        let b = BatchArrays::build(entries.into_iter(), 4);
        assert_eq!(b.input_ids, vec![-1]);
        assert_eq!(b.positions, vec![5]);
        assert_eq!(b.slot_mapping, vec![17]);
        assert_eq!(b.sample_mask, vec![true]);
    }
}
