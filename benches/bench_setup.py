"""Shared set-up for the GPU benchmarks: a model folder for `load_format="dummy"`, random prompts,
and the machine's own ceilings (copy bandwidth, bf16 matmul rate) measured in the same run.

No tokenizer exists on the GPU machine, so `make_model_dir` writes a byte-level BPE
tokenizer.json built with the `tokenizers` package: the 256 byte symbols, synthetic multi-byte
tokens up to the first special id, and Llama-3-style special tokens (<|begin_of_text|>,
<|end_of_text|>, <|eom_id|>, <|eot_id|>, reserved ones) at the config's ids, so every id the
dummy model can emit decodes to bytes and the EOS ids are real special tokens.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LLAMA_8B_CONFIG = ROOT / "benches" / "configs" / "llama-3.1-8b" / "config.json"

_SPECIALS = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128006: "<|start_header_id|>",
             128007: "<|end_header_id|>", 128008: "<|eom_id|>", 128009: "<|eot_id|>"}


def _synthetic_vocab(size: int) -> dict[str, int]:
    """Byte-level tokens: the 256 byte symbols first, then distinct 2- and 3-symbol strings."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {sym: i for i, sym in enumerate(alphabet)}
    # Letters first so the early ids look like text when decoded; the rest of the alphabet after.
    letters = [c for c in alphabet if c.isalpha() and c.isascii()]
    ordered = letters + [c for c in alphabet if c not in letters]
    for a in ordered:
        for b in ordered:
            if len(vocab) >= size:
                return vocab
            vocab.setdefault(a + b, len(vocab))
    for a in ordered:
        for b in ordered:
            for c in letters:
                if len(vocab) >= size:
                    return vocab
                vocab.setdefault(a + b + c, len(vocab))
    return vocab


def build_tokenizer_json(vocab_size: int, first_special: int) -> str:
    """tokenizer.json text: byte-level BPE over `first_special` ordinary ids, specials above."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = _synthetic_vocab(min(first_special, vocab_size))
    merges: list[tuple[str, str]] = []
    for token in vocab:
        if len(token) == 2:  # a merge for each 2-symbol token, so encoding produces some of them
            merges.append((token[0], token[1]))
        if len(merges) >= 20000:
            break
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(_SPECIALS.get(i, f"<|reserved_special_token_{i - first_special}|>"), special=True)
                for i in range(first_special, vocab_size)]
    tok.add_special_tokens(specials)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"synthetic tokenizer has {tok.get_vocab_size()} ids, wanted {vocab_size}")
    return tok.to_str()


# config.json quantization_config of the quantized dummy models the benchmarks load (load_format="dummy"
# makes random weights in that layout): an AWQ int4 checkpoint, group 128, and a compressed-tensors
# FP8 weight-only (W8A16) one.
AWQ_INT4_G128 = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
W8A16_CHANNEL = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                 "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                               "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                           "symmetric": True, "dynamic": False}}}}


def make_model_dir(config_path: str | os.PathLike = LLAMA_8B_CONFIG, out_dir: str | None = None,
                   quantization_config: dict[str, Any] | None = None) -> str:
    """A folder with config.json (plus `quantization_config` when given) + tokenizer.json +
    tokenizer_config.json (temp dir unless given)."""
    config = json.loads(Path(config_path).read_text())
    folder = Path(out_dir or tempfile.mkdtemp(prefix="ferrox-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    if quantization_config is None:
        shutil.copy(config_path, folder / "config.json")
    else:
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    vocab_size = int(config["vocab_size"])
    bos = config.get("bos_token_id")
    eos = config.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos]
    first_special = first_special_id(config)
    (folder / "tokenizer.json").write_text(build_tokenizer_json(vocab_size, first_special))
    names = {i: _SPECIALS.get(i, f"<|reserved_special_token_{i - first_special}|>") for i in range(first_special, vocab_size)}
    tokenizer_config = {
        "bos_token": names.get(bos) if isinstance(bos, int) else None,
        "eos_token": names.get(eos_ids[0]) if eos_ids and isinstance(eos_ids[0], int) else None,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    return str(folder)


def _gpt_oss(layers: int, experts: int) -> dict[str, Any]:
    """gpt-oss's published config.json (MXFP4 experts) with `layers` layers of `experts` experts."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": experts, "num_experts_per_tok": 4, "experts_per_token": 4, "vocab_size": 201088,
        "rms_norm_eps": 1e-05, "rope_theta": 150000, "max_position_embeddings": 131072, "sliding_window": 128,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2), "swiglu_limit": 7.0,
        "attention_bias": True, "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 200002,
        "pad_token_id": 199999, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    }


