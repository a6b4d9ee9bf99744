"""Block-wise FP8 checkpoints: DeepSeek-V3's layout, which Qwen3's FP8 releases (Qwen3-8B-FP8, ...)
and others publish as config.json quantization_config {"quant_method": "fp8", "weight_block_size":
[128, 128], "activation_scheme": "dynamic"}.

Per linear layer: `weight` float8_e4m3fn [out, in] and `weight_scale_inv` float32 [ceil(out / BN),
ceil(in / BK)], one scale per BN x BK block of the weight (despite the name, a multiplier: W[n, k] =
weight[n, k] * weight_scale_inv[n // BN, k // BK]); compressed-tensors' FP8_BLOCK names it `weight_scale`,
and ModelOpt's FP8_PB_WO (modelopt.py) too, shaped [ceil(out / BN), 1, ceil(in / BK), 1]. Activations are
quantized at run time per token and per group of BK inputs (each group's absmax maps to 448), so every
K block of the product has one activation scale and one weight scale, applied to that block's fp32
partial sum -- vLLM's meaning of these checkpoints (kernels/fp8_block_gemm.py).

Merged layers (q/k/v, gate/up) stack their shards' scale rows, so every shard must start and end on
a block row (vLLM refuses the same); tensor-parallel shards likewise cut on block rows (column
parallel) or block columns (row parallel). A cut inside a block is refused naming the layer.

How a layer multiplies (`Fp8BlockLinear`): on CUDA the activations are quantized per group in one
Triton launch, then a Triton FP8 tensor-core GEMM with the block scales in its K loop
(kernels/fp8_block_gemm.py). One token takes the split-K one-token product with the block scales
(kernels/w8a8_dot_gemv.py: each K tile a group, quantized in the kernel; on a GPU with FP8 mma.sync,
128-input groups take kernels/dense_gemv_cuda.py's product, which also takes batches of 2-8 rows), and
the fused decode path runs whole layers so (norm, SiLU, residual in its prologue and epilogues). On CPU (tests,
development) the same arithmetic on a dequantized float32 copy of the weight, activations rounded
through fp8 per group in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.distributed.sharding import Weight, materialize, narrow, shape_of
from ferrox.kernels import dense_gemv_cuda
from ferrox.kernels.fp8_block_gemm import (
    dequantize_fp8_blocks,
    fp8_block_linear,
    quantize_fp8_groups_torch,
)
from ferrox.kernels.w8a8_dot_gemv import w8a8_dot_gemv
from ferrox.layers.linear import Linear, RowParallelLinear
from ferrox.layers.quant.fp8 import _checkpoint_rows, _column_split, _rank_weight, check_fp8_device
from ferrox.layers.quant.fp8_linear import FP8_DTYPE, FP8_MAX
from ferrox.layers.quant.method import LinearWeightMethod, QuantConfig
from ferrox.model_spec import UnsupportedModelError

if TYPE_CHECKING:
    from ferrox.layers.fused_moe import FusedMoE
    from ferrox.layers.quant.excluded_modules import ExcludeList
    from ferrox.layers.quant.fp8_moe import Fp8MoeMethod
    from ferrox.model_spec import ModelSpec

_MIN_AMAX = 1e-12


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [out, in], float32 [ceil(out / BN), ceil(in / BK)]) with each block's absmax -> 448: what
    a block-FP8 checkpoint stores (for dummy weights; checkpoints come quantized)."""
    bn, bk = block
    out, k = weight.shape
    rows, cols = -(-out // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=weight.device)
    padded[:out, :k] = weight.float()
    blocks = padded.view(rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=_MIN_AMAX) / FP8_MAX
    codes = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes.view(rows * bn, cols * bk)[:out, :k].contiguous(), scale


# ---- the runner ---------------------------------------------------------------------------------
class Fp8BlockLinear(nn.Module):
    """y = x @ W.T + bias with W = weight * weight_scale_inv (per block), in x's dtype (module docstring)."""

    weight: torch.Tensor  # float8_e4m3fn [out, in]
    weight_scale_inv: torch.Tensor  # float32 [ceil(out / BN), ceil(in / BK)]
    dequantized: torch.Tensor | None  # CPU only: float32 [out, in]

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block: tuple[int, int]):
        super().__init__()
        bn, bk = block
        rows, cols = -(-weight.shape[0] // bn), -(-weight.shape[1] // bk)
        if weight.dtype != FP8_DTYPE or weight.dim() != 2 or weight_scale_inv.dtype != torch.float32 or (
                tuple(weight_scale_inv.shape) != (rows, cols)):
            raise ValueError(f"need an fp8 weight [out, in] and float32 block scales [{rows}, {cols}], got "
                             f"{weight.dtype} {tuple(weight.shape)} and {weight_scale_inv.dtype} "
                             f"{tuple(weight_scale_inv.shape)}")
        self.out_features, self.in_features = weight.shape
        self.block = (bn, bk)
        self.register_buffer("weight", weight.contiguous(), persistent=False)
        self.register_buffer("weight_scale_inv", weight_scale_inv.contiguous(), persistent=False)
        cuda = weight.device.type == "cuda"
        self.register_buffer("dequantized", None if cuda else self.dequantize(), persistent=False)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, block={list(self.block)}"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer multiplies by, [out, in] in `dtype`."""
        return dequantize_fp8_blocks(self.weight, self.weight_scale_inv, self.block, dtype)

    def one_token_blocks(self) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """For the fused one-token kernels (attention/fused_decode.py): the block scales and block,
        or None where that kernel cannot take them (groups under 32 inputs: below an FP8 MMA's K)."""
        return (self.weight_scale_inv, self.block) if fused_one_token(self.block) else None

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.dequantized is None:  # CUDA
            if x.numel() == self.in_features and fused_one_token(self.block):  # one token: one launch
                y = w8a8_dot_gemv(x.reshape(1, -1).contiguous(), self.weight, self.weight_scale_inv, bias,
                                  block=self.block)
                return y.reshape(*x.shape[:-1], self.out_features)
            # A few rows (decode batches, verify steps): the tensor-core product quantizes them itself.
            few = dense_gemv_cuda.few_token_product(x.reshape(-1, self.in_features), self.weight, bias,
                                                    weight_scale=self.weight_scale_inv, block=self.block)
            if few is not None:
                return few.reshape(*x.shape[:-1], self.out_features)
            return fp8_block_linear(x, self.weight, self.weight_scale_inv, self.block, bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        q, scale = quantize_fp8_groups_torch(x2, self.block[1])
        x2 = q.float() * scale.repeat_interleave(self.block[1], dim=1)[:, :self.in_features]
        # The bias in float32 and one rounding, as the GPU's GEMM epilogue adds it.
        y = F.linear(x2, self.dequantized, None if bias is None else bias.float()).to(x.dtype)
        return y.reshape(*lead, self.out_features)


# ---- the per-layer method -----------------------------------------------------------------------
def fused_one_token(block: tuple[int, int]) -> bool:
    """Whether one-token steps of these blocks run kernels/w8a8_dot_gemv.py (groups of 32 inputs or
    more: an FP8 MMA's K), and so the fused decode path."""
    return block[1] >= 32


class Fp8BlockMethod(LinearWeightMethod):
    """One layer's block-FP8 checkpoint tensors (module docstring), gathered into `Fp8BlockLinear`.
    scale_param: the scales' name, `weight_scale_inv` (the fp8 layout) or `weight_scale`
    (compressed-tensors, which may also store all-zero zero points)."""

    def __init__(self, block: tuple[int, int], scale_param: str = "weight_scale_inv"):
        self.block = block
        # The fused one-token path reads `layer.weight` (fp8) and the runner's one_token_blocks().
        self.fused_decode = fused_one_token(block)
        self.scale_param = scale_param
        self.checkpoint_params = ("weight", scale_param)
        if scale_param == "weight_scale":
            self.optional_params = ("weight_zero_point", "input_zero_point")
        self._weight: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None

    def _tensors(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor]:
        # Allocated at the first load: the layer is not fully built when it chooses its method.
        if self._weight is None or self._scale is None:
            bn, bk = self.block
            device = layer.weight.device
            self._weight = torch.empty(layer.out_features, layer.in_features, dtype=FP8_DTYPE, device=device)
            self._scale = torch.empty(-(-layer.out_features // bn), -(-layer.in_features // bk), dtype=torch.float32,
                                      device=device)
        return self._weight, self._scale

    def load(self, layer: Linear, param_name: str, tensor: Weight, shard: str | None) -> None:
        weight, scale = self._tensors(layer)
        bn, bk = self.block
        dst, rows = layer._shard_rows()[shard or "weight"]
        first, held, full = _checkpoint_rows(layer, shard)
        k_full = layer.in_features * _column_split(layer)
        if param_name == "weight":
            value = _rank_weight(layer, tensor, first, held, full)
            if value.dtype != FP8_DTYPE:
                raise ValueError(f"weight is {value.dtype}, the block-wise fp8 layout stores float8_e4m3fn")
            if tuple(value.shape) != (rows, layer.in_features):
                raise ValueError(f"weight: checkpoint shape {shape_of(tensor)}, model expects {(full, k_full)}")
            weight[dst:dst + rows].copy_(value)
            return
        if param_name.endswith("_zero_point") and param_name in self.optional_params:
            if materialize(tensor).float().abs().max() != 0:
                raise ValueError(f"{param_name} is not zero: an asymmetric scheme, which the config says it is not")
            return
        if param_name != self.scale_param:
            raise ValueError(f"{param_name}: not a tensor of the block-wise fp8 layout")
        shape = shape_of(tensor)
        if len(shape) == 4 and shape[1] == shape[3] == 1:  # ModelOpt's FP8_PB_WO writes [rows, 1, cols, 1]
            tensor = materialize(tensor).reshape(shape[0], shape[2])
        expected = (-(-full // bn), -(-k_full // bk))
        if shape_of(tensor) != expected:
            raise ValueError(f"{param_name}: shape {shape_of(tensor)}, expected {expected} (one scale per "
                             f"{bn} x {bk} block of a [{full}, {k_full}] weight)")
        # This rank's (and this shard's) block rows and columns: cuts must fall on block edges.
        ends_on_edge = (first + held) % bn == 0 or first + held == full
        if first % bn or not ends_on_edge or dst % bn or (rows % bn and dst + rows != layer.out_features):
            raise ValueError(f"{param_name}: {'shard ' + repr(shard) + ' ' if shard else ''}rows {first}.."
                             f"{first + held} of {full} (at row {dst} of the layer) do not fall on the {bn}-row "
                             "weight blocks (a merged or tensor-parallel layer must split on block edges)")
        col0, cols = 0, expected[1]
        if isinstance(layer, RowParallelLinear) and layer.tp.size > 1:
            if layer.in_start % bk or (layer.in_features % bk and layer.in_start + layer.in_features != k_full):
                raise ValueError(f"{param_name}: a rank's input columns {layer.in_start}.."
                                 f"{layer.in_start + layer.in_features} do not fall on the {bk}-column weight blocks")
            col0, cols = layer.in_start // bk, -(-layer.in_features // bk)
        value = narrow(narrow(tensor, 0, first // bn, -(-held // bn)), 1, col0, cols)
        scale[dst // bn:dst // bn + value.shape[0]].copy_(materialize(value).float())

    def dummy(self, layer: Linear, seed: int) -> None:
        gen = torch.Generator(device=layer.weight.device).manual_seed(seed)
        w = torch.empty(layer.out_features, layer.in_features, dtype=torch.bfloat16, device=layer.weight.device)
        self._weight, self._scale = quantize_fp8_blocks(w.normal_(0.0, 0.02, generator=gen), self.block)

    def finalize(self, layer: Linear) -> nn.Module:
        if self._weight is None or self._scale is None:
            raise ValueError("a block-wise fp8 layer was finalized before its checkpoint tensors were loaded")
        layer.weight.data = self._weight  # (the layer's float weight was never filled: a checkpoint method)
        runner = Fp8BlockLinear(self._weight, self._scale, self.block)
        self._weight = self._scale = None  # the layer and its runner hold them now
        return runner


# ---- the model's config -------------------------------------------------------------------------
class Fp8BlockConfig(QuantConfig):
    """A block-wise FP8 checkpoint (fp8.py's Fp8Config.from_hf builds it for `weight_block_size`)."""

    name = "fp8"

    def __init__(self, block: tuple[int, int], excluded: ExcludeList | None = None, *,
                 name: str = "fp8", scale_param: str = "weight_scale_inv"):
        """name: the quant_method ("fp8"; "compressed-tensors" for its FP8 block scheme and "modelopt" for
        FP8_PB_WO, whose scales are named `weight_scale`). excluded: the modules the checkpoint leaves float."""
        self.block = block
        self.excluded = excluded
        self.name = name
        self.scale_param = scale_param

    @staticmethod
    def block_size(value: object, where: str) -> tuple[int, int]:
        """A checkpoint's [BN, BK]: powers of two from 16 (the kernels' tiles are the blocks)."""
        if not (isinstance(value, list | tuple) and len(value) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 16 and v & (v - 1) == 0 for v in value)):
            raise UnsupportedModelError(f"{where} {value!r}: expected [block_n, block_k], powers of two from 16 "
                                        "(checkpoints use [128, 128])")
        return int(value[0]), int(value[1])

    def check(self, spec: ModelSpec, device: torch.device, tp_size: int) -> None:
        check_fp8_device(self.name, device)

    def linear_method(self, layer: Linear) -> LinearWeightMethod:
        return Fp8BlockMethod(self.block, self.scale_param)

    def moe_method(self, layer: FusedMoE) -> Fp8MoeMethod:
        """The experts' blocks, loaded as the linear layers' (fp8_moe.py)."""
        from ferrox.layers.quant.fp8_moe import Fp8MoeMethod

        if self.block[1] < 32:
            raise UnsupportedModelError(f"quantization {self.name!r}: weight blocks {list(self.block)} are too narrow "
                                        "for the FP8 expert kernels (block_k of 32 or more: an FP8 MMA's K)")
        return Fp8MoeMethod(self.block, online=False, scale_param=self.scale_param)

    def describe(self) -> str:
        return (f"{self.name} (checkpoint): E4M3 weights, a scale per {self.block[0]} x {self.block[1]} block, "
                f"activations per token and group of {self.block[1]} (dynamic)")
