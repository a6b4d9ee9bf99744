//! Recurrent-state snapshots: the prefix cache's other half for hybrid models (vLLM's
//! `mamba_cache_mode="align"`).
//!
//! A hybrid model's linear-attention layers carry one fixed-size state per request instead of
//! K/V per token, so a cached prefix is only reusable where the state after it was kept. The
//! runner keeps a pool of snapshot slots beside the requests' state rows; this table says which
//! prefix each slot holds, keyed by the prefix hash of the KV block that ends where the snapshot
//! was taken. A prefix-cache hit then ends at the last block boundary that has both its K/V
//! blocks cached and a snapshot here.
//!
//! Snapshots are taken only where a step ends on the state grid (every `state_block_size`
//! tokens): the scheduler cuts prefill chunks to end there, so the state after the last full
//! grid block of a prompt is kept (the next turn of a conversation resumes from it).
//!
//! Within a step the runner restores snapshots before the forward and saves new ones after it,
//! so a slot reserved in a step becomes readable only from the next step on (`begin_step`).
//! Slots are reused least recently used first; a slot read or written this step is kept.
//!
//! Under async scheduling a decode step's last input is the previous step's sample, unknown
//! when the step is scheduled, and so is the hash of a block it completes: such a save takes a
//! slot without a hash (`reserve_unkeyed`), keyed once the token has arrived (`key`) or given
//! back (`release`).

use std::collections::HashMap;

use crate::prefix_cache::BlockHash;

/// A snapshot slot's index in the runner's snapshot pool.
pub type SnapshotSlot = u32;

#[derive(Debug, Clone)]
struct Entry {
    /// None: saved under a hash not known yet (never found, never evicted until keyed).
    hash: Option<BlockHash>,
    /// The step it was last restored or saved in (`StateSnapshots::step`).
    last_used: u64,
    /// Saved in a step that has run (a slot reserved this step is written after its forward).
    ready: bool,
}

#[derive(Debug)]
pub struct StateSnapshots {
    slots: Vec<Option<Entry>>,
    by_hash: HashMap<BlockHash, SnapshotSlot>,
    free: Vec<SnapshotSlot>,
    step: u64,
    /// Snapshots restored / saved (cumulative, for tests and metrics).
    pub num_restored: u64,
    pub num_saved: u64,
}

impl StateSnapshots {
    pub fn new(num_slots: usize) -> Self {
        StateSnapshots {
            slots: vec![None; num_slots],
            by_hash: HashMap::new(),
            free: (0..num_slots as SnapshotSlot).rev().collect(),
            step: 1,
            num_restored: 0,
            num_saved: 0,
        }
    }

    pub fn num_slots(&self) -> usize {
        self.slots.len()
    }

    /// A new step is being scheduled: last step's saves have run (or will, in stream order,
    /// before this step's restores).
    pub fn begin_step(&mut self) {
        self.step += 1;
        for e in self.slots.iter_mut().flatten() {
            e.ready = true;
        }
    }

    /// The slot holding the state after the block with this hash, if saved by a past step.
    pub fn lookup(&self, hash: BlockHash) -> Option<SnapshotSlot> {
        let slot = *self.by_hash.get(&hash)?;
        self.slots[slot as usize]
            .as_ref()
            .is_some_and(|e| e.ready)
            .then_some(slot)
    }

    /// A restore of `slot` this step: it stays until the step is over.
    pub fn note_restore(&mut self, slot: SnapshotSlot) {
        if let Some(e) = self.slots[slot as usize].as_mut() {
            e.last_used = self.step;
            self.num_restored += 1;
        }
    }

    /// A slot to save the state after the block `hash` into, after this step's forward: None if
    /// one already holds it (or is being written this step) or every slot is in use this step.
    pub fn reserve(&mut self, hash: BlockHash) -> Option<SnapshotSlot> {
        if let Some(&slot) = self.by_hash.get(&hash) {
            if let Some(e) = self.slots[slot as usize].as_mut() {
                e.last_used = self.step; // still wanted: keep it longer
            }
            return None;
        }
        let slot = self.take_slot()?;
        let e = self.slots[slot as usize].as_mut().expect("just taken");
        e.hash = Some(hash);
        self.by_hash.insert(hash, slot);
        self.num_saved += 1;
        Some(slot)
    }

