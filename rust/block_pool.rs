//! The pool of KV-cache blocks: ref counts, the free queue and the hash -> block map.
//!
//! Block 0 is the *null block*: it pads block tables and is never handed out.
//!
//! The free queue is an intrusive doubly-linked list threaded through the block array, so
//! taking a block from the middle (a prefix-cache hit on a free block) is O(1), as are
//! allocation (pop from the head) and free (push to the head or tail). Freed blocks that
//! still hold a cached prefix go to the tail, so the head holds the least recently used ones
//! and they are evicted first; freed blocks without a hash go to the head, because nothing
//! is lost by reusing them at once.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::kv_events::{external_hash, KvEvent, KvEvents};
use crate::prefix_cache::BlockHash;

pub type BlockId = u32;
pub const NULL_BLOCK: BlockId = 0;
const NIL: u32 = u32::MAX;

/// Block hashes are already uniformly random, so the map hashes a u128 key by folding it
/// rather than running SipHash over it again.
#[derive(Default)]
pub struct FoldHasher(u64);

impl Hasher for FoldHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 ^= u64::from_le_bytes(b);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = (v as u64) ^ ((v >> 64) as u64);
    }
}

pub type HashToBlock = HashMap<BlockHash, BlockId, BuildHasherDefault<FoldHasher>>;

#[derive(Debug, Clone)]
struct Block {
    ref_cnt: u32,
    /// Set while the block's content is registered in `cached` under this hash.
    hash: Option<BlockHash>,
    prev: u32,
    next: u32,
    in_free_queue: bool,
}

pub struct BlockPool {
    blocks: Vec<Block>,
    head: u32,
    tail: u32,
    num_free: usize,
    cached: HashToBlock,
    /// What entered and left `cached` (kv_events.rs); records nothing unless switched on.
    pub events: KvEvents,
    /// Cached blocks evicted by `allocate` (block, hash), collected while a host tier takes
    /// them (host_tier.rs); None: not collected.
    pub evictions: Option<Vec<(BlockId, BlockHash)>>,
}

impl BlockPool {
    /// `num_blocks` includes the null block; at least 2 (validated by the scheduler config).
    pub fn new(num_blocks: usize) -> Self {
        assert!(
            (2..NIL as usize).contains(&num_blocks),
            "num_blocks out of range"
        );
        let blocks = (0..num_blocks)
            .map(|_| Block {
                ref_cnt: 0,
                hash: None,
                prev: NIL,
                next: NIL,
                in_free_queue: false,
            })
            .collect();
        let mut pool = BlockPool {
            blocks,
            head: NIL,
            tail: NIL,
            num_free: 0,
            cached: HashToBlock::default(),
            events: KvEvents::default(),
            evictions: None,
        };
        for id in 1..num_blocks as u32 {
            pool.push_back(id);
        }
        pool
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be allocated now (includes free blocks still holding a cached prefix).
    pub fn num_free_blocks(&self) -> usize {
        self.num_free
    }

    /// Blocks that can ever be handed out (all but the null block).
    pub fn num_usable_blocks(&self) -> usize {
        self.blocks.len() - 1
    }

    /// Fraction of usable blocks held by live requests.
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free as f64 / self.num_usable_blocks() as f64
    }

    pub fn ref_cnt(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_cnt
    }

    pub fn block_hash(&self, id: BlockId) -> Option<BlockHash> {
        self.blocks[id as usize].hash
    }

