"""Build a model and fill its weights: safetensors, GGUF, or random ("dummy") for benchmarks."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ferrox.distributed.parallel_state import get_tp_group
from ferrox.layers.quant.method import QuantConfig, use_quant_config
from ferrox.loader.errors import ModelLoadError
from ferrox.loader.json_file import read_json
from ferrox.loader.model_config import load_model_spec
from ferrox.loader.source import ModelSource
from ferrox.model_spec import ModelSpec, UnsupportedModelError

logger = logging.getLogger(__name__)

__all__ = ["load_model_spec", "load_model", "load_generation_config", "LOAD_FORMATS"]

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy", "mistral")


def load_model(source: ModelSource, spec: ModelSpec, *, dtype: torch.dtype, device: torch.device | str,
               load_format: str = "auto", seed: int = 0, keep_quantized: bool = False,
               quant_config: QuantConfig | None = None, cpu_offload_bytes: int = 0,
               mm_limits: Mapping[str, int] | None = None, mm_encoder_tp_mode: str = "weights") -> nn.Module:
    """keep_quantized: a quantized GGUF's matrices stay in their blocks and run the Rust CPU kernels' quantized matmuls
    (layers/quant) -- on the CPU, with one rank, for models that take them; otherwise (and for every
    other format) the weights are dequantized to `dtype` as before. The engine asks for it when the
    dtype is "auto" (worker/model_setup.py).

    quant_config: the checkpoint's (or `--quantization`'s) method (layers/quant/config.py); the
    model's linear layers are built with it and finalized into its runners after loading.

    cpu_offload_bytes: vLLM's cpu_offload_gb, in bytes: the first parameters the model registers, up to
    that many bytes, live in host memory the GPU reads in place (loader/cpu_offload.py).

    mm_limits: the images / videos a prompt may carry (EngineConfig.mm_limits: --limit-mm-per-prompt, 0 for all
    under --language-model-only); a vision model none of whose modalities may be given is built and loaded
    without its vision side. mm_encoder_tp_mode: how a vision tower runs under tensor parallelism ('weights':
    sharded, 'data': whole, the images split among the ranks). Both: models/vision/encoder_setup.py."""
    from ferrox.loader import weights
    from ferrox.loader.cpu_offload import GIB, offloaded_bytes, offloading
    from ferrox.models.registry import get_model_class
    from ferrox.models.vision.encoder_setup import (
        building_text_only,
        building_without,
        drop_vision_encoder,
        place_vision_encoder,
        text_only_model,
    )

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is unknown (choose one of {', '.join(LOAD_FORMATS)})")
    if load_format == "auto":
        if source.format == "gguf":
            load_format = "gguf"
        elif mistral_layout(source.path):
            load_format = "mistral"  # Mistral's native consolidated*.safetensors (loader/mistral_weights.py)
        elif weights.has_torch_bin(source.path) and not weights.has_safetensors(source.path):
            load_format = "pt"  # an older checkpoint with pytorch_model*.bin only
        else:
            load_format = "safetensors"  # (with no weights at all, its error names the folder)
    if load_format == "gguf" and source.format != "gguf":
        raise ModelLoadError(f"load_format 'gguf' needs a .gguf file, {source.path} is a folder")
    if load_format in ("safetensors", "pt", "mistral") and source.format != "hf":
        raise ModelLoadError(f"load_format {load_format!r} needs a Hugging Face folder, {source.path} is a GGUF file")

    cls = get_model_class([spec.architecture], spec.hf_config)
    device = torch.device(device)
    tp = get_tp_group()
    if tp.size > 1 and not getattr(cls, "supports_tensor_parallel", False):
        raise UnsupportedModelError(f"architecture {spec.architecture!r} does not support tensor_parallel_size > 1 "
                                    f"(got {tp.size})")
    if load_format == "gguf":
        # Check quantization types before allocating anything: fail fast with the type's name.
        from ferrox.loader.gguf_file import open_gguf

        open_gguf(source.path).check_quant_types()
    keep_quantized = keep_quantized and load_format == "gguf" and quantized_gguf_runs(cls, device, tp.size)
    if quant_config is not None:
        if not getattr(cls, "supports_quantization", False):
            raise UnsupportedModelError(f"quantization {quant_config.name!r}: {spec.architecture} does not take "
                                        "quantized weights in this version")
        quant_config.check(spec, device, tp.size)
        logger.info("quantization: %s", quant_config.describe())
    text_only = text_only_model(cls, mm_limits, spec.hf_config)
    with (torch.no_grad(), use_quant_config(quant_config), offloading(cpu_offload_bytes, device),
          building_text_only(text_only), building_without(mm_limits)):
        model = cls(spec, dtype, device)
        if quant_config is not None:  # (layers the checkpoint left in float: its exclude list, by module name)
            quant_config.keep_unquantized(model)
    with torch.no_grad():
        if load_format == "dummy":
            drop_vision_encoder(model)  # (nothing to drop unless text_only)
            init_dummy_weights(model, seed)
        elif load_format == "gguf":
            model.load_weights(_progress(weights.iter_gguf(source.path, spec.num_heads, spec.num_kv_heads,
                                                           keep_quantized=keep_quantized),
                                         len(open_gguf(source.path).tensor_names)))
        elif load_format == "pt":
            model.load_weights(_progress(_renamed(weights.iter_torch_bin(source.path), quant_config), None))
        elif load_format == "mistral":
            from ferrox.loader.mistral_weights import iter_mistral_safetensors, mistral_files

            model.load_weights(_progress(_renamed(iter_mistral_safetensors(source.path, spec, lazy=tp.size > 1),
                                                  quant_config),
                                         _num_safetensors(source.path, mistral_files(source.path))))
        else:
            # Under tensor parallelism each rank reads only its shard of every tensor.
            model.load_weights(_progress(_renamed(weights.iter_safetensors(source.path, lazy=tp.size > 1),
                                                  quant_config), _num_safetensors(source.path)))
        # Text only: the vision side was built on the meta device, where loading checked its shapes and
        # stored nothing.
        drop_vision_encoder(model)
        place_vision_encoder(model, tp, mm_encoder_tp_mode)
        finalize = getattr(model, "finalize_weights", None)
        if finalize is not None:
            finalize()
    if cpu_offload_bytes:
        logger.info("cpu_offload_gb: %.2f GiB of the weights in host memory (asked %.2f; weights a quantization "
                    "repacked after loading live on the device)", offloaded_bytes(model) / GIB, cpu_offload_bytes / GIB)
    model.eval()
    model.requires_grad_(False)
    return model


def _renamed(tensors: Iterator[tuple[str, Any]], quant_config: QuantConfig | None) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with the suffixes its quantization layout spells otherwise renamed to the layers'
    (QuantConfig.checkpoint_renames)."""
    renames = quant_config.checkpoint_renames if quant_config is not None else ()
    if not renames:
        yield from tensors
        return
    for name, tensor in tensors:
        for old, new in renames:
            if name.endswith(old):
                name = name[:-len(old)] + new
                break
        yield name, tensor


