//! vLLM's reproducible block hashes (`--prefix-caching-hash-algo sha256_cbor` / `xxhash_cbor`).
//!
//! With these two names the prefix hashes are vLLM's own, bit for bit, so that a KV-aware router
//! that computes block keys from prompts the way vLLM does (llm-d's precise prefix-cache scorer)
//! finds ferrox's blocks in the KV events. vLLM names block i by
//!
//!   H(canonical CBOR of (parent digest, tuple of the block's token ids, extra keys or None))
//!
//! where H is SHA-256 (32-byte digests) or XXH3-128 (16 bytes, big-endian), the parent of block 0
//! is the process's root (`NONE_HASH`: H(CBOR of the text PYTHONHASHSEED) when that variable is
//! set, 32 random bytes otherwise), and the extra keys are, in this order: the LoRA adapter's
//! name, one (identifier, offset from the block's start) pair per multimodal item the block
//! overlaps, and the cache salt on block 0 only. Events carry `int.from_bytes(digest, "big")`'s
//! low 64 bits (vLLM's default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`): the last 8 bytes.
//!
//! The prefix cache keys blocks by 128 bits: the digest's last 16 bytes read big-endian, so a
//! key cut to 64 bits (kv_events.rs) is exactly the number vLLM publishes. The full digest is
//! kept only for the request's last hashed block, the next block's parent.
//!
//! Multimodal identifiers are ferrox's (the sha256 of the pixels the model sees), not vLLM's,
//! so an image block's hash matches vLLM's only in structure; the events' `extra_keys` say which
//! identifiers each block used, for consumers that rebuild the chain.

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_128;

use crate::prefix_cache::BlockHash;

/// The digest function under the CBOR encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CborDigest {
    Sha256,
    Xxh3,
}

impl CborDigest {
    fn digest(self, bytes: &[u8]) -> Vec<u8> {
        match self {
            Self::Sha256 => Sha256::digest(bytes).to_vec(),
            Self::Xxh3 => xxh3_128(bytes).to_be_bytes().to_vec(),
        }
    }
}

/// Where the chain's root comes from (vLLM's `init_none_hash`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HashSeed {
    /// PYTHONHASHSEED's value: the root is H(CBOR text of it), the same in every process.
    Text(String),
    /// Used as the root itself (vLLM's 32 random bytes when PYTHONHASHSEED is unset).
    Bytes(Vec<u8>),
}

/// The chain's root digest for a seed.
pub fn none_hash(digest: CborDigest, seed: &HashSeed) -> Vec<u8> {
    match seed {
        HashSeed::Text(text) => {
            let mut buf = Vec::with_capacity(text.len() + 9);
            text_string(&mut buf, text);
            digest.digest(&buf)
        }
        HashSeed::Bytes(bytes) => bytes.clone(),
    }
}

/// One of a block's extra keys, as vLLM puts it in the hashed tuple.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtraKey {
    /// The LoRA adapter's name, or the cache salt.
    Text(String),
    /// A multimodal item overlapping the block: its identifier and its first position's offset
    /// from the block's first token (negative when the item began in an earlier block).
    Item(String, i64),
}

/// A multimodal item's identifier and its placeholder run [offset, offset + length) in the prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ItemSpan {
    pub identifier: String,
    pub offset: usize,
    pub length: usize,
}

/// What besides the tokens a request's block hashes depend on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockExtras {
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
    /// In prompt order.
    pub items: Vec<ItemSpan>,
}

impl BlockExtras {
    /// The extra keys of the block of tokens [start, end), None when it has none.
    pub fn keys(&self, start: usize, end: usize) -> Option<Vec<ExtraKey>> {
        let mut keys = Vec::new();
        if let Some(name) = &self.lora_name {
            keys.push(ExtraKey::Text(name.clone()));
        }
        for item in crate::prefix_cache::items_in(&self.items, start, end) {
            keys.push(ExtraKey::Item(
                item.identifier.clone(),
                item.offset as i64 - start as i64,
            ));
        }
        // (vLLM: an empty salt is no salt)
        if let Some(salt) = self
            .cache_salt
            .as_ref()
            .filter(|s| start == 0 && !s.is_empty())
        {
            keys.push(ExtraKey::Text(salt.clone()));
        }
        (!keys.is_empty()).then_some(keys)
    }
}

