//! The prefix cache's second tier, in host memory (vLLM's native KV offloading,
//! `--kv-offloading-size`): full blocks evicted from the device cache are copied to host slots
//! under their prefix hashes, and a request whose prefix the device no longer holds but the
//! host does gets fresh device blocks filled from those slots instead of recomputing them.
//!
//! This module only decides which host slot holds which hash; the copies are the runner's. The
//! scheduler asks for them per step (kv_cache_manager.rs): the step's offloads (device block ->
//! host slot) run before its loads (host slot -> device block), both before the forward, so a
//! device block evicted and refilled in one step is read before it is overwritten, and a host
//! slot stored in one step can be loaded by a later request of the same step.
//!
//! Slots are evicted least recently used first (stored or loaded counts as a use); a slot used
//! in the current step is never evicted in it (its copy has not run yet).

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use crate::block_pool::FoldHasher;
use crate::prefix_cache::BlockHash;

pub type HostSlot = u32;
const NIL: u32 = u32::MAX;

pub struct HostTier {
    slot_of: HashMap<BlockHash, HostSlot, BuildHasherDefault<FoldHasher>>,
    hash_of: Vec<Option<BlockHash>>,
    /// Used slots in a doubly-linked list, least recently used at the head.
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    /// The step a slot was last used in: such slots are not evicted during that step.
    used_in: Vec<u64>,
    step: u64,
    /// Slots never used yet (taken before any eviction).
    unused: Vec<HostSlot>,
}

impl HostTier {
    pub fn new(num_slots: usize) -> Self {
        assert!(num_slots < NIL as usize, "too many host slots");
        HostTier {
            slot_of: HashMap::default(),
            hash_of: vec![None; num_slots],
            prev: vec![NIL; num_slots],
            next: vec![NIL; num_slots],
            head: NIL,
            tail: NIL,
            used_in: vec![0; num_slots],
            step: 1,
            unused: (0..num_slots as u32).rev().collect(),
        }
    }

    pub fn num_slots(&self) -> usize {
        self.hash_of.len()
    }

    /// Blocks the tier holds.
    pub fn len(&self) -> usize {
        self.slot_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slot_of.is_empty()
    }

    /// A new step: last step's copies have been issued, its slots may be evicted again.
    pub fn begin_step(&mut self) {
        self.step += 1;
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.slot_of.contains_key(&hash)
    }

    /// The slot holding `hash` (a use: it becomes the most recently used, kept this step).
    pub fn lookup(&mut self, hash: BlockHash) -> Option<HostSlot> {
        let slot = *self.slot_of.get(&hash)?;
        self.use_slot(slot);
        Some(slot)
    }

    /// A slot to copy the block named `hash` into: None when the tier already holds it (then
    /// it counts as used) or every slot is in use this step. Evicts the least recently used
    /// slot when none is free; `evicted` gets that slot's hash.
    pub fn reserve(&mut self, hash: BlockHash, evicted: &mut Vec<BlockHash>) -> Option<HostSlot> {
        if self.lookup(hash).is_some() {
            return None;
        }
        let slot = match self.unused.pop() {
            Some(s) => s,
            None => {
                let mut s = self.head;
                while s != NIL && self.used_in[s as usize] == self.step {
                    s = self.next[s as usize];
                }
                if s == NIL {
                    return None;
                }
                self.unlink(s);
                let old = self.hash_of[s as usize]
                    .take()
                    .expect("a listed slot holds a hash");
                self.slot_of.remove(&old);
                evicted.push(old);
                s
            }
        };
        self.hash_of[slot as usize] = Some(hash);
        self.slot_of.insert(hash, slot);
        self.push_back(slot);
        self.used_in[slot as usize] = self.step;
        Some(slot)
    }

    /// Drops `hash` (its copy never ran: the step was rolled back); the slot becomes free.
    /// Whether the tier held it.
    pub fn forget(&mut self, hash: BlockHash) -> bool {
        let Some(slot) = self.slot_of.remove(&hash) else {
            return false;
        };
        self.hash_of[slot as usize] = None;
        self.unlink(slot);
        self.unused.push(slot);
        true
    }

    /// Forgets every block (reset_prefix_cache).
    pub fn clear(&mut self) {
        let n = self.num_slots();
        *self = HostTier::new(n);
    }

    fn use_slot(&mut self, slot: HostSlot) {
        self.unlink(slot);
        self.push_back(slot);
        self.used_in[slot as usize] = self.step;
    }

    fn unlink(&mut self, s: u32) {
        let (p, n) = (self.prev[s as usize], self.next[s as usize]);
        if p == NIL {
            if self.head == s {
                self.head = n;
            }
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            if self.tail == s {
                self.tail = p;
            }
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[s as usize] = NIL;
        self.next[s as usize] = NIL;
    }

    fn push_back(&mut self, s: u32) {
        self.prev[s as usize] = self.tail;
        self.next[s as usize] = NIL;
        if self.tail == NIL {
            self.head = s;
        } else {
            self.next[self.tail as usize] = s;
        }
        self.tail = s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_look_up_and_evict_least_recently_used_first() {
        let mut t = HostTier::new(2);
        let mut ev = Vec::new();
        let (a, b, c) = (
            t.reserve(1, &mut ev).unwrap(),
            t.reserve(2, &mut ev).unwrap(),
            0,
        );
        assert_ne!(a, b);
        assert_eq!(t.reserve(1, &mut ev), None, "already held");
        t.begin_step();
        assert_eq!(t.lookup(1), Some(a)); // 1 is now the most recently used
        let got = t.reserve(3, &mut ev).unwrap(); // evicts 2
        assert_eq!((got, ev), (b, vec![2]));
        assert!(!t.contains(2) && t.contains(1) && t.contains(3));
        assert_eq!(t.len(), 2);
        let _ = c;
    }

    #[test]
    fn slots_used_this_step_are_not_evicted_in_it() {
        let mut t = HostTier::new(2);
        let mut ev = Vec::new();
        t.reserve(1, &mut ev);
        t.reserve(2, &mut ev);
        assert_eq!(
            t.reserve(3, &mut ev),
            None,
            "both slots were stored this step"
        );
        t.begin_step();
        t.lookup(1);
        t.lookup(2);
        assert_eq!(
            t.reserve(3, &mut ev),
            None,
            "both slots are being loaded this step"
        );
        t.begin_step();
        assert!(t.reserve(3, &mut ev).is_some());
    }

    #[test]
    fn forgotten_and_cleared_slots_are_free_again() {
        let mut t = HostTier::new(2);
        let mut ev = Vec::new();
        let a = t.reserve(1, &mut ev).unwrap();
        t.reserve(2, &mut ev);
        assert!(t.forget(1) && !t.forget(1));
        assert!(!t.contains(1) && t.len() == 1);
        assert_eq!(t.reserve(5, &mut ev), Some(a));
        t.clear();
        assert!(t.is_empty());
        assert!(t.reserve(7, &mut ev).is_some() && t.reserve(8, &mut ev).is_some());
        assert!(ev.is_empty());
    }
}
