"""vLLM's own block hashes (--prefix-caching-hash-algo sha256_cbor / xxhash_cbor; rust/cbor_block_hash.rs):
the KV events of the real Rust scheduler carry, for every cached block, the number vLLM publishes for it,
checked against vLLM's chain computed with the serializer and hash functions vLLM uses
(tests/helpers/vllm_block_hash.py): the root from PYTHONHASHSEED's text, the parent's full digest, the
tuple of token ids, the extra keys (LoRA name, (item, offset) pairs, the salt on block 0), the low 64
bits of the big-endian digest. Also: images separate only the blocks from theirs on
under ferrox's own hashes too, and the seed is required, typed and refused where it means nothing."""

from __future__ import annotations

import numpy as np
import pytest
from ferrox._core import InvalidArgumentError, Scheduler

from tests.helpers.vllm_block_hash import DIGESTS, vllm_chain, vllm_hash

from .driver import run_to_completion

BLOCK = 4


def stored_blocks(sched: Scheduler) -> dict[int, tuple[list[int], object]]:
    """Every stored block in the events: its hash -> (its tokens, its extra keys)."""
    out = {}
    for event in sched.take_kv_events():
        if event[0] != "stored":
            continue
        _, hashes, _, tokens, _, extra_keys = event
        assert extra_keys is not None and len(extra_keys) == len(hashes)
        for i, h in enumerate(hashes):
            out[h] = (tokens[i * BLOCK:(i + 1) * BLOCK], extra_keys[i])
    return out


@pytest.mark.parametrize("algo", sorted(DIGESTS))
def test_events_carry_vllms_block_hashes_and_extra_keys(algo):
    seed = "1234"
    sched = Scheduler(num_blocks=256, max_model_len=512, block_size=BLOCK, prefix_caching_hash_algo=algo,
                      prefix_hash_seed=seed)
    sched.record_kv_events()
    rng = np.random.default_rng(0)
    cases = {
        "plain": dict(),
        "lora": dict(lora_id=3, lora_name="sql-adapter"),
        "salted": dict(cache_salt="tenant-7"),
        # An item starting inside block 1 and ending inside block 3, one filling block 5, and big ids.
        "images": dict(mm_items=[("img-a", 6, 7), ("img-b", 20, 4)]),
        "all": dict(lora_id=5, lora_name="x" * 30, cache_salt="é-salt", mm_items=[("img-c", 0, 9)]),
    }
    want = {}
    for name, kw in cases.items():
        prompt = [int(t) for t in rng.integers(0, 200_000, size=27)]
        sched.add_request(name, prompt, max_tokens=6, detokenize=False, ignore_eos=True, **kw)
        want[name] = (prompt, kw)
    tokens, *_ = run_to_completion(sched, block_size=BLOCK)
    got = stored_blocks(sched)
    for name, (prompt, kw) in want.items():
        # Prompt blocks and the blocks completed by generated tokens (27 + 6 = 33 tokens: 8 blocks).
        full = prompt + tokens[name]
        extras = dict(lora_name=kw.get("lora_name"), salt=kw.get("cache_salt"),
                      items=[(i, o, n) for i, o, n in kw.get("mm_items", [])])
        hashes, keys = vllm_chain(algo, seed, full, BLOCK, **extras)
        assert len(hashes) == 8
        for j, (h, k) in enumerate(zip(hashes, keys, strict=True)):
            assert h in got, f"{name}: block {j}'s vLLM hash is not in the events"
            block_tokens, block_keys = got[h]
            assert block_tokens == full[j * BLOCK:(j + 1) * BLOCK]
            assert block_keys == k, (name, j)
    assert len(got) == 5 * 8  # nothing else was stored


def test_the_root_comes_from_the_seed_and_random_bytes_are_the_root_itself():
    def first_hash(seed):
        sched = Scheduler(num_blocks=16, max_model_len=64, block_size=BLOCK, prefix_caching_hash_algo="sha256_cbor",
                          prefix_hash_seed=seed)
        sched.record_kv_events()
        sched.add_request("r", [1, 2, 3, 4, 5], max_tokens=1, detokenize=False)
        run_to_completion(sched, block_size=BLOCK)
        return sched.take_kv_events()[0][1][0]

    root = bytes(range(32))
    want = vllm_hash("sha256_cbor", (root, (1, 2, 3, 4), None))
    assert first_hash(root) == int.from_bytes(want[-8:], "big")
    assert first_hash("0") == vllm_chain("sha256_cbor", "0", [1, 2, 3, 4], BLOCK)[0][0]
    assert first_hash("0") != first_hash("1")


def test_images_separate_only_their_blocks_and_those_after():
    """Under ferrox's own hash: a system prompt before different images is shared; from the image on
    nothing is; the same image in the same place shares everything."""
    sched = Scheduler(num_blocks=64, max_model_len=256, block_size=BLOCK)
    prompt = list(range(100, 124))  # 6 blocks; the image's placeholders at 9..16

    def cached(rid, ident):
        sched.add_request(rid, prompt, max_tokens=1, detokenize=False, mm_items=[(ident, 9, 8)])
        out = sched.schedule()
        sched.update_from_output(np.full(out.num_reqs, 7, dtype=np.int64))
        run_to_completion(sched, block_size=BLOCK)
        return int(out.num_computed_tokens[0])

    assert cached("a", "img-1") == 0
    assert cached("b", "img-2") == 8  # blocks 0-1 end before the image (position 9 is in block 2)
    assert cached("c", "img-1") == 20  # all but the last block (at least one token is computed)


def test_the_seed_and_lora_name_are_checked_by_name():
    make = dict(num_blocks=16, max_model_len=64, block_size=BLOCK)
    with pytest.raises(InvalidArgumentError, match="prefix_hash_seed"):
        Scheduler(**make, prefix_caching_hash_algo="sha256_cbor")
    with pytest.raises(InvalidArgumentError, match="prefix_hash_seed"):
        Scheduler(**make, prefix_caching_hash_algo="sha256", prefix_hash_seed="0")
    with pytest.raises(InvalidArgumentError, match="prefix_hash_seed"):
        Scheduler(**make, prefix_caching_hash_algo="xxhash_cbor", prefix_hash_seed=b"")
    with pytest.raises(InvalidArgumentError, match="prefix_hash_seed"):
        Scheduler(**make, prefix_caching_hash_algo="xxhash_cbor", prefix_hash_seed=7)
    sched = Scheduler(**make, prefix_caching_hash_algo="sha256_cbor", prefix_hash_seed="0")
    with pytest.raises(InvalidArgumentError, match="lora_name"):
        sched.add_request("a", [1, 2], max_tokens=1, lora_id=2)
    with pytest.raises(InvalidArgumentError, match="lora_name"):
        sched.add_request("b", [1, 2], max_tokens=1, lora_name="x")
    with pytest.raises(InvalidArgumentError, match=r"mm_items\[1\]"):
        sched.add_request("c", list(range(10)), max_tokens=1, mm_items=[("i", 0, 4), ("j", 3, 2)])
    with pytest.raises(InvalidArgumentError, match=r"mm_items\[0\]"):
        sched.add_request("d", list(range(10)), max_tokens=1, mm_items=[("i", 8, 4)])
    assert not sched.has_unfinished_requests()
