"""KV blocks as seen through the scheduler: prefix sharing (n>1 fan-out), eviction order,
usage accounting, reset_prefix_cache."""

from __future__ import annotations

import numpy as np
from ferrox._core import Scheduler

from .driver import run_step, run_to_completion


def make(**kw) -> Scheduler:
    args = dict(num_blocks=64, max_model_len=1024, block_size=4)
    args.update(kw)
    return Scheduler(**args)


def test_fan_out_requests_share_full_prompt_blocks_in_the_same_step():
    s = make()
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks + 2 tokens
    for i in range(3):
        s.add_request(f"n{i}", prompt, max_tokens=4, detokenize=False, ignore_eos=True)
    out = s.schedule()
    assert list(out.num_computed_tokens) == [0, 12, 12]
    blocks = [s.request_block_ids(f"n{i}") for i in range(3)]
    assert blocks[0][:3] == blocks[1][:3] == blocks[2][:3]
    assert len({b[3] for b in blocks}) == 3, "the partial last block is private"
    assert s.stats().num_free_blocks == 63 - 6
    s.update_from_output(np.full(3, 9, dtype=np.int64))
    run_to_completion(s, block_size=4)
    assert s.stats().num_free_blocks == 63


def test_usage_and_block_table_padding():
    s = make()
    s.add_request("a", list(range(1, 10)), max_tokens=2, detokenize=False)  # 3 blocks
    s.add_request("b", [50, 51], max_tokens=2, detokenize=False)  # 1 block
    out, _ = run_step(s, block_size=4)
    assert out.block_table.shape == (2, 3)
    assert list(out.block_table[1][1:]) == [0, 0]
    st = s.stats()
    assert st.num_total_blocks == 64 and st.num_free_blocks == 59
    assert abs(st.kv_cache_usage - 4 / 63) < 1e-9
    assert s.request_block_ids("a") == [int(b) for b in out.block_table[0]]


def test_cached_blocks_survive_until_evicted_lru():
    s = make(num_blocks=9)  # 8 usable blocks
    old = list(range(100, 109))  # 9 tokens: 2 cacheable blocks
    new = list(range(200, 209))
    for rid, p in (("old", old), ("new", new)):
        s.add_request(rid, p, max_tokens=1, detokenize=False)
        run_to_completion(s, block_size=4)
    # Both prompts' blocks are free but cached; a big request evicts the least recent first.
    s.add_request("big", list(range(300, 321)), max_tokens=1, detokenize=False)  # 6 blocks
    run_to_completion(s, block_size=4)
    s.add_request("new2", new, max_tokens=1, detokenize=False)
    s.add_request("old2", old, max_tokens=1, detokenize=False)
    out = s.schedule()
    assert dict(zip(out.req_ids, map(int, out.num_computed_tokens), strict=True)) == {"new2": 8, "old2": 0}


def test_reset_prefix_cache_refused_while_in_use():
    s = make()
    s.add_request("a", list(range(1, 20)), max_tokens=2, detokenize=False)
    run_step(s, block_size=4)
    assert s.reset_prefix_cache() is False
    run_to_completion(s, block_size=4)
    assert s.reset_prefix_cache() is True
    s.add_request("b", list(range(1, 20)), max_tokens=1, detokenize=False)
    assert int(s.schedule().num_computed_tokens[0]) == 0


def test_prefix_caching_can_be_disabled_and_salt_separates_tenants():
    s = make(enable_prefix_caching=False)
    for rid in ("a", "b"):
        s.add_request(rid, list(range(1, 20)), max_tokens=1, detokenize=False)
    assert list(s.schedule().num_computed_tokens) == [0, 0]
    s = make()
    s.add_request("a", list(range(1, 20)), max_tokens=1, detokenize=False, cache_salt="t1")
    s.add_request("b", list(range(1, 20)), max_tokens=1, detokenize=False, cache_salt="t2")
    s.add_request("c", list(range(1, 20)), max_tokens=1, detokenize=False, cache_salt="t1")
    s.add_request("d", list(range(1, 20)), max_tokens=1, detokenize=False, lora_id=3, cache_salt="t1")
    assert list(s.schedule().num_computed_tokens) == [0, 0, 16, 0]
