"""FP8 experts: how a FusedMoE layer (layers/fused_moe.py) holds float8 E4M3 expert weights.

Three sources, one layout per layer (layers/quant/fp8_moe_ref.py gives the arithmetic):

- `quantization="fp8"` on a float checkpoint: the layer loads its float experts as usual and each
  expert's matrix is quantized per output row at the end of loading (vLLM quantizes experts per
  tensor; per row is the same kernels' cost and the linear layers' rule here).
- An "fp8"-layout checkpoint with dynamic activations (AutoFP8, transformers): per expert
  projection `weight` float8_e4m3fn and `weight_scale`, one value or one per output row (a per-tensor
  scale is written into every row, as the linear layers do).
- A block-wise checkpoint (Qwen3-30B-A3B-FP8, DeepSeek's layout; compressed-tensors FP8_BLOCK):
  `weight` and a scale per BN x BK block (`weight_scale_inv`, or `weight_scale`).

Activations are quantized at run time, per token / pair (per row) or per token and group of BK
(blocks). A static checkpoint's expert input scales are read and not used (fp8.py Fp8Config.moe_method).

Non-gated experts (Nemotron-H's Relu2: layers/fused_moe.py) hold the up rows alone in w13 [E, I, H] and its
scales [E, I] (or [E, I / BN, ...]); ModelOpt's FP8 Nemotron 3 releases store them per expert with per-tensor
scales, each written into its expert's rows.

The gate and up halves of w13 are stacked rows, so with blocks each half must hold whole block rows
(moe_intermediate_size, per rank, a multiple of BN), and a rank's intermediate columns of w2 must
start on a BK column; a checkpoint that breaks this is refused naming the field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ferrox.distributed.sharding import Weight, materialize, narrow, shape_of
from ferrox.layers.quant.fp8 import _row_scales
from ferrox.layers.quant.fp8_block import quantize_fp8_blocks
from ferrox.layers.quant.fp8_linear import FP8_DTYPE, quantize_per_row
from ferrox.model_spec import UnsupportedModelError

if TYPE_CHECKING:
    from ferrox.layers.fused_moe import FusedMoE


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8MoeMethod:
    """One FusedMoE layer's FP8 experts (module docstring). block None: a scale per output row."""

    def __init__(self, block: tuple[int, int] | None, *, online: bool, scale_param: str = "weight_scale"):
        self.block = block
        # Online: the layer allocates and loads float experts; finalize quantizes them.
        self.float_weight = online
        self.scale_param = scale_param
        self.checkpoint_params: tuple[str, ...] = () if online else ("weight", scale_param)
        # A dynamic checkpoint may carry calibration scales or all-zero zero points: read, not used.
        self.optional_params: tuple[str, ...] = ("input_scale", "weight_zero_point", "input_zero_point")

    # ---- shapes ---------------------------------------------------------------------------------
    def check(self, layer: FusedMoE) -> None:
        """Refuse (by field) a block layout whose blocks a rank's experts would cut."""
        if self.block is None:
            return
        bn, bk = self.block
        inter, start = layer.intermediate_size, layer.inter_start
        if inter % bn or start % bk:
            raise UnsupportedModelError(
                f"quantization 'fp8' with weight_block_size {list(self.block)}: moe_intermediate_size "
                f"{layer.checkpoint_intermediate_size} (this rank's {inter} rows from {start}) must split into whole "
                f"{bn}-row weight blocks for the stacked gate/up experts (and start on a {bk}-column block of down)")

    def scale_shapes(self, layer: FusedMoE) -> tuple[tuple[int, ...], tuple[int, ...]]:
        local, inter, hidden = layer.num_local_experts, layer.intermediate_size, layer.hidden_size
        rows = 2 * inter if layer.gated else inter
        if self.block is None:
            return (local, rows), (local, hidden)
        bn, bk = self.block
        return (local, rows // bn, _cdiv(hidden, bk)), (local, _cdiv(hidden, bn), _cdiv(inter, bk))

    def allocate(self, layer: FusedMoE, device: torch.device | str | None) -> None:
        """The fp8 experts and their scales, empty until loaded (a checkpoint method: no float copy)."""
        local, inter, hidden = layer.num_local_experts, layer.intermediate_size, layer.hidden_size
        w13_shape, w2_shape = (local, 2 * inter if layer.gated else inter, hidden), (local, hidden, inter)
        s13, s2 = self.scale_shapes(layer)
        layer.set_expert_tensors(torch.empty(w13_shape, dtype=FP8_DTYPE, device=device),
                                 torch.empty(w2_shape, dtype=FP8_DTYPE, device=device),
                                 torch.empty(s13, dtype=torch.float32, device=device),
                                 torch.empty(s2, dtype=torch.float32, device=device))

    # ---- loading --------------------------------------------------------------------------------
    def load(self, layer: FusedMoE, param_name: str, local: int, shard: str, tensor: Weight) -> None:
        """One checkpoint tensor of expert `local` (this rank's index), shard gate / up / down."""
        if param_name in self.optional_params:
            if param_name.endswith("_zero_point") and materialize(tensor).float().abs().max() != 0:
                raise ValueError(f"{param_name} is not zero: an asymmetric scheme, which the config says it is not")
            return
        inter, start, full = layer.intermediate_size, layer.inter_start, layer.checkpoint_intermediate_size
        hidden = layer.hidden_size
        if param_name == "weight":
            value = materialize(tensor) if inter == full else narrow(tensor, 1 if shard == "down" else 0, start, inter)
            if value.dtype != FP8_DTYPE:
                raise ValueError(f"weight is {value.dtype}, the fp8 layout stores float8_e4m3fn (experts left "
                                 "unquantized in an fp8 checkpoint are not supported)")
            if shard == "gate":
                layer.w13[local, :inter].copy_(value)
            elif shard == "up":
                layer.w13[local, inter if layer.gated else 0:].copy_(value)
            else:
                layer.w2[local].copy_(value)
            return
        if param_name != self.scale_param:
            raise ValueError(f"{param_name}: not a tensor of the fp8 expert layout (weight, {self.scale_param})")
        assert layer.w13_scale is not None and layer.w2_scale is not None  # (allocated with the layer)
        if self.block is None:
            rows = (_row_scales(tensor, 0, hidden, hidden) if shard == "down"
                    else _row_scales(tensor, start, inter, full))
            dst = layer.w2_scale[local] if shard == "down" else (
                layer.w13_scale[local, :inter] if shard == "gate" else layer.w13_scale[local, inter if layer.gated else 0:])
            dst.copy_(rows)
            return
        bn, bk = self.block
        if shard == "down":
            expected = (_cdiv(hidden, bn), _cdiv(full, bk))
            cut = (1, start // bk, _cdiv(inter, bk))
        else:
            expected = (_cdiv(full, bn), _cdiv(hidden, bk))
            cut = (0, start // bn, inter // bn)
        if shape_of(tensor) != expected:
            raise ValueError(f"{param_name}: shape {shape_of(tensor)}, expected {expected} (a scale per {bn} x {bk} "
                             f"block of the expert's {'down' if shard == 'down' else shard} matrix)")
        value = materialize(narrow(tensor, *cut)).float()
        assert layer.w13_scale is not None and layer.w2_scale is not None  # (allocated with the layer)
        half = inter // bn
        dst = layer.w2_scale[local] if shard == "down" else (
            layer.w13_scale[local, :half] if shard == "gate" else layer.w13_scale[local, half if layer.gated else 0:])
        dst.copy_(value)

    # ---- dummy weights, the end of loading ------------------------------------------------------
    def _quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_per_row(w) if self.block is None else quantize_fp8_blocks(w, self.block)

    def _quantize_experts(self, layer: FusedMoE, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Quantize float experts into the layer's fp8 tensors, one expert at a time (small temporaries)."""
        self.allocate(layer, w13.device)
        assert layer.w13_scale is not None and layer.w2_scale is not None
        for e in range(layer.num_local_experts):
            layer.w13[e], layer.w13_scale[e] = self._quantize(w13[e])
            layer.w2[e], layer.w2_scale[e] = self._quantize(w2[e])

    def dummy(self, layer: FusedMoE, seed: int) -> None:
        """Random experts (std 0.02, as the float dummy weights), quantized as a checkpoint stores them."""
        gen = torch.Generator(device=layer.w13.device).manual_seed(seed)
        self.allocate(layer, layer.w13.device)
        assert layer.w13_scale is not None and layer.w2_scale is not None
        for e in range(layer.num_local_experts):
            for dst, scale in ((layer.w13, layer.w13_scale), (layer.w2, layer.w2_scale)):
                w = torch.empty(dst.shape[1:], dtype=torch.bfloat16, device=dst.device).normal_(0.0, 0.02,
                                                                                                 generator=gen)
                dst[e], scale[e] = self._quantize(w)

    def finalize(self, layer: FusedMoE) -> None:
        if self.float_weight and layer.w13_scale is None:
            w13, w2 = layer.w13, layer.w2
            self._quantize_experts(layer, w13, w2)  # (the float experts are freed with the last reference)