# Dummy-weight configs beside bench_moe.CONFIGS (served by benches/live/serve_dummy.py --moe NAME): gpt-oss's
# two sizes with their experts in MXFP4 (kept packed on the GPU: layers/quant/mxfp4_moe.py).
GPT_OSS_CONFIGS = {"gpt-oss-20b": _gpt_oss(24, 32), "gpt-oss-120b": _gpt_oss(36, 128)}


def dummy_model_dir(config_path: str, moe: str | None = None) -> tuple[str, int]:
    """(a model folder for load_format="dummy", its first special id) from config.json, or from
    bench_moe.py's config named `moe` when given."""
    if moe is not None:
        import bench_moe

        config_path = str(Path(tempfile.mkdtemp(prefix="ferrox-bench-config-")) / "config.json")
        Path(config_path).write_text(json.dumps(bench_moe.CONFIGS.get(moe) or GPT_OSS_CONFIGS[moe]))
    config = json.loads(Path(config_path).read_text())
    return make_model_dir(config_path), first_special_id(config)


def random_prompts(num: int, input_len: int, max_id: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """Token-id prompts below the special ids (vLLM's throughput benchmark uses random ids too)."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(max_id) for _ in range(input_len)]} for _ in range(num)]


# Special ids below this (Llama 2 / Mixtral: <s> 1, </s> 2) are left among the ordinary byte-level
# tokens: the synthetic vocabulary keeps its specials above the ordinary ids (Llama 3's layout).
_LOW_SPECIALS = 256


def first_special_id(config: dict[str, Any]) -> int:
    eos = config.get("eos_token_id")
    ids = [config.get("bos_token_id"), *(eos if isinstance(eos, list) else [eos])]
    return min([i for i in ids if isinstance(i, int) and i >= _LOW_SPECIALS] + [int(config["vocab_size"])])


def num_params(config: dict[str, Any]) -> int:
    """Parameter count of a Llama-family config (what the weight bytes follow from)."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    vocab = config["vocab_size"]
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter + 2 * hidden
    lm_head = 0 if config.get("tie_word_embeddings") else vocab * hidden
    return vocab * hidden + layers * per_layer + hidden + lm_head


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 2) -> int:
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def attention_flops_per_token(config: dict[str, Any], context: float) -> float:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 4.0 * config["num_hidden_layers"] * heads * head_dim * context


def measure_copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second (median of 20)."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / _median_ms(lambda: dst.copy_(src), 20) / 1e6


def measure_matmul_tflops() -> float:
    """bf16 8192^3 matmul on random data (the compute ceiling the throughput floor uses)."""
    import torch

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    return 2 * 8192**3 / _median_ms(lambda: a @ b, 20) / 1e9


def release_engine(llm: Any) -> None:
    """Shut an LLM's engine down and give its GPU memory back (the next engine, or a floor's buffers,
    need what its KV cache held). The caller drops its own reference too."""
    import gc

    import torch

    llm.engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def graph_replay_ms(step, replays: int = 10) -> tuple[float, Any]:
    """(milliseconds a replay, what the captured step returned): step() run twice on a side stream
    (compiles, allocator warm-up), captured once in a CUDA graph, replayed `replays` times."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays, result


def timed_ms(fn, reps: int) -> list[float]:
    """CUDA-event times (ms) of `reps` runs of fn, after 3 untimed ones."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _median_ms(fn, reps: int) -> float:
    times = sorted(timed_ms(fn, reps))
    return times[len(times) // 2]


def environment() -> dict[str, str]:
    import torch

    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "none"
    info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    return info


def process_age_seconds() -> float:
    """Seconds since this process started (start-up time includes interpreter + imports)."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / ticks)
    except (OSError, ValueError, IndexError):
        return math.nan
