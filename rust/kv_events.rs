//! KV cache events (vLLM's `--kv-events-config`): what entered and left the prefix cache, for
//! routers that send a request to the engine already holding its prefix (KV-aware routing).
//!
//! The block pool and the cache manager record them while recording is on (`KvEvents::on`); the
//! engine core drains them once a step and publishes them (ferrox/engine/kv_events.py). Off, the
//! recording costs a branch per cached or evicted block and nothing else.

use crate::cbor_block_hash::ExtraKey;
use crate::prefix_cache::BlockHash;

/// A block's hash as consumers see it: 64 bits (msgpack integers are at most 64 bits wide), an
/// opaque id they match between a block's Stored and Removed events.
pub fn external_hash(hash: BlockHash) -> u64 {
    hash as u64
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive full blocks of one request entered the cache: their hashes in token order, the
    /// hash of the block before the first (None: the first block of a sequence), their tokens
    /// (block_size each, concatenated) and the request's LoRA adapter (0: none). Under vLLM's
    /// CBOR hashes, each block's extra keys too (None: the block had none), so that consumers
    /// can rebuild its hash; under ferrox's own hashes, None.
    Stored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        lora_id: i64,
        extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    },
    /// Cached blocks whose content was dropped (evicted for reuse, or never computed).
    Removed { block_hashes: Vec<u64> },
    /// Blocks copied into the host tier (host_tier.rs; vLLM's medium "CPU"): their hashes only,
    /// as vLLM's offloading connector publishes them (no tokens, no parent).
    HostStored { block_hashes: Vec<u64> },
    /// Blocks the host tier dropped (evicted for room, or their copy never ran).
    HostRemoved { block_hashes: Vec<u64> },
    /// Every cached block was forgotten (reset_prefix_cache).
    Cleared,
}

/// The recorded events, or nothing while recording is off.
#[derive(Debug, Default)]
pub struct KvEvents {
    events: Option<Vec<KvEvent>>,
}

impl KvEvents {
    pub fn on() -> Self {
        KvEvents {
            events: Some(Vec::new()),
        }
    }

    pub fn recording(&self) -> bool {
        self.events.is_some()
    }

    pub fn push(&mut self, event: KvEvent) {
        if let Some(events) = self.events.as_mut() {
            events.push(event);
        }
    }

    /// The events since the last call, oldest first.
    pub fn take(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }
}
