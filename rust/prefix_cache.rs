//! Prefix hashes: each *full* block of a request's tokens is named by a hash chained over its
//! parent block's hash and its own token ids. Two requests whose first k blocks hold the same
//! tokens (and the same extra keys) get the same k hashes, so they can share those KV blocks.
//!
//! Extra keys (LoRA adapter id, `cache_salt`) are folded into a per-request *root* hash that
//! seeds the chain, so they separate every block of the request without being re-hashed per
//! block.
//!
//! The hash is xxh3-128. The cache trusts a hash match without comparing tokens: with 128 bits,
//! the chance that any two of even 2^40 distinct blocks collide is about 2^-49, far below the
//! rate of hardware memory errors, so collisions are not a practical concern.

use xxhash_rust::xxh3::{xxh3_128, Xxh3};

/// Hash naming one full block (and, through the chain, everything before it).
pub type BlockHash = u128;

/// The chain's seed for a request: separates requests that use a different LoRA adapter or
/// a different cache salt even when their token ids are equal.
pub fn root_hash(lora_id: u64, cache_salt: Option<&str>) -> BlockHash {
    let mut h = Xxh3::new();
    h.update(b"ferrox-prefix-v1");
    h.update(&lora_id.to_le_bytes());
    match cache_salt {
        Some(salt) => {
            h.update(&[1]);
            h.update(&(salt.len() as u64).to_le_bytes());
            h.update(salt.as_bytes());
        }
        None => h.update(&[0]),
    }
    h.digest128()
}

/// Hash of one full block: H(parent hash ‖ token ids as little-endian u32).
pub fn hash_block(parent: BlockHash, tokens: &[u32]) -> BlockHash {
    // A stack buffer covers the usual block sizes (<= 64 tokens) without allocating.
    const STACK_TOKENS: usize = 64;
    if tokens.len() <= STACK_TOKENS {
        let mut buf = [0u8; 16 + 4 * STACK_TOKENS];
        buf[..16].copy_from_slice(&parent.to_le_bytes());
        for (i, t) in tokens.iter().enumerate() {
            buf[16 + 4 * i..20 + 4 * i].copy_from_slice(&t.to_le_bytes());
        }
        xxh3_128(&buf[..16 + 4 * tokens.len()])
    } else {
        let mut h = Xxh3::new();
        h.update(&parent.to_le_bytes());
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        h.digest128()
    }
}

/// Extends `hashes` (the hashes of the first `hashes.len()` full blocks of `tokens`) with the
/// hashes of every further full block. Called whenever tokens are appended; O(new blocks).
pub fn extend_block_hashes(
    root: BlockHash,
    tokens: &[u32],
    block_size: usize,
    hashes: &mut Vec<BlockHash>,
) {
    // Called after every token: a multiplication decides "no new full block" (a division
    // costs tens of cycles).
    while (hashes.len() + 1) * block_size <= tokens.len() {
        let i = hashes.len();
        let parent = if i == 0 { root } else { hashes[i - 1] };
        hashes.push(hash_block(
            parent,
            &tokens[i * block_size..(i + 1) * block_size],
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_parent_tokens_and_extra_keys() {
        let r = root_hash(0, None);
        let a = hash_block(r, &[1, 2, 3, 4]);
        assert_eq!(a, hash_block(r, &[1, 2, 3, 4]));
        assert_ne!(a, hash_block(r, &[1, 2, 3, 5]));
        assert_ne!(a, hash_block(a, &[1, 2, 3, 4]));
        assert_ne!(r, root_hash(1, None));
        assert_ne!(r, root_hash(0, Some("")));
        assert_ne!(root_hash(0, Some("a")), root_hash(0, Some("b")));
    }

    #[test]
    fn long_blocks_use_the_streaming_path_consistently() {
        let toks: Vec<u32> = (0..100).collect();
        let r = root_hash(0, None);
        let mut h = Xxh3::new();
        h.update(&r.to_le_bytes());
        for t in &toks {
            h.update(&t.to_le_bytes());
        }
        assert_eq!(hash_block(r, &toks), h.digest128());
        // The stack path and the streaming path agree on short blocks too.
        let mut h = Xxh3::new();
        h.update(&r.to_le_bytes());
        for t in &toks[..16] {
            h.update(&t.to_le_bytes());
        }
        assert_eq!(hash_block(r, &toks[..16]), h.digest128());
    }

    #[test]
    fn extend_only_hashes_full_blocks_incrementally() {
        let r = root_hash(0, None);
        let toks: Vec<u32> = (0..37).collect();
        let mut hs = Vec::new();
        extend_block_hashes(r, &toks[..10], 4, &mut hs);
        assert_eq!(hs.len(), 2);
        extend_block_hashes(r, &toks, 4, &mut hs);
        assert_eq!(hs.len(), 9);
        let mut all = Vec::new();
        extend_block_hashes(r, &toks, 4, &mut all);
        assert_eq!(hs, all);
        assert_eq!(hs[1], hash_block(hs[0], &[4, 5, 6, 7]));
    }
}