def quantized_gguf_runs(cls: type, device: torch.device, tp_size: int) -> bool:
    """Whether a quantized GGUF can stay quantized: the quantized matmul is a CPU kernel (rust/cpu/), the
    packed groups are not sharded across ranks yet, and the model class must take QuantizedTensors.
    Otherwise it is dequantized (the GPU path and tensor parallelism are unchanged)."""
    if device.type != "cpu" or not getattr(cls, "supports_quantized_gguf", False):
        return False
    if tp_size > 1:
        logger.info("tensor_parallel_size=%d: dequantizing the GGUF weights (quantized ones run on one rank)",
                    tp_size)
        return False
    return True


def mistral_layout(folder: str) -> bool:
    """Whether load_format 'auto' reads a folder as Mistral's native layout: it has consolidated*.safetensors and
    either no config.json (params.json describes it) or no Hugging Face-named safetensors beside them. vLLM's
    'auto' takes the consolidated files whenever they are there; ferrox pairs the weights with the config it
    reads (loader/config_file.py), so a folder with both layouts loads the Hugging Face one."""
    from ferrox.loader.mistral_config import consolidated_files

    if not consolidated_files(folder):
        return False
    hf_named = [f for f in os.listdir(folder) if f.endswith(".safetensors") and not f.startswith("consolidated")]
    return not os.path.isfile(os.path.join(folder, "config.json")) or not hf_named


