"""Iterators of (HF tensor name, tensor) from checkpoint files, for `model.load_weights`.

Safetensors: one `model.safetensors`, or shards listed in `model.safetensors.index.json` (every
shard named by the index must exist; every tensor must be where the index says).
GGUF: dequantized to float32 by gguf_file.py, the caller casts to the run dtype; or, with
`keep_quantized`, quantized matrices as layers/quant QuantizedTensors (raw blocks).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ferrox.loader.errors import ModelLoadError, ModelNotFoundError
from ferrox.loader.json_file import read_json


def _indexed_shards(folder: str, index_name: str) -> list[str] | None:
    """The shard files a sharded checkpoint's index names (its weight_map values), or None if the folder
    has no such index. A missing or empty weight_map, or a named shard that is absent, is an error."""
    index_path = os.path.join(folder, index_name)
    if not os.path.isfile(index_path):
        return None
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index_path}: field 'weight_map' is missing or empty")
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise ModelNotFoundError(f"{index_path} names shard(s) that do not exist: {', '.join(missing)}")
    return [os.path.join(folder, f) for f in files]


def safetensors_files(folder: str) -> list[str]:
    shards = _indexed_shards(folder, "model.safetensors.index.json")
    if shards is not None:
        return shards
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    # Mistral's repositories may hold its native consolidated*.safetensors beside the Hugging Face files: the same
    # weights under other names (load_format 'mistral' reads those: loader/mistral_weights.py).
    if found:
        return [f for f in found if not os.path.basename(f).startswith("consolidated")] or found
    raise ModelNotFoundError(f"model folder {folder} has no *.safetensors weights (use load_format='dummy' "
                             "for random weights)")


def iter_safetensors(folder: str, *, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """lazy: yield CheckpointSlices (distributed/sharding.py) that read only the part a
    tensor-parallel rank asks for, instead of whole tensors."""
    yield from iter_safetensors_files(safetensors_files(folder), lazy=lazy)


def iter_safetensors_files(paths: list[str], *, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """iter_safetensors over the given files (Mistral's consolidated*.safetensors: loader/mistral_weights.py)."""
    from safetensors import safe_open

    from ferrox.distributed.sharding import CheckpointSlice

    for path in paths:
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # SafetensorError: header too small / invalid JSON / truncated
            raise ModelLoadError(f"cannot read safetensors file {path}: {e} (truncated or corrupt?)") from e
        with handle as f:
            for name in f.keys():
                if lazy:
                    yield name, CheckpointSlice(f.get_slice(name))
                    continue
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(f"cannot read tensor {name!r} from {path}: {e}") from e
                yield name, tensor


def iter_safetensors_prefixed(folder: str, prefix: str) -> Iterator[tuple[str, Any]]:
    """The tensors whose names start with `prefix` (a checkpoint's MTP layer: mtp.), reading no other tensor and,
    where the index maps names to shards, opening only the shards that hold them."""
    from safetensors import safe_open

    paths = safetensors_files(folder)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map", {})
        wanted = {os.path.join(folder, shard) for name, shard in weight_map.items() if name.startswith(prefix)}
        paths = [p for p in paths if p in wanted]
    for path in paths:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.startswith(prefix):
                        yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot read {prefix}* tensors from {path}: {e}") from e


def has_safetensors(folder: str) -> bool:
    return bool(glob.glob(os.path.join(folder, "*.safetensors")))


def has_torch_bin(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, f)) for f in ("pytorch_model.bin", "pytorch_model.bin.index.json"))


def torch_bin_files(folder: str) -> list[str]:
    """Older checkpoints: pytorch_model.bin, or shards listed in pytorch_model.bin.index.json."""
    shards = _indexed_shards(folder, "pytorch_model.bin.index.json")
    if shards is not None:
        return shards
    single = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(single):
        return [single]
    raise ModelNotFoundError(f"model folder {folder} has no *.safetensors or pytorch_model*.bin weights (use "
                             "load_format='dummy' for random weights)")


def iter_torch_bin(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in torch_bin_files(folder):
        try:
            # weights_only: a checkpoint is data; never run pickled code from it.
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise ModelLoadError(f"cannot read PyTorch checkpoint {path}: {e} (truncated or corrupt?)") from e
        if not isinstance(state, dict):
            raise ModelLoadError(f"PyTorch checkpoint {path} does not hold a state dict")
        yield from state.items()


def iter_gguf(path: str, n_heads: int, n_kv_heads: int, *, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    from ferrox.loader.gguf_file import open_gguf

    for name, array in open_gguf(path).iter_hf_tensors(n_heads, n_kv_heads, keep_quantized=keep_quantized):
        yield name, torch.from_numpy(array) if isinstance(array, np.ndarray) else array
