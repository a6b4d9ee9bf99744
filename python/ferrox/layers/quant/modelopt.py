"""NVIDIA TensorRT Model Optimizer (ModelOpt) FP8 checkpoints: vLLM's `quantization="modelopt"`
(nvidia/Llama-3.1-8B-Instruct-FP8 and the nvidia/*-FP8 releases), read into the FP8 methods of fp8.py and
fp8_block.py.

Where the config is (either, as vLLM reads them; config.json's wins when both are there):

- config.json `quantization_config` (ModelOpt 0.31 and later), compressed-tensors-like:
      {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head", ...],
       "kv_cache_scheme": {"dynamic": false, "num_bits": 8, "type": "float"} | "FP8" | null,
       "config_groups": {"group_0": {"weights": {...8-bit float}, "input_activations": {...}, "targets": ["Linear"]}},
       "producer": {"name": "modelopt", "version": ...}}
  (`exclude_modules` / `kv_cache_quant_algo` are read there too, under the names of the older file);
- hf_quant_config.json beside it (older exports; loader/config_file.py folds it into the config):
      {"producer": {"name": "modelopt", ...},
       "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" | null, "exclude_modules": [...]}}

quant_algo (vLLM's list):
- "FP8": per linear layer `weight` float8_e4m3fn, `weight_scale` (one value) and `input_scale` (one value,
  the calibrated static activation scale). Merged q/k/v and gate/up write each shard's scale into its rows
  (no requantizing; vLLM requantizes to the largest) and take the largest shard input scale, as vLLM does.
- "FP8_PER_CHANNEL_PER_TOKEN": `weight_scale` per output channel, activations quantized per token at run time.
- "FP8_PB_WO" (per-block, "weight-only"): `weight_scale` float32 [out / 128, 1, in / 128, 1], one per 128 x 128
  block, no input scale. vLLM runs it as block FP8 with activations quantized per token and group of 128 at
  run time (its W8A8 block GEMM, not a weight-only one): the block-wise method of fp8_block.py, as DeepSeek's
  `weight_block_size` [128, 128] checkpoints. Its experts are refused (vLLM's ModelOpt experts read
  per-tensor scales, which these are not).
- Refused by name: the FP4 formats (NVFP4, W4A16_NVFP4, NVFP4_AWQ, W4A8_NVFP4_FP8...: FP4 matmuls need
  Blackwell's FP4 tensor cores, which ferrox has no kernels for), MXFP8, the integer / AWQ formats,
  MIXED_PRECISION (a scheme per layer) and any other.

Experts (Qwen3-MoE, Mixtral): per-expert `weight` / `weight_scale` load into the FP8 experts of fp8_moe.py (a
per-tensor scale written into every row); their `input_scale`s are read and not used: the expert kernels
quantize activations per token (vLLM runs them with the largest calibrated scale).

The exclude list keeps the modules it names in the model dtype (excluded_modules.py: ModelOpt's wildcards,
lm_head, routers, whole layers); the LM head, embeddings and routers are never quantized here.

KV cache (kv_cache_quant_algo "FP8"): each attention layer's `k_proj.k_scale` / `v_proj.v_scale` (or
`k_scale` / `v_scale`) are the FP8 cache's scales (attention/kv_cache.py), and kv_cache_dtype "auto" gives an
FP8 cache, as vLLM resolves it for these checkpoints; an explicit 16-bit kv_cache_dtype keeps a 16-bit cache
and the scales unused. An NVFP4 KV cache is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ferrox.layers.quant.excluded_modules import ExcludeList
from ferrox.layers.quant.fp8 import Fp8Config, string_list
from ferrox.layers.quant.fp8_block import Fp8BlockConfig
from ferrox.model_spec import UnsupportedModelError

if TYPE_CHECKING:
    from ferrox.layers.fused_moe import FusedMoE
    from ferrox.layers.quant.fp8_moe import Fp8MoeMethod
    from ferrox.layers.quant.method import QuantConfig

_CONFIG = "config.json quantization_config"
_HF_QUANT = "hf_quant_config.json quantization"
# quant_algo -> fp8.ACTIVATIONS mode of the linear layers.
_ALGOS = {"FP8": "static", "FP8_PER_CHANNEL_PER_TOKEN": "dynamic-token"}
_PER_BLOCK = "FP8_PB_WO"
_PER_BLOCK_SIZE = (128, 128)  # (vLLM's, fixed: the config does not say)
_FP4 = ("NVFP4", "W4A16_NVFP4", "NVFP4_AWQ", "NVFP4_SVD", "W4A8_NVFP4_FP8", "W4A8_MXFP4_FP8")
_NO_FP4 = "FP4 weights need Blackwell's FP4 tensor cores (sm100+), for which ferrox has no kernels"
_REFUSED = {
    **dict.fromkeys(_FP4, _NO_FP4),
    "MXFP8": "MX block-scaled FP8 needs Blackwell's block-scaled tensor cores (sm100+), for which ferrox has no "
             "kernels",
    "MIXED_PRECISION": "a quantization scheme per layer is not supported (one scheme over every linear layer is)",
    **{algo: "integer and AWQ ModelOpt exports are not supported" for algo in (
        "W4A16_AWQ", "W4A8_AWQ", "W8A16", "W8A8_SQ_PER_CHANNEL", "INT8", "INT4_AWQ")},
}
# Fields of each form (module docstring); anything else is refused by name. (group_size is the group of the FP4 /
# AWQ formats, refused above; an FP8 checkpoint's scale shapes are checked as its tensors load.)
_FLAT_FIELDS = ("quant_method", "quant_algo", "config_groups", "ignore", "exclude_modules", "kv_cache_scheme",
                "kv_cache_quant_algo", "producer", "quant_library", "group_size")
_NESTED_TOP = ("producer", "quantization", "quant_method")
_NESTED_FIELDS = ("quant_algo", "kv_cache_quant_algo", "exclude_modules", "group_size", "has_zero_point",
                  "pre_quant_scale")


def is_modelopt_export(cfg: dict[str, Any]) -> bool:
    """Whether a quantization config is ModelOpt's: quant_method "modelopt" (vLLM's "modelopt_fp4" /
    "modelopt_mixed" spellings too, which quant_algo then refuses), or hf_quant_config.json's producer."""
    method = str(cfg.get("quant_method") or "").lower()
    producer = cfg.get("producer")
    return method.startswith("modelopt") or (isinstance(producer, dict) and producer.get("name") == "modelopt"
                                             and not method)


