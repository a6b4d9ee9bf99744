"""EngineConfig: every argument of `LLM(...)` / `ferrox serve`, validated in one place.

Values left as None ("auto") are resolved by the engine once the model is known
(`EngineCore` fills max_model_len, the torch dtype and the KV block count); this file only
holds the user's choices and the defaults that depend on the device.

Defaults that differ by device, and why:
- max_model_len: the model's max_position_embeddings on GPU; on CPU at most 8192, because a
  longer context would not fit a useful number of requests in the CPU KV budget.
- max_num_seqs: 512 on GPU (an 8B model on an H200: 30.3k vs 26.4k tok/s at 256 for 1000 x 256/256;
  decode GEMMs reuse each weight read for more rows), 64 on CPU (a 2-core CPU gains nothing from larger batches).
- max_num_batched_tokens: 8192 on GPU, 2048 on CPU (bounds one step's activation memory and
  the latency a long prefill adds to running decodes).
- kv_cache_memory: on CPU 2 GiB, capped at half of the memory the OS reports available; on GPU
  None means "size from gpu_memory_utilization after a profiling forward pass".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

CPU_DEFAULT_MAX_MODEL_LEN = 8192
CPU_DEFAULT_KV_CACHE_MEMORY = 2 << 30
_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "fp32", "fp16", "bf16")
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# Mirrors ferrox.loader.model_loader.LOAD_FORMATS (kept here so that config imports no torch).
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
_DEVICES = ("auto", "cpu", "cuda")
_POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # path to a HF folder or .gguf; None: the embedded SmolLM2
    tokenizer: str | None = None  # defaults to the model's own tokenizer
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    load_format: str = "auto"
    device: str = "auto"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    block_size: int = 16
    policy: str = "fcfs"
    enforce_eager: bool = False
    # Schedule step N+1 while step N computes (CPU/GPU overlap); None: on for CUDA, off on CPU.
    async_scheduling: bool | None = None
    chat_template: str | None = None  # a template string or a path to a .jinja file
    served_model_name: str | None = None
    max_logprobs: int = 20  # largest `logprobs` / `prompt_logprobs` a request may ask for
    num_threads: int | None = None  # CPU intra-op threads; None: all cores torch sees

    def __post_init__(self) -> None:
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype) if isinstance(self.dtype, str) else self.dtype
        _choice("dtype", self.dtype, _DTYPES)
        _choice("load_format", self.load_format, LOAD_FORMATS)
        _choice("device", self.device, _DEVICES)
        _choice("policy", self.policy, _POLICIES)
        _positive_int("max_model_len", self.max_model_len, optional=True)
        _positive_int("max_num_seqs", self.max_num_seqs, optional=True)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens, optional=True)
        _positive_int("kv_cache_memory", self.kv_cache_memory, optional=True)
        _positive_int("block_size", self.block_size)
        _positive_int("max_logprobs", self.max_logprobs)
        _positive_int("num_threads", self.num_threads, optional=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("model", "tokenizer", "chat_template", "served_model_name"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name}: must be a string, got {type(value).__name__}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments (LLM(**kw), CLI flags); an unknown name is a ValueError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    # ---- device-dependent defaults, resolved by the engine ------------------------------------
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_max_num_seqs(self, device: str) -> int:
        return self.max_num_seqs or (512 if device == "cuda" else 64)

    def resolved_max_num_batched_tokens(self, device: str) -> int:
        return self.max_num_batched_tokens or (8192 if device == "cuda" else 2048)

    def resolved_cpu_kv_cache_memory(self) -> int:
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        return min(CPU_DEFAULT_KV_CACHE_MEMORY, _available_memory() // 2)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(allowed)}")


def _positive_int(name: str, value: Any, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def _available_memory() -> int:
    """Bytes the OS reports available (Linux /proc/meminfo); a conservative 4 GiB elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
