"""Prompts given as input embeddings (vLLM's `prompt_embeds`, `--enable-prompt-embeds`).

A prompt of embeddings is one MultiModalItem of modality "embeds" covering the whole prompt (offset 0,
length L). The core sees L placeholder token ids (for lengths and block tables); the model's forward
starts from the item's rows instead of the placeholders' token embeddings, as it does for an image
(worker/multimodal.py). The embeddings' sha256 is the item's identifier, which the prefix hashes of
every block depend on (inputs.py), so the same embeddings reuse their cached prefix blocks and
different ones of the same length never share a block.

Where each step happens:
- the API server (no torch): `decode_base64` takes the request's string to torch.save bytes, and
  `item_from_saved` reads only the tensor's shape and storage class from the archive's pickle (a restricted
  unpickler that knows torch.save's few globals) to size the placeholder prompt and refuse what cannot be
  one (not a tensor, not 2-D, empty, not floating);
- the offline LLM: `item_from_tensor` saves the caller's tensor into the same bytes;
- the engine core: `load_item` runs torch.load(weights_only=True) on the bytes, checks the tensor against
  the model (rank, hidden size, a floating dtype, finite values, the declared length) and returns the
  item holding the float32 rows and their hash. Every refusal is an InvalidArgumentError naming
  prompt_embeds (a 400 on the server), raised before the scheduler takes the request.
"""

from __future__ import annotations

import binascii
import hashlib
import io
import pickle
import zipfile
from collections import OrderedDict
from typing import Any

import numpy as np

from ferrox._core import InvalidArgumentError
from ferrox.multimodal.inputs import MultiModalItem

EMBEDS_MODALITY = "embeds"
PARAM = "prompt_embeds"
# The placeholder token id of an embeddings prompt's positions (vLLM's 0). The runner gets no prompt ids
# for such a request, so penalties count generated tokens only, as transformers does with inputs_embeds.
PLACEHOLDER_TOKEN_ID = 0


