//! The flat per-step arrays the model runner feeds to the model and attention backend.
//! Built in one pass over the scheduled requests, in batch order; the Python glue moves each
//! Vec into a numpy array without copying.

use std::sync::Arc;

use crate::block_pool::NULL_BLOCK;

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
    pub logits_indices: Vec<i64>,
    pub sample_mask: Vec<bool>,
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
}

impl BatchArrays {
    pub fn build<'a>(
        entries: impl ExactSizeIterator<Item = BatchEntry<'a>> + Clone,
        block_size: usize,
    ) -> Self {
        let num_reqs = entries.len();
        let num_tokens: usize = entries.clone().map(|e| e.num_new_tokens).sum();
        let max_blocks = entries.clone().map(|e| e.blocks.len()).max().unwrap_or(0);
        let mut b = BatchArrays {
            input_ids: Vec::with_capacity(num_tokens),
            positions: Vec::with_capacity(num_tokens),
            slot_mapping: Vec::with_capacity(num_tokens),
            query_start_loc: Vec::with_capacity(num_reqs + 1),
            num_scheduled_tokens: Vec::with_capacity(num_reqs),
            num_computed_tokens: Vec::with_capacity(num_reqs),
            seq_lens: Vec::with_capacity(num_reqs),
            block_table: vec![NULL_BLOCK as i32; num_reqs * max_blocks],
            max_blocks,
            logits_indices: Vec::with_capacity(num_reqs),
            sample_mask: Vec::with_capacity(num_reqs),
        };
        b.query_start_loc.push(0);
        for (r, e) in entries.enumerate() {
            let start = e.num_computed_tokens;
            let end = start + e.num_new_tokens;
            for pos in start..end {
                b.input_ids
                    .push(e.token_ids.get(pos).map_or(-1, |&t| t as i64));
                b.positions.push(pos as i64);
                let block = e.blocks[pos / block_size] as i64;
                b.slot_mapping
                    .push(block * block_size as i64 + (pos % block_size) as i64);
            }
            let row = &mut b.block_table[r * max_blocks..r * max_blocks + e.blocks.len()];
            for (dst, &src) in row.iter_mut().zip(e.blocks) {
                *dst = src as i32;
            }
            b.num_scheduled_tokens.push(e.num_new_tokens as i32);
            b.num_computed_tokens.push(start as i32);
            b.seq_lens.push(end as i32);
            b.query_start_loc.push(b.input_ids.len() as i32);
            b.logits_indices.push(b.input_ids.len() as i64 - 1);
            b.sample_mask
                .push(end == e.token_ids.len() + e.num_placeholders);
        }
        b
    }
}

/// Everything `schedule()` decided for one step.
#[derive(Debug, Default, Clone)]
pub struct SchedulerOutput {
    /// Batch order: running requests first, then newly scheduled (new or resumed) ones.
    pub req_ids: Vec<Arc<str>>,
    pub new_req_ids: Vec<Arc<str>>,
    pub resumed_req_ids: Vec<Arc<str>>,
    pub finished_req_ids: Vec<Arc<str>>,
    pub preempted_req_ids: Vec<Arc<str>>,
    pub num_tokens: usize,
    pub arrays: BatchArrays,
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
            },
            // prefill chunk: tokens 2..6 of 10 (2 cached), blocks [7, 8]
            BatchEntry {
                token_ids: &a_toks,
                blocks: &[7, 8],
                num_computed_tokens: 2,
                num_new_tokens: 4,
                num_placeholders: 0,
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
            },
            BatchEntry {
                token_ids: &t,
                blocks: &[1, 2, 6],
                num_computed_tokens: 0,
                num_new_tokens: 9,
                num_placeholders: 0,
            },
        ];
        let b = BatchArrays::build(entries.into_iter(), 4);
        assert_eq!(b.max_blocks, 3);
        assert_eq!(b.block_table, vec![5, 0, 0, 1, 2, 6]);
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
        }];
        let b = BatchArrays::build(entries.into_iter(), 4);
        assert_eq!(b.input_ids, vec![-1]);
        assert_eq!(b.positions, vec![5]);
        assert_eq!(b.slot_mapping, vec![17]);
        assert_eq!(b.sample_mask, vec![true]);
    }
}
