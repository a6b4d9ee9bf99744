"""Mixture-of-experts models on dummy weights: batch-1 decode against the bytes it must read, throughput,
and start-up time (issue 14).

    python benches/bench_moe.py                               # every model below, one process each
    python benches/bench_moe.py --model qwen3-30b-a3b --enforce-eager
    python benches/bench_moe.py --model mixtral-8x7b --num-prompts 200
    python benches/bench_moe.py --model qwen3-30b-a3b --weights bf16,fp8,fp8-block   # FP8 experts side by side
    python benches/bench_moe.py --model gemma-4-26b-a4b                 # Gemma 4's MoE (bf16 only), batch 1 in graphs

Configs are the published config.json of each model, written into a folder with a synthetic
tokenizer (bench_setup.make_model_dir), loaded with load_format="dummy" in bf16.

Floors of a batch-1 decode step (bandwidths measured in this run): the honest one first
(benches/floor.py) -- the bytes it must read (the dense weights without the input embedding, only
its k experts of each sparse layer, and the KV it attends) over the best streaming-read bandwidth:
Qwen3-30B-A3B ~6.1 GB, Mixtral-8x7B ~25.5 GB -- then the older copy floor, the active weights with
the embedding table counted whole (~6.7 / ~25.9 GB) over device-to-device copy bandwidth. The
issue's target for Qwen3-30B-A3B is <= 1.3x.

Gemma 4 26B-A4B (google/gemma-4-26B-A4B's text_config as Gemma4ForCausalLM: 30 layers, 128 experts of 704
beside a dense MLP of 2112 in every layer, sliding layers of 8 x 256 KV heads and full layers of 2 x 512 with
k = v): floor.py's formulas do not describe its layer, so `gemma4_bytes` counts it (both MLPs, its two attention
shapes, the router in bf16, the sliding layers' KV up to the window): ~7.6 GB a batch-1 step (3.8 B weights: the
tied embedding is read whole as the LM head), of 50.5 GB in all.

Throughput: N x (input, output) random-id prompts with ignore_eos, all at once (vLLM's offline
benchmark), reported as total and output tokens/s.

Weights (`--weights`, a comma list run side by side, one child process each): bf16; fp8
(`quantization="fp8"`: E4M3 weights with a scale per row, activations per token); fp8-block (the
config gains Qwen3-30B-A3B-FP8's quantization_config, 128 x 128 weight blocks, activations per
group of 128, dummy codes and scales). An FP8 run's floor counts its quantized weights at one byte
(the embedding, LM head and KV cache stay bf16, the routers fp32).

Each model runs in a child process, so one model's engine and memory are gone before the next
loads; the summary line comes last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402
import floor  # noqa: E402
from bench_latency import StepTimer  # noqa: E402

CONFIGS = {
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "num_attention_heads": 32, "num_experts_per_tok": 2,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "vocab_size": 32000,
    },
    # google/gemma-4-26B-A4B's text_config (the multimodal checkpoint's language model, served as text).
    "gemma-4-26b-a4b": {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "attention_bias": False,
        "attention_k_eq_v": True, "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
        "enable_moe_block": True, "final_logit_softcapping": 30.0, "global_head_dim": 512, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2816, "hidden_size_per_layer_input": 0,
        "intermediate_size": 2112, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
        "max_position_embeddings": 262144, "moe_intermediate_size": 704, "num_attention_heads": 16,
        "num_experts": 128, "num_global_key_value_heads": 2, "num_hidden_layers": 30, "num_key_value_heads": 8,
        "num_kv_shared_layers": 0, "rms_norm_eps": 1e-06,
        "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                               "rope_type": "proportional"},
                            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        "sliding_window": 1024, "tie_word_embeddings": True, "top_k_experts": 8, "torch_dtype": "bfloat16",
        "use_double_wide_mlp": False, "vocab_size": 262144,
    },
}
# Configs whose layer floor.py's formulas do not describe: their bytes are counted here (gemma4_bytes).
GEMMA4 = ("gemma-4-26b-a4b",)


def gemma4_bytes(config: dict, context_len: int, dtype_bytes: int = 2) -> tuple[int, int, int]:
    """(bytes a batch-1 Gemma 4 MoE step reads -- weights without the input embedding, its k experts, the KV
    it attends --, active weight bytes with the embedding, all weight bytes). Per layer: the attention of its
    type (sliding: KV heads x head_dim; full: num_global_key_value_heads x global_head_dim, no v_proj with
    attention_k_eq_v), the dense GELU MLP, the router (E x H, in the model dtype, as models/gemma4.py keeps it)
    and top_k (or all) experts; the KV cache holds k and v for every layer, the sliding ones up to the window."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, experts, top_k = config["num_attention_heads"], config["num_experts"], config["top_k_experts"]
    expert = 3 * hidden * config["moe_intermediate_size"]
    fixed = 3 * hidden * config["intermediate_size"] + experts * hidden + hidden + experts + 8 * hidden + 1
    read = total = 0
    kv = 0
    for kind in config["layer_types"]:
        full = kind == "full_attention"
        head_dim = config["global_head_dim"] if full else config["head_dim"]
        kv_heads = config["num_global_key_value_heads"] if full and config["attention_k_eq_v"] else \
            config["num_key_value_heads"]
        planes = 1 if full and config["attention_k_eq_v"] else 2  # (k = v: one projection)
        attn = hidden * (heads + planes * kv_heads) * head_dim + heads * head_dim * hidden + 2 * head_dim
        read += attn + fixed + top_k * expert
        total += attn + fixed + experts * expert
        kv += 2 * kv_heads * head_dim * (context_len if full else min(context_len, config["sliding_window"]))
    head = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2) + hidden
    lm_head = vocab * hidden + hidden
    return ((read + lm_head) * dtype_bytes + kv * dtype_bytes, (read + head) * dtype_bytes,
            (total + head) * dtype_bytes)