class ModelOptConfig(Fp8Config):
    """A ModelOpt FP8 checkpoint (module docstring): fp8.py's checkpoint method with ModelOpt's settings."""

    name = "modelopt"

    def __init__(self, *, algo: str, excluded: ExcludeList, kv_cache_fp8: bool):
        super().__init__(online=False, activations=_ALGOS[algo], excluded=excluded)
        self.algo = algo
        self.checkpoint_renames = ()  # (ModelOpt writes `weight_scale` / `input_scale` under those names)
        # vLLM's kv_cache_dtype "auto" for such a checkpoint: an FP8 cache with its scales.
        self.kv_cache_dtype = "fp8" if kv_cache_fp8 else None

    @classmethod
    def from_hf(cls, cfg: dict) -> QuantConfig:
        """Either form of the config (module docstring); the quant_algo is checked first, so a format ferrox does
        not run is named before any field of it."""
        nested = "quantization" in cfg
        where = _HF_QUANT if nested else _CONFIG
        body = cfg["quantization"] if nested else cfg
        if not isinstance(body, dict):
            raise UnsupportedModelError(f"hf_quant_config.json: 'quantization' must be an object, got {body!r}")
        algo = _quant_algo(body.get("quant_algo"), f"{where}.quant_algo")
        if nested:
            _refuse_unknown(cfg, _NESTED_TOP, "hf_quant_config.json")
            _refuse_unknown(body, _NESTED_FIELDS, where)
            for flag in ("has_zero_point", "pre_quant_scale"):
                if body.get(flag):
                    raise UnsupportedModelError(f"{where}.{flag} {body[flag]!r}: zero points and AWQ pre-quantization "
                                                "scales are not supported (FP8 exports store neither)")
            kv_fields: tuple[str, ...] = ("kv_cache_quant_algo",)
            exclude_fields: tuple[str, ...] = ("exclude_modules",)
        else:
            _refuse_unknown(body, _FLAT_FIELDS, where)
            _check_config_groups(body.get("config_groups"), f"{where}.config_groups")
            # (config.json's names, and the older file's, which some exports write there too)
            kv_fields, exclude_fields = ("kv_cache_scheme", "kv_cache_quant_algo"), ("ignore", "exclude_modules")
        # Each field is checked, so a KV-cache scheme ferrox cannot run is refused under either name.
        kv = any([_kv_cache_fp8(body.get(key), f"{where}.{key}") for key in kv_fields])
        entries = [e for key in exclude_fields for e in string_list(body.get(key), f"{where}.{key}")]
        field = next((key for key in exclude_fields if body.get(key)), exclude_fields[0])
        excluded = ExcludeList(entries, f"{where}.{field}")
        if algo == _PER_BLOCK:
            return ModelOptBlockConfig(excluded=excluded, kv_cache_fp8=kv)
        return cls(algo=algo, excluded=excluded, kv_cache_fp8=kv)

    def describe(self) -> str:
        weights = "per-tensor" if self.algo == "FP8" else "per-channel"
        activations = "static per-tensor" if self.activations == "static" else "dynamic per-token"
        kv = ", FP8 KV-cache scales" if self.kv_cache_dtype else ""
        return (f"{self.name} (quant_algo {self.algo}): E4M3 weights, {weights} scales, {activations} activations"
                f"{kv}; {len(self.excluded.entries) if self.excluded else 0} exclude entries")


