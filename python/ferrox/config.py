"""EngineConfig: every argument of `LLM(...)` / `ferrox serve`, validated in one place.

This dataclass is the one source of the engine's configuration: `ferrox serve`'s engine flags
are generated from its fields (ferrox.entrypoints.cli), so each field's help text, choices and
documented default live here, in `dataclasses.field(metadata=...)`:

- "help": what the field does (required on every field);
- "default_help": how to describe the default when the value alone does not (a None that means
  "auto", or a device-dependent default); built from the same constants the resolve functions
  below use, so the help cannot drift from the code;
- "choices": the values accepted (the same tuples `__post_init__` validates against);
- "size": True for a byte count that the CLI accepts with units ("4GiB");
- "aliases": extra flag spellings kept for compatibility;
- "refuse_inverse": for a bool, why ferrox cannot do what its opposite value asks: the CLI then refuses the
  partner spelling (--enable-x of a --disable-x field, --no-x) by name instead of accepting it;
- "positional": True for the one field (model) taken as a positional CLI argument.

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
- async_scheduling: on for CUDA, off on CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

from ferrox.compilation_config import GraphPlan, graph_plan
from ferrox.kv_events_config import parse_kv_events_config
from ferrox.kv_transfer_config import parse_kv_transfer_config
from ferrox.media_io_config import parse_media_io_kwargs
from ferrox.pooling.params import parse_pooler_overrides
from ferrox.reasoning.parser import REASONING_PARSER_CHOICES, reasoning_parser_names
from ferrox.reasoning.plugin import load_reasoning_parser_plugin
from ferrox.speculative_config import SPEC_SHORTHANDS, parse_speculative_config, with_spec_shorthands
from ferrox.structured_outputs_config import parse_structured_outputs_config

CPU_DEFAULT_MAX_MODEL_LEN = 8192
CPU_DEFAULT_KV_CACHE_MEMORY = 2 << 30
GPU_DEFAULT_MAX_NUM_SEQS = 512
CPU_DEFAULT_MAX_NUM_SEQS = 64
GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "fp32", "fp16", "bf16")
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# Mirrors ferrox.loader.model_loader.LOAD_FORMATS (kept here so that config imports no torch).
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy", "mistral")
DEVICES = ("auto", "cpu", "cuda")
# layers/quant/config.py resolves these (tests check the two lists agree); "gguf" names a GGUF's blocks.
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "awq", "gptq", "modelopt", "awq_marlin", "gptq_marlin",
                        "compressed_tensors", "gguf")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3")
# vLLM's MambaDType: the element type of a hybrid model's recurrent states (worker/recurrent_states.py).
MAMBA_DTYPES = ("auto", "float32", "float16", "bfloat16")
# vLLM's MambaCacheMode: how a hybrid model's recurrent states take part in prefix caching (rust/state_snapshots.rs).
MAMBA_CACHE_MODES = ("none", "align", "all")
POLICIES = ("fcfs", "priority")
# rust/prefix_cache.rs HashAlgo::parse (vLLM's --prefix-caching-hash-algo names).
PREFIX_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# vLLM's engine-argument names where ferrox's field has another (LLM(scheduling_policy=...), and the
# flag spellings through each field's aliases).
_VLLM_KWARGS = {"scheduling_policy": "policy", "kv_cache_memory_bytes": "kv_cache_memory"}
# vLLM's --logprobs-mode: what a reported logprob is. raw_*: the model's logits before any sampling
# setting; processed_*: the logits the draw sees (layers/sampler.py processed_logits). *_logprobs:
# log-softmaxed; *_logits: as they are.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# "mp": one worker process per extra rank on this machine; "ray": ranks as Ray actors in a placement
# group (an existing cluster, or a local one); "uni": everything in the engine process (size 1 only).
EXECUTOR_BACKENDS = ("mp", "ray", "uni")
# vLLM's --runner; "auto" resolves once the architecture is known (ferrox.pooling.config.resolve_runner).
RUNNERS = ("auto", "generate", "pooling")
# vLLM's --convert: how a model runs for pooling (ferrox.pooling.convert).
CONVERT_TYPES = ("auto", "none", "embed", "classify")
# vLLM's --attention-backend / --moe-backend names that are kernels ferrox has, each -> ferrox's kernel set
# (kernels.select_kernels: "triton" on CUDA with Triton installed, "torch" otherwise; it picks the attention
# backend and the MoE experts' path together). "triton": ferrox's Triton attention (with its CUDA decode kernel
# and FlashAttention-3 / cuDNN for long prefill chunks where they apply) and its Triton fused-MoE kernels;
# "torch": its torch reference (SDPA attention, a per-expert MoE loop), the CPU's. A name is honoured where it
# is the kernel set the engine runs and refused by name elsewhere (check_kernel_backends).
ATTENTION_BACKENDS = {"TRITON_ATTN": "triton", "TORCH_SDPA": "torch", "CPU_ATTN": "torch"}
MOE_BACKENDS = {"triton": "triton"}
TOKENIZER_MODES = ("auto", "hf", "mistral")
# vLLM's --model-impl: ferrox's model families are its own ("vllm": the engine's native ones); running
# transformers' modelling code ("transformers", "terratorch") is not something it does.
MODEL_IMPLS = ("auto", "vllm")
# vLLM's --config-format: a Hugging Face config.json (or a GGUF's metadata), or Mistral's params.json
# (loader/config_file.py; mirrors its CONFIG_FORMATS).
CONFIG_FORMATS = ("auto", "hf", "mistral")
# vLLM's --mm-encoder-tp-mode: the vision encoder's weights sharded across the tensor-parallel ranks, or whole on
# each rank with a step's images split among them (models/vision/encoder_setup.py).
MM_ENCODER_TP_MODES = ("weights", "data")
# The modalities ferrox's multimodal models take (--limit-mm-per-prompt's keys beyond them may only be 0).
MM_MODALITIES = ("image", "video", "audio")
# vLLM's --mm-processor-cache-type: the front-end's LRU alone, or with the shared-memory ring the pixels cross to the
# engine cores through (multimodal/processor_cache.py, multimodal/shm_store.py).
MM_PROCESSOR_CACHE_TYPES = ("lru", "shm")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):g}GiB"


def _check_mm_limits(limits: Any) -> None:
    if limits is None:
        return
    if not isinstance(limits, dict):
        raise ValueError(f"limit_mm_per_prompt: must be a JSON object like {{\"image\": 2}}, got {limits!r}")
    for key, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"limit_mm_per_prompt.{key}: must be a count >= 0, got {value!r}")
        if key not in MM_MODALITIES and value:
            raise ValueError(f"limit_mm_per_prompt.{key}: ferrox takes images, videos and audio only ({key} inputs "
                             "are not supported)")


def _check_mm_processor_cache(size: Any, kind: Any, max_object_mb: Any) -> None:
    """--mm-processor-cache-gb / --mm-processor-cache-type / --mm-shm-cache-max-object-size-mb (vLLM's;
    multimodal/processor_cache.py, multimodal/shm_store.py)."""
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not size >= 0 or size == float("inf"):
        raise ValueError(f"mm_processor_cache_gb: must be a number of GiB >= 0 (0: no cache), got {size!r}")
    _choice("mm_processor_cache_type", kind, MM_PROCESSOR_CACHE_TYPES)
    if isinstance(max_object_mb, bool) or not isinstance(max_object_mb, int) or max_object_mb <= 0:
        raise ValueError(f"mm_shm_cache_max_object_size_mb: must be a positive integer (MiB), got {max_object_mb!r}")


def _normalize_kernel_backends(config: Any) -> None:
    """--attention-backend / --moe-backend as vLLM spells them (attention names in any case, 'auto' meaning
    the device's, as None does; MoE names lower case with '_' or '-'), refused by name where ferrox has no
    such kernels."""
    attention = config.attention_backend
    if attention is not None:
        if not isinstance(attention, str):
            raise ValueError(f"attention_backend: must be a backend name, got {attention!r}")
        attention = None if attention.lower() == "auto" else attention.upper()
        if attention is not None and attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: {attention!r} is not an attention backend ferrox has; it takes "
                             "'auto', 'TRITON_ATTN' (its Triton kernels, on CUDA) and 'TORCH_SDPA' / 'CPU_ATTN' "
                             "(its torch backend, on the CPU)")
        config.attention_backend = attention
    moe = config.moe_backend
    if not isinstance(moe, str):
        raise ValueError(f"moe_backend: must be a backend name, got {moe!r}")
    moe = moe.lower().replace("-", "_")
    if moe != "auto" and moe not in MOE_BACKENDS:
        raise ValueError(f"moe_backend: {moe!r} is not an MoE backend ferrox has; it takes 'auto' and 'triton' "
                         "(its Triton fused-MoE kernels, on CUDA)")
    config.moe_backend = moe


def check_kernel_backends(config: Any, kernel_set: str, device: str) -> None:
    """--attention-backend / --moe-backend against the kernel set the engine runs on `device`
    (kernels.select_kernels): a name is honoured where it is that set, refused by name where it is not."""
    for name, value, table in (("attention_backend", config.attention_backend, ATTENTION_BACKENDS),
                               ("moe_backend", config.moe_backend, MOE_BACKENDS)):
        wanted = table.get(value) if value is not None else None
        if wanted is None or wanted == kernel_set:
            continue
        where = "on CUDA with Triton installed" if wanted == "triton" else "on the CPU"
        runs = sorted(k for k, v in table.items() if v == kernel_set)
        raise ValueError(f"{name}: {value!r} is ferrox's {wanted} kernels, which it runs {where}; this engine runs "
                         f"on {device} with its {kernel_set} kernels ({', '.join(map(repr, ['auto', *runs]))})")


def _opt(help: str, default: Any = None, **meta: Any) -> Any:
    """A dataclass field carrying its CLI documentation (see the module docstring)."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


def _check_swap_space(swap_space: Any, tensor_parallel_size: Any) -> None:
    """vLLM's check of its (V1: unused) swap space against host memory, per GPU of the node."""
    if isinstance(swap_space, bool) or not isinstance(swap_space, (int, float)) or not swap_space >= 0:
        raise ValueError(f"swap_space: must be a number of GiB >= 0, got {swap_space!r}")
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return  # (no sysconf: nothing to compare with)
    ranks = tensor_parallel_size if isinstance(tensor_parallel_size, int) and tensor_parallel_size > 0 else 1
    usage = swap_space * (1 << 30) * ranks
    message = (f"swap_space: {usage / (1 << 30):.2f} GiB ({swap_space} GiB x {ranks} ranks) out of the "
               f"{total / (1 << 30):.2f} GiB of host memory")
    if usage > 0.7 * total:
        raise ValueError(f"{message} is too much (vLLM refuses more than 70%)")
    if usage > 0.4 * total:
        logging.getLogger(__name__).warning("%s is possibly too much", message)


def _check_partial_prefills(config: Any) -> None:
    """vLLM's concurrent partial prefills (rust/partial_prefills.rs), checked as vLLM's SchedulerConfig does."""
    _positive_int("max_num_partial_prefills", config.max_num_partial_prefills)
    _positive_int("max_long_partial_prefills", config.max_long_partial_prefills)
    if config.max_long_partial_prefills > config.max_num_partial_prefills:
        raise ValueError(f"max_long_partial_prefills: {config.max_long_partial_prefills} is more than "
                         f"max_num_partial_prefills ({config.max_num_partial_prefills})")
    if config.max_num_partial_prefills > 1 and (not config.enable_chunked_prefill or config.runner == "pooling"):
        raise ValueError("max_num_partial_prefills: prompts prefill together in chunks, so more than one needs "
                         "chunked prefill (it is off with enable_chunked_prefill false and for pooling models)")


def long_prefill_threshold(config: Any, max_model_len: int) -> int:
    """The threshold the scheduler gets: vLLM's default of 4% of the context with concurrent partial prefills."""
    if config.long_prefill_token_threshold or config.max_num_partial_prefills <= 1:
        return config.long_prefill_token_threshold
    return max(1, int(max_model_len * 0.04))


def _check_kv_offloading(config: Any) -> None:
    """--kv-offloading-size / --kv-offloading-backend (vLLM's), checked against host memory as swap_space is."""
    if config.kv_offloading_backend != "native":
        raise ValueError(f"kv_offloading_backend: {config.kv_offloading_backend!r} is not supported (ferrox's host "
                         "tier is 'native'; LMCache is not there)")
    tier = parse_kv_transfer_config(config.kv_transfer_config, config.block_size)
    if tier is not None and config.kv_offloading_size is not None:
        raise ValueError("kv_transfer_config: sizes the host tier, as kv_offloading_size does: give one of them")
    if tier is None and config.kv_offloading_size is None:
        return
    name, size = ("kv_transfer_config", tier.gib) if tier is not None else ("kv_offloading_size",
                                                                           config.kv_offloading_size)
    if tier is None and (isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0):
        raise ValueError(f"kv_offloading_size: must be a number of GiB > 0, got {size!r}")
    if not config.enable_prefix_caching:
        raise ValueError(f"{name}: the host tier holds prefix-cache blocks: it needs enable_prefix_caching")
    if size is None:
        return  # num_cpu_blocks: checked against host memory by the engine, which knows a block's bytes
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if size * (1 << 30) > 0.7 * total:
        raise ValueError(f"{name}: {size} GiB out of the {total / (1 << 30):.2f} GiB of host memory is "
                         "too much (at most 70%)")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = _opt(
        "model folder (Hugging Face layout) or .gguf file", positional=True,
        default_help="the embedded SmolLM2-135M-Instruct")
    tokenizer: str | None = _opt("tokenizer folder or .gguf file", default_help="the model's own")
    tokenizer_mode: str = _opt(
        "which tokenizer implementation (vLLM's): 'hf', the Hugging Face fast tokenizer (tokenizer.json, or a GGUF's "
        "vocabulary); 'mistral', Mistral's tekken.json through mistral_common, which also encodes chats (no chat "
        "template; sentencepiece tokenizer.model.v* files are refused); 'auto', 'mistral' for a folder with "
        "tekken.json and consolidated*.safetensors (as vLLM) or with tekken.json and no tokenizer.json, else 'hf'. "
        "vLLM's 'slow' is refused",
        "auto", choices=TOKENIZER_MODES)
    revision: str | None = _opt(
        "a hub model id's version in the Hugging Face cache: a branch or tag the cache has a ref for, or a "
        "commit (at least 7 characters) it has a snapshot of; also the tokenizer's when --tokenizer is not given",
        default_help="refs/main, else the newest snapshot")
    tokenizer_revision: str | None = _opt(
        "the tokenizer's version in the Hugging Face cache (vLLM's): a branch, tag or commit of --tokenizer's hub "
        "id, or of the model's when --tokenizer is not given", default_help="--revision for the model's own "
        "tokenizer, else refs/main")
    trust_remote_code: bool = _opt(
        "vLLM's permission to run a model repository's own Python code (auto_map). ferrox's model families are "
        "built in and it runs no code from a model folder whether or not this is set, so there is nothing for it "
        "to allow: accepted so that vLLM command lines and LLM(...) calls run unchanged", False)
    dtype: str = _opt("weights/activations dtype", "auto", choices=DTYPES,
                      default_help="auto: float32 on CPU (a quantized GGUF stays quantized: packed int4 "
                      "matmuls); on GPU the checkpoint's float16/bfloat16, bfloat16 for a float32 checkpoint")
    quantization: str | None = _opt(
        "weight quantization: 'fp8' quantizes an unquantized checkpoint at load time (FP8 E4M3, per-channel "
        "scales, dynamic per-token activations); the others name a quantized checkpoint's layout and must match "
        "its config.json quantization_config", choices=QUANTIZATION_METHODS, aliases=("-q",),
        default_help="the checkpoint's quantization_config, else none")
    kv_cache_dtype: str = _opt("KV cache element type: 'fp8' stores keys and values as FP8 E4M3 with per-layer "
                               "scales (the checkpoint's k_scale/v_scale, else 1.0), twice the tokens per byte; "
                               "'bfloat16' / 'float16' name the model's dtype (refused when it is another)",
                               "auto", choices=KV_CACHE_DTYPES,
                               default_help="auto: the model dtype (fp8 for a ModelOpt checkpoint whose "
                               "kv_cache_quant_algo is FP8, as vLLM)")
    mamba_cache_dtype: str = _opt(
        "hybrid models (Qwen3.5, Qwen3-Next; the Mamba2 hybrids Granite 4.0-H, Nemotron-H): element type of each "
        "request's recurrent states, the short convolution's and (unless mamba_ssm_cache_dtype says otherwise) the "
        "delta rule's or scan's",
        "auto", choices=MAMBA_DTYPES, default_help="auto: the model dtype")
    mamba_ssm_cache_dtype: str = _opt(
        "hybrid models: element type of the delta rule's (or Mamba2 scan's) state alone (float32 keeps the "
        "recurrence's sums exact over long contexts, at twice the bytes of bfloat16)",
        "auto", choices=MAMBA_DTYPES, default_help="auto: config.json's mamba_ssm_cache_dtype (Nemotron-H), else "
        "mamba_cache_dtype's")
    mamba_cache_mode: str | None = _opt(
        "hybrid linear-attention models and the prefix cache: 'align' keeps a request's recurrent state where a "
        "step ends on the mamba_block_size grid (a prompt's last chunk before its last grid point is cut to end "
        "there), so a later prompt sharing that prefix (the next turn of a conversation) resumes from it; 'none' "
        "serves them without prefix caching; 'all' (a state at every grid point inside a chunk) is refused",
        None, choices=MAMBA_CACHE_MODES, default_help="align with prefix caching on, else none")
    mamba_block_size: int | None = _opt(
        "hybrid models with prefix caching: tokens between the points where recurrent states may be kept, a "
        "multiple of block_size", None, default_help="256, rounded up to a multiple of block_size")
    calculate_kv_scales: bool = _opt(
        "with kv_cache_dtype fp8: measure each layer's K/V scales on the first step that serves requests (vLLM's: "
        "max |k| / 200, max |v| / 100, the divisors from K_SCALE_CONSTANT / V_SCALE_CONSTANT), replacing the "
        "checkpoint's or 1.0; refused with kv_cache_dtype auto", False)
    max_model_len: int | None = _opt(
        "context length (prompt + output) per request",
        default_help=f"the model's max_position_embeddings; on CPU at most {CPU_DEFAULT_MAX_MODEL_LEN}")
    skip_tokenizer_init: bool = _opt(
        "run without a tokenizer (vLLM's): prompts are token ids, outputs token ids with empty text, and no "
        "tokenizer file is read; text prompts, chat, stop strings, bad words and structured outputs are refused "
        "by name (EOS ids from generation_config.json / config.json)", False)
    disable_sliding_window: bool = _opt(
        "serve a model with sliding-window layers (Mistral's, Gemma's, gpt-oss's...) with full attention, its "
        "context capped to the window, as vLLM's; a model without one is unchanged", False)
    hf_overrides: dict[str, Any] | None = _opt(
        "fields of the model's config.json replaced before the model is built (vLLM's --hf-overrides, a JSON "
        "object), e.g. {\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
        "\"original_max_position_embeddings\": 32768}} for Qwen3 past 32k tokens; each key replaces the "
        "whole value", default_help="none")
    allowed_local_media_path: str | None = _opt(
        "a folder whose images requests may name by file:// URL or path (vLLM's; resolved, so a link or '..' "
        "out of it is refused)", default_help="none: local files are refused")
    allowed_media_domains: list[str] | None = _opt(
        "the only hosts http(s) images and videos may be fetched from (vLLM's; exact host names), redirects then "
        "not followed", nargs="+", default_help="any host")
    limit_mm_per_prompt: dict[str, int] | None = _opt(
        "most images, videos and audio clips one prompt may carry, as vLLM's JSON object {\"image\": N, "
        "\"video\": M, \"audio\": K} (other modalities only as 0)",
        default_help="no limit but the context")
    media_io_kwargs: dict[str, Any] | None = _opt(
        "arguments of the media loaders by modality (vLLM's JSON object): video num_frames (the frames kept of a "
        "file, default 32; -1: every frame, for a processor that samples by fps) and fps (at most duration * fps "
        "frames); a chat request's media_io_kwargs go over these; other keys are refused",
        default_help="none")
    mm_processor_kwargs: dict[str, Any] | None = _opt(
        "image processor settings over the model folder's (vLLM's JSON object): Qwen2-VL / Qwen2.5-VL's "
        "min_pixels and max_pixels (fewer pixels, fewer image tokens); other keys and families are refused",
        default_help="none")
    mm_processor_cache_gb: float = _opt(
        "GiB of processed images and videos (the image / video processor's pixels of one item) kept, by the item's "
        "content and the processor's settings, so a repeated one is not processed again (vLLM's; in the process that "
        "prepares prompts: the API server, or the offline LLM's); 0: no cache", 4.0)
    mm_processor_cache_type: str = _opt(
        "the processor cache's kind (vLLM's): 'lru', a least-recently-used cache of processed items in the process "
        "that prepares prompts, their pixels sent to the engine core with each request; 'shm', the same cache, and "
        "the pixels go to an engine core in its own process (ferrox serve, AsyncLLM) through a shared-memory FIFO "
        "ring of mm_processor_cache_gb GiB (allocated at start in /dev/shm), an item already there as a reference "
        "only (items over mm_shm_cache_max_object_size_mb, or finding no room, go inline). The offline LLM runs its "
        "core in the caller's process: its items never cross a socket, so 'shm' works there as 'lru'; with "
        "mm_processor_cache_gb 0 or a text model there is no store", "lru", choices=MM_PROCESSOR_CACHE_TYPES)
    mm_shm_cache_max_object_size_mb: int = _opt(
        "MiB: the largest item (its pixel bytes) the 'shm' store takes; larger ones go inline (vLLM's)", 128)
    language_model_only: bool = _opt(
        "serve a vision-language model as a text model (vLLM's): every modality's limit is 0, so a request's images "
        "and videos are refused as with --limit-mm-per-prompt '{\"image\": 0, \"video\": 0}' (the flag wins over "
        "that one, as vLLM's), and the vision encoder and projector are neither built nor loaded (their memory "
        "stays free; so too when --limit-mm-per-prompt alone gives every modality the model takes 0, as vLLM "
        "does); a text-only model is unchanged", False)
    mm_encoder_tp_mode: str = _opt(
        "how the vision encoder runs under tensor parallelism (vLLM's): 'weights' shards its attention and MLP "
        "weights across the ranks as the language model's are (each rank holds 1/N of them and runs every image "
        "with them; a tower whose heads or MLP width do not split N ways falls back to 'data'); 'data' keeps the "
        "whole encoder on every rank and splits each step's images among the ranks, their embeddings then "
        "gathered to every rank; the projector stays whole either way. One rank: the two are the same",
        "weights", choices=MM_ENCODER_TP_MODES)
    enable_prompt_embeds: bool = _opt(
        "accept prompts given as input embeddings (vLLM's: LLM.generate({\"prompt_embeds\": tensor}), /v1/completions' "
        "prompt_embeds, base64 of torch.save bytes); off, such prompts are refused. Only for text models whose "
        "forward takes input embeddings, without speculative decoding or tensor parallelism", False)
    seed: int = _opt("engine seed (dummy weights, unseeded sampling)", 0)
    load_format: str = _opt("weight format; 'dummy' = random weights of the real architecture; 'mistral' = Mistral's "
                            "native consolidated*.safetensors (its tensor names and rotary row order, mapped at load; "
                            "'auto' takes them when the folder has no Hugging Face-named weights or no config.json)",
                            "auto", choices=LOAD_FORMATS)
    model_impl: str = _opt(
        "which model implementation (vLLM's): 'auto' and 'vllm' are the engine's own (ferrox's built-in families, "
        "the only ones it has); 'transformers' (transformers' modelling code) is refused", "auto", choices=MODEL_IMPLS)
    config_format: str = _opt(
        "the model config's format (vLLM's): 'hf' reads config.json (or a GGUF's metadata); 'mistral' Mistral's "
        "params.json, mapped to the config it stands for (keys it cannot map are refused by name); 'auto' config.json, "
        "else params.json when that is all the folder has", "auto", choices=CONFIG_FORMATS)
    code_revision: str | None = _opt(
        "vLLM's revision of a hub model's own Python code (with trust_remote_code); ferrox runs no code from a "
        "model repository, so there is none to pick: accepted so vLLM command lines run unchanged",
        default_help="none")
    disable_cascade_attn: bool = _opt(
        "vLLM's switch off of cascade attention (one attention pass over a prefix the whole batch shares); ferrox "
        "has no cascade attention, so it is always off: accepted so vLLM command lines run unchanged", False,
        refuse_inverse="ferrox has no cascade attention to turn on (vLLM 0.34 has removed its own too)")
    device: str = _opt("where to run", "auto", choices=DEVICES, default_help="auto: cuda when available, else cpu")
    attention_backend: str | None = _opt(
        "the attention kernels (vLLM's name, any case): 'TRITON_ATTN' is ferrox's Triton attention (its CUDA "
        "decode kernel and FlashAttention-3 / cuDNN for long prefill chunks beside it), what it runs on CUDA; "
        "'TORCH_SDPA' / 'CPU_ATTN' its torch backend (SDPA), what it runs on the CPU; 'auto' the device's. "
        "A name the device does not run, and vLLM's other backends (FLASH_ATTN, FLASHINFER, ROCM_*...), are "
        "refused by name", default_help="auto")
    moe_backend: str = _opt(
        "the MoE experts' kernels (vLLM's name): 'triton' is ferrox's Triton fused-MoE kernels, what it runs on "
        "CUDA; 'auto' the device's (on the CPU a per-expert torch loop). vLLM's other backends (deep_gemm, "
        "cutlass, marlin, flashinfer_*, aiter...) are refused by name; a model without experts is unchanged",
        "auto")
    gpu_memory_utilization: float = _opt("fraction of GPU memory for weights, activations and KV cache", 0.9,
                                         aliases=("--device-memory-utilization",))
    kv_cache_memory: int | None = _opt(
        "KV cache size in bytes (the CLI accepts units: 512MiB, 4GiB)", size=True, aliases=("--kv-cache-memory-bytes",),
        default_help=f"on CPU {_gib(CPU_DEFAULT_KV_CACHE_MEMORY)} capped at half the available memory; "
        "on GPU sized from --gpu-memory-utilization after a profiling pass")
    num_gpu_blocks_override: int | None = _opt(
        "the KV cache's block count, the null block included, instead of the one the memory budget gives (vLLM's: "
        "for tests of preemption and of small caches; also on CPU)", default_help="from the memory budget")
    max_num_seqs: int | None = _opt(
        "most requests in the running batch",
        default_help=f"{GPU_DEFAULT_MAX_NUM_SEQS} on GPU, {CPU_DEFAULT_MAX_NUM_SEQS} on CPU")
    max_num_batched_tokens: int | None = _opt(
        "token budget of one engine step",
        default_help=f"{GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS} on GPU, {CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS} on CPU")
    enable_prefix_caching: bool = _opt("automatic prefix caching (reuse KV blocks of shared prompt prefixes)", True)
    prefix_caching_hash_algo: str = _opt(
        "the hash naming cached KV blocks (vLLM's): 'sha256' (truncated to 128 bits), which crafted prompts cannot "
        "collide, so one tenant cannot be served another's blocks; 'xxhash' (xxh3-128), cheaper, for prompts from "
        "one trusted party; 'sha256_cbor' / 'xxhash_cbor': vLLM's own block hashes bit for bit (its CBOR chain, "
        "rooted at PYTHONHASHSEED), which the KV events carry, for routers that compute block keys from prompts "
        "as vLLM does (llm-d)", "sha256", choices=PREFIX_HASH_ALGOS)
    enable_chunked_prefill: bool = _opt(
        "split long prompts across steps, beside running decodes; off, each prompt is computed in one step, so "
        "the step's token budget (max_num_batched_tokens) must hold the longest (it defaults to max_model_len then)",
        True)
    disable_chunked_mm_input: bool = _opt(
        "vLLM's: a multimodal item's tokens (an image's, a video's, an audio clip's) are never split across prefill "
        "steps: each is computed whole in one step, whose token budget must hold the largest (a longer item is "
        "refused naming max_num_batched_tokens). Off, a causal model's items are cut over chunked-prefill steps as "
        "text is; images whose tokens attend both ways (Gemma 3 / 4, ...) are computed whole either way", False)
    long_prefill_token_threshold: int = _opt(
        "at most this many of one request's prompt tokens per step (vLLM's; 0: off): a long prompt then shares "
        "steps with shorter ones instead of filling them (an image computed whole is not cut)", 0)
    max_num_partial_prefills: int = _opt(
        "prompts that may prefill together, sharing each step's token budget (vLLM's, with the meaning its "
        "documentation and V0 scheduler give it; its V1 scheduler does not enforce it): with more than one, a "
        "prompt in prefill computes at most budget / n tokens a step, n being the prompts that can prefill "
        "together, and at most --max-long-partial-prefills of them may be long, so shorter prompts pass long "
        "ones instead of waiting behind them; --long-prefill-token-threshold then defaults to 4% of "
        "--max-model-len; 1: off", 1)
    max_long_partial_prefills: int = _opt(
        "of the prompts prefilling together, how many may be long (more than --long-prefill-token-threshold "
        "tokens still to compute; vLLM's): a long prompt queued behind them waits while prompts after it go "
        "ahead", 1)
    block_size: int = _opt("tokens per KV-cache block", 16)
    policy: str = _opt("order of waiting requests: arrival (fcfs), or the request's priority field", "fcfs",
                       choices=POLICIES, aliases=("--scheduling-policy",))
    enforce_eager: bool = _opt("disable CUDA graphs (run every step eagerly)", False)
    cpu_offload_gb: float = _opt(
        "GiB of each GPU's weights to keep in host memory, read by the GPU in place at every step (vLLM's): a "
        "model larger than the GPU runs, slower by the bytes streamed over the host link; 0: none "
        "(loader/cpu_offload.py)", 0.0)
    kv_offloading_size: float | None = _opt(
        "GiB of host memory (pinned) for a second tier of the prefix cache, summed over the tensor-parallel ranks "
        "(vLLM's native KV offloading): cached blocks evicted from the device are copied there, and a prefix the "
        "device no longer holds is copied back instead of recomputed; needs prefix caching",
        default_help="none")
    kv_offloading_backend: str = _opt(
        "the offloading implementation (vLLM's): 'native' (ferrox's host tier) only; vLLM's 'lmcache' is refused",
        "native")
    kv_transfer_config: dict[str, Any] | None = _opt(
        "vLLM's KV connector (a JSON object): ferrox has its OffloadingConnector only, which is the host tier "
        "--kv-offloading-size sizes ('{\"kv_connector\": \"OffloadingConnector\", \"kv_role\": \"kv_both\", "
        "\"kv_connector_extra_config\": {\"cpu_bytes_to_use\": BYTES}}' or num_cpu_blocks per rank); "
        "disaggregated-prefill, LMCache and storage connectors are refused", default_help="none")
    swap_space: float | None = _opt(
        "vLLM's CPU swap space per GPU, GiB. vLLM's V1 engine, like ferrox, preempts by recomputing and never "
        "swaps KV blocks to the host, so it reserves nothing: it is checked as vLLM checks it (more than 70% of "
        "host memory across the tensor-parallel ranks is refused, more than 40% warned) and reported in "
        "cache_config_info", default_help="4, vLLM's, unchecked")
    compilation_config: dict[str, Any] | None = _opt(
        "vLLM's compilation settings, a JSON object (-cc; LLM(compilation_config=3) is a mode): ferrox runs no "
        "torch.compile, so it takes the keys that choose CUDA graphs, with vLLM's meaning -- cudagraph_mode "
        "FULL_AND_PIECEWISE (whole decode steps + piecewise graphs around attention for the others), "
        "FULL_DECODE_ONLY, PIECEWISE or NONE; cudagraph_capture_sizes; max_cudagraph_capture_size; mode 3 "
        "(VLLM_COMPILE) or 0 (NONE: no piecewise graphs); custom_ops ['all'] -- and refuses the others by name "
        "(ferrox/compilation_config.py)", aliases=("-cc",),
        default_help="FULL_AND_PIECEWISE at ferrox's own sizes")
    optimization_level: int = _opt(
        "vLLM's -O0 ... -O3: the defaults of what compilation_config leaves unset -- 0 no CUDA graphs, 1 piecewise "
        "graphs only, 2 and 3 whole decode steps + piecewise graphs", 2, aliases=("-O",))
    cudagraph_capture_sizes: list[int] | None = _opt(
        "the step sizes (tokens) to capture CUDA graphs for (vLLM's): decode graphs take those up to "
        "max_num_seqs, piecewise graphs those up to max_num_batched_tokens; larger steps run eagerly",
        nargs="+", item_type=int,
        default_help="decode 1, 2, 4, 8, 16, 24, ... max_num_seqs; piecewise 8 ... 512 (2048 for MoE models)")
    max_cudagraph_capture_size: int | None = _opt(
        "the largest step size captured (vLLM's): caps both ladders (and raises the piecewise one to it); with "
        "cudagraph_capture_sizes it must be their largest", default_help="the ladders' own tops")
    cuda_graph_sizes: list[int] | None = _opt(
        "vLLM's older name for the capture sizes: one value N is the largest size (as "
        "max_cudagraph_capture_size: the ladders 1, 2, 4, 8, 16, ... up to N), several are the sizes themselves "
        "(as cudagraph_capture_sizes)", nargs="+", item_type=int, default_help="unset")
    enable_sleep_mode: bool = _opt(
        "allow sleep / wake_up (vLLM's): sleep(level=1) gives the GPU memory of the weights (kept in host memory) "
        "and of the KV cache (discarded) back until wake_up, without a reload; the server's /sleep, /wake_up and "
        "/is_sleeping with VLLM_SERVER_DEV_MODE=1. Needs the torch-memory-saver package on CUDA", False)
    async_scheduling: bool | None = _opt(
        "schedule step N+1 while step N computes (CPU/GPU overlap)", default_help="on for CUDA, off on CPU")
    chat_template: str | None = _opt("chat template (jinja text or a .jinja file path) overriding the model's",
                                     default_help="the model's")
    served_model_name: str | list[str] | None = _opt(
        "model id(s) clients use: the server answers to each, /v1/models lists each, and responses name the "
        "first (vLLM's nargs: --served-model-name a b)", default_help="the model's name", nargs="+")
    max_logprobs: int = _opt("largest `logprobs` / `prompt_logprobs` a request may ask for", 20)
    logprobs_mode: str = _opt(
        "what logprobs report (vLLM's): raw_logprobs, the model's; raw_logits, its logits; processed_logprobs / "
        "processed_logits, after penalties, bias, masks, temperature, min-p and top-k/top-p (what the draw saw)",
        "raw_logprobs", choices=LOGPROBS_MODES)
    otlp_traces_endpoint: str | None = _opt(
        "export a span per request to this OpenTelemetry collector (vLLM's): OTLP over gRPC, or HTTP with "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf; vLLM's llm_request spans and gen_ai.* attributes, "
        "continuing the HTTP request's traceparent (needs pip install 'ferrox[otel]'; the server's, not the "
        "offline LLM's)", default_help="off")
    logits_processors: list[str] | None = _opt(
        "custom logits processor classes (vLLM's), as 'package.module:Class' (or the classes, offline): subclasses "
        "of ferrox.logits_processor.LogitsProcessor, vLLM's V1 interface, applied to every step's logits; requests "
        "reach them through extra_args (vllm_xargs over HTTP). Steps then run one at a time (no async "
        "scheduling); not with speculative decoding or pooling models", nargs="+", default_help="none")
    num_threads: int | None = _opt("CPU threads for the model (torch intra-op)", default_help="all cores torch sees")
    tensor_parallel_size: int = _opt("GPUs (or CPU processes) one model is sharded across (Megatron-style)", 1,
                                     aliases=("-tp",))
    pipeline_parallel_size: int = _opt("pipeline stages (only 1: pipeline parallelism is not implemented)", 1,
                                       aliases=("-pp",))
    data_parallel_size: int = _opt("engine replicas behind one API server, each with its own GPUs", 1,
                                   aliases=("-dp",))
    enable_expert_parallel: bool = _opt(
        "MoE models under tensor parallelism: split the experts across the ranks (E/N whole experts each) "
        "instead of sharding every expert", False, aliases=("-ep",))
    disable_custom_all_reduce: bool = _opt(
        "vLLM's switch from its custom all-reduce kernel to NCCL's; ferrox's tensor-parallel all-reduce always "
        "is NCCL's (gloo on CPU), so it holds with or without this", False,
        refuse_inverse="ferrox's tensor-parallel all-reduce is NCCL's (gloo on CPU); it has no custom all-reduce "
        "kernel to turn on")
    distributed_executor_backend: str | None = _opt(
        "how tensor-parallel workers are started", choices=EXECUTOR_BACKENDS,
        default_help="mp when tensor_parallel_size > 1, else uni")
    disable_log_stats: bool = _opt(
        "turn off the periodic engine stats log line (throughput, running/waiting, KV usage, prefix-cache hit "
        "rate; every 10 s while busy)", False)
    speculative_config: dict[str, Any] | None = _opt(
        "speculative decoding, vLLM's spelling (a JSON object on the CLI): {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": k, \"prompt_lookup_min\": 1, \"prompt_lookup_max\": 5} (prompt lookup) or "
        "{\"method\": \"draft_model\", \"model\": PATH, \"num_speculative_tokens\": k} (-sc; --spec-method, "
        "--spec-model and --spec-tokens set those keys, as vLLM's)", aliases=("-sc",),
        default_help="off")
    runner: str = _opt(
        "what the model is run for (vLLM's --runner): 'generate' text, or 'pooling' (embeddings: /v1/embeddings, "
        "LLM.embed); 'auto' picks pooling for encoder-only models (BertModel, RobertaModel, XLMRobertaModel) and "
        "generate otherwise; 'pooling' on a Llama/Qwen decoder embeds with its last token", "auto", choices=RUNNERS)
    convert: str = _opt(
        "how a model is adapted for pooling (vLLM's --convert): 'embed' (a causal LM embeds with its last token) or "
        "'classify' (a causal LM of a family with a sequence classifier becomes it: Qwen3ForCausalLM -> "
        "Qwen3ForSequenceClassification, its head from score.weight or from LM-head rows with classifier_from_token) "
        "run the model with runner 'pooling'; 'none' pools only models built for it; 'auto' adapts as the "
        "architecture says", "auto", choices=CONVERT_TYPES)
    pooler_config: dict[str, Any] | None = _opt(
        "a pooling model's pooling, overriding what its folder declares (vLLM's --pooler-config, a JSON object): "
        "{\"pooling_type\": \"MEAN\" | \"CLS\" | \"LAST\", \"normalize\": true | false}",
        default_help="the folder's modules.json + 1_Pooling/config.json, else CLS (encoders) or LAST (decoders), "
        "normalized")
    enable_lora: bool = _opt("serve LoRA adapters over the base model (requests pick one with lora_request, or "
                             "by name in the `model` field)", False)
    max_loras: int = _opt("most distinct LoRA adapters in one batch (the GPU-resident adapter slots)", 1)
    max_lora_rank: int = _opt("largest LoRA rank an adapter may have (slots are sized for it)", 16)
    max_cpu_loras: int | None = _opt("LoRA adapters kept in CPU memory (an LRU cache behind the GPU slots)",
                                     default_help="max_loras")
    reasoning_parser: str | None = _opt(
        "how a reasoning model's thinking is told from its answer (vLLM's --reasoning-parser): 'deepseek_r1' "
        "(DeepSeek-R1 and its distills, QwQ), 'qwen3', 'glm45' / 'glm47' (GLM-4.5 / 4.6 / 4.7), 'seed_oss' "
        "(Seed-OSS's <seed:think>), 'deepseek_v3' "
        "(DeepSeek-V3.1 / V3.2: thinks only with chat_template_kwargs thinking true), 'kimi_k2' (Kimi-K2-Thinking / "
        "K2.5: thinks unless thinking false), 'minimax_m2' (MiniMax-M2 / M2.1 / M2.5; 'minimax_m2_append_think' "
        "keeps the thinking in the content, after a '<think>'), 'mistral' (Magistral's [THINK] / [/THINK]), "
        "'granite' (Granite 3.2+'s 'Here is my thought process:' / 'Here is my response:' text, with thinking "
        "true), 'gemma4' (Gemma 4's <|channel>thought ... <channel|>, with enable_thinking true) or 'openai_gptoss' "
        "(gpt-oss's harmony channels); the chat API "
        "then returns the thinking as `reasoning`, parses tool calls from the answer only, and structured outputs "
        "constrain the answer after the end of thinking (refused with granite and openai_gptoss, as are "
        "thinking budgets)",
        choices=REASONING_PARSER_CHOICES, default_help="none: the whole output is the content")
    reasoning_parser_plugin: str | None = _opt(
        "a Python file run at start-up (vLLM's) that registers reasoning parsers for --reasoning-parser: ferrox marker "
        "families (ferrox.reasoning.plugin.register_reasoning_parser)", default_help="none")

    kv_events_config: dict[str, Any] | None = _opt(
        "vLLM's KV cache events for KV-aware routers, a JSON object: enable_kv_cache_events, publisher ('zmq', "
        "the default once enabled, or 'null'), endpoint (tcp://*:5557), replay_endpoint, buffer_steps, hwm, "
        "max_queue_size, topic; blocks stored / removed / all cleared, in vLLM's msgpack format "
        "(ferrox/engine/kv_events.py)", default_help="off")
    structured_outputs_config: dict[str, Any] | None = _opt(
        "vLLM's engine-level structured-output settings, a JSON object: backend 'auto' or 'guidance' (ferrox's "
        "one backend, llguidance; xgrammar, outlines, lm-format-enforcer refused), disable_any_whitespace and "
        "disable_additional_properties as the default of requests that do not set them, reasoning_parser (as "
        "--reasoning-parser), enable_in_reasoning (constrain the thinking too), disable_fallback "
        "(ferrox/structured_outputs_config.py)", default_help="guidance, ferrox's JSON defaults")

    def __post_init__(self) -> None:
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype) if isinstance(self.dtype, str) else self.dtype
        _choice("dtype", self.dtype, DTYPES)
        _choice("load_format", self.load_format, LOAD_FORMATS)
        _choice("device", self.device, DEVICES)
        _choice("tokenizer_mode", self.tokenizer_mode, TOKENIZER_MODES)
        _choice("model_impl", self.model_impl, MODEL_IMPLS)
        _choice("config_format", self.config_format, CONFIG_FORMATS)
        _normalize_kernel_backends(self)
        if self.device == "cpu":  # (on CUDA the kernel set depends on Triton: the engine checks, check_kernel_backends)
            check_kernel_backends(self, "torch", "cpu")
        if self.quantization is not None:
            _choice("quantization", self.quantization, QUANTIZATION_METHODS)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("mamba_cache_dtype", self.mamba_cache_dtype, MAMBA_DTYPES)
        _choice("mamba_ssm_cache_dtype", self.mamba_ssm_cache_dtype, MAMBA_DTYPES)
        if self.mamba_cache_mode is not None:
            _choice("mamba_cache_mode", self.mamba_cache_mode, MAMBA_CACHE_MODES)
        self._check_logits_processors()
        if self.calculate_kv_scales and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError("calculate_kv_scales: measures the scales of an FP8 KV cache; kv_cache_dtype is "
                             f"{self.kv_cache_dtype!r} (set it to 'fp8')")
        _choice("policy", self.policy, POLICIES)
        _choice("prefix_caching_hash_algo", self.prefix_caching_hash_algo, PREFIX_HASH_ALGOS)
        _choice("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        _positive_int("max_model_len", self.max_model_len, optional=True)
        _positive_int("max_num_seqs", self.max_num_seqs, optional=True)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens, optional=True)
        _positive_int("kv_cache_memory", self.kv_cache_memory, optional=True)
        _positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override, optional=True)
        _positive_int("mamba_block_size", self.mamba_block_size, optional=True)
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(f"num_gpu_blocks_override: {self.num_gpu_blocks_override} leaves no block for tokens "
                             "(one is the null block)")
        _positive_int("block_size", self.block_size)
        if isinstance(self.cpu_offload_gb, bool) or not isinstance(self.cpu_offload_gb, (int, float)) \
                or not self.cpu_offload_gb >= 0:
            raise ValueError(f"cpu_offload_gb: must be a number of GiB >= 0, got {self.cpu_offload_gb!r}")
        if self.swap_space is not None:
            _check_swap_space(self.swap_space, self.tensor_parallel_size)
        _check_kv_offloading(self)
        if self.cpu_offload_gb and self.enable_sleep_mode:
            raise ValueError("cpu_offload_gb: sleep mode moves the weights into a device region of its own; the two "
                             "cannot be combined")
        if self.cpu_offload_gb and self.quantization == "fp8":
            raise ValueError("cpu_offload_gb: quantization 'fp8' converts every weight after loading into new device "
                             "tensors, so nothing would stay offloaded; use an FP8 checkpoint or no offload")
        if isinstance(self.compilation_config, int) and not isinstance(self.compilation_config, bool):
            self.compilation_config = {"mode": self.compilation_config}  # vLLM's shorthand: a mode
        self.graph_plan()  # raises ValueError naming the key or flag
        if isinstance(self.long_prefill_token_threshold, bool) or not isinstance(self.long_prefill_token_threshold, int) \
                or self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold: must be an integer >= 0 (0: off), got "
                             f"{self.long_prefill_token_threshold!r}")
        if self.long_prefill_token_threshold and (not self.enable_chunked_prefill or self.runner == "pooling"):
            raise ValueError("long_prefill_token_threshold: caps prefill chunks, so it needs chunked prefill (it is "
                             "off with enable_chunked_prefill false and for pooling models)")
        _check_partial_prefills(self)
        _positive_int("max_logprobs", self.max_logprobs)
        _positive_int("num_threads", self.num_threads, optional=True)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        _positive_int("data_parallel_size", self.data_parallel_size)
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size: {self.pipeline_parallel_size} is not supported (ferrox runs "
                             "one pipeline stage; use tensor_parallel_size to shard a model across GPUs)")
        if self.distributed_executor_backend is not None:
            _choice("distributed_executor_backend", self.distributed_executor_backend, EXECUTOR_BACKENDS)
            if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
                raise ValueError(f"distributed_executor_backend: 'uni' runs one rank, tensor_parallel_size is "
                                 f"{self.tensor_parallel_size} (use 'mp' or 'ray')")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.hf_overrides is not None and (not isinstance(self.hf_overrides, dict) or not all(
                isinstance(k, str) for k in self.hf_overrides)):
            raise ValueError(f"hf_overrides: must be a JSON object of config.json fields, got {self.hf_overrides!r}")
        _check_mm_limits(self.limit_mm_per_prompt)
        _choice("mm_encoder_tp_mode", self.mm_encoder_tp_mode, MM_ENCODER_TP_MODES)
        if self.language_model_only and any((self.limit_mm_per_prompt or {}).values()):
            # vLLM's precedence (MultiModalConfig.get_limit_per_prompt): the flag sets every limit to 0.
            logging.getLogger(__name__).warning(
                "language_model_only: every modality's limit is 0, over limit_mm_per_prompt %s",
                self.limit_mm_per_prompt)
        parse_media_io_kwargs(self.media_io_kwargs)  # (InvalidArgumentError is a ValueError naming the key)
        if self.mm_processor_kwargs is not None and not isinstance(self.mm_processor_kwargs, dict):
            raise ValueError(f"mm_processor_kwargs: must be a JSON object, got {self.mm_processor_kwargs!r}")
        _check_mm_processor_cache(self.mm_processor_cache_gb, self.mm_processor_cache_type,
                                  self.mm_shm_cache_max_object_size_mb)
        parse_speculative_config(self.speculative_config)  # raises ValueError naming the key
        _choice("runner", self.runner, RUNNERS)
        _choice("convert", self.convert, CONVERT_TYPES)
        if self.convert in ("embed", "classify") and self.runner == "generate":
            raise ValueError(f"convert: {self.convert!r} adapts the model for pooling; runner is 'generate' "
                             "(use runner 'pooling' or 'auto')")
        parse_pooler_overrides(self.pooler_config)  # raises ValueError naming the key
        if self.runner == "pooling":
            self.check_graphs_for_pooling()
        if self.runner == "pooling" and self.speculative_config:
            raise ValueError("speculative_config: a pooling model generates no tokens to speculate on (leave "
                             "speculative_config unset with runner 'pooling')")
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        _positive_int("max_cpu_loras", self.max_cpu_loras, optional=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: {self.max_cpu_loras} is less than max_loras ({self.max_loras})")
        if self.skip_tokenizer_init:
            for name, value in (("tokenizer", self.tokenizer), ("tokenizer_revision", self.tokenizer_revision),
                                ("reasoning_parser", self.reasoning_parser)):
                if value is not None:
                    raise ValueError(f"{name}: {value!r} needs the tokenizer, which skip_tokenizer_init leaves "
                                     "unloaded")
        if self.tokenizer_mode == "mistral" and self.chat_template is not None:
            raise ValueError("chat_template: tokenizer_mode 'mistral' encodes chats with mistral_common, not a chat "
                             "template (vLLM refuses one too); leave chat_template unset")
        if parse_kv_events_config(self.kv_events_config).enable_kv_cache_events and not self.enable_prefix_caching:
            raise ValueError("kv_events_config.enable_kv_cache_events: the events are the prefix cache's; they need "
                             "enable_prefix_caching")
        # structured_outputs_config's reasoning keys are the flags of the same names: given twice, they must agree.
        so_config = parse_structured_outputs_config(self.structured_outputs_config)
        for name in ("reasoning_parser", "reasoning_parser_plugin"):
            so_value, own = getattr(so_config, name), getattr(self, name)
            if so_value is not None:
                if own is not None and own != so_value:
                    raise ValueError(f"structured_outputs_config.{name}: {so_value!r} differs from {name} {own!r}; "
                                     "give it once")
                setattr(self, name, so_value)
        load_reasoning_parser_plugin(self.reasoning_parser_plugin)  # (its names before the check below)
        if self.reasoning_parser is not None:
            _choice("reasoning_parser", self.reasoning_parser, reasoning_parser_names())
            if self.runner == "pooling":
                raise ValueError("reasoning_parser: a pooling model generates no text to parse (leave it unset "
                                 "with runner 'pooling')")
        if isinstance(self.served_model_name, (list, tuple)):
            names = list(self.served_model_name)
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"served_model_name: must be a name or a non-empty list of names, got {names!r}")
            self.served_model_name = names[0] if len(names) == 1 else names
        for name in ("model", "tokenizer", "chat_template") + (
                () if isinstance(self.served_model_name, list) else ("served_model_name",)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name}: must be a string, got {type(value).__name__}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments (LLM(**kw), CLI flags); an unknown name is a ValueError."""
        for vllm_name, name in _VLLM_KWARGS.items():
            if vllm_name in kwargs:
                if name in kwargs:
                    raise ValueError(f"{vllm_name}: give it or {name}, not both (the same setting)")
                kwargs[name] = kwargs.pop(vllm_name)
        # vLLM's spec_method / spec_model / spec_tokens (--spec-*): keys of speculative_config.
        shorthands = {name: kwargs.pop(name) for name in SPEC_SHORTHANDS if name in kwargs}
        if any(v is not None for v in shorthands.values()):
            kwargs["speculative_config"] = with_spec_shorthands(kwargs.get("speculative_config"), shorthands)
        # vLLM's hub token (bool: the stored login's): ferrox downloads nothing, so no request would carry it.
        token = kwargs.pop("hf_token", None)
        if token is not None and not isinstance(token, (bool, str)):
            raise ValueError(f"hf_token: must be a token string or a bool, got {type(token).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def mm_limits(self) -> dict[str, int] | None:
        """The images and videos a prompt may carry, by modality (None: no limit but the context):
        limit_mm_per_prompt, or 0 for every modality under language_model_only (vLLM's rule)."""
        if self.language_model_only:
            return {**(self.limit_mm_per_prompt or {}), **dict.fromkeys(MM_MODALITIES, 0)}
        return self.limit_mm_per_prompt

    def served_names(self) -> list[str]:
        """--served-model-name as a list (empty: the model's own name); the first names responses."""
        name = self.served_model_name
        return [] if name is None else [name] if isinstance(name, str) else list(name)

    def graph_plan(self, log: bool = False) -> GraphPlan:
        """Which CUDA graphs the engine captures (ferrox/compilation_config.py)."""
        sizes, top = self.cudagraph_capture_sizes, self.max_cudagraph_capture_size
        if self.cuda_graph_sizes:
            if sizes or top:
                raise ValueError("cuda_graph_sizes: vLLM's older name of cudagraph_capture_sizes / "
                                 "max_cudagraph_capture_size; give one of them")
            sizes, top = (None, self.cuda_graph_sizes[0]) if len(self.cuda_graph_sizes) == 1 else (
                list(self.cuda_graph_sizes), None)
        return graph_plan(self.compilation_config, cudagraph_capture_sizes=sizes, max_cudagraph_capture_size=top,
                          enforce_eager=self.enforce_eager, optimization_level=self.optimization_level, log=log)

    def _check_logits_processors(self) -> None:
        """Their form here (class paths or classes); they are imported by the engine (ferrox.logits_processor)."""
        procs = self.logits_processors
        if procs is None:
            return
        if isinstance(procs, (str, type)):
            procs = self.logits_processors = [procs]
        if not isinstance(procs, (list, tuple)) or not all(isinstance(p, (str, type)) for p in procs):
            raise ValueError(f"logits_processors: must be a list of class paths ('package.module:Class') or classes, "
                             f"got {procs!r}")
        if not procs:
            self.logits_processors = None
            return
        if self.speculative_config:
            raise ValueError("logits_processors: custom logits processors see one row per request, which speculative "
                             "decoding does not give (as in vLLM); leave speculative_config unset")
        if self.async_scheduling:
            raise ValueError("async_scheduling: custom logits processors need each step's tokens before the next step "
                             "is sampled; leave async_scheduling unset (off) with logits_processors")
        if self.runner == "pooling":
            raise ValueError("logits_processors: a pooling model samples no tokens")

    def check_graphs_for_pooling(self) -> None:
        """A pooling model runs every step eagerly (whole prompts of any shape): CUDA-graph settings asked
        of one are refused by name rather than ignored."""
        asked = (self.compilation_config or self.cudagraph_capture_sizes or self.max_cudagraph_capture_size
                 or self.cuda_graph_sizes)
        if asked and self.graph_plan().any:
            raise ValueError("compilation_config / cudagraph_capture_sizes / max_cudagraph_capture_size: a pooling "
                             "model runs its steps without CUDA graphs (whole prompts of any shape); leave them "
                             "unset or set cudagraph_mode NONE")

    # ---- device-dependent defaults, resolved by the engine ------------------------------------
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.tensor_parallel_size > 1 else "uni"

    def resolved_max_num_seqs(self, device: str) -> int:
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return GPU_DEFAULT_MAX_NUM_SEQS if device == "cuda" else CPU_DEFAULT_MAX_NUM_SEQS

    def resolved_max_num_batched_tokens(self, device: str) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS if device == "cuda" else CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS

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
