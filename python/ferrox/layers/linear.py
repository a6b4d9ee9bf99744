"""Linear layers, sharded Megatron-style over the tensor-parallel group they are built in.

- `Linear`: replicated (every rank holds the whole weight).
- `MergedLinear`: column-parallel; several HF projections (gate/up) stacked as one weight so a
  layer runs one matmul; each rank holds its share of every shard's rows.
- `QKVLinear`: q/k/v merged, split by heads; KV heads replicated when ranks outnumber them.
- `RowParallelLinear`: input columns split; partial products summed by one all-reduce. The bias
  (and, in the fused decode path, the residual) is added on rank 0 only, so the sum has it once.

Every layer loads checkpoint tensors through `load_weight(param_name, tensor, shard)`, which
reads only this rank's part (distributed/sharding.py); with one rank that is the whole tensor.

Quantized weights (layers/quant): `load_weight` also takes a `QuantizedTensor` (a GGUF tensor in
its blocks). The layer keeps those shards and `finalize_quantized` packs them into a
`CpuQuantWeight` (4/8-bit groups run by the Rust CPU kernels), which `forward` then runs instead of F.linear; the float `weight` is emptied.
One rank only for now (a shard of packed groups is not cut yet).

Checkpoint quantization methods (layers/quant/method.py: fp8, AWQ, GPTQ, compressed-tensors): a
layer built inside `use_quant_config` gets a `weight_method`. Checkpoint tensors it names
(`qweight`, `weight_scale`, ...) go to the method's `load`; `finalize_quantized` asks it for the
runner, kept in `quant` like the GGUF one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.distributed.parallel_state import TPGroup, get_tp_group
from ferrox.distributed.sharding import Weight, even_split, kv_head_range, materialize, narrow, shape_of
from ferrox.kernels import dense_gemv_cuda
from ferrox.layers.quant import CpuQuantWeight, QuantizedTensor
from ferrox.layers.quant.method import LinearWeightMethod, get_quant_config


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _copy(target: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(value.shape)}, model expects {tuple(target.shape)}")
    target.copy_(value)


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for a 16-bit (or float32) weight: batches of 2-8 rows on a GPU through the
    tensor-core product for few tokens (kernels/dense_gemv_cuda.py, which says None elsewhere),
    everything else through F.linear."""
    if 2 <= x.numel() // x.shape[-1] <= dense_gemv_cuda.MAX_TOKENS:
        y = dense_gemv_cuda.few_token_product(x.reshape(-1, x.shape[-1]), weight, bias)
        if y is not None:
            return y.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.tp: TPGroup = get_tp_group()
        quant_config = get_quant_config()
        self.weight_method: LinearWeightMethod | None = (
            quant_config.linear_method(self) if quant_config is not None else None)
        # A checkpoint method holds the weight in tensors of its own: the float weight stays empty.
        float_weight = self.weight_method is None or self.weight_method.float_weight
        self.weight = _param((out_features, in_features) if float_weight else (0,), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None
        # The runner (forward(x, bias)), set by finalize_quantized when the weight is quantized.
        self.quant: nn.Module | None = None
        self._quantized_shards: dict[str, QuantizedTensor] = {}
        # A constant the model folded into this layer's weight and bias at load (Granite's
        # residual_multiplier): a LoRA delta, which the checkpoint's layer gets before the model
        # scales its output, is scaled by it too (lora/packed.py).
        self.output_scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant(x, self.bias)
        return float_linear(x, self.weight, self.bias)

    # ---- quantized weights --------------------------------------------------------------------
    def _shard_rows(self) -> dict[str, tuple[int, int]]:
        """shard name -> (first row in `weight`, rows): one shard, "weight", for a plain layer."""
        return {"weight": (0, self.out_features)}

    def _keep_quantized(self, param_name: str, shard: str, tensor: QuantizedTensor) -> None:
        if param_name != "weight":
            raise ValueError(f"{param_name}: only weights can be quantized")
        if self.tp.size > 1:
            raise ValueError("quantized GGUF weights run with tensor_parallel_size=1 only (load with "
                             "dtype='float32' to dequantize them)")
        rows = self._shard_rows()[shard][1]
        if tuple(tensor.shape) != (rows, self.in_features):
            raise ValueError(f"{shard}: checkpoint shape {tuple(tensor.shape)}, model expects {(rows, self.in_features)}")
        self._quantized_shards[shard] = tensor

    def _method_takes(self, param_name: str) -> bool:
        method = self.weight_method
        return method is not None and param_name in (*method.checkpoint_params, *method.optional_params)

    def checkpoint_keys(self, name: str) -> set[str]:
        """The checkpoint tensors this layer (module path `name`) needs, merged-layer shards
        written `name.leaf#shard` (what models check after loading, models/load_check.py)."""
        leaves = ["bias"] if self.bias is not None else []
        method = self.weight_method
        leaves += ["weight"] if method is None or method.float_weight else []
        leaves += list(method.checkpoint_params) if method is not None else []
        shards = list(self._shard_rows()) if isinstance(self, MergedLinear) else [None]
        return {f"{name}.{leaf}" + (f"#{shard}" if shard else "") for leaf in dict.fromkeys(leaves) for shard in shards}

    def finalize_quantized(self) -> None:
        """After loading: the weight method's runner; or pack the quantized GGUF shards for the
        CPU kernels. If some GGUF shards came as floats (a GGUF may keep a tensor in F16), the
        quantized ones are dequantized into `weight` instead, so the layer runs one matmul either way."""
        if self.weight_method is not None and self.quant is None:
            self.quant = self.weight_method.finalize(self)
            return
        if not self._quantized_shards:
            return
        shards = self._shard_rows()
        if set(self._quantized_shards) == set(shards):
            self.quant = CpuQuantWeight([self._quantized_shards[name].decode() for name in shards])
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
        else:
            for name, tensor in self._quantized_shards.items():
                start, rows = shards[name]
                self.weight.data[start:start + rows].copy_(tensor.dequantize())
        self._quantized_shards.clear()

    def _target(self, param_name: str) -> torch.Tensor:
        param = self.weight if param_name == "weight" else self.bias if param_name == "bias" else None
        if param is None:
            raise ValueError(f"{param_name} given for a layer built without one")
        return param.data

    def load_weight(self, param_name: str, tensor: Weight, shard: str | None = None) -> None:
        """Copy a checkpoint tensor (weight [out, in] or bias [out]) in; replicated: all of it."""
        if self._method_takes(param_name):
            self.weight_method.load(self, param_name, tensor, shard)  # type: ignore[union-attr]
            return
        if isinstance(tensor, QuantizedTensor):
            self._keep_quantized(param_name, "weight", tensor)
            return
        _copy(self._target(param_name), materialize(tensor), param_name)


class MergedLinear(Linear):
    """Output rows are the named shards stacked in order, e.g. {"gate": 1536, "up": 1536} (full
    checkpoint sizes); each rank holds rows [rank * size / N, (rank + 1) * size / N) of each."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], *, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        tp = get_tp_group()
        rows = {name: (*even_split(size, tp.size, tp.rank, f"{name} rows"), size) for name, size in shard_sizes.items()}
        self._init_shards(in_features, rows, bias=bias, dtype=dtype, device=device)

    def _init_shards(self, in_features: int, rows: dict[str, tuple[int, int, int]], *, bias: bool,
                     dtype: torch.dtype, device: torch.device | str | None) -> None:
        """rows: shard -> (first checkpoint row this rank holds, rows held, checkpoint rows)."""
        super().__init__(in_features, sum(r[1] for r in rows.values()), bias=bias, dtype=dtype, device=device)
        self.checkpoint_rows = dict(rows)
        self.shard_sizes = {name: r[1] for name, r in rows.items()}  # local rows of each shard
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in self.shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def _shard_rows(self) -> dict[str, tuple[int, int]]:
        return {name: (self.shard_offsets[name], size) for name, size in self.shard_sizes.items()}

    def load_weight(self, param_name: str, tensor: Weight, shard: str | None = None) -> None:
        if shard is None:
            raise ValueError(f"{param_name}: a merged layer loads one shard at a time ({', '.join(self.shard_sizes)})")
        if self._method_takes(param_name):
            self.weight_method.load(self, param_name, tensor, shard)  # type: ignore[union-attr]
            return
        if isinstance(tensor, QuantizedTensor):
            self._keep_quantized(param_name, shard, tensor)
            return
        self.load_shard(param_name, shard, tensor)

    def load_shard(self, param_name: str, shard: str, tensor: Weight) -> None:
        """Copy this rank's rows of a checkpoint tensor (weight [size, in] or bias [size]) into its shard."""
        start, size, full = self.checkpoint_rows[shard]
        target = self._target(param_name)[self.shard_offsets[shard]:self.shard_offsets[shard] + size]
        what = f"shard {shard!r} {param_name}"
        shape = shape_of(tensor)
        if size == full or not shape or shape[0] != full:  # one rank, or a wrong shape: _copy names it
            _copy(target, materialize(tensor), what)
        else:
            _copy(target, narrow(tensor, 0, start, size), what)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(list(self.shard_sizes.values()), dim=-1)


class QKVLinear(MergedLinear):
    """q, k and v projections by heads: rank r holds query heads [r*H/N, (r+1)*H/N) and the KV
    heads they read (kv_head_range); local head counts in num_heads / num_kv_heads.
    q_rows_per_head: the q projection's rows per head when not head_dim (Qwen3.5's gated attention:
    2 x head_dim, each head's query rows then its output gate's)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, bias: bool,
                 dtype: torch.dtype, device: torch.device | str | None = None, q_rows_per_head: int | None = None):
        tp = get_tp_group()
        q_start, q_heads = even_split(num_heads, tp.size, tp.rank, "num_attention_heads")
        kv_start, kv_heads = kv_head_range(num_kv_heads, tp.size, tp.rank)
        self.num_heads, self.num_kv_heads = q_heads, kv_heads
        q_rows = head_dim if q_rows_per_head is None else q_rows_per_head
        q = (q_start * q_rows, q_heads * q_rows, num_heads * q_rows)
        kv = (kv_start * head_dim, kv_heads * head_dim, num_kv_heads * head_dim)
        self._init_shards(hidden_size, {"q": q, "k": kv, "v": kv}, bias=bias, dtype=dtype, device=device)


class RowParallelLinear(Linear):
    """Input columns split across ranks (in_features is the full size); output summed over them."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        tp = get_tp_group()
        self.in_start, local_in = even_split(in_features, tp.size, tp.rank, "row-parallel input features")
        super().__init__(local_in, out_features, bias=bias, dtype=dtype, device=device)

    @property
    def adds_bias(self) -> bool:
        """Whether this rank adds the bias (and a fused residual): rank 0 only, summed once."""
        return self.tp.rank == 0

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """reduce False: this rank's partial product (its bias share included), for a caller that adds
        other partials before one all-reduce (layers/fused_moe.py experts_with_shared)."""
        bias = self.bias if self.adds_bias else None
        y = float_linear(x, self.weight, bias) if self.quant is None else self.quant(x, bias)
        return self.tp.all_reduce(y) if reduce else y

    def load_weight(self, param_name: str, tensor: Weight, shard: str | None = None) -> None:
        if isinstance(tensor, QuantizedTensor) or self._method_takes(param_name):
            super().load_weight(param_name, tensor, shard)
            return
        shape = shape_of(tensor)
        if param_name == "weight" and self.tp.size > 1 and len(shape) == 2 and shape[1] == self.in_features * self.tp.size:
            _copy(self._target("weight"), narrow(tensor, 1, self.in_start, self.in_features), "weight")
        else:
            super().load_weight(param_name, tensor, shard)
