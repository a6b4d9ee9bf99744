"""Time to first token of long prompts on DeepSeek-V2-Lite (dummy weights, bf16, batch 1): the latent attention's
long chunks expanded through FlashAttention-3 (kernels/mla_prefill.py) or absorbed (FERROX_FA3_PREFILL=0).

    python benches/bench_mla_ttft.py                       # 8192 and 32768 tokens, the engine's default path
    FERROX_FA3_PREFILL=0 python benches/bench_mla_ttft.py  # the absorbed Triton MLA kernels, for the ratio

One request per length after a warm-up prompt; TTFT is the wall time of a one-token generate (prefill in
8192-token chunks, then the first token). The last line is the longest prompt's TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402

# DeepSeek-V2-Lite's config.json (15.7B parameters, 2.4B active), without its YaRN context extension.
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
    "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 40960,
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000, "routed_scaling_factor": 1.0,
    "scoring_func": "softmax", "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy",
    "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,32768")
    args = parser.parse_args()
    from ferrox import LLM, SamplingParams

    lengths = [int(x) for x in args.lengths.split(",")]
    config_path = Path(tempfile.mkdtemp(prefix="ferrox-bench-config-")) / "config.json"
    config_path.write_text(json.dumps(DEEPSEEK_V2_LITE))
    llm = LLM(model=bench_setup.make_model_dir(str(config_path)), load_format="dummy", dtype="bfloat16",
              max_model_len=max(lengths) + 16, max_num_batched_tokens=8192, kv_cache_memory=4 << 30)
    max_id = bench_setup.first_special_id(DEEPSEEK_V2_LITE)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(bench_setup.random_prompts(1, 9000, max_id, seed=1), params, use_tqdm=False)
    path = "absorbed (FERROX_FA3_PREFILL=0)" if os.environ.get("FERROX_FA3_PREFILL") == "0" else "engine default"
    print(f"DeepSeek-V2-Lite dummy, bf16, long MLA chunks: {path}")
    print("| prompt | TTFT s |")
    print("| --- | --- |")
    ttft = 0.0
    for i, length in enumerate(lengths):
        prompt = bench_setup.random_prompts(1, length, max_id, seed=10 + i)
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        ttft = time.perf_counter() - start
        print(f"| {length} | {ttft:.3f} |")
    print(f"\n{lengths[-1]} tokens: TTFT {ttft:.3f} s ({path})")


if __name__ == "__main__":
    main()
