"""LoRA on the routed experts (lora/moe.py LoRAExperts): the Triton path (kernels/fused_moe.py's raw gate/up rows
and weighted down rows, kernels/lora.py's shrink / expand over (slot, expert) virtual slots) and the torch path
against a plain per-pair reference written here, in float64: top-k 1 and 2, an expert no token routes to, tokens of
the base model (slot -1), pairs whose adapter has no module for their expert, two adapters of different ranks, and
the expert-parallel id past the rank's experts (torch path). The kernels' own entry points against fused_moe. On CPU
the Triton cases run in the interpreter child (tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ferrox.kernels.fused_moe import align_by_expert, expert_down_rows, expert_gate_up_rows, fused_moe
from ferrox.layers.fused_moe import FusedMoE
from ferrox.layers.ops import for_device
from ferrox.lora.moe import ExpertSlotWeights, LoRAExperts
from ferrox.lora.slots import TokenSlots

from tests.kernels.kernel_refs import relative_error
from tests.kernels.test_fused_moe import SMALL_GEMM

EXPERTS, HIDDEN, INTER, MAX_RANK = 4, 32, 16, 8


def _adapter(rank: int, present: list[int], seed: int) -> ExpertSlotWeights:
    """Random pairs for the experts in `present` (zeros elsewhere), scaling baked in as packing does."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.zeros(EXPERTS, dtype=torch.int32)
    keep[present] = 1
    mask = keep.float()

    def rand(*shape):
        return torch.randn(*shape, generator=g) * mask.view(-1, *[1] * (len(shape) - 1)) * 0.3

    return ExpertSlotWeights(rand(EXPERTS, 2 * rank, HIDDEN), rand(EXPERTS, 2 * INTER, rank),
                             rand(EXPERTS, rank, INTER), rand(EXPERTS, HIDDEN, rank), keep)


