"""A projection layer with multi-LoRA: the base layer's output plus each token's adapter delta.

`LoRALinear` wraps a built linear layer (layers/linear.py: a plain, merged q/k/v or gate/up, or
row-parallel layer, float or quantized) and adds, in place on its output, the delta of the slot
each token runs (TokenSlots, -1: none). Its slot weights are stacked across the output slices of
the merged layer, so q/k/v (or gate/up) take one shrink and one expand launch (kernels/lora.py;
lora/torch_delta.py for the layout and the torch path). The model file is not changed: the
manager swaps the wrapper in for the layer, and attributes the model reads from its projections
(num_heads, shard_sizes, weight...) pass through to the base layer.

Under tensor parallelism the slot weights are this rank's share, cut as the base layer is: a
column-parallel layer (q/k/v, gate/up) holds all of A and its own output rows of B, and its delta
is its output shard's; a row-parallel layer (o, down) holds its input columns of A and all of B,
so x_r A_r^T B^T is this rank's partial delta, added to the base layer's partial product before
their one all-reduce (the sum over ranks is x A^T B^T). No extra communication either way.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from ferrox.layers.linear import Linear, MergedLinear, RowParallelLinear
from ferrox.lora.slots import TokenSlots
from ferrox.lora.torch_delta import add_lora_torch, slot_groups


class LoRALinear(nn.Module):
    row_parallel: bool
    a_columns: tuple[int, int, int]
    b_rows: tuple[tuple[int, int, int], ...]

    def __init__(self, base_layer: Linear, slice_widths: dict[str, int], token_slots: TokenSlots, *,
                 max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device, use_triton: bool) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.slice_names = tuple(slice_widths)
        self.slice_widths = tuple(slice_widths.values())
        self.slice_bounds = tuple(itertools.accumulate(self.slice_widths, initial=0))
        self.in_features = base_layer.in_features
        self.out_features = self.slice_bounds[-1]
        self.max_rank = max_rank
        num_slices = len(self.slice_widths)
        self.a_stack: torch.Tensor
        self.b_stack: torch.Tensor
        self.slice_offsets: torch.Tensor
        # Buffers (moved by .to(), kept out of state_dict); allocated once, rewritten in place, so a
        # CUDA graph captured over them stays valid while adapters swap through the slots.
        self.register_buffer("a_stack", torch.zeros(max_loras, num_slices * max_rank, self.in_features, dtype=dtype,
                                                    device=device), persistent=False)
        self.register_buffer("b_stack", torch.zeros(max_loras, self.out_features, max_rank, dtype=dtype,
                                                    device=device), persistent=False)
        self.register_buffer("slice_offsets", torch.tensor(self.slice_bounds, dtype=torch.int32, device=device),
                             persistent=False)
        self.token_slots = token_slots
        self.use_triton = use_triton
        # How this rank's share is cut from an adapter's tensors (lora/packed.py): the input columns of
        # A, and per output slice the rows of B, each as (first, count, checkpoint total).
        self.row_parallel = isinstance(base_layer, RowParallelLinear)
        local_in = int(self.in_features)
        self.a_columns = (0, local_in, local_in)
        if isinstance(base_layer, RowParallelLinear):
            self.a_columns = (base_layer.in_start, local_in, local_in * base_layer.tp.size)
        if isinstance(base_layer, MergedLinear):
            self.b_rows = tuple(base_layer.checkpoint_rows[name] for name in self.slice_names)
        else:
            self.b_rows = tuple((0, w, w) for w in self.slice_widths)

    def __getattr__(self, name: str) -> Any:
        # nn.Module's lookup (parameters, buffers, submodules) first; then the base layer's
        # attributes, so callers that read a projection's shape fields keep working.
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self.__dict__["_modules"].get("base_layer")
            if base is None:
                raise
            return getattr(base, name)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """reduce: a row-parallel layer's all-reduce, after the delta joins its partial product (False: the
        partial sum for a caller that reduces later, as the base layer's own reduce=False)."""
        if not self.row_parallel:
            return self._add_delta(self.base_layer(x), x)
        y = self._add_delta(self.base_layer(x, reduce=False), x)
        return self.base_layer.tp.all_reduce(y) if reduce else y

    def _add_delta(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        slots = self.token_slots.buffer
        if self.use_triton:
            from ferrox.kernels.lora import add_lora

            # Always launched (no host check for "any adapter?"): tiles without adapter rows return at once.
            if x.stride(-1) != 1:
                x = x.contiguous()
            add_lora(y, x, self.a_stack, self.b_stack, self.token_slots.order, self.token_slots.sorted_slots,
                     self.slice_offsets, self.slice_widths)
            return y
        groups = self.token_slots.groups(num_tokens)
        if groups is None:
            groups = slot_groups(slots[:num_tokens])
        if groups:
            add_lora_torch(y, x, self.a_stack, self.b_stack, slots, self.slice_bounds, groups)
        return y

    def load_slot(self, slot: int, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None) -> None:
        """Copy an adapter into a slot: lora_a [S*r, in] (slice s at rows [s*r, (s+1)*r)),
        lora_b [out, r] with the scaling baked in, r <= max_rank; None: the adapter leaves this
        layer alone (the slot is zeroed). From pinned memory the copies do not block the host."""
        a_slot = self.a_stack[slot].view(len(self.slice_widths), self.max_rank, self.in_features)
        b_slot = self.b_stack[slot]
        if lora_a is None or lora_b is None:
            a_slot.zero_()
            b_slot.zero_()
            return
        rank = lora_b.shape[1]
        if rank < self.max_rank:
            a_slot[:, rank:].zero_()
            b_slot[:, rank:].zero_()
        a_slot[:, :rank].copy_(lora_a.view(len(self.slice_widths), rank, self.in_features), non_blocking=True)
        b_slot[:, :rank].copy_(lora_b, non_blocking=True)

    def extra_repr(self) -> str:
        slices = ", ".join(f"{n}={w}" for n, w in zip(self.slice_names, self.slice_widths, strict=True))
        return f"slices=({slices}), slots={self.a_stack.shape[0]}, max_rank={self.max_rank}"
