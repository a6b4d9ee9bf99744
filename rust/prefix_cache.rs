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
//!
//! vLLM's `_cbor` names (sha256_cbor, xxhash_cbor) compute vLLM's own chain instead, bit for bit,
//! for routers that compute block keys from prompts as vLLM does (cbor_block_hash.rs).

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

use crate::cbor_block_hash::{BlockExtras, CborChain, CborDigest, ExtraKey, ItemSpan};

/// Hash naming one full block (and, through the chain, everything before it).
pub type BlockHash = u128;

/// The block hash function (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HashAlgo {
    #[default]
    Sha256,
    Xxh3,
    /// vLLM's chain under SHA-256 (cbor_block_hash.rs).
    Sha256Cbor,
    /// vLLM's chain under XXH3-128.
    Xxh3Cbor,
}

impl HashAlgo {
    /// vLLM's names. Its plain `sha256` / `xxhash` hash a pickle of the block's data, which only
    /// Python can reproduce: ferrox names its own fixed byte layout by them (the same in every
    /// process). The `_cbor` names are vLLM's chain exactly.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "sha256" => Some(Self::Sha256),
            "xxhash" => Some(Self::Xxh3),
            "sha256_cbor" => Some(Self::Sha256Cbor),
            "xxhash_cbor" => Some(Self::Xxh3Cbor),
            _ => None,
        }
    }

    /// The digest under vLLM's CBOR chain, None for ferrox's own layout.
    pub fn cbor(self) -> Option<CborDigest> {
        match self {
            Self::Sha256Cbor => Some(CborDigest::Sha256),
            Self::Xxh3Cbor => Some(CborDigest::Xxh3),
            Self::Sha256 | Self::Xxh3 => None,
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
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => Self::Sha256(Sha256::new()),
            HashAlgo::Xxh3 | HashAlgo::Xxh3Cbor => Self::Xxh3(Box::new(Xxh3::new())),
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
        HashAlgo::Sha256 | HashAlgo::Sha256Cbor => truncate(&Sha256::digest(bytes)),
        HashAlgo::Xxh3 | HashAlgo::Xxh3Cbor => xxh3_128(bytes),
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

/// Hash of a full block that overlaps multimodal items: H(parent ‖ token ids ‖ per item: its
/// identifier's length and bytes, its offset from the block's start). The items' identifiers
/// separate blocks whose placeholder ids are equal; blocks before the first item keep the
/// hashes of the same text without images, so a shared system prompt stays shared (vLLM's rule).
fn hash_block_with_items(
    algo: HashAlgo,
    parent: BlockHash,
    tokens: &[u32],
    start: usize,
    items: &[ItemSpan],
) -> BlockHash {
    let mut h = Hasher::new(algo);
    h.update(&parent.to_le_bytes());
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    for item in items {
        h.update(&(item.identifier.len() as u64).to_le_bytes());
        h.update(item.identifier.as_bytes());
        h.update(&(item.offset as i64 - start as i64).to_le_bytes());
    }
    h.finish()
}

/// The items overlapping tokens [start, end) (items in prompt order).
pub fn items_in(items: &[ItemSpan], start: usize, end: usize) -> &[ItemSpan] {
    let first = items.partition_point(|i| i.offset + i.length <= start);
    let last = items.partition_point(|i| i.offset < end);
    &items[first..last.max(first)]
}

/// How one request names its blocks: ferrox's chain (a root folding every extra key in, then
/// parent ‖ tokens) or vLLM's (cbor_block_hash.rs: per-block extra keys, full digests chained).
#[derive(Clone, Debug)]
pub enum BlockHasher {
    Plain {
        algo: HashAlgo,
        root: BlockHash,
        items: Vec<ItemSpan>,
    },
    Cbor(Box<CborChain>),
}

impl BlockHasher {
    /// The hasher for a request: `extras` are its LoRA adapter's name, cache salt and multimodal
    /// items; `cbor_root` is the process's root digest, needed by (only) the CBOR algorithms.
    pub fn new(
        algo: HashAlgo,
        lora_id: u64,
        extras: BlockExtras,
        cbor_root: Option<&[u8]>,
    ) -> Self {
        match (algo.cbor(), cbor_root) {
            (Some(digest), Some(root)) => {
                Self::Cbor(Box::new(CborChain::new(digest, root.to_vec(), extras)))
            }
            (Some(_), None) => panic!("{algo:?} needs the root digest (the scheduler's hash seed)"),
            (None, _) => Self::Plain {
                algo,
                root: root_hash(algo, lora_id, extras.cache_salt.as_deref()),
                items: extras.items,
            },
        }
    }

    /// Extends `hashes` (this request's first `hashes.len()` block hashes) with the hashes of
    /// every further full block of `tokens`. Called whenever tokens are appended.
    #[inline]
    pub fn extend(&mut self, tokens: &[u32], block_size: usize, hashes: &mut Vec<BlockHash>) {
        // A multiplication decides "no new full block" (this runs after every token).
        if (hashes.len() + 1) * block_size > tokens.len() {
            return;
        }
        match self {
            Self::Plain { algo, root, items } => {
                extend_with_items(*algo, *root, items, tokens, block_size, hashes)
            }
            Self::Cbor(chain) => chain.extend(tokens, block_size, hashes),
        }
    }

    /// Block `index`'s extra keys as its KV events publish them: Some (one entry, maybe None, per
    /// block) under vLLM's chain, whose consumers rebuild hashes from them; None under ferrox's,
    /// whose hashes nobody outside rebuilds.
    pub fn event_extra_keys(
        &self,
        index: usize,
        block_size: usize,
    ) -> Option<Option<Vec<ExtraKey>>> {
        match self {
            Self::Plain { .. } => None,
            Self::Cbor(chain) => Some(
                chain
                    .extras
                    .keys(index * block_size, (index + 1) * block_size),
            ),
        }
    }
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
    extend_with_items(algo, root, &[], tokens, block_size, hashes);
}

/// `extend_block_hashes` for a request with multimodal items (in prompt order): a block
/// overlapping any is hashed with their identifiers (`hash_block_with_items`).
fn extend_with_items(
    algo: HashAlgo,
    root: BlockHash,
    items: &[ItemSpan],
    tokens: &[u32],
    block_size: usize,
    hashes: &mut Vec<BlockHash>,
) {
    // Called after every token: a multiplication decides "no new full block" (a division
    // costs tens of cycles).
    while (hashes.len() + 1) * block_size <= tokens.len() {
        let start = hashes.len() * block_size;
        let end = start + block_size;
        let parent = hashes.last().copied().unwrap_or(root);
        let block = &tokens[start..end];
        hashes.push(match items_in(items, start, end) {
            [] => hash_block(algo, parent, block),
            over => hash_block_with_items(algo, parent, block, start, over),
        });
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
        assert_eq!(HashAlgo::parse("sha256_cbor"), Some(HashAlgo::Sha256Cbor));
        assert_eq!(HashAlgo::parse("xxhash"), Some(HashAlgo::Xxh3));
        assert_eq!(HashAlgo::parse("xxhash_cbor"), Some(HashAlgo::Xxh3Cbor));
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
    fn items_separate_only_the_blocks_they_overlap_and_those_after() {
        let tokens: Vec<u32> = (0..16).collect();
        let item = |id: &str| ItemSpan {
            identifier: id.into(),
            offset: 5,
            length: 4,
        };
        let hashes = |items: Vec<ItemSpan>| {
            let extras = BlockExtras {
                items,
                ..Default::default()
            };
            let mut h = BlockHasher::new(HashAlgo::Sha256, 0, extras, None);
            let mut out = Vec::new();
            h.extend(&tokens, 4, &mut out);
            out
        };
        let (none, a, b) = (
            hashes(vec![]),
            hashes(vec![item("a")]),
            hashes(vec![item("b")]),
        );
        // Block 0 (tokens 0-3) precedes the image: shared with the text-only prompt.
        assert_eq!(none[0], a[0]);
        assert_eq!(a[0], b[0]);
        // Blocks 1-2 hold the image, block 3 follows it: each differs by image.
        for j in 1..4 {
            assert_ne!(none[j], a[j]);
            assert_ne!(a[j], b[j]);
        }
        assert_eq!(items_in(&[item("a")], 0, 5), &[] as &[ItemSpan]);
        assert_eq!(items_in(&[item("a")], 8, 12).len(), 1);
        assert_eq!(items_in(&[item("a")], 9, 12).len(), 0);
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
