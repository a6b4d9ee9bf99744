"""A reference int4 quantizer for tests: turns a tiny HF folder (tiny_models.make_tiny_llama) into an
AWQ- or GPTQ-layout checkpoint as AutoAWQ / AutoGPTQ write them, plus the same model with the
dequantized weights as a plain float checkpoint (the reference the quantized model must match).

Written from the formats' descriptions, independently of ferrox's unpacking code:

- round-to-nearest per group of input columns; asymmetric (scale = (max - min) / 15 over a range that
  includes 0, integer zero point) or GPTQ-symmetric (scale = 2 max|w| / 15, zero 8);
- AWQ "gemm": qweight [K, N/8] and qzeros [G, N/8] pack 8 output columns per int32 in the order
  0, 2, 4, 6, 1, 3, 5, 7 (column 2i in nibble i, column 2i + 1 in nibble i + 4); scales [G, N] fp16;
- GPTQ: qweight [K/8, N] packs 8 consecutive input rows per int32 (row 8w + i in nibble i); qzeros
  [G, N/8] packs 8 consecutive columns; the "gptq" (v1) format stores zero - 1 masked to 4 bits, so a
  reader sees ((z - 1) & 15) + 1 (16 for a zero of 0), "gptq_v2" stores z; g_idx [K] int32;
- compressed-tensors "pack-quantized" (llm-compressor's W4A16): weight_packed [N, K/8] packs 8
  consecutive input columns per int32 (column 8w + i in nibble i), each the signed code (q - 8) plus
  8; weight_scale [N, G]; asymmetric: weight_zero_point [N/8, G], the signed zero point plus 8, packed
  8 consecutive output rows per int32; weight_g_idx [K] with actorder "group"; weight_shape [N, K];
- act-order (desc_act): columns are quantized in a random order perm, the i-th column in that order
  joining group i // group_size, so g_idx[perm[i]] = i // group_size.

The float reference is what a reader of the checkpoint computes: (q - z_read) * scale_fp16.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from tests.helpers.gptq import gptq_quantize

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of a word's 8 held in nibble 0, 1, ..., 7


def quantize_groups(w: torch.Tensor, group: int, *, sym: bool, g_idx: torch.Tensor | None = None):
    """w [N, K] float -> codes uint8 [N, K], scales fp16 [G, N], zeros int64 [G, N]; column k is in
    group g_idx[k] (default k // group)."""
    n, k = w.shape
    group = k if group == -1 else group
    g_idx = torch.arange(k) // group if g_idx is None else g_idx.to(torch.int64)
    num_groups = int(g_idx.max()) + 1
    if k % num_groups or not torch.equal(torch.bincount(g_idx), torch.full((num_groups,), k // num_groups)):
        # Groups of unequal size (K not a multiple of group_size: the last one is short): one at a time.
        parts = [quantize_groups(w[:, g_idx == g], -1, sym=sym) for g in range(num_groups)]
        codes = torch.empty(n, k, dtype=torch.uint8)
        for g, (c, _, _) in enumerate(parts):
            codes[:, g_idx == g] = c
        return codes, torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
    order = torch.sort(g_idx, stable=True).indices  # the columns of group 0, then group 1, ...
    part = w[:, order].double().reshape(n, num_groups, k // num_groups)
    if sym:
        scale = (2 * part.abs().amax(dim=2) / 15).clamp(min=1e-8)
        zero = torch.full((n, num_groups), 8, dtype=torch.int64)
    else:
        lo, hi = part.amin(dim=2).clamp(max=0), part.amax(dim=2).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, 15).to(torch.int64)
    scale16 = scale.to(torch.float16)
    q = (torch.round(part / scale16.double()[..., None]) + zero[..., None]).clamp(0, 15).reshape(n, k)
    codes = torch.empty(n, k, dtype=torch.uint8)
    codes[:, order] = q.to(torch.uint8)
    return codes, scale16.t().contiguous(), zero.t().contiguous()


def _pack(values: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Integers 0..15 along `dim` -> int32 words of 8; order[i] is the index (within each 8) held in nibble i."""
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for nibble, index in enumerate(order):
        word |= (v[..., index] & 0xF) << (4 * nibble)
    word = torch.where(word >= 2**31, word - 2**32, word)  # the int32 two's-complement value
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def _awq_tensors(w: torch.Tensor, group: int, hessian: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    if hessian is None:
        codes, scales, zeros = quantize_groups(w, group, sym=False)
    else:  # AWQ's layout has no g_idx: GPTQ in the natural column order
        codes, scales, zeros, _ = gptq_quantize(w, hessian, group, sym=False, act_order=False)
    deq = _dequantize(codes, scales, zeros, torch.arange(w.shape[1]) // (w.shape[1] if group == -1 else group))
    tensors = {"qweight": _pack(codes.t(), 1, AWQ_PACK_ORDER), "qzeros": _pack(zeros, 1, AWQ_PACK_ORDER),
               "scales": scales}
    return tensors, deq


def _group_index(k: int, size: int, act_order: bool, gen: torch.Generator) -> torch.Tensor:
    """The group of each input column: k // size, or with act-order the i-th column of a random
    order joining group i // size."""
    if not act_order:
        return torch.arange(k) // size
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // size
    return g_idx


def _gptq_tensors(w: torch.Tensor, group: int, *, sym: bool, act_order: bool, fmt: str,
                  gen: torch.Generator, hessian: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    k = w.shape[1]
    size = k if group == -1 else group
    if hessian is not None:  # calibrated: act-order from the Hessian's diagonal, as GPTQ sorts
        codes, scales, zeros, g_idx = gptq_quantize(w, hessian, group, sym=sym, act_order=act_order)
    else:
        g_idx = _group_index(k, size, act_order, gen)
        codes, scales, zeros = quantize_groups(w, group, sym=sym, g_idx=g_idx)
    stored = (zeros - 1) & 0xF if fmt == "gptq" else zeros
    read = stored + 1 if fmt == "gptq" else stored  # what a reader computes from the stored nibble
    tensors = {"qweight": _pack(codes.t(), 0), "qzeros": _pack(stored, 1), "scales": scales,
               "g_idx": g_idx.to(torch.int32)}
    return tensors, _dequantize(codes, scales, read, g_idx)


def _compressed_tensors_tensors(w: torch.Tensor, group: int, *, sym: bool, act_order: bool,
                                gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    n, k = w.shape
    g_idx = _group_index(k, k if group == -1 else group, act_order, gen)
    codes, scales, zeros = quantize_groups(w, group, sym=sym, g_idx=g_idx)
    # The format stores signed values (code - 8, zero - 8) plus 8: the unsigned codes themselves.
    signed_codes, signed_zeros = codes.to(torch.int64) - 8, zeros - 8
    tensors = {"weight_packed": _pack(signed_codes + 8, 1), "weight_scale": scales.t().contiguous(),
               "weight_shape": torch.tensor([n, k])}
    if not sym:
        tensors["weight_zero_point"] = _pack(signed_zeros.t() + 8, 0)
    if act_order:
        tensors["weight_g_idx"] = g_idx.to(torch.int32)
    return tensors, _dequantize(codes, scales, zeros, g_idx)


def _hessian_of(hessians: dict[str, torch.Tensor] | None, prefix: str) -> torch.Tensor | None:
    if hessians is None:
        return None
    if prefix not in hessians:
        raise KeyError(f"no calibration Hessian for {prefix!r}")
    return hessians[prefix]


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    return ((codes.double() - zeros.double()[g_idx].t()) * scales.double()[g_idx].t()).float()


def _copy_folder(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and not name.endswith(".safetensors.index.json"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def _read_weights(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def quantization_config(fmt: str, group: int, *, sym: bool = False, act_order: bool = False,
                        checkpoint_format: str = "gptq") -> dict[str, Any]:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if fmt == "ct":
        weights = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "channel" if group == -1 else "group",
                   "group_size": None if group == -1 else group, "dynamic": False,
                   "actorder": "group" if act_order else None, "block_structure": None, "observer": "minmax",
                   "observer_kwargs": {}}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "version": "0.10.2", "global_compression_ratio": None, "kv_cache_scheme": None,
                "sparsity_config": {}, "transform_config": {}, "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "output_activations": None, "format": "pack-quantized"}}}
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": sym,
            "checkpoint_format": checkpoint_format, "damp_percent": 0.01, "true_sequential": True}


def make_int4_checkpoint(src: str, dst: str, fmt: str, *, group: int = 32, sym: bool = False,
                         act_order: bool = False, checkpoint_format: str = "gptq", zero_bias: bool = False,
                         seed: int = 0, hessians: dict[str, torch.Tensor] | None = None) -> tuple[str, str]:
    """(quantized folder, float reference folder) from the HF folder `src`, written under `dst`.

    Projections that read the same input (q/k/v, gate/up) share their act-order permutation, as
    GPTQ's does (it sorts columns by the input's Hessian, the same for all of them).
    zero_bias: GPTQ only; write an all-zero `bias` for every projection (some exports do).
    hessians: module name (e.g. "model.layers.0.self_attn.q_proj") -> its input Hessian sum(x x^T):
    quantize with GPTQ (tests/helpers/gptq.py) instead of round-to-nearest; act-order then follows
    the Hessian, not a random permutation."""
    from safetensors.torch import save_file

    if fmt not in ("awq", "gptq", "ct"):
        raise ValueError(f"fmt must be 'awq', 'gptq' or 'ct' (compressed-tensors), got {fmt!r}")
    weights = _read_weights(src)
    quant, ref = {}, {}
    perms: dict[str, torch.Generator] = {}
    for name, tensor in weights.items():
        prefix, _, leaf = name.rpartition(".")
        proj = prefix.rpartition(".")[2]
        if leaf != "weight" or proj not in LINEAR_SUFFIXES:
            quant[name] = ref[name] = tensor
            continue
        # One generator state per shared input: q/k/v and gate/up draw the same act-order permutation.
        shared = prefix.rpartition(".")[0] + ("/attn" if proj in ("q_proj", "k_proj", "v_proj") else
                                              "/mlp" if proj in ("gate_proj", "up_proj") else "/" + proj)
        gen = perms.setdefault(shared, torch.Generator().manual_seed(seed + len(perms)))
        gen_state = gen.get_state()
        if fmt == "awq":
            tensors, deq = _awq_tensors(tensor.float(), group, _hessian_of(hessians, prefix))
        elif fmt == "ct":
            tensors, deq = _compressed_tensors_tensors(tensor.float(), group, sym=sym, act_order=act_order, gen=gen)
        else:
            tensors, deq = _gptq_tensors(tensor.float(), group, sym=sym, act_order=act_order,
                                         fmt=checkpoint_format, gen=gen, hessian=_hessian_of(hessians, prefix))
            if zero_bias and f"{prefix}.bias" not in weights:
                tensors["bias"] = torch.zeros(tensor.shape[0], dtype=torch.float16)
        gen.set_state(gen_state)
        for leaf_name, value in tensors.items():
            quant[f"{prefix}.{leaf_name}"] = value
        ref[name] = deq.to(tensor.dtype)
    qdir, rdir = os.path.join(dst, f"{fmt}-quantized"), os.path.join(dst, f"{fmt}-reference")
    for folder, tensors in ((qdir, quant), (rdir, ref)):
        _copy_folder(src, folder)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(qdir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(fmt, group, sym=sym, act_order=act_order,
                                                        checkpoint_format=checkpoint_format)
    with open(os.path.join(qdir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return qdir, rdir
