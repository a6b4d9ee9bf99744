"""Multi-LoRA Triton kernels (kernels/lora.py) against the torch path (lora/torch_delta.py).

On CPU the Triton cases run in test_interpreter.py's child pytest under TRITON_INTERPRET=1, with
every kernel test of this directory (and tests/lora/test_lora_model.py's Triton-kernel-set case);
on a GPU they run natively.
"""

from __future__ import annotations

import os

import pytest
import torch
from ferrox.lora.torch_delta import add_lora_torch, slot_groups

from tests.kernels.kernel_refs import relative_error

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _stacks(slices: list[int], in_features: int, ranks: list[int], max_rank: int, dtype, device):
    """Random slot stacks in the manager's layout: slot i has rank ranks[i] (zero past it)."""
    num_slots, num_slices = len(ranks), len(slices)
    a = torch.zeros(num_slots, num_slices, max_rank, in_features)
    b = torch.zeros(num_slots, sum(slices), max_rank)
    for slot, rank in enumerate(ranks):
        a[slot, :, :rank] = torch.randn(num_slices, rank, in_features) / in_features ** 0.5
        b[slot, :, :rank] = torch.randn(sum(slices), rank)
    return a.reshape(num_slots, num_slices * max_rank, in_features).to(dtype).to(device), b.to(dtype).to(device)


def _compare(device, *, tokens: int, slices: list[int], in_features: int, ranks: list[int], max_rank: int,
             token_slots: torch.Tensor, dtype=torch.float32, tolerance: float = 1e-5, config=None,
             expand_config=None, grouped: bool = True) -> None:
    """grouped: visit the tokens grouped by slot (as the manager does); else in batch order, which
    must give the same result (the grouping is for speed only)."""
    from ferrox.kernels.lora import add_lora, lora_expand, lora_shrink, sort_tokens_by_slot

    a, b = _stacks(slices, in_features, ranks, max_rank, dtype, device)
    x = torch.randn(tokens, in_features, dtype=dtype, device=device)
    y = torch.randn(tokens, sum(slices), dtype=dtype, device=device)
    # The persistent buffer is longer than the batch (the layers read [:T]); garbage past T must not matter.
    slots = torch.full((tokens + 9,), 2, dtype=torch.int32, device=device)
    slots[:tokens] = token_slots.to(device)
    bounds = [0]
    for width in slices:
        bounds.append(bounds[-1] + width)
    ref = add_lora_torch(y.float().clone(), x.float(), a.float(), b.float(), slots, bounds)
    offsets = torch.tensor(bounds, dtype=torch.int32, device=device)
    if grouped:
        order, sorted_slots = sort_tokens_by_slot(slots[:tokens])
        assert torch.equal(sorted_slots, slots[:tokens][order.long()])
    else:
        order, sorted_slots = torch.arange(tokens, dtype=torch.int32, device=device), slots
    if config is None:
        out = add_lora(y.clone(), x, a, b, order, sorted_slots, offsets, slices)
    else:
        shrunk = lora_shrink(x, a, order, sorted_slots, config)
        out = lora_expand(y.clone(), shrunk, b, order, sorted_slots, offsets, max(slices), expand_config)
    base_rows = token_slots < 0
    assert torch.equal(out[base_rows.to(device)], y[base_rows.to(device)]), "rows without an adapter changed"
    assert relative_error(out, ref) < tolerance


def _mixed(tokens: int, num_slots: int) -> torch.Tensor:
    return torch.randint(-1, num_slots, (tokens,), dtype=torch.int32)


@pytest.mark.parametrize("slices", [[24, 8, 8], [16, 16], [20]])
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("grouped", [True, False])
def test_mixed_slots_match_torch(kernel_device, seed, slices, tokens, grouped):
    """Slots of ranks 8, 4, 2 and 5 (padded to 8) and base rows (-1) mixed in one batch."""
    token_slots = _mixed(tokens, 4)
    if tokens == 1:
        token_slots[0] = 1
    _compare(kernel_device, tokens=tokens, slices=slices, in_features=48, ranks=[8, 4, 2, 5], max_rank=8,
             token_slots=token_slots, grouped=grouped)


