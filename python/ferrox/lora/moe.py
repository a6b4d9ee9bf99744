"""LoRA on the routed experts of an MoE layer (vLLM's FusedMoEWithLoRA): every expert has its own adapter pair for
its gate, up and down projections, and a token's delta follows the expert each of its top-k pairs is routed to.

For the pair (token t, expert e) of a token running slot s (x: the token's row, W13_e / W2_e the expert's weights):

    gate_up = W13_e x + B13_{s,e} (A13_{s,e} x)          (gate and up rows, each its own A and B)
    act     = activation(gate_up)                        (SiLU-and-mul, Gemma 4's GELU-tanh-and-mul...)
    down    = W2_e act + B2_{s,e} (A2_{s,e} act)
    out_t   = sum over the token's k pairs of routing_weight * down

with the adapter's scaling baked into B (lora/packed.py). A base-model token (slot -1), or a pair whose adapter has
no module of that expert, adds nothing. Non-gated experts (Nemotron-H's ReLU^2: FusedMoE.gated False) have no gate:
their "gate_up" is the up rows alone (W13_e [I, H]), one A and B, and act = relu(up)^2; the slots then hold one
slice where gated layers hold two (gate | up), and everything else runs as above.

Design: (slot, expert) is one "virtual slot" s * E + e of stacks flattened to [max_loras * E, ...], and the rows are
the step's T * k pairs, so the per-row LoRA kernels of the dense projections (kernels/lora.py: shrink / expand by
slot) do the work unchanged; the pairs are sorted by virtual slot on the device each layer (no host sync: CUDA
graphs capture it). The fused MoE kernel applies the activation inside its gate/up launch, which would leave no
place for the gate/up delta; under LoRA the layer runs the same grouped launches through two additive entry points
(kernels/fused_moe.py expert_gate_up_rows: the raw gate and up rows of each pair; expert_down_rows: each pair's
weighted down product, not yet summed), adds the gate/up delta to the raw rows, applies the activation in torch,
runs the down launch and adds the down delta scaled by each pair's routing weight (it is linear: w B (A act) =
B (A (w act)), so the weight scales the shrunk rows), then sums each token's k rows. The experts' own fused path
(the small-batch GEMVs, the one-token decode path) is left exactly as it was for models without LoRA: the
manager sends every step through the general path (lora/manager.py). On CPU the torch path is a per-expert loop
(layers/fused_moe.py experts_torch's), correct, not fast.

Slot buffers are allocated once and rewritten in place when an adapter is copied into a slot (as LoRALinear's),
so CUDA graphs captured over them stay valid.

Tensor parallelism: with each expert's intermediate rows sharded, a rank holds the gate and up B rows and the down
A columns of its share (the dense column- and row-parallel rule of lora/layers.py), so its down delta is a partial
sum that joins its partial product before the layer's one all-reduce. With expert parallelism a rank holds the
adapter pairs of its own experts only. Quantized experts (FP8, MXFP4) and families other than those
lora/moe_targets.py names are refused by name there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.layers.expert_loop import per_expert
from ferrox.layers.fused_moe import FusedMoE, gated_activation_torch
from ferrox.lora.slots import TokenSlots


@dataclass(frozen=True, slots=True)
class ExpertSlotWeights:
    """One adapter's pairs for one MoE layer's experts (this rank's), laid out as a slot holds them, r the adapter's
    largest rank, scaling baked into B, zeros where a module is absent."""

    w13_a: torch.Tensor  # [E, 2r, H]: gate A at rows [0, r), up A at [r, 2r) (non-gated experts: [E, r, H], up's)
    w13_b: torch.Tensor  # [E, 2I, r]: gate B rows, then up B rows, this rank's intermediate rows (non-gated: [E, I, r])
    w2_a: torch.Tensor  # [E, r, I] (this rank's intermediate columns)
    w2_b: torch.Tensor  # [E, H, r]
    present: torch.Tensor  # [E] int32: 1 where the adapter has a module of that expert


class LoRAExperts(nn.Module):
    """The adapter slots of one FusedMoE layer, hooked into it (FusedMoE.lora): the layer's run_experts calls
    `forward(experts, x, topk_weights, topk_ids, residual)` with ids local to this rank."""

    def __init__(self, experts: FusedMoE, token_slots: TokenSlots, *, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, use_triton: bool) -> None:
        super().__init__()
        # (sizes only: a reference to the FusedMoE would make it a submodule of its own submodule)
        self.num_experts = experts.num_local_experts
        self.hidden_size = experts.hidden_size
        self.intermediate_size = experts.intermediate_size  # this rank's rows of each expert
        # gate | up, or the up rows alone (non-gated experts: module docstring)
        self.slices = 2 if experts.gated else 1
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.token_slots = token_slots
        self.use_triton = use_triton
        virtual = max_loras * self.num_experts
        hidden, inter, slices = self.hidden_size, self.intermediate_size, self.slices
        self.w13_a: torch.Tensor
        self.w13_b: torch.Tensor
        self.w2_a: torch.Tensor
        self.w2_b: torch.Tensor
        self.present: torch.Tensor
        self.w13_offsets: torch.Tensor
        self.w2_offsets: torch.Tensor
        for name, shape in (("w13_a", (virtual, slices * max_rank, hidden)),
                            ("w13_b", (virtual, slices * inter, max_rank)),
                            ("w2_a", (virtual, max_rank, inter)), ("w2_b", (virtual, hidden, max_rank))):
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        # Virtual slots holding an adapter's module: the others' pairs take slot -1 (no launch work, no delta).
        self.register_buffer("present", torch.zeros(virtual, dtype=torch.int32, device=device), persistent=False)
        # Output column bounds of the expand kernels' slices: gate | up (or up alone), and the one down slice.
        self.register_buffer("w13_offsets", torch.tensor([inter * s for s in range(slices + 1)], dtype=torch.int32,
                                                         device=device), persistent=False)
        self.register_buffer("w2_offsets", torch.tensor((0, hidden), dtype=torch.int32, device=device),
                             persistent=False)

    @staticmethod
    def slot_elements(experts: FusedMoE, max_loras: int, max_rank: int) -> int:
        """Elements of the four stacks __init__ allocates for this layer (the GPU memory budget's share)."""
        hidden, inter, slices = experts.hidden_size, experts.intermediate_size, 2 if experts.gated else 1
        per_expert = slices * (max_rank * hidden + inter * max_rank) + max_rank * inter + hidden * max_rank
        return max_loras * experts.num_local_experts * per_expert

    def load_slot(self, slot: int, weights: ExpertSlotWeights | None) -> None:
        """Copy an adapter's pairs into a slot (None: the adapter leaves these experts alone; the slot is zeroed).
        From pinned memory the copies do not block the host."""
        rows = slice(slot * self.num_experts, (slot + 1) * self.num_experts)
        stacks = (self.w13_a[rows], self.w13_b[rows], self.w2_a[rows], self.w2_b[rows])
        if weights is None:
            for stack in stacks:
                stack.zero_()
            self.present[rows].zero_()
            return
        rank, full = weights.w2_a.shape[1], self.max_rank
        w13_a, w13_b, w2_a, w2_b = stacks
        if rank < full:
            for stack in stacks:
                stack.zero_()
        slices = self.slices
        w13_a.view(self.num_experts, slices, full, self.hidden_size)[:, :, :rank].copy_(
            weights.w13_a.view(self.num_experts, slices, rank, self.hidden_size), non_blocking=True)
        w13_b[:, :, :rank].copy_(weights.w13_b, non_blocking=True)
        w2_a[:, :rank].copy_(weights.w2_a, non_blocking=True)
        w2_b[:, :, :rank].copy_(weights.w2_b, non_blocking=True)
        self.present[rows].copy_(weights.present, non_blocking=True)

    def forward(self, experts: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        out = (self._run_triton(experts, x, topk_weights, topk_ids) if self.use_triton
               else self._run_torch(experts, x, topk_weights, topk_ids))
        return out if residual is None else out + residual

    def _pair_slots(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Each pair's virtual slot (token slot * E + expert), -1 for a base-model token, a pair whose adapter has no
        module of that expert, or an id past this rank's experts (expert parallelism, torch path). Device ops only."""
        num_tokens, top_k = topk_ids.shape
        slots = self.token_slots.buffer[:num_tokens].to(torch.int64)[:, None].expand(num_tokens, top_k)
        ids = topk_ids.to(torch.int64)
        virtual = slots * self.num_experts + ids
        valid = (slots >= 0) & (ids < self.num_experts)
        virtual = torch.where(valid, virtual, torch.zeros_like(virtual))
        valid &= self.present[virtual] > 0
        return torch.where(valid, virtual, torch.full_like(virtual, -1)).reshape(-1)

    def _run_triton(self, experts: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        from ferrox.kernels.fused_moe import (
            align_by_expert,
            choose_gemm_config,
            expert_down_rows,
            expert_gate_up_rows,
        )
        from ferrox.kernels.lora import lora_expand, lora_shrink, sort_tokens_by_slot

        num_tokens, top_k = topk_ids.shape
        num_pairs, hidden, inter = num_tokens * top_k, self.hidden_size, self.intermediate_size
        if num_tokens == 0:
            return torch.empty(0, hidden, dtype=x.dtype, device=x.device)
        if x.stride(-1) != 1:
            x = x.contiguous()
        ids = topk_ids.contiguous()
        route_w = topk_weights.to(torch.float32).reshape(-1).contiguous()
        config = choose_gemm_config(num_pairs, self.num_experts)
        blocks = align_by_expert(ids, self.num_experts, config.block_m)
        gate_up = expert_gate_up_rows(x, experts.w13, blocks, top_k, config, w13_bias=experts.w13_bias)
        # The pairs in virtual-slot order (no adapter first): the dense LoRA kernels' token order, over pairs.
        order, sorted_slots = sort_tokens_by_slot(self._pair_slots(ids).to(torch.int32))
        x_pairs = x[:, None].expand(num_tokens, top_k, hidden).reshape(num_pairs, hidden)  # pair p: token p // k
        lora_expand(gate_up, lora_shrink(x_pairs, self.w13_a, order, sorted_slots), self.w13_b, order, sorted_slots,
                    self.w13_offsets, inter)
        act = gated_activation_torch(gate_up, experts.activation).contiguous()
        routed = expert_down_rows(act, experts.w2, blocks, route_w, config, w2_bias=experts.w2_bias)
        shrunk = lora_shrink(act, self.w2_a, order, sorted_slots)
        # The weight of the pair at each position of the order: the delta joins the weighted product.
        shrunk.mul_(route_w.index_select(0, order.to(torch.int64))[None, :, None])
        lora_expand(routed, shrunk, self.w2_b, order, sorted_slots, self.w2_offsets, hidden)
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
        torch.sum(routed.view(num_tokens, top_k, hidden), dim=1, out=out)  # (fp32 accumulation, as fused_moe's)
        return out

    def _run_torch(self, experts: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = topk_ids.shape
        virtual = self._pair_slots(topk_ids).view(num_tokens, top_k)
        rank, inter = self.max_rank, self.intermediate_size
        w13, w2, b13, b2 = experts.w13, experts.w2, experts.w13_bias, experts.w2_bias

        def expert_fn(expert: int, tokens: torch.Tensor) -> torch.Tensor:
            xs = x[tokens]
            gate_up = F.linear(xs, w13[expert], b13[expert] if b13 is not None else None)
            # Each token's virtual slot for this expert (a token routes to an expert at most once).
            mine = virtual[tokens]
            slot_of_row = torch.where(topk_ids[tokens] == expert, mine, torch.full_like(mine, -1)).amax(dim=1)
            groups = [(int(v), (slot_of_row == v).nonzero().flatten()) for v in torch.unique(slot_of_row).tolist()
                      if v >= 0]
            for v, rows in groups:
                shrunk = xs[rows] @ self.w13_a[v].t()
                for s in range(self.slices):  # gate, up (non-gated: up alone), each its own A and B
                    cols = slice(s * inter, (s + 1) * inter)
                    gate_up[rows, cols] += shrunk[:, s * rank:(s + 1) * rank] @ self.w13_b[v, cols].t()
            act = gated_activation_torch(gate_up, experts.activation)
            down = F.linear(act, w2[expert], b2[expert] if b2 is not None else None)
            for v, rows in groups:
                down[rows] += (act[rows] @ self.w2_a[v].t()) @ self.w2_b[v].t()
            return down

        return per_expert(x, topk_weights, topk_ids, self.num_experts, expert_fn)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"slots={self.max_loras}, max_rank={self.max_rank}")
