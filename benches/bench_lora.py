"""Multi-LoRA throughput and decode overhead (issue 15), side by side in one run:

    python benches/bench_lora.py                       # H200: 8B dummy, 4 adapters of rank 16
    python benches/bench_lora.py --config benches/configs/... --num-prompts 64 --device cpu
    python benches/bench_lora.py --moe qwen3-30b-a3b --num-adapters 2   # adapters on every expert too (lora/moe.py)

1. Mixed batch: N prompts (input x output tokens, ignore_eos) over the base model and the adapters
   in turn, on an engine with enable_lora (max_loras = the number of adapters); then the same
   prompts, no adapters, on an engine without LoRA. Ratio = LoRA tokens/s over base tokens/s.
2. Batch-1 decode: the ms per output token of one request with an adapter and without one, on the
   LoRA engine, and on the base engine.

The adapters are random PEFT-format folders (adapter_config.json + adapter_model.safetensors over
all seven projections; on an MoE config (--moe, bench_moe.py's CONFIGS) the attention's four and every
routed expert's gate / up / down, one module per expert as vLLM reads them), written here: no `peft`
needed on the GPU machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402

PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_random_adapter(config: dict, folder: Path, rank: int, seed: int) -> str:
    """A PEFT LoRA folder for a Llama-family config: A ~ N(0, 1/in), B ~ N(0, 0.01^2)."""
    import torch
    from safetensors.torch import save_file

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    modules = {f"model.layers.{layer}.{parent}.{proj}": shapes[proj] for layer in range(config["num_hidden_layers"])
               for proj, parent in PROJECTIONS.items()}
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if num_experts:  # every layer sparse (the configs of bench_moe.py): the attention's and the experts' modules
        block, names = ("block_sparse_moe", ("w1", "w3", "w2")) if "num_local_experts" in config else (
            "mlp", ("gate_proj", "up_proj", "down_proj"))
        expert_inter = config.get("moe_intermediate_size") or inter
        modules = {name: shape for name, shape in modules.items() if ".self_attn." in name}
        for layer in range(config["num_hidden_layers"]):
            for e in range(num_experts):
                for proj, shape in zip(names, ((hidden, expert_inter), (hidden, expert_inter), (expert_inter, hidden)),
                                       strict=True):
                    modules[f"model.layers.{layer}.{block}.experts.{e}.{proj}"] = shape
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (fan_in, fan_out) in modules.items():
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5).bfloat16()
        tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).bfloat16()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    targets = sorted({name.rsplit(".", 1)[1] for name in modules})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
        "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False, "task_type": "CAUSAL_LM"}))
    return str(folder)


def _throughput(llm, prompts, params, loras) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(p["prompt_token_ids"]) + len(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)) / elapsed


def _decode_ms(llm, prompt, params, lora) -> float:
    llm.generate([prompt], params.clone(max_tokens=8), use_tqdm=False, lora_request=lora)  # warm
    short = params.clone(max_tokens=16)
    start = time.perf_counter()
    llm.generate([prompt], short, use_tqdm=False, lora_request=lora)
    t_short = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
    t_long = time.perf_counter() - start
    return (t_long - t_short) / (params.max_tokens - 16) * 1000  # prefill and start-up cancel out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="ferrox multi-LoRA throughput and decode overhead")
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG))
    parser.add_argument("--moe", default=None, help="an MoE config of bench_moe.py (qwen3-30b-a3b, mixtral-8x7b) "
                        "instead of --config: adapters on the experts too")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=144)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args(argv)

    import torch
    from ferrox import LLM, SamplingParams
    from ferrox.lora.request import LoRARequest

    tmp = Path(tempfile.mkdtemp(prefix="ferrox-lora-"))
    if args.moe is not None:
        from bench_moe import CONFIGS

        (tmp / "config.json").write_text(json.dumps(CONFIGS[args.moe]))
        args.config = str(tmp / "config.json")
    config = json.loads(Path(args.config).read_text())
    model_dir = bench_setup.make_model_dir(args.config)
    adapters = [LoRARequest(f"a{i}", i + 1, write_random_adapter(config, tmp / f"a{i}", args.rank, i))
                for i in range(args.num_adapters)]
    prompts = bench_setup.random_prompts(args.num_prompts, args.input_len, bench_setup.first_special_id(config))
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    decode = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    mixed = [None if i % (len(adapters) + 1) == 0 else adapters[i % (len(adapters) + 1) - 1]
             for i in range(len(prompts))]
    common = dict(load_format="dummy", dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                  max_num_seqs=args.num_prompts)

    def release() -> None:  # after the caller dropped its engine: free its GPU memory for the next
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    lora_llm = LLM(model_dir, enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank, **common)
    _throughput(lora_llm, prompts[:8], params.clone(max_tokens=8), mixed[:8])  # warm every adapter slot
    lora_tps = _throughput(lora_llm, prompts, params, mixed)
    lora_b1 = _decode_ms(lora_llm, prompts[0], decode, adapters[0])
    lora_b1_base = _decode_ms(lora_llm, prompts[0], decode, None)
    lora_llm.engine.shutdown()
    del lora_llm
    release()

    base_llm = LLM(model_dir, **common)
    _throughput(base_llm, prompts[:8], params.clone(max_tokens=8), None)
    base_tps = _throughput(base_llm, prompts, params, None)
    base_b1 = _decode_ms(base_llm, prompts[0], decode, None)
    base_llm.engine.shutdown()
    del base_llm
    release()

    result = {"lora_tokens_per_s": lora_tps, "base_tokens_per_s": base_tps, "ratio": lora_tps / base_tps,
              "b1_ms_adapter": lora_b1, "b1_ms_lora_engine_no_adapter": lora_b1_base, "b1_ms_base_engine": base_b1}
    print(f"{'case':<44} {'value':>12}")
    print(f"{'mixed batch, LoRA engine (tokens/s)':<44} {lora_tps:>12.0f}")
    print(f"{'same prompts, base engine (tokens/s)':<44} {base_tps:>12.0f}")
    print(f"{'batch-1 decode, adapter (ms/token)':<44} {lora_b1:>12.3f}")
    print(f"{'batch-1 decode, LoRA engine, no adapter (ms)':<44} {lora_b1_base:>12.3f}")
    print(f"{'batch-1 decode, base engine (ms/token)':<44} {base_b1:>12.3f}")
    print(f"batch-1 adapter overhead: {lora_b1 / base_b1:.2f}x the base engine")
    print(f"mixed-batch throughput ratio (LoRA / base): {lora_tps / base_tps:.3f}")
    return result


if __name__ == "__main__":
    main()
