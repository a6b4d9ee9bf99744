"""How a linear layer holds a quantized weight, for checkpoints and `--quantization` methods.

Two levels, as in the checkpoint's `quantization_config`:

- `QuantConfig`: one per model, what the checkpoint (or the `quantization` argument) says: the
  method ("fp8", "awq", "gptq", "compressed-tensors") and its settings (bits, group size, scales).
  It refuses what it cannot run by name (`check`) and hands every linear layer its method.
- `LinearWeightMethod`: one per linear layer. While the checkpoint loads it collects the layer's
  quantized tensors (`load`, or `dummy` for random weights); after loading, `finalize` turns them
  into the runner, a module whose `forward(x, bias)` is the layer's matmul.

Models are built inside `use_quant_config(config)` (loader/model_loader.py); `Linear.__init__`
asks `get_quant_config()` for its method, as it asks `get_tp_group()` for its shard. Layers that are
not `Linear` (embeddings, the LM head, norms, routers) stay in the model dtype; a mixture-of-experts
layer's experts ask `QuantConfig.moe_method` (FP8 only: layers/quant/fp8_moe.py). A layer has no name
when it chooses, so a checkpoint that leaves named layers in float (its ignore / exclude list,
`QuantConfig.excluded`) puts them back once the model is built (`QuantConfig.keep_unquantized`, before any
tensor loads).

A method that quantizes online (`float_weight = True`, e.g. fp8 from a bf16 checkpoint) lets the
layer load its float `weight` as usual and quantizes it in `finalize`; a checkpoint method
(`float_weight = False`) gets every tensor named in `checkpoint_params` through `load` instead,
and the layer's float `weight` stays empty.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ferrox.model_spec import UnsupportedModelError

if TYPE_CHECKING:
    from ferrox.distributed.sharding import Weight
    from ferrox.layers.fused_moe import FusedMoE
    from ferrox.layers.linear import Linear
    from ferrox.layers.quant.excluded_modules import ExcludeList
    from ferrox.layers.quant.fp8_moe import Fp8MoeMethod
    from ferrox.model_spec import ModelSpec


class LinearWeightMethod:
    """One linear layer's quantized weight (see the module docstring)."""

    # Checkpoint tensors (the leaf after the module name, e.g. "qweight", "weight_scale") this
    # method takes through `load`; every one must arrive (per shard for a merged layer).
    checkpoint_params: tuple[str, ...] = ()
    # Taken through `load` when present, not required (e.g. fp8's static "input_scale").
    optional_params: tuple[str, ...] = ()
    # True: the layer allocates and loads its float `weight`; `finalize` quantizes it.
    float_weight: bool = False
    # Whether the fused one-token decode kernels (kernels/gemv.py) can read this layer's finalized
    # weight (`layer.weight` plus the attributes they know); False sends the model's one-token
    # steps through the general path, where each layer runs its runner.
    fused_decode: bool = False

    def load(self, layer: Linear, param_name: str, tensor: Weight, shard: str | None) -> None:
        """Take one checkpoint tensor of `layer` (shard: the merged-layer shard it belongs to,
        e.g. "q", "gate"; None for a plain layer). Under tensor parallelism keep this rank's part
        (layer.checkpoint_rows / RowParallelLinear.in_start say which)."""
        raise NotImplementedError(f"{type(self).__name__} takes no checkpoint tensors")

    def dummy(self, layer: Linear, seed: int) -> None:
        """Random checkpoint tensors of the real shapes, as if loaded (load_format="dummy"), with
        magnitudes like the float dummy weights (std 0.02)."""
        raise NotImplementedError(f"{type(self).__name__} has no dummy weights")

    def finalize(self, layer: Linear) -> nn.Module:
        """After loading: the runner (forward(x, bias) -> x @ W.T + bias, in x's dtype). Frees
        what the runner does not need (the float `weight` of an online method)."""
        raise NotImplementedError


class QuantConfig:
    """A model's quantization method (see the module docstring)."""

    name: str = ""
    # (checkpoint suffix, the suffix the layers take): tensor names a layout's publishers spell otherwise, renamed
    # as the loader reads them (loader/model_loader.py), e.g. transformers' per-tensor FP8 `.weight_scale_inv`.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # The KV cache element type kv_cache_dtype "auto" gives for this checkpoint (EngineConfig.kv_cache_dtype's
    # names), None for the model dtype: vLLM resolves "auto" to "fp8" for ModelOpt's kv_cache_quant_algo FP8.
    kv_cache_dtype: str | None = None
    # The modules the checkpoint leaves in the model dtype (its ignore / exclude list,
    # layers/quant/excluded_modules.py); None: every linear layer takes the method.
    excluded: ExcludeList | None = None

    def check(self, spec: ModelSpec, device: torch.device, tp_size: int) -> None:
        """Raise UnsupportedModelError naming what this method cannot run here (device, tensor
        parallelism, a layout setting)."""

    def keep_unquantized(self, model: nn.Module) -> None:
        """Once the model is built, before its weights load: return the layers `excluded` names to the model
        dtype (layers/quant/excluded_modules.py); without a list every layer keeps the method it took."""
        if self.excluded:
            from ferrox.layers.quant.excluded_modules import keep_excluded_in_float

            keep_excluded_in_float(model, self.excluded)

    def linear_method(self, layer: Linear) -> LinearWeightMethod | None:
        """The method of one linear layer (a fresh object: it holds that layer's tensors), or None
        to keep that layer in the model dtype."""
        raise NotImplementedError

    def moe_method(self, layer: FusedMoE) -> Fp8MoeMethod | None:
        """The method of a mixture-of-experts layer's experts (layers/fused_moe.py), or None to keep
        them in the model dtype. Methods without expert kernels refuse by name."""
        raise UnsupportedModelError(f"quantization {self.name!r}: mixture-of-experts layers do not take "
                                    f"{self.name} weights in this version (FP8 ones do)")

    def describe(self) -> str:
        """One line for the load log."""
        return self.name


_current: QuantConfig | None = None


def get_quant_config() -> QuantConfig | None:
    return _current


@contextlib.contextmanager
def use_quant_config(config: QuantConfig | None) -> Iterator[QuantConfig | None]:
    """Build models inside this block to quantize their linear layers with `config`."""
    global _current
    previous, _current = _current, config
    try:
        yield config
    finally:
        _current = previous


def hf_quantization_config(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's `quantization_config` (some exports nest it under `compression_config`). A multimodal
    checkpoint's spec holds its text config, the rest of config.json under "multimodal" (loader/model_config.py):
    its quantization_config sits there, at config.json's top level (Ministral 3's FP8 releases)."""
    for config in (hf_config, hf_config.get("multimodal")):
        for key in ("quantization_config", "compression_config"):
            value = config.get(key) if isinstance(config, dict) else None
            if isinstance(value, dict):
                return value
    return None
