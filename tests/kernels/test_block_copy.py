"""Whole KV blocks copied by index (kernels/block_copy.py, the host tier's offloads and loads): every cache
dtype and row width against torch's index ops, scattered and repeated indices, unlike caches refused; on a
GPU, both directions between the device and pinned host memory at an 8B model's block shape."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.block_copy import copy_blocks


def _reference(src, dst, src_index, dst_index):
    out = dst.clone()
    out[:, dst_index.cpu()] = src[:, src_index.cpu()].to(out.device)
    return out


@pytest.mark.parametrize(("dtype", "trailing"), [
    (torch.bfloat16, (16, 2, 8)),      # rows of whole 32-bit words
    (torch.float32, (4, 3, 5)),
    (torch.float8_e4m3fn, (16, 1, 6)),  # an FP8 cache: 96 bytes a row
    (torch.uint8, (3, 1, 7)),           # 21 bytes: copied byte by byte
])
def test_copies_the_indexed_blocks_and_nothing_else(kernel_device, seed, dtype, trailing):
    src = torch.randn((2, 9, *trailing), device=kernel_device).mul(40).to(dtype)
    dst = torch.randn((2, 5, *trailing), device=kernel_device).mul(40).to(dtype)
    src_index = torch.tensor([7, 0, 3, 3], device=kernel_device)  # a source block may go to two slots
    dst_index = torch.tensor([4, 1, 0, 2], device=kernel_device)
    want = _reference(src, dst, src_index, dst_index)
    copy_blocks(src, dst, src_index, dst_index)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))


def test_one_plane_caches_and_empty_steps(kernel_device):
    src = torch.arange(4 * 64, dtype=torch.float32, device=kernel_device).view(1, 4, 64)  # a latent (MLA) cache
    dst = torch.zeros((1, 3, 64), device=kernel_device)
    empty = torch.zeros(0, dtype=torch.int64, device=kernel_device)
    copy_blocks(src, dst, empty, empty)
    assert not dst.any()
    copy_blocks(src, dst, torch.tensor([3], device=kernel_device), torch.tensor([1], device=kernel_device))
    assert torch.equal(dst[0, 1], src[0, 3]) and not dst[0, 0].any() and not dst[0, 2].any()


def test_refuses_unlike_caches(kernel_device):
    a = torch.zeros((2, 4, 8), device=kernel_device)
    idx = torch.tensor([0], device=kernel_device)
    with pytest.raises(ValueError, match="unlike caches"):
        copy_blocks(a, torch.zeros((2, 4, 6), device=kernel_device), idx, idx)
    with pytest.raises(ValueError, match="unlike caches"):
        copy_blocks(a, torch.zeros((2, 4, 8), dtype=torch.float16, device=kernel_device), idx, idx)
    with pytest.raises(ValueError, match="1 source blocks for 2 destinations"):
        copy_blocks(a, a.clone(), idx, torch.tensor([0, 1], device=kernel_device))


@pytest.mark.gpu
def test_device_and_pinned_host_memory_both_ways(cuda_device, seed):
    shape = (16, 8, 128)  # Llama-3.1-8B's block: 16 tokens x 8 KV heads x 128
    cache = torch.randn((2, 300, *shape), device=cuda_device, dtype=torch.bfloat16)
    host = torch.zeros((2, 200, *shape), dtype=torch.bfloat16, pin_memory=True)
    blocks = torch.randperm(300, device=cuda_device)[:150]
    slots = torch.randperm(200, device=cuda_device)[:150]
    copy_blocks(cache, host, blocks, slots)  # offload: the device writes host memory over the bus
    torch.cuda.synchronize()
    assert torch.equal(host[:, slots.cpu()], cache[:, blocks].cpu())
    back = torch.zeros_like(cache)
    copy_blocks(host, back, slots, blocks)  # load: the device reads it back
    assert torch.equal(back[:, blocks], cache[:, blocks])
