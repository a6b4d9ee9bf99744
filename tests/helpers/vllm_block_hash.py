"""vLLM's prefix-cache block hashes for the CBOR algorithms (sha256_cbor, xxhash_cbor), computed as vLLM's
kv_cache_utils does with the serializer and hash functions it uses (cbor2's canonical encoding, hashlib's
SHA-256, xxhash's XXH3-128): the reference ferrox's Rust chain (rust/cbor_block_hash.rs) is tested against."""

from __future__ import annotations

import hashlib

import cbor2
import xxhash

DIGESTS = {"sha256_cbor": lambda b: hashlib.sha256(b).digest(), "xxhash_cbor": xxhash.xxh3_128_digest}


def vllm_hash(algo: str, obj) -> bytes:
    return DIGESTS[algo](cbor2.dumps(obj, canonical=True))


def vllm_extra_keys(start: int, end: int, lora_name=None, items=(), salt=None):
    """vLLM's generate_block_hash_extra_keys, for a block [start, end): the adapter's name, (identifier,
    offset from the block's start) for each item the block overlaps, the salt on block 0."""
    keys: list = [lora_name] if lora_name else []
    keys += [(ident, off - start) for ident, off, length in items if off < end and off + length > start]
    if start == 0 and salt:
        keys.append(salt)
    return tuple(keys) if keys else None


def vllm_chain(algo: str, seed: str, tokens: list[int], block_size: int, **extras) -> tuple[list[int], list]:
    """(the events' block hashes, each block's extra keys) of vLLM's request_block_hasher: the root is
    H(seed) (NONE_HASH with PYTHONHASHSEED set), each block H((parent digest, token tuple, extra keys)),
    published as the big-endian digest's low 64 bits."""
    parent = vllm_hash(algo, seed)
    hashes, keys = [], []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = vllm_extra_keys(start, start + block_size, **extras)
        parent = vllm_hash(algo, (parent, tuple(tokens[start:start + block_size]), extra))
        hashes.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
        keys.append(extra)
    return hashes, keys
