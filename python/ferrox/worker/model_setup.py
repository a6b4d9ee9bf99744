"""Engine start-up: resolve the model, load tokenizer and weights, size and allocate the KV cache.

KV cache sizing:
- CPU: `kv_cache_memory` bytes (default 2 GiB, capped at half the available RAM).
- GPU: `kv_cache_memory` when given; otherwise a profiling forward pass at
  `max_num_batched_tokens` measures peak activation memory, and the cache gets
  gpu_memory_utilization * total - (memory in use after the pass, weights and peak included),
  further capped by what is actually free (other processes).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ferrox.attention.kv_cache import (
    allocate_kv_caches,
    kv_cache_bytes_per_block,
    resolve_kv_cache_dtype,
    warn_if_uncalibrated,
)
from ferrox.config import CPU_DEFAULT_MAX_MODEL_LEN, EngineConfig, check_kernel_backends
from ferrox.distributed.parallel_state import TPGroup, get_tp_group, use_tp_group
from ferrox.kernels import fp8_unsupported_gpu, select_kernels
from ferrox.layers.quant.config import resolve_quant_config
from ferrox.layers.quant.method import QuantConfig
from ferrox.loader.cpu_offload import GIB
from ferrox.loader.model_loader import load_generation_config, load_model, load_model_spec
from ferrox.loader.no_tokenizer import no_tokenizer_for
from ferrox.loader.source import ModelSource, resolve_model, resolve_tokenizer
from ferrox.loader.tokenizer import load_tokenizer
from ferrox.model_spec import rope_type_of, spec_for_context
from ferrox.pooling.config import pooling_max_model_len, pooling_setup, pooling_token_budget
from ferrox.pooling.convert import apply_convert
from ferrox.pooling.params import PoolerConfig
from ferrox.pooling.seq_cls_conversion import resolve_token_ids
from ferrox.sleep_mode import KV_CACHE
from ferrox.worker.cpu_threads import CpuThreadGovernor
from ferrox.worker.dummy_batch import decode_step, prefill_step, upload_step
from ferrox.worker.pooling_runner import empty_kv_caches, virtual_num_blocks
from ferrox.worker.recurrent_states import (
    StateCachePlan,
    allocate_recurrent_states,
    check_recurrent_config,
    recurrent_layers,
    state_cache_plan,
    state_dtypes,
)
from ferrox.worker.sleep_memory import SleepMemory
from ferrox.worker.step_inputs import Uploader

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class LoadedModel:
    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any
    spec: Any
    model: Any
    kv_caches: list[torch.Tensor]
    num_blocks: int  # including the null block
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab_size: int
    eos_token_ids: list[int]
    generation_defaults: dict[str, Any]
    threads: CpuThreadGovernor | None  # CPU only: intra-op thread count, adjusted to the machine's load
    # runner "pooling": how the model pools (ferrox.pooling); then kv_caches are empty and num_blocks virtual.
    pooler_config: PoolerConfig | None = None
    # enable_sleep_mode: the regions the weights and the KV cache were allocated in (worker/sleep_memory.py),
    # and the same model loaded again, for reload_weights (worker/sleep_control.py).
    sleep_memory: SleepMemory | None = None
    reload_model: Callable[[], Any] | None = None
    # A hybrid model whose layers keep per-request recurrent states (worker/recurrent_states.py): the engine
    # hands out their rows; with prefix caching, states are kept as the plan says (rust/state_snapshots.rs).
    recurrent: bool = False
    state_cache: StateCachePlan = StateCachePlan()
    quant_config: QuantConfig | None = None  # the weights' (a checkpoint's MTP layer is built with it)
    # kv_cache_dtype as resolved: "auto" turned into the checkpoint's calibrated cache (fp8 for a ModelOpt export
    # with kv_cache_quant_algo FP8), which cache_config_info reports, as vLLM's resolved cache_dtype.
    kv_cache_dtype: str = "auto"


def resolve_dtype(config: EngineConfig, spec: Any, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return _TORCH_DTYPES[config.dtype]
    if device.type == "cpu":
        return torch.float32
    checkpoint = spec.dtype if isinstance(spec.dtype, torch.dtype) else _TORCH_DTYPES.get(str(spec.dtype))
    # float32 checkpoints run in bf16 on GPU (as vLLM does); half-precision ones keep their dtype.
    return checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.bfloat16


def resolve_max_model_len(config: EngineConfig, spec: Any, device: torch.device) -> int:
    limit = int(spec.max_position_embeddings)
    # disable_sliding_window (vLLM's): the context ends at the window, so every layer attends fully
    # (spec_for_context then gives no layer a window: the unwindowed kernels serve them all).
    window = spec.sliding_window if config.disable_sliding_window and spec.sliding_layers and any(
        spec.sliding_layers) else None
    if window is not None and window < limit:
        limit = window
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's sliding window ({window} "
                             "tokens), to which disable_sliding_window caps the context")
    if config.max_model_len is None:
        return limit if device.type == "cuda" else min(limit, CPU_DEFAULT_MAX_MODEL_LEN)
    if config.max_model_len > limit:
        if rope_type_of(spec.rope_scaling) in ("linear", "yarn") and spec.rope_scaling.get("factor") is not None:
            raise ValueError(
                f"max_model_len: {config.max_model_len} exceeds the model's context ({limit} tokens, as its "
                f"rope_scaling ({rope_type_of(spec.rope_scaling)}, factor {spec.rope_scaling['factor']}) extends it)")
        raise ValueError(
            f"max_model_len: {config.max_model_len} exceeds the model's max_position_embeddings ({limit})"
        )
    return config.max_model_len


def load_everything(config: EngineConfig, tp: TPGroup | None = None, device_index: int | None = None) -> LoadedModel:
    """Every rank of a tensor-parallel model runs this, in the same order (its profiling and
    warm-up forwards are collectives). tp: the rank's group (None: one rank). device_index: the
    rank's CUDA device (default: its rank)."""
    tp = tp or get_tp_group()
    device = torch.device(config.resolved_device())
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was requested but torch sees no CUDA device")
    # --attention-backend / --moe-backend name kernels: those of the set the model is built with (models/*.py).
    check_kernel_backends(config, select_kernels(device), device.type)
    if device.type == "cuda" and tp.size > 1:
        device = torch.device("cuda", tp.rank if device_index is None else device_index)
        torch.cuda.set_device(device)
    threads = CpuThreadGovernor(config.num_threads) if device.type == "cpu" else None
    _show_progress_logs()
    source = resolve_model(config.model, config.revision)
    logger.info("model %s: %s (%s)", source.name, source.path, source.format)
    tokenizer: Any = None
    if not config.skip_tokenizer_init:  # (first: a snapshot missing its tokenizer is named before its config)
        tok_source = (resolve_tokenizer(config.tokenizer, config.model, config.revision, config.tokenizer_revision)
                      if config.tokenizer is not None or config.tokenizer_revision is not None else source)
        logger.info("loading the tokenizer from %s", tok_source.path)
        tokenizer = _cached_tokenizer(tok_source, _mtime(tok_source.path), config.tokenizer_mode)
    overrides = _overrides_key(config.hf_overrides)
    spec = _cached_spec(source, _mtime(source.path), overrides, config.config_format)
    # --convert classify names the family's classifier; a causal LM converted into a classifier reads its head
    # off LM-head rows named by token (vLLM's classifier_from_token): their ids, from the tokenizer, before the
    # pooler and the model are set up.
    spec = resolve_token_ids(apply_convert(config.convert, config.runner, spec), tokenizer)
    if config.skip_tokenizer_init:  # token ids in and out (loader/no_tokenizer.py)
        tokenizer = no_tokenizer_for(source.name, spec.hf_config, spec.vocab_size)
    dtype = resolve_dtype(config, spec, device)
    quant_config = resolve_quant_config(config.quantization, spec, is_gguf=source.format == "gguf")
    kv_cache_dtype = _kv_cache_dtype(config, quant_config, device)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, device)  # fp8: half
    pooler_config = pooling_setup(config, source, spec, tp.size)  # None: a generation model
    if pooler_config is None:
        max_model_len = resolve_max_model_len(config, spec, device)
        spec = spec_for_context(spec, max_model_len)
    else:
        max_model_len = pooling_max_model_len(config.max_model_len, source, spec)
    max_num_seqs = config.resolved_max_num_seqs(device.type)
    max_num_batched_tokens = config.resolved_max_num_batched_tokens(device.type)
    if pooler_config is not None:
        max_num_batched_tokens = pooling_token_budget(config.max_num_batched_tokens, max_num_batched_tokens,
                                                      max_model_len)
    elif not config.enable_chunked_prefill:
        max_num_batched_tokens = pooling_token_budget(
            config.max_num_batched_tokens, max_num_batched_tokens, max_model_len,
            why="with enable_chunked_prefill off each prompt is computed in one step")
    logger.info("loading the weights (%s, %s) onto %s", config.load_format, str(dtype).removeprefix("torch."), device)
    # Sleep mode releases this engine's weights: they must be its own, allocated in its region.
    sleep_memory = SleepMemory(device) if config.enable_sleep_mode else None
    # dtype "auto" keeps a quantized GGUF quantized where it can run so (the CPU); an explicit
    # dtype dequantizes it to that dtype (loader/model_loader.py).
    offload = int(config.cpu_offload_gb * GIB)
    if offload and device.type != "cuda":
        raise ValueError("cpu_offload_gb: offloads GPU weights to host memory; on the CPU the model already runs "
                         "from it")
    load = functools.partial(_shared_model, source, spec, dtype, device, config.load_format, config.seed, tp,
                             keep_quantized=config.dtype == "auto" and quant_config is None,
                             # (calculate_kv_scales writes the model's KV scales: another engine's must not see them)
                             private=config.enable_lora or sleep_memory is not None or bool(offload)
                             or config.calculate_kv_scales,
                             cpu_offload_bytes=offload,
                             quant_config=quant_config, quantization=config.quantization,
                             hf_overrides=config.hf_overrides, mm_limits=config.mm_limits(),
                             mm_encoder_tp_mode=config.mm_encoder_tp_mode)
    with use_tp_group(tp):
        model = load()
    reload_model = None
    if sleep_memory is not None:
        sleep_memory.adopt(model)

        def reload_model() -> Any:
            with use_tp_group(tp):
                return load()
    generation_defaults = dict(load_generation_config(source) or {})
    eos = _eos_token_ids(tokenizer, generation_defaults)
    recurrent = bool(recurrent_layers(model))
    state_cache = StateCachePlan()
    if recurrent:
        num_drafts = num_speculative_tokens(config)
        check_recurrent_config(config, num_drafts)
        state_cache = state_cache_plan(config, max_num_seqs, pooling=pooler_config is not None)
        allocate_recurrent_states(model, max_num_seqs, state_cache.snapshot_slots,
                                  *state_dtypes(config.mamba_cache_dtype, config.mamba_ssm_cache_dtype, dtype,
                                               spec.hf_config), device,
                                  num_speculative_tokens=num_drafts)
    if pooler_config is not None:
        # No KV cache (worker/pooling_runner.py): the scheduler counts virtual blocks.
        if config.num_gpu_blocks_override is not None:
            raise ValueError("num_gpu_blocks_override: a pooling model keeps no KV cache here (its prompts run whole "
                             "each step), so there are no blocks to count")
        return LoadedModel(
            source=source, device=device, dtype=dtype, tokenizer=tokenizer, spec=spec, model=model,
            kv_caches=empty_kv_caches(spec.num_layers, dtype, device),
            num_blocks=virtual_num_blocks(max_num_seqs, max_model_len, config.block_size),
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            vocab_size=int(spec.vocab_size), eos_token_ids=eos, generation_defaults={}, threads=threads,
            pooler_config=pooler_config, sleep_memory=sleep_memory, reload_model=reload_model, recurrent=recurrent,
        )

    if not config.calculate_kv_scales:  # (else the first step measures them)
        warn_if_uncalibrated(model, kv_dtype)
    per_block = kv_cache_bytes_per_block(spec, config.block_size, kv_dtype, tp.size)
    if device.type == "cpu":
        kv_bytes = config.resolved_cpu_kv_cache_memory()
    else:
        kv_bytes = config.kv_cache_memory or profile_gpu_kv_budget(
            model, spec, dtype, device, config, max_num_batched_tokens, max_num_seqs, tp.size, max_model_len,
            kv_dtype=kv_dtype,
        )
    if device.type != "cpu" and config.kv_cache_memory is None:
        # Draft-model speculation keeps a twin KV cache of the same block count (worker/draft_model.py)
        # plus a few scratch blocks per request: in a profiled GPU budget every block costs both
        # models' bytes. (An explicit kv_cache_memory sizes the target's cache; the twin is extra.)
        draft_per_block, draft_scratch = _draft_kv_cost(config, dtype, tp.size, max_num_seqs, spec)
        kv_bytes = max(0, kv_bytes - draft_scratch * draft_per_block)
        per_block += draft_per_block
        if config.enable_lora:  # the adapter slots, allocated after this (engine/lora_state.py)
            from ferrox.lora.manager import slot_bytes

            kv_bytes = max(0, kv_bytes - slot_bytes(model, max_loras=config.max_loras,
                                                    max_rank=config.max_lora_rank, dtype=dtype))
    # Every rank holds the same block ids (of its own KV heads): the smallest budget decides.
    num_blocks = tp.min_int(kv_bytes // per_block + 1)  # + the null block, which holds nothing
    if config.num_gpu_blocks_override is not None:
        logger.info("num_gpu_blocks_override: %d KV blocks instead of the %d the budget gives",
                    config.num_gpu_blocks_override, num_blocks)
        num_blocks = config.num_gpu_blocks_override
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory: {kv_bytes} bytes do not hold one KV block ({per_block} bytes at block_size "
            f"{config.block_size}, dtype {kv_dtype})"
        )
    check_kv_capacity((num_blocks - 1) * config.block_size, max_model_len, device.type,
                      block_count_override=config.num_gpu_blocks_override is not None)
    logger.info("allocating the KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks - 1, config.block_size,
                (num_blocks - 1) * per_block / 2**30)
    with _region(sleep_memory, KV_CACHE):
        kv_caches = allocate_kv_caches(spec, num_blocks, config.block_size, kv_dtype, device, tp.size)
    if sleep_memory is not None:
        sleep_memory.kv_caches = kv_caches
    return LoadedModel(
        source=source, device=device, dtype=dtype, tokenizer=tokenizer, spec=spec, model=model,
        kv_caches=kv_caches, num_blocks=num_blocks, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, vocab_size=int(spec.vocab_size), eos_token_ids=eos,
        generation_defaults=generation_defaults, threads=threads, sleep_memory=sleep_memory,
        reload_model=reload_model, recurrent=recurrent, state_cache=state_cache, quant_config=quant_config,
        kv_cache_dtype=kv_cache_dtype,
    )


def _kv_cache_dtype(config: EngineConfig, quant_config: QuantConfig | None, device: torch.device) -> str:
    """config.kv_cache_dtype, with "auto" resolved to the cache the checkpoint's quantization asks for
    (QuantConfig.kv_cache_dtype: fp8 for ModelOpt's kv_cache_quant_algo FP8, as vLLM resolves it). On a GPU
    without FP8 conversions (before sm89) "auto" keeps the model dtype, with a warning: the user asked for
    no particular cache, and an explicit "fp8" is still refused there by name."""
    wanted = quant_config.kv_cache_dtype if quant_config is not None else None
    if config.kv_cache_dtype != "auto" or wanted is None:
        return config.kv_cache_dtype
    old_gpu = fp8_unsupported_gpu(device) if wanted in ("fp8", "fp8_e4m3") else None
    if old_gpu is not None:
        logger.warning("kv_cache_dtype auto: the checkpoint's KV scales are for an FP8 cache, which %s cannot "
                       "hold (sm89+); keeping the model dtype", old_gpu)
        return "auto"
    logger.info("kv_cache_dtype auto: %s, the KV cache the checkpoint's %s quantization calibrated scales for",
                wanted, quant_config.name if quant_config is not None else "")
    return wanted


def _region(sleep_memory: SleepMemory | None, tag: str) -> Any:
    return contextlib.nullcontext() if sleep_memory is None else sleep_memory.region(tag)


def num_speculative_tokens(config: EngineConfig) -> int:
    from ferrox.speculative_config import parse_speculative_config

    spec_config = parse_speculative_config(config.speculative_config)
    return spec_config.num_speculative_tokens if spec_config is not None else 0


def _draft_kv_cost(config: EngineConfig, dtype: torch.dtype, tp_size: int, max_num_seqs: int,
                   target_spec: Any = None) -> tuple[int, int]:
    """Under draft-model speculation, the draft model's KV bytes per block and its scratch blocks
    (worker/draft_model.py: a twin cache of the same block ids, plus proposal scratch per request);
    (0, 0) otherwise. The draft runs in the target's dtype."""
    from ferrox.speculative_config import parse_speculative_config
    from ferrox.worker.draft_model import scratch_blocks_per_request

    spec_config = parse_speculative_config(config.speculative_config)
    if spec_config is not None and spec_config.method == "mtp" and target_spec is not None:
        # One full-attention layer of the target's shape, in the model dtype (worker/mtp_proposer.py).
        from ferrox.worker.mtp_proposer import mtp_kv_shape

        per_block = math.prod(mtp_kv_shape(target_spec, 1, config.block_size, tp_size)) * dtype.itemsize
        return per_block, max_num_seqs * scratch_blocks_per_request(config.block_size,
                                                                     spec_config.num_speculative_tokens)
    if spec_config is None or spec_config.method != "draft_model" or spec_config.model is None:
        return 0, 0
    draft_source = resolve_model(spec_config.model)
    draft_spec = _cached_spec(draft_source, _mtime(draft_source.path))
    per_block = kv_cache_bytes_per_block(draft_spec, config.block_size, dtype, tp_size)
    return per_block, max_num_seqs * scratch_blocks_per_request(config.block_size, spec_config.num_speculative_tokens)


# Fewer whole max_model_len requests than this fit in the KV cache at once: start, with a warning.
KV_WARN_CONCURRENCY = 2


def check_kv_capacity(capacity_tokens: int, max_model_len: int, device_type: str, *,
                      block_count_override: bool = False) -> None:
    """Refuse an engine that could never finish one max_model_len request (as vLLM does); warn when
    only a few fit at once."""
    memory_flag = "--kv-cache-memory" if device_type == "cpu" else "--gpu-memory-utilization or --kv-cache-memory"
    if block_count_override:
        memory_flag = "--num-gpu-blocks-override"
    if capacity_tokens < max_model_len:
        raise ValueError(
            f"max_model_len: the KV cache holds {capacity_tokens} tokens, fewer than max_model_len={max_model_len}, "
            f"so one full-length request could never finish; lower --max-model-len (max_model_len=) to at most "
            f"{capacity_tokens}, or give the KV cache more memory ({memory_flag})"
        )
    concurrency = capacity_tokens / max_model_len
    if concurrency < KV_WARN_CONCURRENCY:
        logger.warning("the KV cache holds %d tokens: %.2f requests of max_model_len=%d fit at once (raise %s or "
                       "lower --max-model-len for more)", capacity_tokens, concurrency, max_model_len, memory_flag)
    else:
        logger.info("KV cache: %d tokens, %.1fx concurrency at max_model_len=%d", capacity_tokens, concurrency,
                    max_model_len)


def _show_progress_logs() -> None:
    """`LLM()` in a script that configured no logging still shows its loading phases (as vLLM's logger
    does): the "ferrox" logger gets an INFO handler of its own. A process that configured logging
    (`ferrox serve`, pytest, an application) keeps its own setup."""
    package = logging.getLogger("ferrox")
    if logging.getLogger().handlers or package.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(logging.INFO)


# Engines in one process share the weights of the same checkpoint (inference never writes them):
# a second LLM(...) with other scheduler settings, as tests and benchmarks build, costs no reload.
# Weak values: the weights are freed with the last engine that uses them.
_MODELS: weakref.WeakValueDictionary[tuple[Any, ...], Any] = weakref.WeakValueDictionary()


def _shared_model(source: ModelSource, spec: Any, dtype: torch.dtype, device: torch.device, load_format: str,
                  seed: int, tp: TPGroup, *, keep_quantized: bool = False, private: bool = False,
                  quant_config: QuantConfig | None = None, quantization: str | None = None,
                  hf_overrides: dict[str, Any] | None = None, cpu_offload_bytes: int = 0,
                  mm_limits: dict[str, int] | None = None, mm_encoder_tp_mode: str = "weights") -> Any:
    """private: a model of this engine's own (LoRA wraps its layers), neither shared nor cached.
    quantization, hf_overrides: what quant_config and spec were resolved from (part of the cache key).
    mm_limits, mm_encoder_tp_mode: what the vision side is built as (loader/model_loader.py load_model)."""
    keep_quantized = keep_quantized and source.format == "gguf"  # (only a GGUF has blocks to keep)
    if private:
        return load_model(source, spec, dtype=dtype, device=device, load_format=load_format, seed=seed,
                          keep_quantized=keep_quantized, quant_config=quant_config, cpu_offload_bytes=cpu_offload_bytes,
                          mm_limits=mm_limits, mm_encoder_tp_mode=mm_encoder_tp_mode)
    # A sharded model's layers hold its process group: another engine's group (after the first shut down,
    # its LLM still alive) needs its own model, or its collectives would run on the destroyed group. The
    # cached model keeps its group object alive, so the group's id cannot be reused while the entry lives.
    group = id(tp) if tp.size > 1 else 0
    key = (source.path, _mtime(source.path), str(dtype), str(device), load_format, seed, tp.rank, tp.size, group,
           keep_quantized, quantization, spec.rope_long_context, _overrides_key(hf_overrides),
           json.dumps(mm_limits, sort_keys=True), mm_encoder_tp_mode)
    model = _MODELS.get(key)
    if model is None:
        model = load_model(source, spec, dtype=dtype, device=device, load_format=load_format, seed=seed,
                           keep_quantized=keep_quantized, quant_config=quant_config,
                           mm_limits=mm_limits, mm_encoder_tp_mode=mm_encoder_tp_mode)
        _MODELS[key] = model
    return model


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(source: ModelSource, mtime: float, mode: str = "auto") -> Any:
    return load_tokenizer(source, mode)


@functools.lru_cache(maxsize=4)
def _cached_spec(source: ModelSource, mtime: float, overrides: str = "", config_format: str = "auto") -> Any:
    return load_model_spec(source, json.loads(overrides) if overrides else None, config_format)


def _overrides_key(hf_overrides: dict[str, Any] | None) -> str:
    """hf_overrides as a cache key (the spec's and the shared model's): canonical JSON, "" for none."""
    return json.dumps(hf_overrides, sort_keys=True) if hf_overrides else ""


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _eos_token_ids(tokenizer: Any, generation_defaults: dict[str, Any]) -> list[int]:
    ids = list(tokenizer.eos_token_ids or [])
    gen_eos = generation_defaults.get("eos_token_id")
    for t in gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []:
        if int(t) not in ids:
            ids.append(int(t))
    return ids


@torch.inference_mode()
def profile_gpu_kv_budget(
    model: Any,
    spec: Any,
    dtype: torch.dtype,
    device: torch.device,
    config: EngineConfig,
    num_tokens: int,
    num_seqs: int,
    tp_size: int = 1,
    max_model_len: int | None = None,
    kv_dtype: torch.dtype | None = None,
) -> int:
    """Run one forward pass at the largest step size and return the bytes left for the KV cache. kv_dtype: the
    cache's element type (default: config.kv_cache_dtype's)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    if kv_dtype is None:
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
    scratch, hidden, logits = profile_forward(model, spec, dtype, device, config.block_size, num_tokens, num_seqs,
                                              tp_size, kv_dtype=kv_dtype)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    scratch_bytes = sum(t.numel() * t.element_size() for t in scratch)
    del scratch, hidden, logits
    _compile_first_request_kernels(model, spec, kv_dtype, device, config.block_size, tp_size)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(config.gpu_memory_utilization * total) - (peak - scratch_bytes)
    budget -= _long_prefill_reserve(model, spec, dtype, kv_dtype, device, num_tokens, max_model_len or num_tokens,
                                     tp_size)
    # Other processes on the GPU count against us too.
    budget = min(budget, free - (1 << 28))
    logger.info(
        "GPU memory: total %.1f GiB, peak in profiling %.2f GiB, KV cache budget %.2f GiB",
        total / 2**30, (peak - scratch_bytes) / 2**30, budget / 2**30,
    )
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {config.gpu_memory_utilization} leaves no memory for the KV cache "
            f"(weights + activations take {(peak - scratch_bytes) / 2**30:.2f} GiB of {total / 2**30:.1f} GiB)"
        )
    return budget


def _long_prefill_reserve(model: Any, spec: Any, dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device,
                          num_tokens: int, max_model_len: int, tp_size: int) -> int:
    """Bytes a long chunk's cuDNN attention or FlashAttention-3 holds beyond what the profiling pass
    saw (its prefill is many short requests, which stay on the Triton kernel): kept out of the KV
    budget. cuDNN's estimate serves both: FlashAttention-3 gathers the same context (plus the chunk's
    own rows, fewer bytes than cuDNN's q copies and second output) with the same length cut."""
    from ferrox.distributed.sharding import local_num_kv_heads
    from ferrox.kernels import cudnn_prefill, fa3_prefill

    backend = getattr(model, "backend", None)
    if backend is not None and getattr(backend, "name", None) == "mla-triton":  # DeepSeek's latent attention, expanded (kernels/mla_prefill.py)
        from ferrox.kernels import mla_prefill

        mla = backend.mla
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if not mla_prefill.expanded_supported(device, dtype, kv_dtype, qk, mla.v_head_dim):
            return 0
        return mla_prefill.scratch_bytes(spec.num_heads // tp_size, qk, mla.qk_nope_head_dim, mla.v_head_dim,
                                         torch.empty((), dtype=dtype).element_size(), num_tokens)
    if getattr(backend, "name", None) != "triton":
        return 0
    if not (fa3_prefill.fa3_prefill_applies(device, dtype, kv_dtype, spec.head_dim)
            or cudnn_prefill.cudnn_prefill_applies(device, dtype, kv_dtype, spec.head_dim)):
        return 0
    return cudnn_prefill.scratch_bytes(spec.num_heads // tp_size, local_num_kv_heads(spec, tp_size), spec.head_dim,
                                       torch.empty((), dtype=dtype).element_size(), num_tokens, max_model_len,
                                       fp8_cache=kv_dtype != dtype)


@torch.inference_mode()
def profile_forward(
    model: Any,
    spec: Any,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    num_tokens: int,
    num_seqs: int,
    tp_size: int = 1,
    *,
    kv_dtype: torch.dtype | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The profiling pass: a forward over a dummy prefill step of num_tokens tokens in (up to)
    num_seqs requests, scheduled by a throwaway core scheduler (worker/dummy_batch.py) over a
    scratch KV cache just large enough for it, then the logits of each request's last token and
    the sampler's largest temporary. Returns (scratch KV caches, hidden states, logits); runs on
    any device (the memory accounting around it is the caller's). kv_dtype: the cache's element
    type (default: dtype), so that the kernels of the real cache compile here."""
    step = prefill_step(num_tokens, num_seqs, block_size)
    scratch = allocate_kv_caches(spec, step.num_blocks, block_size, kv_dtype or dtype, device, tp_size)
    t = upload_step(step.so, Uploader(device))
    hidden = model.forward(t.input_ids, t.positions, scratch, t.meta)
    logits = model.compute_logits(hidden.index_select(0, t.logits_indices))
    torch.softmax(logits, dim=-1)  # the sampler's largest temporary
    return scratch, hidden, logits


@torch.inference_mode()
def _compile_first_request_kernels(model: Any, spec: Any, kv_dtype: torch.dtype, device: torch.device,
                                   block_size: int, tp_size: int = 1) -> None:
    """Compile now what the first request would otherwise wait ~1 s for (Triton JIT): a dummy
    decode step of batch 1 (the one-token kernels of an eager decode), its one-row logits kernel
    (kernels/gemv.py; runs outside the CUDA graphs) and the sampler's one-pass draw. Measured on
    the embedded model on an H200: first chat 1.2 s -> ~0.1 s."""
    from ferrox.kernels.exponential_race import exponential_race

    step = decode_step(1, 2, block_size)
    scratch = allocate_kv_caches(spec, step.num_blocks, block_size, kv_dtype, device, tp_size)  # a few blocks
    t = upload_step(step.so, Uploader(device))
    hidden = model.forward(t.input_ids, t.positions, scratch, t.meta)
    row_logits = model.compute_logits(hidden.index_select(0, t.logits_indices))
    exponential_race(row_logits, torch.ones(1, device=device), torch.rand_like(row_logits))