/// One request's chain of vLLM block hashes.
#[derive(Clone, Debug)]
pub struct CborChain {
    digest: CborDigest,
    root: Vec<u8>,
    /// The digest of the last block hashed (the root before the first).
    last: Vec<u8>,
    pub extras: BlockExtras,
    /// The CBOR encoding of the block being hashed (kept to reuse its allocation).
    buf: Vec<u8>,
}

impl CborChain {
    pub fn new(digest: CborDigest, root: Vec<u8>, extras: BlockExtras) -> Self {
        CborChain {
            digest,
            last: root.clone(),
            root,
            extras,
            buf: Vec::new(),
        }
    }

    /// Extends `hashes` (the keys of the first `hashes.len()` full blocks of `tokens`, which this
    /// chain computed) with the keys of every further full block.
    pub fn extend(&mut self, tokens: &[u32], block_size: usize, hashes: &mut Vec<BlockHash>) {
        while (hashes.len() + 1) * block_size <= tokens.len() {
            let start = hashes.len() * block_size;
            let end = start + block_size;
            let parent = if hashes.is_empty() {
                &self.root
            } else {
                &self.last
            };
            let keys = self.extras.keys(start, end);
            self.buf.clear();
            encode_block(&mut self.buf, parent, &tokens[start..end], keys.as_deref());
            self.last = self.digest.digest(&self.buf);
            hashes.push(cache_key(&self.last));
        }
    }
}

/// The prefix cache's key for a digest: its last 16 bytes, big-endian (see the module docs).
pub fn cache_key(digest: &[u8]) -> BlockHash {
    let mut tail = [0u8; 16];
    tail.copy_from_slice(&digest[digest.len() - 16..]);
    u128::from_be_bytes(tail)
}

// Canonical CBOR (RFC 8949 section 4.2.1, what `cbor2.dumps(..., canonical=True)` writes for these
// types): every length and integer in its shortest form, definite-length arrays.

const UINT: u8 = 0;
const NEGINT: u8 = 1;
const BYTES: u8 = 2;
const TEXT: u8 = 3;
const ARRAY: u8 = 4;
const NULL: u8 = 0xf6;

