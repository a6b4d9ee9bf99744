//! The KV cache manager: the only layer the scheduler talks to about blocks. It finds the
//! longest cached prefix of a request, allocates the slots a step needs (or says it cannot),
//! registers blocks in the prefix cache as they fill, and frees a request's blocks.

use crate::block_pool::{BlockId, BlockPool};
use crate::host_tier::{HostSlot, HostTier};
use crate::kv_events::{external_hash, KvEvent, KvEvents};
use crate::prefix_cache::{BlockHash, BlockHasher};

/// The blocks one request holds, in token order. `num_cached` of them (a prefix) are known
/// to be registered in the prefix cache (or were tried), so caching resumes from there.
#[derive(Debug, Default, Clone)]
pub struct KvBlocks {
    pub blocks: Vec<BlockId>,
    pub num_cached: usize,
}

/// Result of a prefix-cache lookup for a request about to be scheduled.
#[derive(Debug, Default)]
pub struct ComputedPrefix {
    /// Blocks whose KV can be reused as-is (not yet referenced by the request).
    pub blocks: Vec<BlockId>,
    /// Tokens covered by `blocks` (= blocks.len() * block_size).
    pub num_tokens: usize,
}

/// One step's copies between the device cache and the host tier (host_tier.rs), in the order
/// the runner must issue them, before the forward: every offload, then every load.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct KvTransfers {
    pub offload_blocks: Vec<BlockId>,
    pub offload_slots: Vec<HostSlot>,
    pub load_slots: Vec<HostSlot>,
    pub load_blocks: Vec<BlockId>,
    /// The offloaded blocks' hashes (forgotten by the tier if the step is rolled back).
    pub offload_hashes: Vec<BlockHash>,
}

impl KvTransfers {
    pub fn is_empty(&self) -> bool {
        self.offload_blocks.is_empty() && self.load_blocks.is_empty()
    }
}

pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    enable_caching: bool,
    /// Tokens looked up in the prefix cache / found there (cumulative, for metrics).
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    /// The host tier (--kv-offloading-size), and the copies of the step being scheduled.
    host: Option<HostTier>,
    transfers: KvTransfers,
    /// Tokens found in the host tier, not the device (cumulative, for metrics).
    pub host_hits: u64,
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize, enable_caching: bool) -> Self {
        KvCacheManager {
            pool: BlockPool::new(num_blocks),
            block_size,
            enable_caching,
            prefix_queries: 0,
            prefix_hits: 0,
            host: None,
            transfers: KvTransfers::default(),
            host_hits: 0,
        }
    }

    /// Adds a host tier of `num_slots` blocks (prefix caching must be on: it holds cached blocks).
    pub fn enable_host_tier(&mut self, num_slots: usize) {
        self.host = Some(HostTier::new(num_slots));
        self.pool.evictions = Some(Vec::new());
    }

    pub fn host_tier(&self) -> Option<&HostTier> {
        self.host.as_ref()
    }

    /// The host slots holding the blocks that follow a request's `device_hits` device-cache hits,
    /// as many consecutive ones as the tier holds (never the block of its last token: at least one
    /// token is computed). Each counts as used this step. Empty without a host tier.
    pub fn host_prefix(
        &mut self,
        hashes: &[BlockHash],
        device_hits: usize,
        num_tokens: usize,
    ) -> Vec<HostSlot> {
        let max_blocks = self.max_prefix_blocks(hashes, num_tokens);
        let Some(host) = self.host.as_mut() else {
            return Vec::new();
        };
        let mut slots = Vec::new();
        for &h in hashes.iter().take(max_blocks).skip(device_hits) {
            match host.lookup(h) {
                Some(slot) => slots.push(slot),
                None => break,
            }
        }
        slots
    }

    /// Device blocks a request took for its host-tier hits: they are filled by loads this step.
    pub fn note_loads(&mut self, slots: &[HostSlot], blocks: &[BlockId]) {
        self.transfers.load_slots.extend_from_slice(slots);
        self.transfers.load_blocks.extend_from_slice(blocks);
        self.host_hits += (slots.len() * self.block_size) as u64;
    }

    /// The copies of the step just scheduled (host_tier.rs says in which order); the tier's
    /// slots used by them may be evicted again from the next step on.
    pub fn take_transfers(&mut self) -> KvTransfers {
        if let Some(host) = self.host.as_mut() {
            host.begin_step();
        }
        std::mem::take(&mut self.transfers)
    }

    /// A rolled-back step's offloads never ran: the tier forgets what they would have stored.
    pub fn forget_offloads(&mut self, hashes: &[BlockHash]) {
        let Some(host) = self.host.as_mut() else {
            return;
        };
        let dropped: Vec<u64> = hashes
            .iter()
            .filter(|&&h| host.forget(h))
            .map(|&h| external_hash(h))
            .collect();
        if !dropped.is_empty() {
            self.pool.events.push(KvEvent::HostRemoved {
                block_hashes: dropped,
            });
        }
    }

    /// Cached blocks the last allocation evicted go to the host tier (a copy each, this step).
    fn offload_evicted(&mut self) {
        let (Some(host), Some(evicted)) = (self.host.as_mut(), self.pool.evictions.as_mut()) else {
            return;
        };
        let first = self.transfers.offload_hashes.len();
        let mut dropped = Vec::new();
        for (block, hash) in evicted.drain(..) {
            if let Some(slot) = host.reserve(hash, &mut dropped) {
                self.transfers.offload_blocks.push(block);
                self.transfers.offload_slots.push(slot);
                self.transfers.offload_hashes.push(hash);
            }
        }
        if self.pool.events.recording() {
            if !dropped.is_empty() {
                let block_hashes = dropped.into_iter().map(external_hash).collect();
                self.pool.events.push(KvEvent::HostRemoved { block_hashes });
            }
            let stored = &self.transfers.offload_hashes[first..];
            if !stored.is_empty() {
                let block_hashes = stored.iter().map(|&h| external_hash(h)).collect();
                self.pool.events.push(KvEvent::HostStored { block_hashes });
            }
        }
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Records KV cache events from now on (kv_events.rs).
    pub fn record_events(&mut self) {
        self.pool.events = KvEvents::on();
    }

    /// The KV cache events since the last call (empty while recording is off).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.pool.events.take()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The longest run of leading full blocks of a request (with `num_tokens` known tokens and
    /// the given block hashes) that is still in the cache. Never covers every token: at least
    /// one token must be computed so the step produces logits to sample from.
    pub fn get_computed_blocks(&self, hashes: &[BlockHash], num_tokens: usize) -> ComputedPrefix {
        let mut out = ComputedPrefix::default();
        for &h in &hashes[..self.max_prefix_blocks(hashes, num_tokens)] {
            match self.pool.get_cached_block(h) {
                Some(id) => out.blocks.push(id),
                None => break,
            }
        }
        out.num_tokens = out.blocks.len() * self.block_size;
        out
    }

    /// How many leading blocks a lookup may reuse: never the one holding the last token (at least
    /// one token is computed, for the logits), none with caching off.
    fn max_prefix_blocks(&self, hashes: &[BlockHash], num_tokens: usize) -> usize {
        if !self.enable_caching || num_tokens == 0 {
            return 0;
        }
        ((num_tokens - 1) / self.block_size).min(hashes.len())
    }

    /// Counts a prefix lookup in the hit-rate metrics (called once the request is scheduled,
    /// so a request that waits for room is not counted on every retry).
    pub fn record_prefix_lookup(&mut self, num_tokens: usize, num_hit_tokens: usize) {
        if self.enable_caching {
            self.prefix_queries += num_tokens as u64;
            self.prefix_hits += num_hit_tokens as u64;
        }
    }

    /// Makes room for `num_new_tokens` more tokens after `num_computed_tokens`, first adopting
    /// `new_computed` (prefix-cache hits from `get_computed_blocks`). Returns false, changing
    /// nothing, if the free queue cannot supply the blocks. Full blocks are registered in the
    /// prefix cache right away: their K/V is written in this step before any later step can
    /// read it, and within one step the runner writes all K/V of a layer before attention.
    /// `tokens`, `lora_id` and `hasher` (the request's) describe the blocks that enter the cache in
    /// its events (the hasher: their extra keys, under vLLM's CBOR hashes).
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub fn allocate_slots(
        &mut self,
        kv: &mut KvBlocks,
        hashes: &[BlockHash],
        num_computed_tokens: usize,
        num_new_tokens: usize,
        new_computed: &[BlockId],
        tokens: &[u32],
        lora_id: i64,
        hasher: Option<&BlockHasher>,
    ) -> bool {
        let total = num_computed_tokens + num_new_tokens;
        // Fast path (most decode steps), inlined into the scheduler's loop: the last block has
        // room and no block fills up, so there is nothing to allocate or cache.
        // Multiplications, not divisions: this runs for every running request every step.
        let bs = self.block_size;
        if new_computed.is_empty()
            && kv.blocks.len() * bs >= total
            && (!self.enable_caching || (kv.num_cached + 1) * bs > total)
        {
            return true;
        }
        self.allocate_slots_slow(kv, hashes, total, new_computed, tokens, lora_id, hasher)
    }

    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots_slow(
        &mut self,
        kv: &mut KvBlocks,
        hashes: &[BlockHash],
        total: usize,
        new_computed: &[BlockId],
        tokens: &[u32],
        lora_id: i64,
        hasher: Option<&BlockHasher>,
    ) -> bool {
        let required = total.div_ceil(self.block_size);
        let have = kv.blocks.len() + new_computed.len();
        let need = required.saturating_sub(have);
        // Hits on free cached blocks also take them out of the free queue.
        let hits_from_free = new_computed
            .iter()
            .filter(|&&b| self.pool.ref_cnt(b) == 0)
            .count();
        if need + hits_from_free > self.pool.num_free_blocks() {
            return false;
        }
        self.pool.touch(new_computed);
        kv.blocks.extend_from_slice(new_computed);
        let ok = self.pool.allocate(need, &mut kv.blocks);
        debug_assert!(ok);
        self.offload_evicted();
        if self.enable_caching {
            let num_full = (total / self.block_size)
                .min(hashes.len())
                .min(kv.blocks.len());
            if kv.num_cached < num_full {
                let first = kv.num_cached;
                let mut stored: Option<KvEvent> = None;
                for j in first..num_full {
                    let cached = self.pool.cache_block(kv.blocks[j], hashes[j]);
                    if self.pool.events.recording() {
                        self.note_stored(&mut stored, cached, j, hashes, tokens, lora_id, hasher);
                    }
                }
                if let Some(event) = stored {
                    self.pool.events.push(event);
                }
            }
            kv.num_cached = kv.num_cached.max(num_full);
        }
        true
    }

    /// Adds block `j` (just cached, or not: a copy of its content was cached already) to the
    /// request's run of Stored blocks; a block not cached here ends the run, as its content's
    /// Stored event came with the copy cached first.
    #[allow(clippy::too_many_arguments)]
    fn note_stored(
        &mut self,
        run: &mut Option<KvEvent>,
        cached: bool,
        j: usize,
        hashes: &[BlockHash],
        tokens: &[u32],
        lora_id: i64,
        hasher: Option<&BlockHasher>,
    ) {
        if !cached {
            if let Some(event) = run.take() {
                self.pool.events.push(event);
            }
            return;
        }
        let bs = self.block_size;
        let block_tokens = &tokens[j * bs..(j + 1) * bs];
        let keys = hasher.and_then(|h| h.event_extra_keys(j, bs));
        match run {
            Some(KvEvent::Stored {
                block_hashes,
                token_ids,
                extra_keys,
                ..
            }) => {
                block_hashes.push(external_hash(hashes[j]));
                token_ids.extend_from_slice(block_tokens);
                if let (Some(all), Some(k)) = (extra_keys.as_mut(), keys) {
                    all.push(k);
                }
            }
            _ => {
                *run = Some(KvEvent::Stored {
                    block_hashes: vec![external_hash(hashes[j])],
                    parent_block_hash: j.checked_sub(1).map(|p| external_hash(hashes[p])),
                    token_ids: block_tokens.to_vec(),
                    lora_id,
                    extra_keys: keys.map(|k| vec![k]),
                });
            }
        }
    }

    /// Releases every block of a request, last block first (see BlockPool::free).
    pub fn free(&mut self, kv: &mut KvBlocks) {
        self.pool.free(kv.blocks.iter().rev());
        kv.blocks.clear();
        kv.num_cached = 0;
    }

    /// Frees a preempted request's blocks. Blocks past its first `num_computed_tokens` tokens
    /// may have been registered in the cache by an allocation in the step being scheduled that
    /// was then taken back (the victim had already been scheduled), so their K/V will never be
    /// written: they leave the cache before going back to the free queue. Only this request
    /// can hold them (no lookup runs in a step that preempts).
    pub fn free_preempted(&mut self, kv: &mut KvBlocks, num_computed_tokens: usize) {
        let first_uncomputed = num_computed_tokens / self.block_size;
        for &b in kv.blocks.iter().skip(first_uncomputed) {
            if self.pool.ref_cnt(b) == 1 {
                self.pool.uncache_block(b);
            }
        }
        self.free(kv);
    }

    /// Forgets the prefix-cache registration of blocks whose K/V turned out never to be written
    /// (their step was rolled back).
    pub fn uncache(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            self.pool.uncache_block(b);
        }
    }

    /// Keeps only the blocks that `num_computed_tokens` tokens need, freeing the rest (last
    /// first), after a rolled-back step took computed tokens back.
    pub fn truncate(&mut self, kv: &mut KvBlocks, num_computed_tokens: usize) {
        let keep = num_computed_tokens.div_ceil(self.block_size);
        if keep < kv.blocks.len() {
            self.pool.free(kv.blocks[keep..].iter().rev());
            kv.blocks.truncate(keep);
        }
        kv.num_cached = kv.num_cached.min(num_computed_tokens / self.block_size);
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        let ok = self.pool.reset_prefix_cache();
        if ok {
            if let Some(host) = self.host.as_mut() {
                host.clear();
            }
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix_cache::{extend_block_hashes, root_hash, HashAlgo};

    fn hashes(tokens: &[u32], bs: usize) -> Vec<BlockHash> {
        let mut h = Vec::new();
        let algo = HashAlgo::default();
        extend_block_hashes(algo, root_hash(algo, 0, None), tokens, bs, &mut h);
        h
    }

    #[test]
    fn second_request_reuses_full_prompt_blocks_but_not_the_last_token() {
        let mut m = KvCacheManager::new(16, 4, true);
        let prompt: Vec<u32> = (0..12).collect();
        let hs = hashes(&prompt, 4);
        let mut a = KvBlocks::default();
        assert!(m.get_computed_blocks(&hs, 12).blocks.is_empty());
        assert!(m.allocate_slots(&mut a, &hs, 0, 12, &[], &[], 0, None));
        assert_eq!(a.blocks.len(), 3);
        // Same 12-token prompt: only 2 blocks may be reused (the last token must be computed).
        let hit = m.get_computed_blocks(&hs, 12);
        assert_eq!(hit.blocks, a.blocks[..2].to_vec());
        assert_eq!(hit.num_tokens, 8);
        let mut b = KvBlocks::default();
        assert!(m.allocate_slots(&mut b, &hs, 8, 4, &hit.blocks, &[], 0, None));
        assert_eq!(b.blocks[..2], a.blocks[..2]);
        assert_ne!(b.blocks[2], a.blocks[2]);
        assert_eq!(m.pool().ref_cnt(a.blocks[0]), 2);
        m.free(&mut a);
        m.free(&mut b);
        assert_eq!(m.pool().num_free_blocks(), 15);
        m.pool().check_invariants();
    }

    #[test]
    fn cache_events_name_what_entered_and_left_the_cache() {
        use crate::kv_events::{external_hash, KvEvent};
        // 5 usable blocks of 4 tokens; recording on.
        let mut m = KvCacheManager::new(6, 4, true);
        m.record_events();
        let prompt: Vec<u32> = (0..10).collect();
        let hs = hashes(&prompt, 4);
        let ext: Vec<u64> = hs.iter().map(|&h| external_hash(h)).collect();
        let mut a = KvBlocks::default();
        // A 6-token chunk fills one block, the next chunk a second: two Stored events chained by parent.
        assert!(m.allocate_slots(&mut a, &hs, 0, 6, &[], &prompt, 7, None));
        assert!(m.allocate_slots(&mut a, &hs, 6, 4, &[], &prompt, 7, None));
        assert_eq!(
            m.take_events(),
            vec![
                KvEvent::Stored {
                    block_hashes: vec![ext[0]],
                    parent_block_hash: None,
                    token_ids: (0..4).collect(),
                    lora_id: 7,
                    extra_keys: None,
                },
                KvEvent::Stored {
                    block_hashes: vec![ext[1]],
                    parent_block_hash: Some(ext[0]),
                    token_ids: (4..8).collect(),
                    lora_id: 7,
                    extra_keys: None,
                },
            ]
        );
        assert!(m.take_events().is_empty());
        // The same prompt again: its cached blocks are hits (no event); a copy of content already
        // cached is not announced twice.
        let mut b = KvBlocks::default();
        let hit = m.get_computed_blocks(&hs, 10);
        assert!(m.allocate_slots(&mut b, &hs, 8, 2, &hit.blocks, &prompt, 7, None));
        assert!(m.take_events().is_empty());
        m.free(&mut a);
        m.free(&mut b);
        // Another request takes all 5 blocks: the two cached ones are evicted, in one event.
        let other: Vec<u32> = (100..120).collect();
        let mut c = KvBlocks::default();
        assert!(m.allocate_slots(&mut c, &hashes(&other, 4), 0, 19, &[], &other, 0, None));
        let events = m.take_events();
        assert!(
            matches!(&events[0], KvEvent::Removed { block_hashes } if block_hashes.len() == 2
            && block_hashes.contains(&ext[0]) && block_hashes.contains(&ext[1])),
            "{events:?}"
        );
        assert!(
            matches!(&events[1], KvEvent::Stored { block_hashes, parent_block_hash: None, token_ids, lora_id: 0, .. }
            if block_hashes.len() == 4 && token_ids.len() == 16),
            "{events:?}"
        );
        m.free(&mut c);
        assert!(m.reset_prefix_cache());
        assert_eq!(m.take_events(), vec![KvEvent::Cleared]);
        // Off (the default), nothing is kept.
        let mut quiet = KvCacheManager::new(6, 4, true);
        let mut d = KvBlocks::default();
        assert!(quiet.allocate_slots(&mut d, &hs, 0, 10, &[], &prompt, 0, None));
        assert!(quiet.take_events().is_empty());
    }

    #[test]
    fn allocation_failure_changes_nothing() {
        let mut m = KvCacheManager::new(3, 4, true);
        let mut a = KvBlocks::default();
        let hs = hashes(&[1; 12], 4);
        assert!(!m.allocate_slots(&mut a, &hs, 0, 12, &[], &[], 0, None));
        assert!(a.blocks.is_empty());
        assert_eq!(m.pool().num_free_blocks(), 2);
    }

    #[test]
    fn cached_blocks_survive_free_until_evicted() {
        let mut m = KvCacheManager::new(4, 2, true);
        let toks = [5, 6, 7, 8, 9];
        let hs = hashes(&toks, 2);
        let mut a = KvBlocks::default();
        assert!(m.allocate_slots(&mut a, &hs, 0, 5, &[], &[], 0, None));
        m.free(&mut a);
        let hit = m.get_computed_blocks(&hs, 5);
        assert_eq!(hit.num_tokens, 4);
        // A different request needing all 3 blocks evicts them.
        let mut b = KvBlocks::default();
        let other = hashes(&[1, 2, 3, 4, 5, 6], 2);
        assert!(m.allocate_slots(&mut b, &other, 0, 6, &[], &[], 0, None));
        assert_eq!(m.get_computed_blocks(&hs, 5).num_tokens, 0);
        m.pool().check_invariants();
    }

    #[test]
    fn preempted_blocks_that_were_never_computed_leave_the_cache() {
        let mut m = KvCacheManager::new(16, 4, true);
        let toks: Vec<u32> = (0..12).collect();
        let hs = hashes(&toks, 4);
        let mut a = KvBlocks::default();
        // Tokens 0..4 were computed in an earlier step; 4..12 were allocated (and their full
        // blocks cached) for a step that was then taken back.
        assert!(m.allocate_slots(&mut a, &hs, 0, 4, &[], &[], 0, None));
        assert!(m.allocate_slots(&mut a, &hs, 4, 8, &[], &[], 0, None));
        assert_eq!(m.pool().num_cached_blocks(), 3);
        m.free_preempted(&mut a, 4);
        assert_eq!(m.get_computed_blocks(&hs, 12).num_tokens, 4);
        assert_eq!(m.pool().num_cached_blocks(), 1);
        m.pool().check_invariants();
    }

    #[test]
    fn caching_disabled_never_hits() {
        let mut m = KvCacheManager::new(8, 2, false);
        let hs = hashes(&[1, 2, 3, 4, 5], 2);
        let mut a = KvBlocks::default();
        assert!(m.allocate_slots(&mut a, &hs, 0, 5, &[], &[], 0, None));
        assert!(m.get_computed_blocks(&hs, 5).blocks.is_empty());
        assert_eq!(m.pool().num_cached_blocks(), 0);
    }
}
