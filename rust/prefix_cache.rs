//! Prefix hashes: each *full* block of a request's tokens is named by a hash chained over its
//! parent block's hash and its own token ids. Two requests whose first k blocks hold the same
//! tokens (and the same extra keys) get the same k hashes, so they can share those KV blocks.
//!
//! Extra keys (LoRA adapter id, `cache_salt`) are folded into a per-request *root* hash that
//! seeds the chain, so they separate every block of the request without being re-hashed per
//! block.
//!
//! The cache trusts a hash match without comparing tokens, so the hash decides whether one
//! request can be served another's KV blocks. Two algorithms (vLLM's --prefix-caching-hash-algo):
//! - SHA-256 (the default, as vLLM's), truncated to 128 bits: finding two prompts whose blocks
//!   collide takes ~2^64 work even for someone crafting them, so a tenant cannot make its prompt
//!   read another's cached blocks.
//! - xxh3-128: ~10x cheaper (a few ns a block against ~100 ns), and random blocks collide with
//!   probability ~2^-49 even among 2^40 of them, but it is not collision-resistant: crafted
//!   prompts can collide. For deployments whose prompts all come from one trusted party.
//!
//! Both hash the same bytes: the parent's 16 bytes then the token ids as little-endian u32.

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

/// Hash naming one full block (and, through the chain, everything before it).
pub type BlockHash = u128;

/// The block hash function (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HashAlgo {
    #[default]
    Sha256,
    Xxh3,
}

impl HashAlgo {
    /// vLLM's names. Its `_cbor` variants serialize a block's data with CBOR before hashing, so
    /// that processes (and KV-event consumers) agree on the hashes; ferrox's hashes already are the
    /// same in every process (fixed byte layout, no per-process seed) and are never exposed, so
    /// they name the same functions.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "sha256" | "sha256_cbor" => Some(Self::Sha256),
            "xxhash" | "xxhash_cbor" => Some(Self::Xxh3),
            _ => None,
        }
    }
}

/// A hasher over either algorithm (both take the bytes in pieces).
enum Hasher {
    Sha256(Sha256),
    Xxh3(Box<Xxh3>),
}

impl Hasher {
    fn new(algo: HashAlgo) -> Self {
        match algo {
            HashAlgo::Sha256 => Self::Sha256(Sha256::new()),
            HashAlgo::Xxh3 => Self::Xxh3(Box::new(Xxh3::new())),
        }
    }

    fn update(&mut self, bytes: &[u8]) {
        match self {
            Self::Sha256(h) => h.update(bytes),
            Self::Xxh3(h) => h.update(bytes),
        }
    }

    fn finish(self) -> BlockHash {
        match self {
            Self::Sha256(h) => truncate(&h.finalize()),
            Self::Xxh3(h) => h.digest128(),
        }
    }
}

/// The first 16 bytes of a SHA-256 digest, little-endian.
fn truncate(digest: &[u8]) -> BlockHash {
    let mut first = [0u8; 16];
    first.copy_from_slice(&digest[..16]);
    u128::from_le_bytes(first)
}

fn hash_bytes(algo: HashAlgo, bytes: &[u8]) -> BlockHash {
    match algo {
        HashAlgo::Sha256 => truncate(&Sha256::digest(bytes)),
        HashAlgo::Xxh3 => xxh3_128(bytes),
    }
}

/// The chain's seed for a request: separates requests that use a different LoRA adapter or
/// a different cache salt even when their token ids are equal.
pub fn root_hash(algo: HashAlgo, lora_id: u64, cache_salt: Option<&str>) -> BlockHash {
    let mut h = Hasher::new(algo);
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
    h.finish()
}

/// Hash of one full block: H(parent hash ‖ token ids as little-endian u32).
pub fn hash_block(algo: HashAlgo, parent: BlockHash, tokens: &[u32]) -> BlockHash {
    // A stack buffer covers the usual block sizes (<= 64 tokens) without allocating.
    const STACK_TOKENS: usize = 64;
    if tokens.len() <= STACK_TOKENS {
        let mut buf = [0u8; 16 + 4 * STACK_TOKENS];
        buf[..16].copy_from_slice(&parent.to_le_bytes());
        for (i, t) in tokens.iter().enumerate() {
            buf[16 + 4 * i..20 + 4 * i].copy_from_slice(&t.to_le_bytes());
        }
        hash_bytes(algo, &buf[..16 + 4 * tokens.len()])
    } else {
        let mut h = Hasher::new(algo);
        h.update(&parent.to_le_bytes());
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        h.finish()
    }
}