    /// `reserve` for a block whose hash is not known yet (module docs).
    pub fn reserve_unkeyed(&mut self) -> Option<SnapshotSlot> {
        let slot = self.take_slot()?;
        self.num_saved += 1;
        Some(slot)
    }

    /// A free slot, else the least recently used keyed one not used this step, emptied and
    /// marked as written this step (unkeyed).
    fn take_slot(&mut self) -> Option<SnapshotSlot> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let victim = self
                    .slots
                    .iter()
                    .enumerate()
                    .filter_map(|(i, e)| e.as_ref().map(|e| (i, e)))
                    .filter(|(_, e)| e.ready && e.hash.is_some() && e.last_used < self.step)
                    .min_by_key(|(_, e)| e.last_used)
                    .map(|(i, _)| i as SnapshotSlot)?;
                let old = self.slots[victim as usize].take().expect("occupied");
                if let Some(h) = old.hash {
                    self.by_hash.remove(&h);
                }
                victim
            }
        };
        self.slots[slot as usize] = Some(Entry {
            hash: None,
            last_used: self.step,
            ready: false,
        });
        Some(slot)
    }

    /// An unkeyed slot's block hash has arrived: it is found from now on (if no other slot
    /// already holds that prefix: then this one is given back).
    pub fn key(&mut self, slot: SnapshotSlot, hash: BlockHash) {
        if self.by_hash.contains_key(&hash) {
            self.release(slot);
            return;
        }
        if let Some(e) = self.slots[slot as usize].as_mut() {
            e.hash = Some(hash);
            self.by_hash.insert(hash, slot);
        }
    }

    /// Gives an unkeyed slot back (its request left, or its step never ran).
    pub fn release(&mut self, slot: SnapshotSlot) {
        if let Some(e) = self.slots[slot as usize].take() {
            debug_assert!(e.hash.is_none(), "only unkeyed slots are released");
            self.free.push(slot);
        }
    }

    /// Forgets snapshots whose saves never ran (their step was rolled back).
    pub fn forget(&mut self, hashes: &[BlockHash]) {
        for h in hashes {
            if let Some(slot) = self.by_hash.remove(h) {
                self.slots[slot as usize] = None;
                self.free.push(slot);
            }
        }
    }

    /// Empties the table (the prefix cache was reset).
    pub fn clear(&mut self) {
        let n = self.slots.len();
        *self = StateSnapshots {
            num_restored: self.num_restored,
            num_saved: self.num_saved,
            ..StateSnapshots::new(n)
        };
    }

    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_save_is_readable_from_the_next_step_on() {
        let mut s = StateSnapshots::new(2);
        let slot = s.reserve(7).expect("a free slot");
        assert_eq!(s.lookup(7), None, "written after this step's forward");
        assert_eq!(s.reserve(7), None, "already being saved");
        s.begin_step();
        assert_eq!(s.lookup(7), Some(slot));
    }

    #[test]
    fn least_recently_used_goes_first_but_never_one_used_this_step() {
        let mut s = StateSnapshots::new(2);
        let a = s.reserve(1).unwrap();
        s.begin_step();
        let b = s.reserve(2).unwrap();
        s.begin_step();
        s.note_restore(a); // 1 is now the more recent
        let c = s.reserve(3).expect("2 evicted");
        assert_eq!(c, b);
        assert_eq!(s.lookup(2), None);
        assert_eq!(
            s.reserve(4),
            None,
            "1 was restored and 3 saved this step: nothing to evict"
        );
        s.begin_step();
        assert_eq!(s.lookup(1), Some(a));
        assert_eq!(s.lookup(3), Some(c));
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn forgotten_and_cleared_slots_come_back() {
        let mut s = StateSnapshots::new(1);
        s.reserve(5).unwrap();
        s.forget(&[5]);
        assert!(s.is_empty());
        s.reserve(6).unwrap();
        s.begin_step();
        s.clear();
        assert_eq!(s.lookup(6), None);
        assert!(s.reserve(8).is_some());
    }
}
