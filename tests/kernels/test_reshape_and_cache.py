"""reshape_and_cache writes K/V at exactly the slots of the slot mapping, and nothing else."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.reshape_and_cache import reshape_and_cache

from tests.kernels.kernel_refs import PagedBatch


def _check(batch: PagedBatch) -> None:
    expected = batch.kv_cache.clone()
    valid = batch.slot_mapping >= 0
    slots = batch.slot_mapping[valid]
    blocks, offsets = slots // batch.block_size, slots % batch.block_size
    expected[0, blocks, offsets] = batch.k[valid]
    expected[1, blocks, offsets] = batch.v[valid]
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    assert torch.equal(batch.kv_cache, expected)  # a copy: bit-exact, untouched slots unchanged


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 2, 32), (4, 3, 24), (32, 1, 16)])
def test_reshape_and_cache_tiny(kernel_device, seed, block_size, num_kv_heads, head_dim):
    batch = PagedBatch(
        [5, 1, 3], [0, 17, 6], num_kv_heads * 2, num_kv_heads, head_dim, block_size, torch.float32, kernel_device,
        num_pad_tokens=3,
    )
    _check(batch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reshape_and_cache_llama8b_shapes(cuda_device, seed, dtype):
    query_lens = [512, 300] + [1] * 64
    context_lens = [0, 1000] + torch.randint(1, 4000, (64,)).tolist()
    _check(PagedBatch(query_lens, context_lens, 32, 8, 128, 16, dtype, cuda_device, num_pad_tokens=16))


def test_reshape_and_cache_rejects_bad_shapes(kernel_device):
    cache = torch.zeros(2, 4, 16, 2, 32, device=kernel_device)
    k = torch.zeros(3, 4, 32, device=kernel_device)
    with pytest.raises(ValueError, match="key/value"):
        reshape_and_cache(k, k, cache, torch.zeros(3, dtype=torch.int64, device=kernel_device))
