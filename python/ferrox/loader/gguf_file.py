"""Reading a GGUF file (llama.cpp's format): metadata, config and dequantized tensors.

The `gguf` package does the byte-level work (memory-mapped GGUFReader, numpy dequantization).
This module adds what ferrox needs on top: errors that name the file, llama.cpp -> Hugging Face
tensor names, and undoing the converter's Q/K row permutation for llama-family models. With
`keep_quantized`, 2-D block-quantized tensors stay in their blocks (layers/quant QuantizedTensor).
The families read back as their own Hugging Face checkpoints (OLMo 2, Cohere, GPT-2, ...) have their
names, layouts and config in gguf_families.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import numpy as np

from ferrox.loader.errors import ModelLoadError, UnsupportedModelError
from ferrox.loader.gguf_families import CONFIG_TENSOR, GGUF_FAMILIES, hf_tensors

# general.architecture -> the Hugging Face `architectures` entry ferrox runs it as.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # MixtralForCausalLM when the file has experts (llama.expert_count)
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    **{arch: family.architecture for arch, family in GGUF_FAMILIES.items()},
}

# llama.cpp's converter permutes the rows of attn_q / attn_k for these architectures so that its
# rotary kernel can use the interleaved (GPT-J) pair layout; HF models use rotate_half (NeoX) pairs.
# (llama.cpp's Granite and Arcee converters are its Llama one)
_PERMUTED_QK_ARCHS = {"llama", "mistral", "granite", "arcee"}

# Per-layer tensor names: llama.cpp suffix -> Hugging Face suffix under model.layers.N.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Mixture of experts: the router, and Qwen2-MoE's shared expert and its gate (one row).
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# llama.cpp stacks a layer's routed experts in one 3-D tensor [experts, rows, cols]; ferrox's MoE
# loader takes them one expert at a time, by their Hugging Face names ({e}: the expert).
_EXPERT_STACKS = {
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}
# Architectures whose files keep Hugging Face's fused projections: Phi-3's [q; k; v] and [gate; up]
# rows, which models/phi3.py cuts as it does a safetensors checkpoint's.
# Gemma's four norms a layer: llama.cpp's ffn_norm is the pre-feedforward one there (Llama's is the
# post-attention one).
_GEMMA_NORMS = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_ARCH_LAYER_NAMES = {
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gemma2": _GEMMA_NORMS,
    "gemma3": _GEMMA_NORMS,
}
# llama.cpp's Gemma converters store every norm weight as 1 + w (its RMSNorm multiplies by the weight);
# transformers' Gemma, which ferrox's Gemma models follow (they fold the 1 in at load), stores w.
_NORMS_PLUS_ONE_ARCHS = {"gemma2", "gemma3"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_tensor_name(gguf_name: str, arch: str = "") -> str | None:
    """The Hugging Face name of a llama.cpp tensor of an `arch` file, None for tensors HF models do not
    have (e.g. rope_factors_*, which the config's rope scaling takes instead)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _ARCH_LAYER_NAMES.get(arch, {}):
        return f"model.layers.{m.group(1)}.{_ARCH_LAYER_NAMES[arch][m.group(2)]}"
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    if m and m.group(2) in _EXPERT_STACKS:
        return f"model.layers.{m.group(1)}.{_EXPERT_STACKS[m.group(2)]}"  # a template: one name per expert
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of attn_q / attn_k (rows = n_heads * head_dim).

    The converter reorders each head's rows from [first half | second half] (rotate_half pairs)
    to interleaved pairs (x0, x_half, x1, x_half+1, ...); we put them back.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """One opened GGUF file. Opening parses the header and metadata; tensors are read lazily."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.reader = _plain_array_reader()(path, "r")
        except Exception as e:  # the gguf package raises ValueError/struct.error/IndexError/OSError alike
            raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e} (truncated or corrupt?)") from e

    # ---- metadata ---------------------------------------------------------------------------
    @cached_property
    def metadata(self) -> dict[str, Any]:
        """All scalar/string metadata plus short arrays; the big tokenizer arrays are read on demand."""
        out: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                       "tokenizer.ggml.scores"):
                continue
            try:
                out[key] = field.contents()
            except Exception as e:
                raise ModelLoadError(f"cannot read metadata {key!r} of GGUF file {self.path}: {e}") from e
        return out

    def array(self, key: str) -> list | None:
        field = self.reader.fields.get(key)
        if field is None:
            return None
        try:
            return field.contents()
        except Exception as e:
            raise ModelLoadError(f"cannot read metadata {key!r} of GGUF file {self.path}: {e}") from e

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"GGUF file {self.path} has no general.architecture")
        return arch

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    # ---- tensors ----------------------------------------------------------------------------
    @cached_property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]

    def float_tensor(self, name: str) -> np.ndarray:
        """One tensor dequantized to float32 (small ones: rope_freqs)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        for t in self.reader.tensors:
            if t.name == name:
                return np.asarray(dequantize(t.data, GGMLQuantizationType(t.tensor_type)), dtype=np.float32).reshape(-1)
        raise KeyError(name)

    def check_quant_types(self) -> None:
        """Fail before loading anything if a tensor uses a type the gguf package cannot dequantize."""
        from gguf import GGMLQuantizationType

        supported = supported_quant_types()
        for t in self.reader.tensors:
            qtype = GGMLQuantizationType(t.tensor_type)
            if qtype not in supported:
                raise UnsupportedModelError(
                    f"GGUF file {self.path}: tensor {t.name!r} uses quantization type {qtype.name}, which ferrox "
                    f"cannot dequantize (supported: {', '.join(sorted(q.name for q in supported))})"
                )

    def iter_hf_tensors(self, n_heads: int, n_kv_heads: int, *,
                        keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
        """(HF name, float32 array) for every tensor HF models have, Q/K rows un-permuted.
        keep_quantized: 2-D block-quantized tensors come as QuantizedTensor (raw blocks) instead (not for
        the gguf_families.py families, whose models take float weights only: the loader never asks)."""
        self.check_quant_types()
        permuted = self.architecture in _PERMUTED_QK_ARCHS
        if self.architecture in GGUF_FAMILIES:
            yield from self._family_tensors(n_heads, n_kv_heads, permuted)
            return
        for t in self.reader.tensors:
            name = hf_tensor_name(t.name, self.architecture)
            if name is None:
                continue
            if keep_quantized and is_block_quantized(t):
                yield name, self._quantized(t, n_heads, n_kv_heads, permuted)
                continue
            arr = self._floats(t)
            if permuted:
                arr = self._unpermute(t.name, arr, n_heads, n_kv_heads)
            if "{e}" in name:  # a stack of experts
                if arr.ndim != 3:
                    raise ModelLoadError(f"GGUF file {self.path}: tensor {t.name!r} has shape {arr.shape}, "
                                         "expected [experts, rows, cols]")
                for expert in range(arr.shape[0]):
                    yield name.format(e=expert), arr[expert]
                continue
            if name.endswith("shared_expert_gate.weight") and arr.ndim == 1:
                arr = arr[None, :]  # llama.cpp keeps the shared expert's gate as a vector
            if self.architecture in _NORMS_PLUS_ONE_ARCHS and name.endswith("norm.weight"):
                arr = arr - np.float32(1.0)
            yield name, arr

    def _family_tensors(self, n_heads: int, n_kv_heads: int, permuted: bool) -> Iterator[tuple[str, np.ndarray]]:
        """A gguf_families.py file's tensors as its Hugging Face checkpoint's, dequantized."""
        family = GGUF_FAMILIES[self.architecture]
        for t in self.reader.tensors:
            name = family.hf_name(t.name)
            if name is None:
                raise UnsupportedModelError(f"GGUF file {self.path}: tensor {t.name!r} is not supported for "
                                            f"{self.architecture} files")
            if name == CONFIG_TENSOR:
                continue
            arr = self._floats(t)
            if permuted:
                arr = self._unpermute(t.name, arr, n_heads, n_kv_heads)
            yield from hf_tensors(family, name, arr, n_heads, n_kv_heads, f"GGUF file {self.path}")

    def _floats(self, t: Any) -> np.ndarray:
        """Tensor `t` dequantized: float32, row-major [rows, cols] (or its 1-D / 3-D shape), writeable."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        try:
            arr = dequantize(t.data, GGMLQuantizationType(t.tensor_type))
        except Exception as e:
            raise ModelLoadError(
                f"cannot read tensor {t.name!r} of GGUF file {self.path}: {type(e).__name__}: {e}"
            ) from e
        # GGML lists dims fastest-first; the numpy array is already row-major [rows, cols].
        expected = tuple(int(d) for d in reversed(t.shape.tolist()))
        if tuple(arr.shape) != expected:
            arr = arr.reshape(expected)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not arr.flags.writeable:  # F32/F16 tensors can be views of the read-only memory map
            arr = arr.copy()
        return arr

    def _unpermute(self, name: str, w: np.ndarray, n_heads: int, n_kv_heads: int) -> np.ndarray:
        """unpermute_qk for attn_q / attn_k (other tensors pass through), once the head count is
        known to split the rows into whole heads of two rotary halves: a corrupt head count
        would otherwise fail in a reshape that names neither the file nor the metadata."""
        if name.endswith("attn_q.weight"):
            n, key = n_heads, "attention.head_count"
        elif name.endswith("attn_k.weight"):
            n, key = n_kv_heads, "attention.head_count_kv"
        else:
            return w
        if n <= 0 or w.shape[0] % (2 * n):
            raise ModelLoadError(f"GGUF file {self.path}: tensor {name!r} has {w.shape[0]} rows, which "
                                 f"metadata {self.architecture}.{key} = {n} does not split into heads")
        return unpermute_qk(w, n)

    def _quantized(self, t: Any, n_heads: int, n_kv_heads: int, permuted: bool) -> Any:
        from gguf import GGMLQuantizationType

        from ferrox.layers.quant import QuantizedTensor

        rows, cols = (int(d) for d in reversed(t.shape.tolist()))
        raw = np.asarray(t.data).reshape(rows, -1)  # a view of the memory map: blocks run along rows
        # Row permutations move whole rows of blocks, as they move rows of floats.
        if permuted:
            raw = self._unpermute(t.name, raw, n_heads, n_kv_heads)
        return QuantizedTensor(GGMLQuantizationType(t.tensor_type).name, np.ascontiguousarray(raw), (rows, cols))


def _plain_array_reader() -> type:
    """gguf's GGUFReader over a plain ndarray view of its memory map instead of the np.memmap itself.

    The reader slices its map once per metadata item (a 49k-token vocabulary and its merges are
    ~250k slices), and every slice of an np.memmap runs memmap's Python-level __getitem__ and
    __array_finalize__: with numpy 2.x that made opening the embedded model's GGUF ~5 s of CPU, in
    every process that loads it (each engine and server start). A plain view of the same mapping
    reads the same bytes, without copying them, in ~1.5 s."""
    global _READER
    if _READER is None:
        from gguf import GGUFReader

        class PlainArrayReader(GGUFReader):
            @property  # type: ignore[override]
            def data(self) -> np.ndarray:
                return self._plain_data

            @data.setter
            def data(self, value: np.ndarray) -> None:
                self._plain_data = value.view(np.ndarray)  # keeps the map alive through .base

        _READER = PlainArrayReader
    return _READER


_READER: type | None = None


def is_block_quantized(t: Any) -> bool:
    """A 2-D tensor in a block-quantized type (Q4_1, Q6_K, ...; not F32/F16/BF16)."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    return len(t.shape) == 2 and GGML_QUANT_SIZES[GGMLQuantizationType(t.tensor_type)][0] > 1


def supported_quant_types() -> frozenset:
    """Quantization types gguf.quants can turn into floats (probed once: the set grows by version)."""
    global _SUPPORTED
    if _SUPPORTED is None:
        from gguf import GGMLQuantizationType
        from gguf.constants import GGML_QUANT_SIZES
        from gguf.quants import dequantize

        ok = set()
        for q in GGMLQuantizationType:
            block, type_size = GGML_QUANT_SIZES[q]
            try:
                dequantize(np.zeros((1, type_size), dtype=np.uint8) if block > 1 else np.zeros((1, 1)), q)
            except NotImplementedError:
                continue
            except Exception:
                pass  # shape quirks of the probe; the type itself is implemented
            ok.add(q)
        _SUPPORTED = frozenset(ok)
    return _SUPPORTED


_SUPPORTED: frozenset | None = None


def open_gguf(path: str) -> GGUFFile:
    """Open (or reuse) a GGUF file: spec, tokenizer and weights all read the same header, and
    parsing it costs ~1.5 s for a 49k-token vocabulary. Keyed by size and mtime, so a replaced
    file is read again."""
    import os

    try:
        st = os.stat(path)
    except FileNotFoundError:
        from ferrox.loader.errors import ModelNotFoundError

        raise ModelNotFoundError(f"GGUF file {path} does not exist") from None
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    cached = _OPEN.get(key)
    if cached is None:
        cached = GGUFFile(path)
        if len(_OPEN) >= 4:
            _OPEN.pop(next(iter(_OPEN)))
        _OPEN[key] = cached
    return cached


_OPEN: dict[tuple, GGUFFile] = {}
