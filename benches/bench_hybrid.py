"""Hybrid Gated DeltaNet / attention models (Qwen3.5, Qwen3.6, Qwen3-Next: models/qwen3_5.py) on dummy weights:
batch-1 decode against the bytes a step must read, throughput, start-up time.

    python benches/bench_hybrid.py                                  # Qwen3.5-9B's shape, then Qwen3.5-35B-A3B's
    python benches/bench_hybrid.py --model qwen3.5-35b-a3b --enforce-eager
    python benches/bench_hybrid.py --model qwen3.5-9b --num-prompts 200 --mamba-ssm-cache-dtype float32

Configs are transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults (the 9B's and the 35B-A3B's shapes:
three Gated DeltaNet layers to one gated full-attention layer), written with a synthetic tokenizer
(bench_setup.make_model_dir), loaded with load_format="dummy" in bf16.

Floor of a batch-1 decode step: every weight but the input embedding (only the k routed experts of a sparse
layer, plus its shared expert and router), each linear-attention layer's recurrent state read and written once
(value heads x key dim x value dim, in the --mamba-ssm-cache-dtype), and the K/V the full-attention layers attend
over, divided by the streaming-read bandwidth measured in the same run (benches/floor.py).

Throughput: N x (input, output) random-id prompts with ignore_eos, all at once. Then the prefix cache's state
snapshots (mamba_cache_mode "align", rust/state_snapshots.rs): the last few conversations' second turns (prompt,
answer, 16 new tokens) prefilled to their first token, resuming from the snapshots the first turns left, against
the same prompts after reset_prefix_cache() (computed from their first token), in the same engine. Each model runs
in its own child process; the summary line comes last.
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

_COMMON = {"hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "attention_bias": False, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
           "torch_dtype": "bfloat16", "bos_token_id": 248_044, "eos_token_id": 248_046, "vocab_size": 248_320}
CONFIGS = {
    "qwen3.5-9b": {**_COMMON, "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                   "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
                   "num_attention_heads": 16, "num_key_value_heads": 4},
    "qwen3.5-35b-a3b": {**_COMMON, "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
                        "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
                        "num_key_value_heads": 2, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                        "num_experts_per_tok": 8, "num_experts": 256},
}


def layer_kinds(config: dict) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(config["num_hidden_layers"])]


def decode_bytes(config: dict, context_len: int, state_bytes: int = 2, dtype_bytes: int = 2) -> int:
    """Bytes a batch-1 decode step reads (module docstring)."""
    h, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv, w = config["linear_key_head_dim"], config["linear_value_head_dim"], config["linear_conv_kernel_dim"]
    key_dim, value_dim = hk * dk, hv * dv
    conv_dim = 2 * key_dim + value_dim
    linear = h * (conv_dim + value_dim + 2 * hv) + value_dim * h + conv_dim * w + dv
    attention = h * (2 * heads + 2 * kv) * d + heads * d * h + 2 * d
    if config.get("num_experts"):
        inter, shared = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
        mlp = 3 * h * inter * config["num_experts_per_tok"] + 3 * h * shared + h  # (+ the shared expert's gate)
        router = config["num_experts"] * h * 4  # (float32)
    else:
        mlp, router = 3 * h * config["intermediate_size"], 0
    total = vocab * h + h  # the LM head, the final norm (the input embedding reads one row)
    states = 0
    kv_read = 0
    for kind in layer_kinds(config):
        total += 2 * h + mlp + (linear if kind == "linear_attention" else attention)
        total += router // dtype_bytes
        if kind == "linear_attention":
            states += 2 * (hv * dk * dv * state_bytes + conv_dim * (w - 1) * dtype_bytes)  # read + written
        else:
            kv_read += 2 * kv * d * context_len * dtype_bytes
    return total * dtype_bytes + states + kv_read


def run_model(name: str, args: argparse.Namespace) -> dict:
    import torch
    from ferrox import LLM, SamplingParams

    config = CONFIGS[name]
    folder = Path(tempfile.mkdtemp(prefix=f"ferrox-bench-{name}-")) / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    model_dir = bench_setup.make_model_dir(folder / "config.json")
    on_gpu = torch.cuda.is_available()
    measured_at = time.perf_counter()
    read_gbps = floor.measure_read_bandwidth_gbps() if on_gpu else float("nan")
    if on_gpu:
        torch.cuda.empty_cache()
    measuring_s = time.perf_counter() - measured_at
    llm = LLM(model=model_dir, load_format="dummy", dtype="bfloat16", enforce_eager=args.enforce_eager,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype)
    ready_s = bench_setup.process_age_seconds() - measuring_s
    max_id = bench_setup.first_special_id(config)
    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(bench_setup.random_prompts(1, 32, max_id, seed=1), SamplingParams(max_tokens=1, **greedy),
                 use_tqdm=False)
    first_token_s = bench_setup.process_age_seconds() - measuring_s

    params = SamplingParams(max_tokens=args.output_len_b1, **greedy)
    llm.generate(bench_setup.random_prompts(1, 32, max_id, seed=2), params, use_tqdm=False)
    timer = StepTimer(llm.engine)
    decode_ms: list[float] = []
    for i in range(args.num_iters):
        timer.times_ms.clear()
        llm.generate(bench_setup.random_prompts(1, 32, max_id, seed=100 + i), params, use_tqdm=False)
        decode_ms.extend(timer.times_ms[1:])  # (the first step is the prefill)
    llm.engine.step = timer.inner

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

    # Second turns of the last conversations (their snapshots and blocks are the least recently used last).
    turn2 = [{"prompt_token_ids": [*o.prompt_token_ids, *o.outputs[0].token_ids, *range(5, 21)]}
             for o in outs[-args.turn2_prompts:]]
    one = SamplingParams(max_tokens=1, **greedy)
    hits_before = llm.engine.stats()["prefix_cache_hits"]
    start = time.perf_counter()
    llm.generate(turn2, one, use_tqdm=False)
    turn2_cached_s = time.perf_counter() - start
    turn2_hits = llm.engine.stats()["prefix_cache_hits"] - hits_before
    if not llm.reset_prefix_cache():
        raise RuntimeError("reset_prefix_cache refused: a block is still in use")
    start = time.perf_counter()
    llm.generate(turn2, one, use_tqdm=False)
    turn2_fresh_s = time.perf_counter() - start
    turn2_tokens = sum(len(p["prompt_token_ids"]) for p in turn2)
    state_bytes = 4 if args.mamba_ssm_cache_dtype == "float32" else 2
    step_bytes = decode_bytes(config, 32 + args.output_len_b1 // 2, state_bytes)
    floor_ms = step_bytes / (read_gbps * 1e6)
    step_ms = statistics.median(decode_ms)
    return {
        "benchmark": "hybrid", **bench_setup.environment(), "model": name, "enforce_eager": args.enforce_eager,
        "ssm_state_dtype": args.mamba_ssm_cache_dtype,
        "startup_ready_s": round(ready_s, 2), "startup_first_token_s": round(first_token_s, 2),
        "decode_b1_step_ms_median": round(step_ms, 3),
        "decode_b1_step_ms_p90": round(sorted(decode_ms)[int(0.9 * (len(decode_ms) - 1))], 3),
        "read_bandwidth_gbps": round(read_gbps, 1), "decode_b1_bytes_read_gb": round(step_bytes / 1e9, 3),
        "decode_b1_floor_ms": round(floor_ms, 3), "decode_b1_over_floor": round(step_ms / floor_ms, 3),
        "throughput_shape": f"{args.num_prompts}x({args.input_len},{args.output_len})",
        "throughput_elapsed_s": round(elapsed, 2), "total_tokens_per_s": round(total_tokens / elapsed, 1),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "turn2_prompts": len(turn2), "turn2_prompt_tokens": turn2_tokens, "turn2_hit_tokens": turn2_hits,
        "turn2_cached_s": round(turn2_cached_s, 3), "turn2_fresh_s": round(turn2_fresh_s, 3),
        "turn2_speedup": round(turn2_fresh_s / turn2_cached_s, 2),
    }


def summary(r: dict) -> str:
    return (f"{r['model']} (ssm state {r['ssm_state_dtype']}): batch-1 decode {r['decode_b1_step_ms_median']:.2f} ms "
            f"vs floor {r['decode_b1_floor_ms']:.2f} ms ({r['decode_b1_bytes_read_gb']} GB at "
            f"{r['read_bandwidth_gbps'] / 1e3:.2f} TB/s) = {r['decode_b1_over_floor']}x; {r['throughput_shape']} "
            f"{r['total_tokens_per_s']} total tok/s, {r['output_tokens_per_s']} output tok/s; start-up "
            f"{r['startup_ready_s']} s ready, {r['startup_first_token_s']} s first token; second turns "
            f"({r['turn2_prompts']} x {r['turn2_prompt_tokens'] // max(r['turn2_prompts'], 1)} tokens, "
            f"{r['turn2_hit_tokens']} from state snapshots) {r['turn2_cached_s']} s vs {r['turn2_fresh_s']} s "
            f"recomputed = {r['turn2_speedup']}x")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description="ferrox hybrid-model decode latency and throughput on dummy weights")
    parser.add_argument("--model", choices=[*CONFIGS, "all"], default="all")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--output-len-b1", type=int, default=128, help="tokens per batch-1 decode run")
    parser.add_argument("--num-iters", type=int, default=3, help="timed batch-1 runs")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--turn2-prompts", type=int, default=32, help="second turns timed with / without snapshots")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=["auto", "float32"])
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.model != "all":
        results = [run_model(args.model, args)]
    else:
        results = []
        for name in CONFIGS:  # one child process each: its memory is freed before the next loads
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                child = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--model", name,
                         "--json", out.name]
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
