"""Which part of a checkpoint tensor a tensor-parallel rank holds, read without the rest.

Checkpoint tensors reach a model's `load_weights` either as torch tensors (GGUF, .bin, tests) or
as `CheckpointSlice`s (safetensors), which read from the file only the rows or columns asked
for: a rank of a sharded model never holds a whole projection in memory. The helpers below
(`shape_of`, `narrow`, `materialize`) accept both, and `row_block` / `scaled` derive from either a
block of its rows or its values times a constant (a family that stores fused projections, or folds
config constants into weights, at load time) without reading it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import torch

from ferrox.model_spec import ModelSpec, UnsupportedModelError


class CheckpointSlice:
    """A tensor still in its safetensors file (safe_open(...).get_slice(name)), or a view of one that
    load_weights derived without reading it: rows [row0, row0 + shape[0]) of it (`row_block`), its
    values times `scale` (`scaled`, read as float32 so the product is rounded once, into the model
    dtype)."""

    __slots__ = ("_slice", "shape", "_row0", "_scale")

    def __init__(self, file_slice: Any, *, row0: int = 0, shape: tuple[int, ...] | None = None,
                 scale: float | None = None) -> None:
        self._slice = file_slice
        self.shape = tuple(int(d) for d in file_slice.get_shape()) if shape is None else shape
        self._row0 = row0
        self._scale = scale

    def _read(self, index: tuple[slice, ...]) -> torch.Tensor:
        tensor = self._slice[index]
        return tensor if self._scale is None else tensor.float() * self._scale

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self._read((slice(self._row0 + start, self._row0 + start + length),))
        rows = slice(self._row0, self._row0 + self.shape[0])
        return self._read((rows,) + (slice(None),) * (dim - 1) + (slice(start, start + length),))

    def load(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0]) if self.shape else self._read(())

    def rows(self, start: int, length: int) -> CheckpointSlice:
        return CheckpointSlice(self._slice, row0=self._row0 + start, shape=(length, *self.shape[1:]), scale=self._scale)

    def times(self, factor: float) -> CheckpointSlice:
        scale = factor if self._scale is None else self._scale * factor
        return CheckpointSlice(self._slice, row0=self._row0, shape=self.shape, scale=scale)


class ExpertRows:
    """A stacked-experts checkpoint tensor [E, ...] each of whose experts (rows along dim 0) must be transformed
    as it is read: transposed (Llama 4, gpt-oss store [E, in, out]), gate / up de-interleaved (gpt-oss). Reading a
    block of rows (`row_block`, then `narrow` / `materialize`) reads and transforms only those experts, so an
    expert-parallel or sharded rank never holds a whole layer's experts; `shape` is the transformed one."""

    __slots__ = ("_inner", "_transform", "shape")

    def __init__(self, inner: Weight, transform: Callable[[torch.Tensor], torch.Tensor],
                 shape: tuple[int, ...]) -> None:
        self._inner = inner
        self._transform = transform
        self.shape = shape

    def rows(self, start: int, length: int) -> ExpertRows:
        return ExpertRows(row_block(self._inner, start, length), self._transform, (length, *self.shape[1:]))

    def load(self) -> torch.Tensor:
        return self._transform(materialize(self._inner))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self.rows(start, length).load()
        return self.load().narrow(dim, start, length)


Weight = Union[torch.Tensor, CheckpointSlice, ExpertRows]