    pub fn num_cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// The block holding the content named by `hash`, if it is still cached (live or free).
    pub fn get_cached_block(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// Takes `n` blocks from the head of the free queue (evicting their cached hashes), each
    /// with ref count 1; None (and nothing changed) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize, out: &mut Vec<BlockId>) -> bool {
        if n > self.num_free {
            return false;
        }
        let mut evicted = Vec::new();
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            let b = &mut self.blocks[id as usize];
            debug_assert_eq!(b.ref_cnt, 0);
            b.ref_cnt = 1;
            if let Some(h) = b.hash.take() {
                // Evict: the content is about to be overwritten.
                self.cached.remove(&h);
                if self.events.recording() {
                    evicted.push(external_hash(h));
                }
                if let Some(ev) = self.evictions.as_mut() {
                    ev.push((id, h));
                }
            }
            out.push(id);
        }
        if !evicted.is_empty() {
            self.events.push(KvEvent::Removed {
                block_hashes: evicted,
            });
        }
        true
    }

    /// Takes one more reference on each block (a prefix-cache hit), pulling free ones out of the
    /// free queue so they cannot be evicted while in use.
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            if self.blocks[id as usize].in_free_queue {
                self.unlink(id);
            }
            self.blocks[id as usize].ref_cnt += 1;
        }
    }

    /// Drops one reference on each block, in the given order. A block whose count reaches zero
    /// joins the free queue: at the tail if it holds a cached prefix (evicted last), at the
    /// head otherwise. Callers pass a request's blocks last-first so its tail blocks, which
    /// are the least likely to be shared, are evicted before its head blocks.
    pub fn free<'a>(&mut self, ids: impl IntoIterator<Item = &'a BlockId>) {
        for &id in ids {
            let b = &mut self.blocks[id as usize];
            assert!(
                b.ref_cnt > 0,
                "block {id} freed more times than it was allocated"
            );
            b.ref_cnt -= 1;
            if b.ref_cnt == 0 {
                if b.hash.is_some() {
                    self.push_back(id);
                } else {
                    self.push_front(id);
                }
            }
        }
    }

    /// Registers a full, live block under `hash`. If another block already holds the same
    /// content (two requests computed the same prefix at the same time) the first one stays
    /// the cached copy and this block remains private.
    /// Returns whether this block became the cached copy.
    pub fn cache_block(&mut self, id: BlockId, hash: BlockHash) -> bool {
        debug_assert!(id != NULL_BLOCK);
        if self.blocks[id as usize].hash.is_some() {
            return false;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash) {
            e.insert(id);
            self.blocks[id as usize].hash = Some(hash);
            return true;
        }
        false
    }

    /// Removes one block's hash from the cache (its content turned out not to be computed).
    pub fn uncache_block(&mut self, id: BlockId) {
        if let Some(h) = self.blocks[id as usize].hash.take() {
            if self.cached.get(&h) == Some(&id) {
                self.cached.remove(&h);
                self.events.push(KvEvent::Removed {
                    block_hashes: vec![external_hash(h)],
                });
            }
        }
    }

    /// Forgets every cached hash. Refused (false) while any block is held by a request,
    /// because a live request's blocks would otherwise silently lose their sharing.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_free != self.num_usable_blocks() {
            return false;
        }
        self.cached.clear();
        for b in &mut self.blocks {
            b.hash = None;
        }
        self.events.push(KvEvent::Cleared);
        true
    }

    fn unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            debug_assert!(b.in_free_queue);
            (b.prev, b.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        b.in_free_queue = false;
        self.num_free -= 1;
    }

    fn push_back(&mut self, id: BlockId) {
        let old_tail = self.tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = old_tail;
            b.next = NIL;
            b.in_free_queue = true;
        }
        if old_tail == NIL {
            self.head = id;
        } else {
            self.blocks[old_tail as usize].next = id;
        }
        self.tail = id;
        self.num_free += 1;
    }

    fn push_front(&mut self, id: BlockId) {
        let old_head = self.head;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = NIL;
            b.next = old_head;
            b.in_free_queue = true;
        }
        if old_head == NIL {
            self.tail = id;
        } else {
            self.blocks[old_head as usize].prev = id;
        }
        self.head = id;
        self.num_free += 1;
    }

    /// Free-queue order, head first (tests and invariant checks).
    pub fn free_queue(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut cur = self.head;
        while cur != NIL {
            out.push(cur);
            cur = self.blocks[cur as usize].next;
        }
        out
    }

    /// Checks the pool's internal invariants; panics with a message on the first violation.
    pub fn check_invariants(&self) {
        let q = self.free_queue();
        assert_eq!(
            q.len(),
            self.num_free,
            "free count disagrees with the free queue"
        );
        assert!(
            !self.blocks[0].in_free_queue && self.blocks[0].ref_cnt == 0,
            "null block escaped"
        );
        for (id, b) in self.blocks.iter().enumerate().skip(1) {
            assert_eq!(
                b.in_free_queue,
                b.ref_cnt == 0,
                "block {id}: free-queue membership vs ref count"
            );
            if let Some(h) = b.hash {
                assert_eq!(
                    self.cached.get(&h),
                    Some(&(id as u32)),
                    "block {id}: hash not mapped to it"
                );
            }
        }
        for (h, &id) in &self.cached {
            assert_eq!(
                self.blocks[id as usize].hash,
                Some(*h),
                "map entry for block {id} is stale"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_block_is_never_handed_out() {
        let mut p = BlockPool::new(4);
        let mut got = Vec::new();
        assert!(p.allocate(3, &mut got));
        assert!(!got.contains(&NULL_BLOCK));
        assert!(!p.allocate(1, &mut got));
        assert_eq!(got.len(), 3);
        p.check_invariants();
    }

    #[test]
    fn allocate_fails_without_side_effects() {
        let mut p = BlockPool::new(3);
        let mut got = Vec::new();
        assert!(!p.allocate(3, &mut got));
        assert!(got.is_empty());
        assert_eq!(p.num_free_blocks(), 2);
    }

    #[test]
    fn cached_free_blocks_are_evicted_lru_and_uncached_first() {
        let mut p = BlockPool::new(5);
        let mut b = Vec::new();
        assert!(p.allocate(4, &mut b));
        p.cache_block(b[0], 10);
        p.cache_block(b[1], 11);
        // free in reverse order: b3 (uncached) -> head, b2 (uncached) -> head, b1 -> tail, b0 -> tail
        p.free(b.iter().rev());
        assert_eq!(p.free_queue(), vec![b[2], b[3], b[1], b[0]]);
        let mut again = Vec::new();
        assert!(p.allocate(3, &mut again));
        assert_eq!(again, vec![b[2], b[3], b[1]]);
        assert_eq!(
            p.get_cached_block(11),
            None,
            "hash of the evicted block is gone"
        );
        assert_eq!(p.get_cached_block(10), Some(b[0]));
        p.check_invariants();
    }

    #[test]
    fn touch_pulls_a_free_cached_block_out_of_the_queue() {
        let mut p = BlockPool::new(4);
        let mut b = Vec::new();
        assert!(p.allocate(1, &mut b));
        p.cache_block(b[0], 7);
        p.free(b.iter());
        assert_eq!(p.num_free_blocks(), 3);
        p.touch(&[b[0]]);
        assert_eq!(p.num_free_blocks(), 2);
        assert_eq!(p.ref_cnt(b[0]), 1);
        p.touch(&[b[0]]);
        assert_eq!(p.ref_cnt(b[0]), 2);
        p.free([b[0], b[0]].iter());
        assert_eq!(p.num_free_blocks(), 3);
        p.check_invariants();
    }

    #[test]
    fn duplicate_content_keeps_the_first_cached_copy() {
        let mut p = BlockPool::new(4);
        let mut b = Vec::new();
        assert!(p.allocate(2, &mut b));
        p.cache_block(b[0], 5);
        p.cache_block(b[1], 5);
        assert_eq!(p.get_cached_block(5), Some(b[0]));
        assert_eq!(p.block_hash(b[1]), None);
        p.check_invariants();
    }

    #[test]
    fn reset_is_refused_while_blocks_are_in_use() {
        let mut p = BlockPool::new(4);
        let mut b = Vec::new();
        assert!(p.allocate(1, &mut b));
        p.cache_block(b[0], 1);
        assert!(!p.reset_prefix_cache());
        p.free(b.iter());
        assert!(p.reset_prefix_cache());
        assert_eq!(p.get_cached_block(1), None);
        p.check_invariants();
    }

    #[test]
    #[should_panic(expected = "freed more times")]
    fn double_free_panics() {
        let mut p = BlockPool::new(3);
        let mut b = Vec::new();
        assert!(p.allocate(1, &mut b));
        p.free(b.iter());
        p.free(b.iter());
    }
}
