"""An adapter's lora_B in a model's terms, for families whose loader rewrites a projection's output rows.

Some loaders reorder or cut the output rows of a checkpoint projection: q/k rows permuted for the rotary layout
(GLM-4, GLM-4.5, Cohere, ERNIE 4.5, MiniMax-M2, Llama 4, the hybrid Qwens' partial rotary), fused projections cut
into their parts (GLM-4's gate_up_proj, Qwen3.5's in_proj_qkv, Qwen3-Next's in_proj_qkvz / in_proj_ba). Such a
family declares the row-only part of that rewrite of the checkpoint stream as

    model.lora_rewrite(pairs: Iterable[(name, tensor)]) -> Iterator[(name, tensor)]

A PEFT module's lora_B [out, r] has exactly the output rows of the module's weight [out, in] (its delta
B (A x) is added to W x row for row), so `(module + ".weight", lora_B)` fed through it comes out as the B of
each model module the checkpoint weight becomes, under that module's name; each keeps the module's lora_A and
scaling (A acts on the input, which a row edit leaves alone). What a row-only rewrite may do, and is exact for B
too: permute rows, cut them into row blocks, rename, drop tensors the model does not run, scale by a constant.
What it must not do to a projection's weight: anything on its columns (a transpose, dequantizing with block
scales, a reshape of the input dimension), which on B would mix its rank columns -- so the families keep those
out of lora_rewrite. The column count of every B that comes out is checked here as a guard.

Tensor parallelism needs nothing more: the rewrite gives the whole B, of which each rank's packing then takes
the rows its layer holds (lora/packed.py), as its loader took them from the rewritten weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ferrox.distributed.sharding import materialize
from ferrox.errors import ModelLoadError
from ferrox.lora.adapter import LoRAAdapterError, LoRAModule, PeftAdapter

LoRARewrite = Callable[[Iterable[tuple[str, Any]]], Iterator[tuple[str, Any]]]
_WEIGHT = ".weight"


def rewritten_modules(adapter: PeftAdapter, rewrite: LoRARewrite) -> dict[str, LoRAModule]:
    """The adapter's modules in the model's names and rows (module docstring), by model module path. Each keeps
    its tensors' keys in the weights file, so errors name the file's tensor. LoRAAdapterError for a module the
    rewrite drops (e.g. a vision tower's, an MTP layer's: the model runs no LoRA there), one it cannot rewrite
    (rows that do not match the model), or two landing on one model module."""
    out: dict[str, LoRAModule] = {}
    source: dict[str, str] = {}  # model module -> the adapter module it came from
    for name, module in adapter.modules.items():
        try:
            # One module at a time, so each part that comes out is known to be this module's.
            parts = [(new, _materialized(b)) for new, b in rewrite([(name + _WEIGHT, module.lora_b)])]
        except (ModelLoadError, ValueError, RuntimeError, IndexError) as e:
            raise LoRAAdapterError(f"{adapter.weights_file}: tensor {module.b_key!r} shape "
                                   f"{tuple(module.lora_b.shape)} does not fit this model's rows ({e})") from e
        if not parts:
            raise LoRAAdapterError(f"{adapter.weights_file}: tensor {module.b_key!r} adapts {name!r}, which this "
                                   "model does not run with LoRA (only its decoder layers' projections)")
        for new_name, b in parts:
            # (a family's rewrite that broke the row-only rule: a bug, not the adapter's fault)
            if not new_name.endswith(_WEIGHT) or b.dim() != 2 or b.shape[1] != module.rank:
                raise RuntimeError(f"lora_rewrite turned {name + _WEIGHT!r} [{tuple(module.lora_b.shape)}] into "
                                   f"{new_name!r} {tuple(b.shape)}: it must keep the columns (module docstring)")
            target = new_name[:-len(_WEIGHT)]
            if target in out:
                raise LoRAAdapterError(f"{adapter.weights_file}: modules {source[target]!r} and {name!r} both adapt "
                                       f"the model's {target!r}")
            out[target] = LoRAModule(target, module.lora_a, b, module.scaling, module.a_key, module.b_key)
            source[target] = name
    return out


def _materialized(tensor: Any) -> torch.Tensor:
    return materialize(tensor).float().contiguous()