def shape_of(x: Weight) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def narrow(x: Weight, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of x, reading only those."""
    return x.narrow(dim, start, length)


def materialize(x: Weight) -> torch.Tensor:
    return x.load() if isinstance(x, (CheckpointSlice, ExpertRows)) else x


def row_block(x: Weight, start: int, length: int) -> Weight:
    """Rows [start, start + length) of x (e.g. the q rows of a fused qkv tensor), still unread if x is."""
    return x.rows(start, length) if isinstance(x, (CheckpointSlice, ExpertRows)) else x.narrow(0, start, length)


def experts_transposed(x: Weight, then: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Weight:
    """Stacked experts stored [E, in, out] as [E, out, in] (then `then` applied to each block read), still unread if x
    is (ExpertRows). A tensor of another rank is passed through, for the loader's shape check to name."""
    shape = shape_of(x)
    if len(shape) != 3:
        return x

    def transform(experts: torch.Tensor) -> torch.Tensor:
        out = experts.transpose(1, 2)
        return out if then is None else then(out)

    return ExpertRows(x, transform, (shape[0], shape[2], shape[1]))


def scaled(x: Weight, factor: float) -> Weight:
    """x times `factor`, computed in float32 (rounded once when copied into the model dtype); still
    unread if x is."""
    return x.times(factor) if isinstance(x, CheckpointSlice) else materialize(x).float() * factor


def even_split(total: int, size: int, rank: int, what: str) -> tuple[int, int]:
    """(start, length) of rank's equal share of `total` items."""
    if total % size:
        raise UnsupportedModelError(f"{what} ({total}) is not divisible by tensor_parallel_size ({size})")
    length = total // size
    return rank * length, length


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """(first KV head, KV heads held) of a rank. With more ranks than KV heads each rank holds
    one head, replicated across size // num_kv_heads ranks (the query heads it serves)."""
    if num_kv_heads >= size:
        start, length = even_split(num_kv_heads, size, rank, "num_key_value_heads")
        return start, length
    if size % num_kv_heads:
        raise UnsupportedModelError(f"tensor_parallel_size ({size}) must divide or be a multiple of the model's "
                                    f"num_key_value_heads ({num_kv_heads})")
    return rank * num_kv_heads // size, 1


def local_num_kv_heads(spec: ModelSpec, size: int) -> int:
    return kv_head_range(spec.num_kv_heads, size, 0)[1]


def check_tp_shapes(spec: ModelSpec, size: int, expert_parallel: bool = False) -> None:
    """Fail at start, naming the numbers, when the model cannot be split `size` ways."""
    if size == 1:
        return
    even_split(spec.num_heads, size, 0, "num_attention_heads")
    kv_head_range(spec.num_kv_heads, size, 0)
    for layer, (heads, _) in enumerate(spec.layer_kv_shapes):
        if heads and heads != spec.num_kv_heads:  # a layer with KV heads of its own (Gemma 4's full layers)
            _check_layer_kv_heads(heads, size, layer)
    even_split(spec.intermediate_size, size, 0, "intermediate_size")
    moe = spec.moe
    if moe is not None:
        if expert_parallel:
            even_split(moe.num_experts, size, 0, "num_experts")
        else:
            even_split(moe.intermediate_size, size, 0, "moe_intermediate_size")
        if moe.shared_expert_intermediate_size:
            even_split(moe.shared_expert_intermediate_size, size, 0, "shared_expert_intermediate_size")
    _check_deepseek_experts(spec.hf_config, size, expert_parallel)
    linear_key_heads = spec.hf_config.get("linear_num_key_heads")
    if isinstance(linear_key_heads, int) and not isinstance(linear_key_heads, bool) and linear_key_heads > 0:
        # A hybrid model's Gated DeltaNet layers: split by key-head groups (layers/gated_delta_net.py).
        even_split(linear_key_heads, size, 0, "linear_num_key_heads")
    _check_mamba2(spec.hf_config, size)


# The Mamba2 hybrids' config fields: (heads, groups, their defaults) as each family names them.
_MAMBA2_FIELDS = {"granitemoehybrid": ("mamba_n_heads", "mamba_n_groups", 128),
                  "nemotron_h": ("mamba_num_heads", "n_groups", 128)}


def _check_mamba2(config: dict[str, Any], size: int) -> None:
    """A Mamba2 hybrid's mixers (layers/mamba2_mixer.py): heads split evenly, B / C groups as mamba2_group_range
    allows; Granite 4.0-H's shared MLP by its rows."""
    fields = _MAMBA2_FIELDS.get(str(config.get("model_type")))
    if fields is None:
        return
    heads_key, groups_key, default_heads = fields
    even_split(int(config.get(heads_key) or default_heads), size, 0, heads_key)
    mamba2_group_range(int(config.get(groups_key) or 1), size, 0, groups_key)
    shared = config.get("shared_intermediate_size")
    if isinstance(shared, int) and not isinstance(shared, bool) and shared > 0:
        even_split(shared, size, 0, "shared_intermediate_size")


def mamba2_group_range(n_groups: int, size: int, rank: int, what: str = "n_groups") -> tuple[int, int]:
    """(first group, groups held) of a rank's share of a Mamba2 mixer's B / C groups. Each rank's heads must find
    their groups on it: with n_groups divisible by the ranks each takes its own groups (those its heads read);
    one group is replicated to every rank. Other counts are refused, as vLLM's MambaMixer2 refuses them (a group
    shared by a subset of the ranks would need its gated norm summed over that subset)."""
    if n_groups % size == 0:
        return rank * (n_groups // size), n_groups // size
    if n_groups == 1:
        return 0, 1
    raise UnsupportedModelError(f"{what} ({n_groups}) must be 1 or divisible by tensor_parallel_size ({size}): "
                                "each rank's Mamba2 heads read their B / C groups on that rank")


def _check_deepseek_experts(config: dict[str, Any], size: int, expert_parallel: bool) -> None:
    """The experts of configs that name them as DeepSeek does (n_routed_experts: DeepSeek-V2/V3, GLM-4.5,
    Nemotron-H's E layers; ModelSpec.moe is None for them): routed ones split by count (expert parallel) or by
    moe_intermediate_size, shared ones (one MLP of n_shared_experts x moe_intermediate_size, or Nemotron-H's
    moe_shared_expert_intermediate_size) by their rows, expert parallel or not."""
    routed = config.get("n_routed_experts")
    if not isinstance(routed, int) or isinstance(routed, bool) or routed <= 0:
        return
    inter = config.get("moe_intermediate_size")
    inter = inter if isinstance(inter, int) and not isinstance(inter, bool) else 0
    if expert_parallel:
        even_split(routed, size, 0, "n_routed_experts")
    else:
        even_split(inter, size, 0, "moe_intermediate_size")
    shared = config.get("n_shared_experts")
    own_width = config.get("moe_shared_expert_intermediate_size")  # (Nemotron-H's; it refuses n_shared_experts != 1)
    if isinstance(own_width, int) and not isinstance(own_width, bool) and own_width > 0:
        even_split(own_width, size, 0, "moe_shared_expert_intermediate_size")
    elif isinstance(shared, int) and not isinstance(shared, bool) and shared > 0:
        even_split(shared * inter, size, 0, "the shared experts' intermediate size (n_shared_experts x "
                   "moe_intermediate_size)")


def vocab_range(vocab_size: int, size: int, rank: int) -> tuple[int, int, int]:
    """(first row, rows held, rows padded) of a vocabulary-parallel table: ceil(vocab / size)
    rows per rank; the last rank's tail rows are padding (zero embeddings, logits dropped)."""
    per_rank = -(-vocab_size // size)
    start = rank * per_rank
    return start, max(0, min(vocab_size - start, per_rank)), per_rank


def _check_layer_kv_heads(heads: int, size: int, layer: int) -> None:
    """kv_head_range's rule (split the heads, or replicate each over size / heads ranks) for one layer's own
    KV head count."""
    if heads % size and size % heads:
        raise UnsupportedModelError(f"layer {layer} has {heads} KV heads of its own (Gemma 4's "
                                    f"num_global_key_value_heads): tensor_parallel_size ({size}) must divide or be "
                                    "a multiple of them")