def decode_bytes(config: dict, dtype_bytes: int = 2) -> tuple[int, int]:
    """(bytes a batch-1 decode step reads, bytes of all weights). The router is stored in fp32."""
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    experts = config.get("num_experts") or config["num_local_experts"]
    top_k = config["num_experts_per_tok"]
    expert_inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    attn = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    norms = 2 * hidden + (2 * head_dim if config["model_type"] == "qwen3_moe" else 0)
    per_expert = 3 * hidden * expert_inter
    dense = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2) + hidden
    router = experts * hidden * 4
    active = (dense + layers * (attn + norms + top_k * per_expert)) * dtype_bytes + layers * router
    total = (dense + layers * (attn + norms + experts * per_expert)) * dtype_bytes + layers * router
    return active, total


WEIGHTS = ("bf16", "fp8", "fp8-block")
BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def fp8_decode_bytes(config: dict, context_len: int) -> int:
    """Bytes a batch-1 step of an FP8 model reads: the quantized weights at one byte (floor.py counts the
    LM head with them, so its second byte is added), the KV cache in bf16."""
    lm_head = config["vocab_size"] * config["hidden_size"]
    return (floor.weight_bytes_read(config, 1, dtype_bytes=1) + lm_head
            + floor.kv_bytes_read(config, context_len, 1, dtype_bytes=2))


def run_model(name: str, args: argparse.Namespace, weights: str = "bf16") -> dict:
    import torch
    from ferrox import LLM, SamplingParams

    config = CONFIGS[name]
    folder = Path(tempfile.mkdtemp(prefix=f"ferrox-bench-{name}-")) / name
    folder.mkdir(parents=True)
    written = {**config, "quantization_config": BLOCK_FP8} if weights == "fp8-block" else config
    (folder / "config.json").write_text(json.dumps(written, indent=1))
    model_dir = bench_setup.make_model_dir(folder / "config.json")
    # The floors' bandwidths first: their 8 GiB buffers do not fit beside an engine that took 90% of an
    # 80 GB card (as bench_latency.py). Their time is taken off the start-up figures below.
    on_gpu = torch.cuda.is_available()
    measured_at = time.perf_counter()
    copy_gbps = bench_setup.measure_copy_bandwidth_gbps() if on_gpu else float("nan")
    read_gbps = floor.measure_read_bandwidth_gbps() if on_gpu else float("nan")
    if on_gpu:
        torch.cuda.empty_cache()
    measuring_s = time.perf_counter() - measured_at
    llm = LLM(model=model_dir, load_format="dummy", dtype="bfloat16", enforce_eager=args.enforce_eager,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              quantization="fp8" if weights == "fp8" else None)
    ready_s = bench_setup.process_age_seconds() - measuring_s
    max_id = bench_setup.first_special_id(config)
    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(bench_setup.random_prompts(1, 32, max_id, seed=1), SamplingParams(max_tokens=1, **greedy),
                 use_tqdm=False)
    first_token_s = bench_setup.process_age_seconds() - measuring_s

    # Batch-1 decode: warm-up at the measured shape, then timed runs (each step timed on the host).
    params = SamplingParams(max_tokens=args.output_len_b1, **greedy)
    llm.generate(bench_setup.random_prompts(1, 32, max_id, seed=2), params, use_tqdm=False)
    timer = StepTimer(llm.engine)
    decode_ms: list[float] = []
    for i in range(args.num_iters):
        timer.times_ms.clear()
        llm.generate(bench_setup.random_prompts(1, 32, max_id, seed=100 + i), params, use_tqdm=False)
        decode_ms.extend(timer.times_ms[1:])  # the first step is the prefill
    llm.engine.step = timer.inner

    # Throughput: every prompt submitted at once.
    prompts = bench_setup.random_prompts(args.num_prompts, args.input_len, max_id, seed=1000)
    tp_params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=1.0, top_p=1.0,
                               detokenize=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, tp_params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if out_tokens != args.num_prompts * args.output_len:
        raise RuntimeError(f"expected {args.num_prompts * args.output_len} output tokens, got {out_tokens}")
    total_tokens = out_tokens + sum(len(o.prompt_token_ids) for o in outs)

    context = 32 + args.output_len_b1 // 2  # the mean KV length of the timed steps
    if name in GEMMA4:
        step_bytes, active, total = gemma4_bytes(config, context)
    else:
        active, total = decode_bytes(config)
        step_bytes = floor.decode_bytes(config, context, 1) if weights == "bf16" else fp8_decode_bytes(config,
                                                                                                        context)
    copy_floor_ms = active / (copy_gbps * 1e6)
    honest_ms = step_bytes / (read_gbps * 1e6)
    step_ms = statistics.median(decode_ms)
    return {
        "benchmark": "moe",
        **bench_setup.environment(),
        "model": name,
        "weights": weights,
        "enforce_eager": args.enforce_eager,
        "startup_ready_s": round(ready_s, 2),
        "startup_first_token_s": round(first_token_s, 2),
        "weights_gb": round(total / 1e9, 2),
        "active_gb": round(active / 1e9, 2),
        "decode_b1_step_ms_median": round(step_ms, 3),
        "decode_b1_step_ms_p90": round(sorted(decode_ms)[int(0.9 * (len(decode_ms) - 1))], 3),
        # Honest floor first: bytes the step reads (no input embedding; k experts; KV) / streaming read.
        "read_bandwidth_gbps": round(read_gbps, 1),
        "decode_b1_bytes_read_gb": round(step_bytes / 1e9, 3),
        "decode_b1_honest_floor_ms": round(honest_ms, 3),
        "decode_b1_over_honest_floor": round(step_ms / honest_ms, 3),
        # The older copy floor: active weights (embedding included) / device-to-device copy bandwidth.
        "copy_bandwidth_gbps": round(copy_gbps, 1),
        "decode_b1_copy_floor_ms": round(copy_floor_ms, 3),
        "decode_b1_over_copy_floor": round(step_ms / copy_floor_ms, 3),
        "throughput_shape": f"{args.num_prompts}x({args.input_len},{args.output_len})",
        "throughput_elapsed_s": round(elapsed, 2),
        "total_tokens_per_s": round(total_tokens / elapsed, 1),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
    }


