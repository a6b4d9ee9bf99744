"""Which quantization a model runs with: the `quantization` argument against config.json's
`quantization_config`, resolved to a `QuantConfig` (layers/quant/method.py) or None.

- No argument, no `quantization_config`: None (the model dtype).
- No argument, a `quantization_config`: the checkpoint's method, as published.
- `quantization="fp8"` on an unquantized checkpoint: online FP8 (weights quantized at load).
- `quantization="fp8"` on a GGUF file: its tensors dequantized to the model dtype, then online FP8.
- ModelOpt's exports say "modelopt" in config.json, or in hf_quant_config.json beside it (folded into the
  config by loader/config_file.py): layers/quant/modelopt.py.
- Both: they must agree (vLLM's kernel-named spellings `awq_marlin` / `gptq_marlin` name the same
  checkpoint layouts and are taken as `awq` / `gptq`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from ferrox.layers.quant.method import QuantConfig, hf_quantization_config
from ferrox.model_spec import ModelSpec, UnsupportedModelError

logger = logging.getLogger(__name__)

# method name -> "module:class"; the class has `from_hf(quantization_config) -> QuantConfig`, and
# fp8's also `online() -> QuantConfig`.
_METHODS = {
    "fp8": "ferrox.layers.quant.fp8:Fp8Config",
    "compressed-tensors": "ferrox.layers.quant.compressed_tensors:CompressedTensorsScheme",
    "awq": "ferrox.layers.quant.awq:AWQConfig",
    "gptq": "ferrox.layers.quant.gptq:GPTQConfig",
    "modelopt": "ferrox.layers.quant.modelopt:ModelOptConfig",
}
_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "compressed_tensors": "compressed-tensors"}
# Checkpoint methods a family's own loader reads (no QuantConfig): method -> the architectures that do.
# gpt-oss's MXFP4 experts: kept MXFP4 on the Triton kernels, else dequantized to the model dtype at load
# (layers/quant/mxfp4_moe.py, models/gpt_oss.py).
DEQUANTIZED_AT_LOAD = {"mxfp4": ("GptOssForCausalLM",)}
# What the `quantization` argument accepts (the CLI's choices); "gguf" names a GGUF file's own blocks.
QUANTIZATION_METHODS = (*_METHODS, *_ALIASES, "gguf")


def _method_class(name: str) -> Any:
    module, _, cls = _METHODS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def resolve_quant_config(quantization: str | None, spec: ModelSpec, *, is_gguf: bool = False) -> QuantConfig | None:
    """The model's QuantConfig (None: unquantized, or a GGUF, whose blocks the GGUF loader keeps)."""
    requested = _ALIASES.get(quantization, quantization) if quantization else None
    if requested is not None and requested not in (*_METHODS, "gguf"):
        raise UnsupportedModelError(f"quantization {quantization!r} is not supported (choose one of "
                                    f"{', '.join(QUANTIZATION_METHODS)})")
    if is_gguf:
        if requested == "fp8":  # the GGUF's tensors are dequantized to the model dtype, then quantized
            return _method_class("fp8").online()
        if requested not in (None, "gguf"):
            raise UnsupportedModelError(f"quantization {quantization!r} does not apply to a GGUF file (its "
                                        "tensors carry their own quantization; leave quantization unset)")
        return None
    if requested == "gguf":
        raise UnsupportedModelError("quantization 'gguf' needs a .gguf model file")
    hf = hf_quantization_config(spec.hf_config)
    if hf is None:
        if requested is None:
            return None
        if requested != "fp8":
            raise UnsupportedModelError(
                f"quantization {quantization!r} needs a checkpoint quantized that way (its config.json has no "
                "quantization_config); only 'fp8' quantizes an unquantized checkpoint at load time")
        return _method_class("fp8").online()
    method = _checkpoint_method(hf)
    if method in DEQUANTIZED_AT_LOAD and spec.architecture in DEQUANTIZED_AT_LOAD[method]:
        if requested is not None:
            raise UnsupportedModelError(f"quantization {quantization!r}: this checkpoint's "
                                        f"quantization_config.quant_method {hf.get('quant_method')!r} is read by "
                                        "the model's own loader, and nothing else applies to it (leave quantization "
                                        "unset)")
        logger.info("quantization_config.quant_method %r: read by the model's loader (kept quantized where its "
                    "kernels take it, else dequantized to the model dtype)", method)
        return None
    if method not in _METHODS:
        where = ("hf_quant_config.json: a quantization config whose producer is not NVIDIA ModelOpt"
                 if "quantization" in hf and not hf.get("quant_method") else
                 f"config.json quantization_config.quant_method {hf.get('quant_method')!r}")
        raise UnsupportedModelError(f"{where} is not supported (ferrox reads {', '.join(_METHODS)} checkpoints)")
    if requested is not None and requested != method:
        raise UnsupportedModelError(f"quantization {quantization!r} does not match the checkpoint's "
                                    f"quantization_config.quant_method {hf.get('quant_method')!r}")
    return _method_class(method).from_hf(hf)


def _checkpoint_method(hf: dict[str, Any]) -> str:
    """The method a checkpoint's quantization config names: its quant_method ("compressed_tensors" spelt
    "compressed-tensors"); ModelOpt's whatever its spelling (vLLM's "modelopt_fp4" / "modelopt_mixed", or
    hf_quant_config.json's producer), whose quant_algo then says which format it is."""
    from ferrox.layers.quant.modelopt import is_modelopt_export

    if is_modelopt_export(hf):
        return "modelopt"
    return str(hf.get("quant_method", "")).lower().replace("_", "-")