def reference(x, w13, w2, weights, ids, token_slots, adapters) -> torch.Tensor:
    """Pair by pair in float64: W13_e x (+ its slot's B A x), SiLU-and-mul, W2_e act (+ B A act), weighted sum."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        slot = int(token_slots[t])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            xt = x[t].double()
            gate_up = w13[e].double() @ xt
            lora = adapters.get(slot)
            on = lora is not None and bool(lora.present[e])
            if on:
                r = lora.w2_a.shape[1]
                a, b = lora.w13_a[e].double(), lora.w13_b[e].double()
                gate_up[:INTER] += b[:INTER] @ (a[:r] @ xt)
                gate_up[INTER:] += b[INTER:] @ (a[r:] @ xt)
            act = F.silu(gate_up[:INTER]) * gate_up[INTER:]
            down = w2[e].double() @ act
            if on:
                down += lora.w2_b[e].double() @ (lora.w2_a[e].double() @ act)
            out[t] += float(weights[t, j]) * down
    return out


def _layer(device, kernels: str, token_slots: TokenSlots, adapters: dict[int, ExpertSlotWeights],
           dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    experts = FusedMoE(EXPERTS, HIDDEN, INTER, dtype=dtype, device=device, ops=for_device(device, kernels))
    experts.w13.data.normal_(0, 0.2)
    experts.w2.data.normal_(0, 0.2)
    lora = LoRAExperts(experts, token_slots, max_loras=3, max_rank=MAX_RANK, dtype=dtype,
                       device=torch.device(device), use_triton=kernels == "triton")
    for slot, weights in adapters.items():
        stacks = (weights.w13_a, weights.w13_b, weights.w2_a, weights.w2_b)
        lora.load_slot(slot, ExpertSlotWeights(*(t.to(device, dtype) for t in stacks), weights.present.to(device)))
    lora.load_slot(1, None)  # (an unused slot, zeroed)
    experts.lora = lora
    return experts


# Slot 0: rank 8 on experts 0, 1, 3; slot 2: rank 4 on experts 1, 2 (3 is absent: those pairs add nothing);
# expert 3 has no tokens in the top-1 case.
ADAPTERS = {0: _adapter(8, [0, 1, 3], seed=1), 2: _adapter(4, [1, 2], seed=2)}


def _routing(tokens: int, top_k: int):
    g = torch.Generator().manual_seed(tokens * 10 + top_k)
    ids = torch.stack([torch.randperm(EXPERTS - (top_k == 1), generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    weights = weights / weights.sum(-1, keepdim=True)
    slots = torch.tensor([[0, -1, 2][t % 3] for t in range(tokens)], dtype=torch.int32)
    return weights, ids, slots


@pytest.mark.parametrize("top_k, dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_triton_experts_lora_match_reference(kernel_device, top_k, dtype):
    tokens = 7
    weights, ids, slots = _routing(tokens, top_k)
    token_slots = TokenSlots(16, torch.device(kernel_device), keep_groups=False)
    token_slots.write(slots.numpy())
    experts = _layer(kernel_device, "triton", token_slots, ADAPTERS, dtype)
    x = torch.randn(tokens, HIDDEN, device=kernel_device).to(dtype)
    rounded = {s: ExpertSlotWeights(*(t.to(dtype).float() for t in (w.w13_a, w.w13_b, w.w2_a, w.w2_b)), w.present)
               for s, w in ADAPTERS.items()}
    ref = reference(x.cpu().float(), experts.w13.cpu().float(), experts.w2.cpu().float(), weights, ids, slots,
                    rounded)
    got = experts(x, weights.to(kernel_device), ids.to(kernel_device))
    assert got.dtype == dtype
    assert relative_error(got.cpu(), ref) < (1e-5 if dtype == torch.float32 else 2e-2)
    if dtype != torch.float32:
        return
    # The base rows are the base model's exactly (fused_moe's own grouped launches, same tiles).
    base = fused_moe(x, experts.w13, experts.w2, weights.to(kernel_device), ids.to(kernel_device), small_batch=False)
    base_rows = (slots < 0).nonzero().flatten()
    assert relative_error(got.cpu()[base_rows], base.cpu()[base_rows]) < 1e-6


@pytest.mark.parametrize("top_k", [1, 2])
def test_torch_experts_lora_match_reference(top_k):
    tokens = 7
    weights, ids, slots = _routing(tokens, top_k)
    token_slots = TokenSlots(16, torch.device("cpu"), keep_groups=True)
    token_slots.write(slots.numpy())
    experts = _layer("cpu", "torch", token_slots, ADAPTERS)
    x = torch.randn(tokens, HIDDEN)
    ref = reference(x, experts.w13, experts.w2, weights, ids, slots, ADAPTERS)
    assert relative_error(experts(x, weights, ids), ref) < 1e-5
    # Expert parallelism (torch path): an id past this rank's experts is another rank's pair and adds nothing.
    far = ids.clone()
    far[:, 0] = EXPERTS
    keep = weights.clone()
    keep[:, 0] = 0
    ref_far = reference(x, experts.w13, experts.w2, keep, ids, slots, ADAPTERS)
    assert relative_error(experts.run_experts(x, weights, far), ref_far) < 1e-5


def test_raw_gate_up_and_weighted_down_rows(kernel_device):
    """The LoRA path's two launches: summed and activated as fused_moe does, they give fused_moe's result."""
    torch.manual_seed(3)
    tokens, top_k = 9, 2
    x = torch.randn(tokens, HIDDEN, device=kernel_device)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=kernel_device) * 0.2
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=kernel_device) * 0.2
    weights, ids, _ = _routing(tokens, top_k)
    weights, ids = weights.to(kernel_device), ids.to(kernel_device)
    blocks = align_by_expert(ids, EXPERTS, SMALL_GEMM.block_m)
    gate_up = expert_gate_up_rows(x, w13, blocks, top_k, SMALL_GEMM)
    pairs = ids.reshape(-1)
    raw = torch.einsum("pih,ph->pi", w13[pairs].double(), x.repeat_interleave(top_k, 0).double())
    assert relative_error(gate_up.cpu(), raw.cpu()) < 1e-6
    act = F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
    routed = expert_down_rows(act, w2, blocks, weights.reshape(-1).float(), SMALL_GEMM)
    out = routed.view(tokens, top_k, HIDDEN).sum(1)
    ref = fused_moe(x, w13, w2, weights, ids, small_batch=False, config=SMALL_GEMM)
    assert relative_error(out.cpu(), ref.cpu()) < 1e-5
