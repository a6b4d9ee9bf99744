"""A tiny Hugging Face folder written as llama.cpp's converter (convert_hf_to_gguf.py) writes that family's GGUF file:
OLMo 2, Command R, Command R7B, StarCoder2, Phi-2, GPT-2, GPT-NeoX, GLM-4-0414, EXAONE 4, Arcee, ERNIE 4.5.

Independent of ferrox's reader (loader/gguf_families.py): tensor names come from the gguf package's own
TensorNameMap (the converter's table), metadata keys from its GGUFWriter; what the converter does to a family's
tensors and keys is repeated here from its source (facts only), so a wrong mapping in ferrox shows as a mismatch
against transformers on the original folder. quantize_q8 gives the weights a Q8_0 file round-trips to, in the
folder's own layout, for a transformers reference of a quantized file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from tests.helpers.tiny_models import write_gguf_vocab

# transformers architecture -> gguf MODEL_ARCH name (gguf.MODEL_ARCH[...]).
ARCHS = {"Olmo2ForCausalLM": "OLMO2", "CohereForCausalLM": "COMMAND_R", "Cohere2ForCausalLM": "COHERE2",
         "Starcoder2ForCausalLM": "STARCODER2", "PhiForCausalLM": "PHI2", "GPT2LMHeadModel": "GPT2",
         "GPTNeoXForCausalLM": "GPTNEOX", "Glm4ForCausalLM": "GLM4", "Exaone4ForCausalLM": "EXAONE4",
         "ArceeForCausalLM": "ARCEE", "Ernie4_5ForCausalLM": "ERNIE4_5"}
# GPT-2's Conv1D weights ([in, out]): the converter transposes them.
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# Buffers some checkpoints carry that the converter drops.
_SKIPPED = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")


def _config(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def quantized(name: str, arr: Any, tensor_type: str) -> bool:
    """Whether llama.cpp's quantizer gives GGUF tensor `name` (array in the file's layout) tensor_type: 2-D weights
    other than norms, in whole blocks."""
    import gguf

    block = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[tensor_type]][0]
    return (tensor_type != "F32" and arr.ndim == 2 and name.endswith(".weight") and "_norm" not in name
            and arr.shape[1] % block == 0)


def _metadata(w, cfg: dict[str, Any], arch: str) -> None:
    """The converter's set_gguf_parameters: its generic keys (TextModel), then the family's own."""
    import gguf

    layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    hidden = cfg.get("hidden_size", cfg.get("n_embd"))
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = _rope(cfg)
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    w.add_block_count(layers)
    if arch == "GPT2":  # GPT2Model's own keys
        w.add_context_length(cfg.get("n_ctx", cfg["n_positions"]))
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(4 * hidden)
        w.add_head_count(heads)
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
        return
    if arch == "PHI2":  # Phi2Model's own keys (no rope base: Phi-2's is llama.cpp's default 10,000)
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(4 * hidden)
        w.add_head_count(heads)
        w.add_head_count_kv(heads)
        w.add_layer_norm_eps(cfg["layer_norm_eps"])
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * hidden) // heads)
        return
    if arch == "GPTNEOX":  # GPTNeoXModel's own keys (no rope base either)
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(cfg["intermediate_size"])
        pct = cfg.get("rotary_pct", rope.get("partial_rotary_factor"))
        w.add_rope_dimension_count(int(pct * head_dim))
        w.add_head_count(heads)
        w.add_parallel_residual(cfg.get("use_parallel_residual", True))
        w.add_layer_norm_eps(cfg["layer_norm_eps"])
        return
    # TextModel.set_gguf_parameters
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    if "num_key_value_heads" in cfg:
        w.add_head_count_kv(cfg["num_key_value_heads"])
    if theta is not None:
        w.add_rope_freq_base(theta)
    if "rms_norm_eps" in cfg:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    eps = next((cfg[k] for k in ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon") if k in cfg), None)
    if eps is not None:
        w.add_layer_norm_eps(eps)
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch in ("COMMAND_R", "COHERE2"):
        w.add_logit_scale(cfg["logit_scale"])
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    if arch == "COHERE2":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(int(cfg.get("rotary_pct", 1.0) * (hidden // heads)))
    if arch == "GLM4":
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
    if arch == "EXAONE4":
        w.add_vocab_size(cfg["vocab_size"])
        if cfg.get("sliding_window") is not None:
            w.add_sliding_window(cfg["sliding_window"])
            if "layer_types" in cfg:
                w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if arch == "ARCEE":  # LlamaModel's: the vocabulary size and the rotary dims
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)


def export_llama_cpp(folder, path, *, tensor_type: str = "F32", fuse_qkv: bool = False,
                     metadata: Callable[[Any], None] | None = None, extra_tensors: dict[str, Any] | None = None) -> str:
    """Write folder's model as llama.cpp's converter would (tensor_type "F32", or "Q8_0" for the 2-D weights
    llama.cpp's quantizer would quantize: quantized() above), with the folder's tokenizer and chat template.
    fuse_qkv: q, k and v as one attn_qkv tensor, as conversions of older layouts hold them (Phi-2's Wqkv);
    metadata(writer) adds keys; extra_tensors: more GGUF tensors by name (files from other converters)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    folder = str(folder)
    cfg = _config(folder)
    arch = ARCHS[cfg["architectures"][0]]
    model_arch = gguf.MODEL_ARCH[arch]
    layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    hidden = cfg.get("hidden_size", cfg.get("n_embd"))
    names = gguf.get_tensor_name_map(model_arch, layers)
    tensors: dict[str, Any] = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(folder, file)))
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        tok_json = json.load(f)

    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[model_arch])
    w.add_name(f"tiny-{arch.lower()}")
    _metadata(w, cfg, arch)
    write_gguf_vocab(w, tok_json)
    if metadata is not None:
        metadata(w)
    if fuse_qkv:
        for hf_name in [n for n in tensors if ".self_attn.q_proj." in n]:
            parts = [tensors.pop(hf_name.replace("q_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
            tensors[hf_name.replace("q_proj", "qkv_proj")] = np.concatenate(parts)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for hf_name, arr in {**tensors, **(extra_tensors or {})}.items():
        if hf_name.endswith(_SKIPPED):
            continue
        arr = np.asarray(arr, dtype=np.float32)
        if arch == "GPT2" and hf_name.endswith(_CONV1D):
            arr = arr.T  # (GPT2Model.modify_tensors)
        if arch == "GPTNEOX" and ".attention.query_key_value." in hf_name:
            # GPTNeoXModel.modify_tensors: per-head [q, k, v] rows regrouped as [all q; all k; all v]
            arr = arr.reshape(heads, 3, hidden // heads, *arr.shape[1:]).swapaxes(0, 1).reshape(arr.shape)
        if arch == "ARCEE" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            # LlamaModel.permute: each head's rotate-half rows interleaved for llama.cpp's rotary kernel
            n = heads if "q_proj" in hf_name else cfg["num_key_value_heads"]
            arr = arr.reshape(n, 2, arr.shape[0] // n // 2, *arr.shape[1:]).swapaxes(1, 2).reshape(arr.shape)
        if hf_name in (extra_tensors or {}):
            name = hf_name
        elif ".self_attn.qkv_proj." in hf_name:  # (the fused tensor's llama.cpp name)
            name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_QKV].format(bid=hf_name.split(".")[2])
            name += hf_name[hf_name.rindex("."):]
        else:
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KeyError(f"llama.cpp has no name for {hf_name} of {arch}")
        arr = np.ascontiguousarray(arr)
        if quantized(name, arr, tensor_type):
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def quantize_q8(model, architecture: str) -> None:
    """Put in transformers model `model` (in place) the weights a Q8_0 export of it holds once dequantized: each
    weight the quantizer takes, round-tripped in the file's layout (GPT-2's Conv1D transposed; GPT-NeoX's and
    Arcee's row orders leave a row's blocks whole, so they need nothing)."""
    import gguf
    import numpy as np
    import torch

    arch = ARCHS[architecture]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], model.config.num_hidden_layers)
    qtype = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for hf_name, param in model.named_parameters():
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            transposed = arch == "GPT2" and hf_name.endswith(_CONV1D)
            value = param.detach().numpy().T if transposed else param.detach().numpy()
            if name is None or not quantized(name, value, "Q8_0"):
                continue
            back = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(value), qtype), qtype)
            param.copy_(torch.from_numpy(np.ascontiguousarray(back.T if transposed else back)))
