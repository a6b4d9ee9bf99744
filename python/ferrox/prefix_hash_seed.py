"""The root of vLLM's CBOR block-hash chains (--prefix-caching-hash-algo sha256_cbor / xxhash_cbor;
rust/cbor_block_hash.rs), chosen as vLLM chooses it: from PYTHONHASHSEED when that is set (the same
hashes in every process, every restart and every replica, which KV-aware routers computing block keys
from prompts need), else 32 random bytes (with a warning, as vLLM's)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

CBOR_ALGOS = ("sha256_cbor", "xxhash_cbor")


def prefix_hash_seed(algo: str) -> str | bytes | None:
    """The Scheduler's prefix_hash_seed for this algorithm: None for ferrox's own hashes (no seed)."""
    if algo not in CBOR_ALGOS:
        return None
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        logger.warning("PYTHONHASHSEED is not set: %s block hashes start from random bytes, so they differ "
                       "between processes and restarts; set it for reproducible block hashes", algo)
        return os.urandom(32)
    return seed