/// Extends `hashes` (the hashes of the first `hashes.len()` full blocks of `tokens`) with the
/// hashes of every further full block. Called whenever tokens are appended; O(new blocks).
pub fn extend_block_hashes(
    algo: HashAlgo,
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
            algo,
            parent,
            &tokens[i * block_size..(i + 1) * block_size],
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALGOS: [HashAlgo; 2] = [HashAlgo::Sha256, HashAlgo::Xxh3];

    #[test]
    fn chain_depends_on_parent_tokens_and_extra_keys() {
        for algo in ALGOS {
            let r = root_hash(algo, 0, None);
            let a = hash_block(algo, r, &[1, 2, 3, 4]);
            assert_eq!(a, hash_block(algo, r, &[1, 2, 3, 4]));
            assert_ne!(a, hash_block(algo, r, &[1, 2, 3, 5]));
            assert_ne!(a, hash_block(algo, a, &[1, 2, 3, 4]));
            assert_ne!(r, root_hash(algo, 1, None));
            assert_ne!(r, root_hash(algo, 0, Some("")));
            assert_ne!(root_hash(algo, 0, Some("a")), root_hash(algo, 0, Some("b")));
        }
        // The two functions name the same block differently.
        assert_ne!(
            root_hash(HashAlgo::Sha256, 0, None),
            root_hash(HashAlgo::Xxh3, 0, None)
        );
    }

    #[test]
    fn sha256_is_the_digest_of_the_documented_bytes() {
        let parent: BlockHash = 7;
        let mut bytes = parent.to_le_bytes().to_vec();
        for t in [1u32, 2, 3] {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let digest = Sha256::digest(&bytes);
        let want = u128::from_le_bytes(digest[..16].try_into().unwrap());
        assert_eq!(hash_block(HashAlgo::Sha256, parent, &[1, 2, 3]), want);
    }

    #[test]
    fn names_parse_as_vllm_spells_them() {
        assert_eq!(HashAlgo::parse("sha256"), Some(HashAlgo::Sha256));
        assert_eq!(HashAlgo::parse("sha256_cbor"), Some(HashAlgo::Sha256));
        assert_eq!(HashAlgo::parse("xxhash"), Some(HashAlgo::Xxh3));
        assert_eq!(HashAlgo::parse("xxhash_cbor"), Some(HashAlgo::Xxh3));
        assert_eq!(HashAlgo::parse("md5"), None);
        assert_eq!(HashAlgo::default(), HashAlgo::Sha256);
    }

    #[test]
    fn long_blocks_use_the_streaming_path_consistently() {
        let toks: Vec<u32> = (0..100).collect();
        for algo in ALGOS {
            let r = root_hash(algo, 0, None);
            let mut h = Hasher::new(algo);
            h.update(&r.to_le_bytes());
            for t in &toks {
                h.update(&t.to_le_bytes());
            }
            assert_eq!(hash_block(algo, r, &toks), h.finish());
            // The stack path and the streaming path agree on short blocks too.
            let mut h = Hasher::new(algo);
            h.update(&r.to_le_bytes());
            for t in &toks[..16] {
                h.update(&t.to_le_bytes());
            }
            assert_eq!(hash_block(algo, r, &toks[..16]), h.finish());
        }
    }

    #[test]
    fn extend_only_hashes_full_blocks_incrementally() {
        for algo in ALGOS {
            let r = root_hash(algo, 0, None);
            let toks: Vec<u32> = (0..37).collect();
            let mut hs = Vec::new();
            extend_block_hashes(algo, r, &toks[..10], 4, &mut hs);
            assert_eq!(hs.len(), 2);
            extend_block_hashes(algo, r, &toks, 4, &mut hs);
            assert_eq!(hs.len(), 9);
            let mut all = Vec::new();
            extend_block_hashes(algo, r, &toks, 4, &mut all);
            assert_eq!(hs, all);
            assert_eq!(hs[1], hash_block(algo, hs[0], &[4, 5, 6, 7]));
        }
    }
}