def _refuse(what: str, problem: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{what}: {problem}", param=PARAM)


def decode_base64(value: Any, what: str = PARAM) -> bytes:
    """A request's prompt_embeds string: base64 of torch.save bytes (strict: other characters are refused)."""
    if not isinstance(value, str) or not value:
        raise _refuse(what, "must be a non-empty base64 string of a tensor saved with torch.save")
    try:
        return binascii.a2b_base64(value.encode("ascii"), strict_mode=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise _refuse(what, "is not valid base64") from None


_MAX_PICKLE_BYTES = 1 << 16
# torch.save's storage classes of the floating dtypes vLLM casts to the model's (others are refused).
FLOAT_STORAGES = ("FloatStorage", "DoubleStorage", "HalfStorage", "BFloat16Storage")


class _StorageType:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class _Header:
    """What a torch.save archive's pickle says about its tensor: the shape and the storage class."""

    __slots__ = ("shape", "storage")

    def __init__(self, shape: list[int], storage: str) -> None:
        self.shape = shape
        self.storage = storage


def _rebuild_tensor(storage: Any, offset: Any, size: Any, *rest: Any) -> _Header:
    if not isinstance(size, tuple) or not all(isinstance(d, int) and d >= 0 for d in size):
        raise pickle.UnpicklingError("a tensor's size must be a tuple of non-negative integers")
    if not isinstance(storage, _StorageType):
        raise pickle.UnpicklingError("a tensor's storage must be a saved storage")
    return _Header(list(size), storage.name)


class _ShapeReader(pickle.Unpickler):
    """An unpickler that builds nothing: torch.save's globals map to stubs, anything else is refused (the
    core's torch.load(weights_only=True) is the authority on the data; this only sizes the prompt)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":  # a saved nn.Parameter: its data
            return lambda data, *rest: data
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return _StorageType(name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a dense tensor's part")

    def persistent_load(self, pid: Any) -> Any:
        # ("storage", storage class, key, location, numel)
        if not isinstance(pid, tuple) or len(pid) < 2 or not isinstance(pid[1], _StorageType):
            raise pickle.UnpicklingError("not a tensor storage")
        return pid[1]


def saved_header(data: bytes, what: str = PARAM) -> _Header:
    """The shape and storage class of the one dense tensor a torch.save archive holds, read without torch."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pickles) != 1:
                raise ValueError("not one tensor archive")
            if archive.getinfo(pickles[0]).file_size > _MAX_PICKLE_BYTES:  # (a tensor's is ~200 bytes)
                raise ValueError("its pickle is too large for one tensor")
            header = _ShapeReader(io.BytesIO(archive.read(pickles[0]))).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, ValueError, EOFError, KeyError, TypeError,
            AttributeError, IndexError) as exc:
        raise _refuse(what, f"could not be read as one dense tensor saved with torch.save ({exc})") from None
    if not isinstance(header, _Header):
        raise _refuse(what, "the saved object is not a tensor")
    return header


def prompt_shape(shape: list[int], what: str = PARAM) -> list[int]:
    """[L, hidden] of a [L, hidden] or [1, L, hidden] tensor (vLLM squeezes a leading batch of one)."""
    if len(shape) == 3 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 2:
        raise _refuse(what, f"must be a 2-D tensor [sequence_length, hidden_size] (or [1, sequence_length, "
                            f"hidden_size]), got shape {shape}")
    if shape[0] < 1:
        raise _refuse(what, "is empty (0 embedding rows)")
    return shape


def item_from_saved(data: bytes, what: str = PARAM) -> tuple[list[int], MultiModalItem]:
    """(placeholder prompt ids, the item) for torch.save bytes, refused here (no torch) when the header already
    says the tensor cannot be a prompt; the core decodes them and checks the rest (load_item)."""
    header = saved_header(data, what)
    shape = prompt_shape(header.shape, what)
    if header.storage not in FLOAT_STORAGES:
        raise _refuse(what, f"a tensor of {header.storage.removesuffix('Storage')} values: the dtype must be "
                            "float32, float64, float16 or bfloat16")
    return [PLACEHOLDER_TOKEN_ID] * shape[0], MultiModalItem(0, shape[0], data, shape, "", modality=EMBEDS_MODALITY)


def item_from_tensor(tensor: Any, what: str = PARAM) -> tuple[list[int], MultiModalItem]:
    """The offline path: a caller's tensor, saved into the bytes the server's requests carry."""
    import torch  # (an offline caller passed a tensor: torch is loaded)

    if not isinstance(tensor, torch.Tensor):
        raise _refuse(what, f"must be a torch.Tensor, got {type(tensor).__name__}")
    buffer = io.BytesIO()
    torch.save(tensor.detach().to("cpu").contiguous(), buffer)
    return item_from_saved(buffer.getvalue(), what)


def is_embeds(items: list[MultiModalItem] | None) -> bool:
    return bool(items) and items[0].modality == EMBEDS_MODALITY  # type: ignore[index]


def load_item(item: MultiModalItem, prompt_len: int, hidden_size: int, what: str) -> MultiModalItem:
    """The engine core's side: torch.load the item's bytes (weights_only), check the tensor against the
    prompt and the model, and return the item holding its rows as float32 (the model casts them to its
    dtype) with the sha256 that salts the request's prefix-cache blocks."""
    import torch

    if item.offset != 0 or item.length != prompt_len:
        raise _refuse(what, "an embeddings prompt is one item covering the whole prompt")
    try:
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(item.pixels), weights_only=True, map_location="cpu")
            if isinstance(tensor, torch.Tensor):
                tensor = tensor.to_dense()
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for bytes that are not a tensor
        raise _refuse(what, f"could not be loaded with torch.load(weights_only=True): {str(exc)[:200]}") from None
    if not isinstance(tensor, torch.Tensor):
        raise _refuse(what, f"the saved object is a {type(tensor).__name__}, not a tensor")
    if tensor.dim() == 3:
        tensor = tensor.squeeze(0)
    shape = prompt_shape(list(tensor.shape), what)
    if shape[1] != hidden_size:
        raise _refuse(what, f"hidden size {shape[1]} does not match the model's hidden_size {hidden_size}")
    if shape[0] != item.length:
        raise _refuse(what, f"{shape[0]} embedding rows, the request declared {item.length}")
    if not tensor.is_floating_point():
        raise _refuse(what, f"dtype {tensor.dtype} is not a floating-point type")
    rows = tensor.detach().to(torch.float32)  # (saved from an embedding layer's output, it may require grad)
    if not bool(torch.isfinite(rows).all()):
        raise _refuse(what, "holds NaN or infinite values")
    array = np.ascontiguousarray(rows.numpy())
    digest = hashlib.sha256(f"embeds\x00{list(array.shape)}\x00".encode())
    digest.update(array.data)
    return MultiModalItem(0, item.length, array.tobytes(), list(array.shape), digest.hexdigest(),
                          modality=EMBEDS_MODALITY)


def startup_problem(model: Any, *, tensor_parallel_size: int, speculative: bool, pooling: bool) -> str | None:
    """Why this engine cannot take prompts of embeddings (start-up refuses enable_prompt_embeds), or None."""
    import inspect

    name = type(model).__name__
    if pooling:
        return "not supported with runner 'pooling' (prompts of embeddings generate text)"
    if getattr(type(model), "takes_images", False):  # (served text only or not: --language-model-only)
        return f"not supported for {name} (a vision model) in this version: text models only"
    if tensor_parallel_size > 1:
        return "not supported with tensor_parallel_size > 1 in this version"
    if speculative:
        # A draft model or the n-gram proposer would propose from the placeholder ids, not the prompt.
        return "not supported with speculative_config (drafts are proposed from prompt token ids)"
    if problem := getattr(model, "prompt_embeds_problem", None):  # (a family's own reason: Gemma 4's E2B/E4B)
        return f"not supported for {name}: {problem}"
    inner = getattr(model, "model", None)
    for fn in (model.forward, getattr(inner, "forward", None)):
        if fn is not None and "inputs_embeds" not in inspect.signature(fn).parameters:
            return f"not supported for {name}: its forward takes no input embeddings"
    if not hasattr(model, "embed_input_ids"):
        return f"not supported for {name}: it has no token embedding lookup to mix the embeddings with"
    return None