@pytest.mark.parametrize("tokens", [93, 300])  # the small- and the large-batch tile sizes
def test_long_runs_of_one_adapter_match_torch(kernel_device, seed, tokens):
    """Prefill-like: runs of one slot spanning whole token tiles, a base run between them."""
    token_slots = torch.tensor([3] * 40 + [-1] * 20 + [0] * (tokens - 60), dtype=torch.int32)
    _compare(kernel_device, tokens=tokens, slices=[32, 16, 16], in_features=40, ranks=[4, 4, 4, 8], max_rank=8,
             token_slots=token_slots)


@pytest.mark.parametrize("tokens", [5, 40])
def test_split_k_and_column_sweeps(kernel_device, seed, tokens):
    """K split over 3 programs (decode-sized batches do this): the expand adds the planes. Each
    expand program sweeps 32 columns 16 at a time, ending inside a slice (widths 40, 24, 24)."""
    from ferrox.kernels.lora import ExpandConfig, ShrinkConfig

    _compare(kernel_device, tokens=tokens, slices=[40, 24, 24], in_features=80, ranks=[8, 3], max_rank=8,
             token_slots=_mixed(tokens, 2), config=ShrinkConfig(block_m=16, block_n=16, block_k=16, split_k=3,
                                                               num_warps=4),
             expand_config=ExpandConfig(block_m=16, block_n=16, num_warps=4, cols_per_program=32))


def test_all_base_rows_leave_the_output_untouched(kernel_device, seed):
    from ferrox.kernels.lora import add_lora

    a, b = _stacks([16, 8, 8], 32, [4, 4], 4, torch.float32, kernel_device)
    x = torch.randn(19, 32, device=kernel_device)
    y = torch.randn(19, 32, device=kernel_device)
    slots = torch.full((19,), -1, dtype=torch.int32, device=kernel_device)
    order = torch.arange(19, dtype=torch.int32, device=kernel_device)
    out = add_lora(y.clone(), x, a, b, order, slots, torch.tensor([0, 16, 24, 32], dtype=torch.int32,
                                                                   device=kernel_device), [16, 8, 8])
    assert torch.equal(out, y)


def test_torch_groups_given_or_computed_agree(seed):
    """The torch path with the manager's per-step row groups equals the one that finds them itself."""
    a, b = _stacks([8, 8], 16, [3, 2, 4], 4, torch.float32, "cpu")
    x, y = torch.randn(11, 16), torch.randn(11, 16)
    slots = _mixed(11, 3)
    ref = y.clone()
    for t in range(11):  # the definition, one token at a time
        s = int(slots[t])
        if s >= 0:
            for i, (lo, hi) in enumerate([(0, 8), (8, 16)]):
                ref[t, lo:hi] += b[s, lo:hi] @ (a[s, i * 4:(i + 1) * 4] @ x[t])
    got = add_lora_torch(y.clone(), x, a, b, slots, [0, 8, 16])
    assert torch.allclose(got, ref, atol=1e-5)
    assert torch.equal(add_lora_torch(y.clone(), x, a, b, slots, [0, 8, 16], slot_groups(slots)), got)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qkv", "o"])
def test_real_shapes_bf16(seed, kind):
    """Llama-3.1-8B projections, 4 adapters of rank 16 mixed over 256 tokens (a decode batch), and
    an 8192-token prefill of mostly one adapter."""
    if not torch.cuda.is_available() or INTERPRETED:
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda")
    slices = [4096, 1024, 1024] if kind == "qkv" else [4096]
    _compare(device, tokens=256, slices=slices, in_features=4096, ranks=[16, 8, 16, 4], max_rank=16,
             token_slots=_mixed(256, 4), dtype=torch.bfloat16, tolerance=2e-2)
    prefill = torch.zeros(8192, dtype=torch.int32)
    prefill[6000:7000] = -1
    prefill[7000:] = 2
    _compare(device, tokens=8192, slices=slices, in_features=4096, ranks=[16, 8, 16, 4], max_rank=16,
             token_slots=prefill, dtype=torch.bfloat16, tolerance=2e-2)
