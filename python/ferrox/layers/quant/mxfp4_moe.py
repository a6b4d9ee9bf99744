"""MXFP4 experts kept quantized: how a FusedMoE layer (layers/fused_moe.py) holds gpt-oss's published
expert weights where its kernels multiply them as they are (kernels/fused_moe.py, MXFP4).

The checkpoint stores each expert matrix W [rows, cols] as `*_blocks` [rows, cols / 32, 16] (two E2M1
codes a byte) and `*_scales` [rows, cols / 32] (E8M0), layers/quant/mxfp4.py. The layer keeps exactly
those bytes, the groups of a row side by side:

- w13 uint8 [E, 2I, H / 2] (gate rows, then up rows, as the float w13) and w13_scale uint8 [E, 2I, H / 32];
- w2 uint8 [E, H, I / 2] and w2_scale uint8 [E, H, I / 32];

4.25 bits a weight against 16 for bf16 (gpt-oss-120b's experts: ~61 GB -> ~16 GB), and a decode step
reads a quarter of the bytes. The biases stay float parameters of the layer.

Where it applies: the kernel set with the MXFP4 kernels (Triton, on CUDA), and, under tensor
parallelism, shards that keep whole 32-column groups of w2 (each rank's intermediate size and start a
multiple of 32). Elsewhere (the torch loop on CPU, or shards that would cut a group) `for_layer`
returns None and the model dequantizes the experts at load, as before: the same model either way, in
more memory. The torch loop over `dequantized` weights is the kernels' reference.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ferrox.layers.quant.mxfp4 import GROUP, dequantize_mxfp4, quantize_mxfp4

if TYPE_CHECKING:
    from ferrox.distributed.sharding import Weight
    from ferrox.layers.fused_moe import FusedMoE
    from ferrox.layers.ops import DeviceOps

logger = logging.getLogger(__name__)

# The kernel sets whose fused MoE kernels take MXFP4 experts (layers/ops.py names them).
_KERNEL_SETS = ("triton",)


class Mxfp4MoeMethod:
    """One FusedMoE layer's MXFP4 experts (module docstring). The interface of Fp8MoeMethod that
    FusedMoE and the loader use; the tensors arrive stacked, through `load_stacked`."""

    block = None  # (no FP8 weight blocks)
    float_weight = False  # the float experts are never allocated
    checkpoint_params: tuple[str, ...] = ()  # (no per-expert tensors: gpt-oss stores its experts stacked)
    optional_params: tuple[str, ...] = ()

    @staticmethod
    def for_layer(layer: FusedMoE, ops: DeviceOps) -> Mxfp4MoeMethod | None:
        """The method for a layer whose checkpoint experts are MXFP4, or None where they are to be
        dequantized at load (module docstring)."""
        if ops.name not in _KERNEL_SETS:
            return None
        inter, start = layer.intermediate_size, layer.inter_start
        if inter % GROUP or start % GROUP or layer.hidden_size % GROUP:
            logger.info("MXFP4 experts: this rank's %d intermediate columns from %d cut 32-column groups; "
                        "dequantizing them to the model dtype at load", inter, start)
            return None
        return Mxfp4MoeMethod()

    def check(self, layer: FusedMoE) -> None:
        """(for_layer checked the shapes)"""

    def shapes(self, layer: FusedMoE) -> dict[str, tuple[int, ...]]:
        local, inter, hidden = layer.num_local_experts, layer.intermediate_size, layer.hidden_size
        return {"w13": (local, 2 * inter, hidden // 2), "w2": (local, hidden, inter // 2),
                "w13_scale": (local, 2 * inter, hidden // GROUP), "w2_scale": (local, hidden, inter // GROUP)}

    def allocate(self, layer: FusedMoE, device: torch.device | str | None) -> None:
        """The packed experts and their scales, empty until loaded."""
        s = self.shapes(layer)
        layer.set_expert_tensors(*(torch.empty(s[name], dtype=torch.uint8, device=device)
                                   for name in ("w13", "w2", "w13_scale", "w2_scale")))

    def load(self, layer: FusedMoE, param_name: str, local: int, shard: str, tensor: Weight) -> None:
        raise ValueError(f"MXFP4 experts load stacked (gate_up_proj_blocks / _scales), not per expert "
                         f"({param_name!r} of expert {local} {shard})")

    def load_stacked(self, layer: FusedMoE, param_name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """Every expert's packed matrix at once, as the checkpoint stores it: "w13" blocks [E, 2I, H / 32,
        16] and scales [E, 2I, H / 32] with gate rows then up rows (the model de-interleaves gpt-oss's),
        "w2" [E, H, I / 32, 16] and [E, H, I / 32]; this rank's experts and intermediate rows (w13) or
        column groups (w2), as FusedMoE.load_stacked takes float ones."""
        full, inter, start, hidden = (layer.checkpoint_intermediate_size, layer.intermediate_size, layer.inter_start,
                                      layer.hidden_size)
        if param_name == "w13":
            rows, cols = 2 * full, hidden
        elif param_name == "w2":
            rows, cols = hidden, full
        else:
            raise ValueError(f"the MXFP4 experts have no stacked tensor {param_name!r} (w13 or w2)")
        expected = (layer.num_experts, rows, cols // GROUP)
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(scales.shape) != expected \
                or tuple(blocks.shape) != (*expected, GROUP // 2):
            raise ValueError(f"experts' {param_name}: MXFP4 blocks {blocks.dtype} {tuple(blocks.shape)} and scales "
                             f"{scales.dtype} {tuple(scales.shape)}, the model expects uint8 "
                             f"{(*expected, GROUP // 2)} and {expected}")
        blocks = blocks.narrow(0, layer.expert_start, layer.num_local_experts)
        scales = scales.narrow(0, layer.expert_start, layer.num_local_experts)
        if inter != full and param_name == "w13":  # this rank's gate rows and up rows
            blocks, scales = (torch.cat([t.narrow(1, start, inter), t.narrow(1, full + start, inter)], dim=1)
                              for t in (blocks, scales))
        elif inter != full:  # this rank's column groups of down
            blocks, scales = (t.narrow(2, start // GROUP, inter // GROUP) for t in (blocks, scales))
        packed = layer.w13 if param_name == "w13" else layer.w2
        scale = layer.w13_scale if param_name == "w13" else layer.w2_scale
        assert scale is not None  # (allocated with the layer)
        packed.view(blocks.shape).copy_(blocks)
        scale.copy_(scales)

    def dequantized(self, layer: FusedMoE, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) in `dtype`: the torch loop's weights, the kernels' reference."""
        assert layer.w13_scale is not None and layer.w2_scale is not None
        w13 = dequantize_mxfp4(layer.w13.unflatten(-1, (-1, GROUP // 2)), layer.w13_scale, dtype)
        w2 = dequantize_mxfp4(layer.w2.unflatten(-1, (-1, GROUP // 2)), layer.w2_scale, dtype)
        return w13, w2

    def dummy(self, layer: FusedMoE, seed: int) -> None:
        """Random experts (std 0.02, as the float dummy weights), quantized as the checkpoints store them."""
        device = layer.w13.device
        gen = torch.Generator(device=device).manual_seed(seed)
        assert layer.w13_scale is not None and layer.w2_scale is not None
        for e in range(layer.num_local_experts):
            for packed, scale in ((layer.w13, layer.w13_scale), (layer.w2, layer.w2_scale)):
                rows, cols = packed.shape[1], packed.shape[2] * 2
                w = torch.empty(rows, cols, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=gen)
                blocks, scales = quantize_mxfp4(w)
                packed[e].copy_(blocks.flatten(-2))
                scale[e].copy_(scales)

    def finalize(self, layer: FusedMoE) -> None:
        """(nothing to do: the checkpoint's bytes are the layout the kernels read)"""
