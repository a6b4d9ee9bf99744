"""LoRA on routed experts whose activation is not SiLU-and-mul (lora/moe.py LoRAExperts): Gemma 4's GELU-tanh gated
experts and Nemotron-H's non-gated ReLU^2 experts (w13 the up rows alone, one adapter slice where gated layers hold
gate | up), on the Triton path (kernels/fused_moe.py expert_gate_up_rows over all w13 rows, expert_down_rows, the
LoRA shrink / expand kernels) and the torch path, against a plain per-pair reference in float64. On CPU the Triton
case runs in the interpreter child (tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ferrox.layers.fused_moe import FusedMoE, GeluTanh, Relu2
from ferrox.layers.ops import for_device
from ferrox.lora.moe import ExpertSlotWeights, LoRAExperts
from ferrox.lora.slots import TokenSlots

from tests.kernels.kernel_refs import relative_error

EXPERTS, HIDDEN, INTER, MAX_RANK, TOKENS = 4, 32, 16, 8, 7
ACTIVATIONS = {"gelu_tanh": GeluTanh(), "relu2": Relu2()}


def _activation(name: str, h: torch.Tensor) -> torch.Tensor:
    if name == "relu2":
        return torch.square(F.relu(h))
    gate, up = h.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _adapter(slices: int, rank: int, present: list[int], seed: int) -> ExpertSlotWeights:
    g = torch.Generator().manual_seed(seed)
    keep = torch.zeros(EXPERTS, dtype=torch.int32)
    keep[present] = 1

    def rand(*shape):
        return torch.randn(*shape, generator=g) * keep.float().view(-1, *[1] * (len(shape) - 1)) * 0.3

    return ExpertSlotWeights(rand(EXPERTS, slices * rank, HIDDEN), rand(EXPERTS, slices * INTER, rank),
                             rand(EXPERTS, rank, INTER), rand(EXPERTS, HIDDEN, rank), keep)


def _reference(name, x, w13, w2, weights, ids, slots, adapters) -> torch.Tensor:
    """Pair by pair in float64: W13_e x plus its slot's B A x per slice (gate, up; or up alone), the activation, W2_e
    act plus B A act, weighted and summed."""
    out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e, xt = int(ids[t, k]), x[t].double()
            h = w13[e].double() @ xt
            a = adapters.get(int(slots[t]))
            if a is not None and a.present[e]:
                rank = a.w2_a.shape[1]
                for s in range(h.shape[0] // INTER):
                    h[s * INTER:(s + 1) * INTER] += (a.w13_b[e, s * INTER:(s + 1) * INTER].double()
                                                     @ (a.w13_a[e, s * rank:(s + 1) * rank].double() @ xt))
            act = _activation(name, h)
            y = w2[e].double() @ act
            if a is not None and a.present[e]:
                y += a.w2_b[e].double() @ (a.w2_a[e].double() @ act)
            out[t] += weights[t, k].double() * y
    return out


def _run(name: str, device, kernels: str) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    experts = FusedMoE(EXPERTS, HIDDEN, INTER, dtype=torch.float32, device=device, ops=for_device(device, kernels),
                       activation=ACTIVATIONS[name])
    experts.w13.data.normal_(0, 0.2)
    experts.w2.data.normal_(0, 0.2)
    slices = 2 if experts.gated else 1
    assert experts.w13.shape[1] == slices * INTER
    token_slots = TokenSlots(16, torch.device(device), keep_groups=kernels != "triton")
    lora = LoRAExperts(experts, token_slots, max_loras=3, max_rank=MAX_RANK, dtype=torch.float32,
                       device=torch.device(device), use_triton=kernels == "triton")
    # Slot 0: rank 8 on experts 0, 1, 3; slot 2: rank 4 on experts 1, 2; slot 1 unused (zeroed).
    adapters = {0: _adapter(slices, 8, [0, 1, 3], seed=1), 2: _adapter(slices, 4, [1, 2], seed=2)}
    for slot, w in adapters.items():
        lora.load_slot(slot, ExpertSlotWeights(*(t.to(device) for t in (w.w13_a, w.w13_b, w.w2_a, w.w2_b)),
                                               w.present.to(device)))
    lora.load_slot(1, None)
    experts.lora = lora
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:2] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, 2, generator=g)
    slots = torch.tensor([[0, -1, 2][t % 3] for t in range(TOKENS)], dtype=torch.int32)
    token_slots.write(slots.numpy())
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    got = experts(x.to(device), weights.to(device), ids.to(device)).cpu()
    want = _reference(name, x, experts.w13.cpu(), experts.w2.cpu(), weights, ids, slots, adapters)
    return got, want


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_triton_experts_lora_match_reference(kernel_device, name):
    got, want = _run(name, kernel_device, "triton")
    assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_torch_experts_lora_match_reference(name):
    got, want = _run(name, "cpu", "torch")
    assert relative_error(got, want) < 1e-5