fn head(out: &mut Vec<u8>, major: u8, value: u64) {
    let m = major << 5;
    if value < 24 {
        out.push(m | value as u8);
    } else if value <= u8::MAX as u64 {
        out.extend_from_slice(&[m | 24, value as u8]);
    } else if value <= u16::MAX as u64 {
        out.push(m | 25);
        out.extend_from_slice(&(value as u16).to_be_bytes());
    } else if value <= u32::MAX as u64 {
        out.push(m | 26);
        out.extend_from_slice(&(value as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&value.to_be_bytes());
    }
}

fn integer(out: &mut Vec<u8>, value: i64) {
    if value >= 0 {
        head(out, UINT, value as u64);
    } else {
        head(out, NEGINT, (-1 - value) as u64);
    }
}

fn text_string(out: &mut Vec<u8>, text: &str) {
    head(out, TEXT, text.len() as u64);
    out.extend_from_slice(text.as_bytes());
}

/// (parent digest, (token ids...), extra keys tuple or None)
fn encode_block(out: &mut Vec<u8>, parent: &[u8], tokens: &[u32], keys: Option<&[ExtraKey]>) {
    head(out, ARRAY, 3);
    head(out, BYTES, parent.len() as u64);
    out.extend_from_slice(parent);
    head(out, ARRAY, tokens.len() as u64);
    for &t in tokens {
        head(out, UINT, t as u64);
    }
    match keys {
        None => out.push(NULL),
        Some(keys) => {
            head(out, ARRAY, keys.len() as u64);
            for key in keys {
                match key {
                    ExtraKey::Text(text) => text_string(out, text),
                    ExtraKey::Item(identifier, offset) => {
                        head(out, ARRAY, 2);
                        text_string(out, identifier);
                        integer(out, *offset);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn integers_and_lengths_take_their_shortest_form() {
        let mut out = Vec::new();
        for v in [
            0i64,
            23,
            24,
            255,
            256,
            65535,
            65536,
            1 << 32,
            -1,
            -24,
            -25,
            -300,
        ] {
            integer(&mut out, v);
        }
        assert_eq!(
            hex(&out),
            "00171818\
             18ff19010019ffff1a000100001b0000000100000000\
             2037381839012b"
        );
    }

    #[test]
    fn a_block_encodes_as_cbor2_writes_it() {
        // cbor2.dumps((b"\x01\x02", (1, 500), None), canonical=True).hex()
        let mut out = Vec::new();
        encode_block(&mut out, &[1, 2], &[1, 500], None);
        assert_eq!(hex(&out), "8342010282011901f4f6");
        // ... and with ("lora-a", ("img", -3), "salt") as extra keys
        let mut out = Vec::new();
        let keys = [
            ExtraKey::Text("lora-a".into()),
            ExtraKey::Item("img".into(), -3),
            ExtraKey::Text("salt".into()),
        ];
        encode_block(&mut out, &[1, 2], &[7], Some(&keys));
        assert_eq!(
            hex(&out),
            "83420102810783666c6f72612d618263696d67226473616c74"
        );
    }

    #[test]
    fn extra_keys_follow_vllms_order_and_overlap_rule() {
        let extras = BlockExtras {
            lora_name: Some("a".into()),
            cache_salt: Some("s".into()),
            items: vec![
                ItemSpan {
                    identifier: "x".into(),
                    offset: 2,
                    length: 6,
                },
                ItemSpan {
                    identifier: "y".into(),
                    offset: 8,
                    length: 4,
                },
            ],
        };
        let t = |s: &str| ExtraKey::Text(s.into());
        let i = |s: &str, o: i64| ExtraKey::Item(s.into(), o);
        assert_eq!(extras.keys(0, 4), Some(vec![t("a"), i("x", 2), t("s")]));
        assert_eq!(extras.keys(4, 8), Some(vec![t("a"), i("x", -2)]));
        assert_eq!(extras.keys(8, 12), Some(vec![t("a"), i("y", 0)]));
        assert_eq!(extras.keys(12, 16), Some(vec![t("a")]));
        assert_eq!(BlockExtras::default().keys(0, 4), None);
        let empty_salt = BlockExtras {
            cache_salt: Some(String::new()),
            ..Default::default()
        };
        assert_eq!(empty_salt.keys(0, 4), None);
    }

    #[test]
    fn the_chain_feeds_each_digest_to_the_next_block() {
        let root = none_hash(CborDigest::Sha256, &HashSeed::Text("0".into()));
        // sha256(cbor2.dumps("0")) = sha256(b"\x61\x30")
        assert_eq!(root, Sha256::digest([0x61, 0x30]).to_vec());
        let mut chain = CborChain::new(CborDigest::Sha256, root.clone(), BlockExtras::default());
        let tokens: Vec<u32> = (0..10).collect();
        let mut hashes = Vec::new();
        chain.extend(&tokens[..5], 4, &mut hashes);
        chain.extend(&tokens, 4, &mut hashes);
        assert_eq!(hashes.len(), 2);
        let mut buf = Vec::new();
        encode_block(&mut buf, &root, &tokens[..4], None);
        let first = Sha256::digest(&buf);
        assert_eq!(hashes[0], cache_key(&first));
        buf.clear();
        encode_block(&mut buf, &first, &tokens[4..8], None);
        assert_eq!(hashes[1], cache_key(&Sha256::digest(&buf)));
        // The key's low 64 bits are the digest's last 8 bytes, big-endian.
        assert_eq!(
            hashes[0] as u64,
            u64::from_be_bytes(first[24..].try_into().unwrap())
        );
    }

    #[test]
    fn xxh3_digests_are_the_big_endian_128_bit_value() {
        let root = none_hash(CborDigest::Xxh3, &HashSeed::Text("0".into()));
        assert_eq!(root, xxh3_128(&[0x61, 0x30]).to_be_bytes().to_vec());
        assert_eq!(cache_key(&root), xxh3_128(&[0x61, 0x30]));
        let random = HashSeed::Bytes(vec![9; 32]);
        assert_eq!(none_hash(CborDigest::Xxh3, &random), vec![9; 32]);
    }
}