def summary(r: dict) -> str:
    return (f"{r['model']} {r.get('weights', 'bf16')}: batch-1 decode {r['decode_b1_step_ms_median']:.2f} ms vs honest floor "
            f"{r['decode_b1_honest_floor_ms']:.2f} ms ({r['decode_b1_bytes_read_gb']} GB read at "
            f"{r['read_bandwidth_gbps'] / 1e3:.2f} TB/s) = {r['decode_b1_over_honest_floor']}x, copy floor "
            f"{r['decode_b1_copy_floor_ms']:.2f} ms ({r['active_gb']} GB active at "
            f"{r['copy_bandwidth_gbps'] / 1e3:.2f} TB/s) = {r['decode_b1_over_copy_floor']}x; {r['throughput_shape']} "
            f"{r['total_tokens_per_s']} total tok/s, {r['output_tokens_per_s']} output tok/s; "
            f"start-up {r['startup_ready_s']} s ready, {r['startup_first_token_s']} s first token")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description="ferrox MoE decode latency and throughput on dummy weights")
    parser.add_argument("--model", choices=[*CONFIGS, "all"], default="all")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--output-len-b1", type=int, default=128, help="tokens per batch-1 decode run")
    parser.add_argument("--num-iters", type=int, default=3, help="timed batch-1 runs")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--weights", default="bf16",
                        help=f"comma list of {', '.join(WEIGHTS)}, run side by side (module docstring)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    weights = args.weights.split(",")
    if unknown := [w for w in weights if w not in WEIGHTS]:
        parser.error(f"--weights: unknown {', '.join(unknown)} (choose from {', '.join(WEIGHTS)})")
    if args.model in GEMMA4 and weights != ["bf16"]:
        parser.error(f"--model {args.model}: bf16 weights only (ferrox refuses quantized Gemma 4 checkpoints)")

    if args.model != "all" and len(weights) == 1:
        results = [run_model(args.model, args, weights[0])]
    else:
        results = []
        models = list(CONFIGS) if args.model == "all" else [args.model]
        for name in models:  # one child process per run: its memory is freed before the next loads
            for w in weights if name not in GEMMA4 else ["bf16"]:
                with tempfile.NamedTemporaryFile(suffix=".json") as out:
                    # The caller's flags first: the last --model / --weights / --json win.
                    child = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])]
                    child += ["--model", name, "--weights", w, "--json", out.name]
                    subprocess.run(child, check=True)
                    results.extend(json.loads(Path(out.name).read_text()))
    for r in results:
        print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("\n" + "\n".join(summary(r) for r in results))
    return results


if __name__ == "__main__":
    main()
