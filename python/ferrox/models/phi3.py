"""Phi-3 (Phi-3-mini/medium 4k, Phi-4): the Llama decoder with its q/k/v and gate/up projections
stored fused in the checkpoint.

`self_attn.qkv_proj.weight` holds [q rows; k rows; v rows] and `mlp.gate_up_proj.weight` holds
[gate rows; up rows]; ferrox's merged layers load one shard at a time, so load_weights cuts the
fused tensors by rows into the q/k/v and gate/up names the Llama loader takes. A tensor-parallel
rank's safetensors slice is cut without being read (distributed/sharding.row_block), so each rank
still reads only its own rows. Everything after loading is the Llama model unchanged (fused CUDA
one-token kernels, CPU decode, CUDA graphs, tensor parallelism, online FP8: it quantizes the split
weights in finalize).

Long-context RoPE (`rope_scaling` "longrope" / "su": Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini) and
partial rotary (`partial_rotary_factor` < 1, Phi-4-mini) are layers/rotary.py's; for the latter the q
and k rows of every head are reordered here while loading (`partial_rotary_order`), so every kernel
keeps rotating whole heads. LoRA adapters (which name the fused modules) get the same cuts and row
order (`lora_rewrite`). Refused by name: checkpoint quantization (`quantization_config`: packed
AWQ/GPTQ tensors, or per-tensor FP8 scales of the fused projections, cannot be cut by rows).
`sliding_window` is every layer's attention window (attention backends); the dropout fields
(resid_pdrop, embd_pdrop, attention_dropout) are training-only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ferrox.distributed.sharding import materialize, row_block, shape_of
from ferrox.layers.quant import QuantizedTensor
from ferrox.layers.quant.method import hf_quantization_config
from ferrox.layers.rotary import partial_rotary_order
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError
from ferrox.models.llama import LlamaForCausalLM

# Leaves of a fused projection that are cut by rows (a Phi-3 checkpoint has weights only; a bias
# would be cut the same way).
_SPLIT_LEAVES = ("weight", "bias")


class Phi3ForCausalLM(LlamaForCausalLM):
    # GGUF: llama.cpp's "phi3" files keep the fused tensors (loader/gguf_file.py); kept quantized on the
    # CPU they are cut by rows of blocks (QuantizedTensor.narrow) and run in the Rust kernels.
    supports_quantized_gguf = True
    reorders_partial_rotary = True

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        check_phi3_config(spec.hf_config)
        super().__init__(spec, dtype, device, kernels=kernels)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self._split_fused(weights))

    def lora_rewrite(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Adapters' (module.weight, lora_B) pairs cut and reordered as the checkpoint's weights are (lora/rewrite.py):
        Phi-3 adapters name the fused qkv_proj / gate_up_proj, whose B rows become q / k / v and gate / up, the q / k
        rows in the partial rotary's order (Phi-4-mini). Row-only."""
        return self._split_fused(pairs)

    def _split_fused(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint stream with each fused qkv_proj / gate_up_proj tensor replaced by its
        parts under the Llama names (q_proj, k_proj, v_proj / gate_proj, up_proj)."""
        spec = self.spec
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        fused = {
            "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
            "gate_up_proj": (("gate_proj", spec.intermediate_size), ("up_proj", spec.intermediate_size)),
        }
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            parent, _, proj = prefix.rpartition(".")
            parts = fused.get(proj)
            if parts is None or leaf not in _SPLIT_LEAVES:
                yield name, tensor
                continue
            shape = shape_of(tensor)
            rows = sum(n for _, n in parts)
            if not shape or shape[0] != rows:
                what = " + ".join(f"{n} {part.removesuffix('_proj')}" for part, n in parts)
                raise ModelLoadError(f"tensor {name!r}: checkpoint shape {shape}, the model expects {rows} rows "
                                     f"({what}) (config.json does not match the weights?)")
            start = 0
            for part, n in parts:
                block = row_block(tensor, start, n)
                if spec.rotary_dim is not None and part in ("q_proj", "k_proj"):
                    block = self._rotary_rows(block)
                yield f"{parent}.{part}.{leaf}", block
                start += n

    def _rotary_rows(self, rows: Any) -> Any:
        """q or k rows (a weight or bias, every head) with each head's rows in the order whole-head
        rotary needs (layers/rotary.py partial_rotary_order). Read whole: a tensor-parallel rank
        then slices its heads from the reordered tensor (the rows of one head stay together)."""
        head_dim, rotary_dim = self.spec.head_dim, self.spec.rotary_dim
        assert rotary_dim is not None
        tensor = rows if isinstance(rows, QuantizedTensor) else materialize(rows)
        heads = tensor.shape[0] // head_dim
        order = (torch.arange(heads)[:, None] * head_dim + partial_rotary_order(head_dim, rotary_dim)).reshape(-1)
        if isinstance(tensor, QuantizedTensor):  # a GGUF's rows of blocks, moved whole
            return tensor.take_rows(order)
        return tensor.index_select(0, order.to(tensor.device))


def check_phi3_config(config: dict[str, Any]) -> None:
    """UnsupportedModelError naming the config.json field of a Phi-3 variant ferrox cannot run exactly."""
    quant = hf_quantization_config(config)
    if quant is not None:
        raise UnsupportedModelError(
            f"config.json: quantization_config (quant_method {quant.get('quant_method')!r}) is not supported for "
            "Phi3ForCausalLM: its fused qkv_proj / gate_up_proj tensors are split by rows at load, which quantized "
            "tensors (packed columns, per-tensor scales) do not allow; load the unquantized checkpoint, with "
            "quantization='fp8' to quantize it at load time")