class ModelOptBlockConfig(Fp8BlockConfig):
    """FP8_PB_WO (module docstring): fp8_block.py's method in 128 x 128 blocks, scales named `weight_scale`."""

    algo = _PER_BLOCK

    def __init__(self, *, excluded: ExcludeList, kv_cache_fp8: bool):
        super().__init__(_PER_BLOCK_SIZE, excluded, name="modelopt", scale_param="weight_scale")
        self.kv_cache_dtype = "fp8" if kv_cache_fp8 else None

    def moe_method(self, layer: FusedMoE) -> Fp8MoeMethod:
        raise UnsupportedModelError(f"quantization 'modelopt' (quant_algo {_PER_BLOCK}): mixture-of-experts layers are "
                                    "not supported (vLLM's ModelOpt experts read per-tensor scales, not these blocks)")

    def describe(self) -> str:
        kv = ", FP8 KV-cache scales" if self.kv_cache_dtype else ""
        return f"{super().describe()} (quant_algo {_PER_BLOCK}){kv}"


def _refuse_unknown(cfg: dict, known: tuple[str, ...], where: str) -> None:
    unknown = sorted(k for k in cfg if k not in known and not k.startswith("_"))
    if unknown:
        raise UnsupportedModelError(f"{where}: field(s) {', '.join(unknown)} of ModelOpt's config are not supported "
                                    f"(ferrox reads {', '.join(known)}; report the checkpoint)")


def _quant_algo(value: Any, where: str) -> str:
    """The quant_algo, upper-cased as vLLM normalizes it; anything but the FP8 ones refused with the reason."""
    if not value:
        raise UnsupportedModelError(f"{where} is missing: ModelOpt's config names its quantization there")
    algo = str(value).upper()
    if algo in _ALGOS or algo == _PER_BLOCK:
        return algo
    reason = _REFUSED.get(algo, "it is not one of ModelOpt's formats ferrox knows")
    raise UnsupportedModelError(f"{where} {value!r}: {reason} (ferrox reads ModelOpt's {', '.join(_ALGOS)} and "
                                f"{_PER_BLOCK})")


def _kv_cache_fp8(value: Any, where: str) -> bool:
    """Whether the checkpoint's KV-cache quantization is FP8 with per-tensor scales (kv_cache_quant_algo "FP8", or
    config.json's kv_cache_scheme as ModelOpt writes it: {"dynamic": false, "num_bits": 8, "type": "float"}); None:
    no KV-cache quantization. Others are refused by name."""
    if value is None:
        return False
    if isinstance(value, str) and value.upper() == "FP8":
        return True
    if isinstance(value, dict) and value.get("num_bits") == 8 and value.get("type") == "float" and (
            not value.get("dynamic")) and value.get("strategy", "tensor") == "tensor":
        return True
    fp4 = ("FP4" in value.upper()) if isinstance(value, str) else (isinstance(value, dict)
                                                                  and value.get("num_bits") == 4)
    reason = ("an NVFP4 KV cache needs Blackwell's FP4 units (sm100+)" if fp4 else
              "only an FP8 KV cache with per-tensor scales is supported")
    raise UnsupportedModelError(f"{where} {value!r}: {reason}")


def _check_config_groups(groups: Any, where: str) -> None:
    """config.json's config_groups, which ModelOpt derives from quant_algo: one group of 8-bit float weights
    (and activations) over Linear layers, or none; anything else is a scheme ferrox does not read."""
    if groups is None:
        return
    if not isinstance(groups, dict) or len(groups) != 1:
        raise UnsupportedModelError(f"{where} {groups!r}: ferrox runs one FP8 scheme group over every linear layer")
    (name, group), = groups.items()
    if not isinstance(group, dict) or group.get("targets", ["Linear"]) != ["Linear"]:
        targets = group.get("targets") if isinstance(group, dict) else group
        raise UnsupportedModelError(f"{where}.{name}: targets {targets!r}; only ['Linear'] (every linear layer) "
                                    "is supported")
    for part in ("weights", "input_activations"):
        args = group.get(part)
        if args is None and part == "input_activations":
            continue
        if not isinstance(args, dict) or args.get("num_bits") != 8 or args.get("type") != "float":
            raise UnsupportedModelError(f"{where}.{name}.{part} {args!r}: ModelOpt's FP8 formats store 8-bit float "
                                        "weights and activation scales")