def _progress(tensors: Iterator[tuple[str, Any]], total: int | None) -> Iterator[tuple[str, Any]]:
    """A progress bar over the checkpoint's tensors as the model takes them (on stderr; the first
    tensor-parallel rank only, the others load the same tensors in step)."""
    from tqdm.auto import tqdm

    return iter(tqdm(tensors, total=total, desc="Loading weights", unit="tensor", dynamic_ncols=True,
                     disable=get_tp_group().rank != 0))


def _num_safetensors(folder: str, files: list[str] | None = None) -> int | None:
    from safetensors import safe_open

    from ferrox.loader import weights

    try:
        total = 0
        for path in files if files is not None else weights.safetensors_files(folder):
            with safe_open(path, framework="pt", device="cpu") as f:
                total += len(f.keys())
        return total
    except Exception:  # unreadable: the load itself reports it, naming the file
        return None


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights with the scale of a trained model's init (std 0.02), norms at 1, biases at 0,
    so activations stay in range and benchmarks exercise realistic numerics."""
    for name, param in model.named_parameters():
        gen = torch.Generator(device=param.device).manual_seed(seed + _stable_hash(name))
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith(".bias"):
            param.data.zero_()
        else:
            param.data.normal_(0.0, 0.02, generator=gen)
    # Quantized layers holding checkpoint tensors of their own (layers/quant/method.py).
    for name, module in model.named_modules():
        method = getattr(module, "weight_method", None)
        if method is not None and not method.float_weight:
            method.dummy(module, seed + _stable_hash(name))


def _stable_hash(name: str) -> int:
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % (1 << 31)
    return h


# The embedded SmolLM2-135M-Instruct ships as a bare GGUF, without the generation config of its model
# card. These are the sampling settings its card recommends; at SamplingParams' default (temperature
# 1.0, no top-p) a 135M model writes noise.
EMBEDDED_GENERATION_DEFAULTS: dict[str, Any] = {"temperature": 0.2, "top_p": 0.9}


def load_generation_config(source: ModelSource) -> dict[str, Any]:
    """generation_config.json of an HF folder (sampling defaults, eos ids); for a GGUF the eos ids
    from its metadata, plus the recommended sampling defaults when it is the embedded model. {} when
    there is nothing."""
    if source.format == "gguf":
        from ferrox.loader.gguf_file import open_gguf

        meta = open_gguf(source.path).metadata
        eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                       "tokenizer.ggml.eom_token_id") if k in meta]
        config = dict(EMBEDDED_GENERATION_DEFAULTS) if _is_embedded(source) else {}
        if eos:
            config["eos_token_id"] = sorted(set(eos), key=eos.index)
        return config
    path = os.path.join(source.path, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    config = read_json(path)
    return {k: v for k, v in config.items() if not k.startswith("_")}


def _is_embedded(source: ModelSource) -> bool:
    """Whether `source` is the embedded default model's GGUF (however it was named: by default or by path)."""
    from ferrox.loader.source import embedded_gguf_path

    try:
        return os.path.samefile(source.path, embedded_gguf_path())
    except (OSError, ModelLoadError):  # ModelNotFoundError: the embedded package is not installed
        return False
