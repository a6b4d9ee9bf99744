"""Which part of a checkpoint tensor a tensor-parallel rank holds, read without the rest.

Checkpoint tensors reach a model's `load_weights` either as torch tensors (GGUF, .bin, tests) or
as `CheckpointSlice`s (safetensors), which read from the file only the rows or columns asked
for: a rank of a sharded model never holds a whole projection in memory. The helpers below
(`shape_of`, `narrow`, `materialize`) accept both.
"""

from __future__ import annotations

from typing import Any, Union

import torch

from ferrox.model_spec import ModelSpec, UnsupportedModelError


class CheckpointSlice:
    """A tensor still in its safetensors file (safe_open(...).get_slice(name))."""

    __slots__ = ("_slice", "shape")

    def __init__(self, file_slice: Any) -> None:
        self._slice = file_slice
        self.shape = tuple(int(d) for d in file_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index: tuple[slice, ...] = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def load(self) -> torch.Tensor:
        return self._slice[:] if self.shape else self._slice[()]


Weight = Union[torch.Tensor, CheckpointSlice]


def shape_of(x: Weight) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def narrow(x: Weight, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of x, reading only those."""
    return x.narrow(dim, start, length)


def materialize(x: Weight) -> torch.Tensor:
    return x.load() if isinstance(x, CheckpointSlice) else x


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
    even_split(spec.intermediate_size, size, 0, "intermediate_size")
    moe = spec.moe
    if moe is not None:
        if expert_parallel:
            even_split(moe.num_experts, size, 0, "num_experts")
        else:
            even_split(moe.intermediate_size, size, 0, "moe_intermediate_size")
        if moe.shared_expert_intermediate_size:
            even_split(moe.shared_expert_intermediate_size, size, 0, "shared_expert_intermediate_size")


def vocab_range(vocab_size: int, size: int, rank: int) -> tuple[int, int, int]:
    """(first row, rows held, rows padded) of a vocabulary-parallel table: ceil(vocab / size)
    rows per rank; the last rank's tail rows are padding (zero embeddings, logits dropped)."""
    per_rank = -(-vocab_size // size)
    start = rank * per_rank
    return start, max(0, min(vocab_size - start, per_rank)), per_rank
