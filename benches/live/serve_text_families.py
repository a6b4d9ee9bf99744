"""Live `ferrox serve` of tiny folders of the text families added in the forty-fifth session: GLM-4-0414, GLM-4.5
(grouped sigmoid routing), DeepSeek-V2-Lite's and V3's layouts (latent attention), gpt-oss (sinks, windows, clamped
SwiGLU experts; its MXFP4 layout too), SmolLM3 (NoPE layers), OLMo 2, OLMoE, OLMo 3, EXAONE 4, ERNIE 4.5 (dense,
MoE), Cohere2, Llama 4 (chunked attention), Gemma 4, Ministral 3, Mistral Small 4, Qwen3.5 / Qwen3.5-MoE /
Qwen3-Next (hybrid linear attention), Granite 4.0-H and Nemotron-H (Mamba2 hybrids), Qwen3.5, Qwen3-Next, GLM-4.5,
DeepSeek-V3 and Nemotron 3 Super drafting with their MTP layers (mtp-*), and a harmony- speaking Llama under `--reasoning-parser
openai_gptoss --tool-call-parser openai`. Per family: 24 concurrent greedy completions (prompts of 4 to 150 token
ids, cut across chunked-prefill steps by --max-num-batched-tokens 24) compared with the offline LLM on the same
device, plus chats and streams; 0 errors and (in float32) 0 mismatches expected. NAMES... pick the families whose
names start so; FERROX_LIVE_DTYPE=bfloat16 counts mismatches without failing on them (near-ties of random weights);
FERROX_LIVE_ARGS adds server flags (e.g. "--tensor-parallel-size 2": the server against the one-GPU offline LLM)."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.helpers import tiny_ministral3, tiny_mistral4  # noqa: E402
from tests.helpers.harmony_tokenizer import make_tiny_harmony_llama  # noqa: E402
from tests.helpers.mtp_layer import add_deepseek_layout_mtp, add_mtp_layer  # noqa: E402
from tests.helpers.tiny_cohere import make_tiny_cohere, make_tiny_cohere2  # noqa: E402
from tests.helpers.tiny_deepseek import make_tiny_deepseek  # noqa: E402
from tests.helpers.tiny_ernie4_5 import make_tiny_ernie4_5, make_tiny_ernie4_5_moe  # noqa: E402
from tests.helpers.tiny_exaone4 import make_tiny_exaone4  # noqa: E402
from tests.helpers.tiny_glm import make_tiny_glm, make_tiny_glm4, make_tiny_glm4_moe  # noqa: E402
from tests.helpers.tiny_gpt_neox import (  # noqa: E402
    make_tiny_gpt2,
    make_tiny_gpt_neox,
    make_tiny_opt,
    make_tiny_phi,
    make_tiny_starcoder2,
)
from tests.helpers.tiny_gpt_oss import make_tiny_gpt_oss, write_mxfp4_copy  # noqa: E402
from tests.helpers.tiny_granitemoehybrid import make_tiny_granitemoehybrid, make_tiny_nemotron_h  # noqa: E402
from tests.helpers.tiny_hunyuan import make_tiny_hunyuan, make_tiny_hunyuan_moe  # noqa: E402
from tests.helpers.tiny_llama4 import make_tiny_llama4, make_tiny_llama4_multimodal  # noqa: E402
from tests.helpers.tiny_ministral3 import make_tiny_ministral3  # noqa: E402
from tests.helpers.tiny_mistral4 import make_tiny_mistral4  # noqa: E402
from tests.helpers.tiny_nemotron_h_moe import add_nemotron_h_mtp, make_tiny_nemotron_h_moe  # noqa: E402
from tests.helpers.tiny_olmo_smollm3 import (  # noqa: E402
    make_tiny_olmo2,
    make_tiny_olmo3,
    make_tiny_olmoe,
    make_tiny_smollm3,
)
from tests.helpers.tiny_qwen3_5 import make_tiny_qwen3_5, make_tiny_qwen3_5_moe, make_tiny_qwen3_next  # noqa: E402
from tests.helpers.tiny_ungated import make_tiny_apertus, make_tiny_arcee  # noqa: E402
from tests.models.test_gemma4 import make_tiny_gemma4  # noqa: E402
from tests.server.server_proc import ServerProcess  # noqa: E402


def post(base: str, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# (YaRN factor 16 over the tiny models' 16 original positions: the 256-token context the script's prompts need)
YARN_256 = {"max_position_embeddings": 256, "rope_parameters": {**tiny_ministral3.ROPE, "factor": 16.0}}
YARN_256_MLA = {"max_position_embeddings": 256, "rope_parameters": {**tiny_mistral4.ROPE, "factor": 16.0}}


MTP = ["--speculative-config", '{"method":"mtp","num_speculative_tokens":2}']


def _with_mtp(folder: str) -> str:
    add_mtp_layer(folder, embed_gain=0.5)
    return folder


def _with_deepseek_layout_mtp(folder: str) -> str:
    add_deepseek_layout_mtp(folder, embed_gain=0.5)
    return folder


def _with_nemotron_h_mtp(folder: str) -> str:
    add_nemotron_h_mtp(folder, embed_gain=0.5)
    return folder


def families(tmp: Path) -> list[tuple[str, str, list[str]]]:
    oss = make_tiny_gpt_oss(tmp / "oss")
    return [("glm4", make_tiny_glm4(tmp / "glm4"), []),
            ("glm4-moe", make_tiny_glm4_moe(tmp / "glm4moe"), []),
            ("deepseek-v2-lite", make_tiny_deepseek(tmp / "dsv2", version=2, q_lora_rank=None), []),
            ("deepseek-v3", make_tiny_deepseek(tmp / "dsv3", version=3), []),
            # (the tiny gpt-oss's YaRN context: 64 x 4)
            ("gpt-oss", oss, ["--max-model-len", "256"]),
            ("gpt-oss-mxfp4", write_mxfp4_copy(oss, str(tmp / "oss-mxfp4")), ["--max-model-len", "256"]),
            ("smollm3", make_tiny_smollm3(tmp / "smollm3"), []),
            ("olmo2", make_tiny_olmo2(tmp / "olmo2"), []),
            ("olmoe", make_tiny_olmoe(tmp / "olmoe"), []),
            # (sixty-first session: sliding windows with per-kind rotaries, global NoPE, interleaved rotary + biases,
            # biased-choice MoE routing)
            ("olmo3", make_tiny_olmo3(tmp / "olmo3"), []),
            ("exaone4", make_tiny_exaone4(tmp / "exaone4"), []),
            ("ernie4_5", make_tiny_ernie4_5(tmp / "ernie4_5"), []),
            ("ernie4_5-moe", make_tiny_ernie4_5_moe(tmp / "ernie4_5_moe"), []),
            ("cohere2", make_tiny_cohere2(tmp / "cohere2"), []),
            ("cohere-plus", make_tiny_cohere(tmp / "cohere_plus", use_qk_norm=True), []),
            ("glm-4-9b", make_tiny_glm(tmp / "glm"), []),
            ("hunyuan", make_tiny_hunyuan(tmp / "hunyuan"), []),
            ("hunyuan-moe", make_tiny_hunyuan_moe(tmp / "hunyuan_moe"), []),
            ("arcee", make_tiny_arcee(tmp / "arcee"), []),
            ("apertus", make_tiny_apertus(tmp / "apertus"), []),
            ("pythia", make_tiny_gpt_neox(tmp / "pythia"), []),
            ("gpt2", make_tiny_gpt2(tmp / "gpt2"), ["--max-model-len", "256"]),
            ("opt", make_tiny_opt(tmp / "opt"), ["--max-model-len", "256"]),
            ("phi-2", make_tiny_phi(tmp / "phi"), []),
            ("starcoder2", make_tiny_starcoder2(tmp / "starcoder2"), []),
            # (chunked local attention over 16-token chunks, NoPE layers, top-1 experts on the input)
            ("llama4-scout", make_tiny_llama4(tmp / "llama4"), []),
            ("llama4-maverick", make_tiny_llama4(tmp / "llama4m", interleave_moe_layer_step=2, use_qk_norm=False,
                                                 tie_word_embeddings=True), []),
            ("llama4-multimodal", make_tiny_llama4_multimodal(tmp / "llama4mm"), []),
            # (Gemma 4: per-layer KV shapes, 512-wide full-attention heads, its experts, per-layer embeddings)
            ("gemma4", make_tiny_gemma4(tmp / "gemma4"), ["--max-model-len", "512"]),
            ("gemma4-moe", make_tiny_gemma4(tmp / "gemma4moe", moe=True), ["--max-model-len", "512"]),
            ("gemma4-per-layer", make_tiny_gemma4(tmp / "gemma4pl", per_layer=True, kv_shared=2),
             ["--max-model-len", "512"]),
            # (Ministral 3: YaRN + Llama 4's query scaling; Mistral Small 4: latent attention + grouped experts)
            ("ministral3", make_tiny_ministral3(tmp / "ministral3", **YARN_256), ["--max-model-len", "256"]),
            ("mistral4", make_tiny_mistral4(tmp / "mistral4", **YARN_256_MLA), ["--max-model-len", "256"]),
            # (hybrid Gated DeltaNet / attention: per-request recurrent state rows beside the KV cache)
            ("qwen3_5", make_tiny_qwen3_5(tmp / "qwen3_5"), ["--max-model-len", "256"]),
            ("qwen3_5-moe", make_tiny_qwen3_5_moe(tmp / "qwen3_5_moe"), ["--max-model-len", "256"]),
            ("qwen3-next", make_tiny_qwen3_next(tmp / "qwen3_next"), ["--max-model-len", "256"]),
            # (Granite 4.0-H: Mamba2 state rows beside NoPE attention; with routed experts and rotary)
            ("granite4-h", make_tiny_granitemoehybrid(tmp / "granite4h"), ["--max-model-len", "256"]),
            ("granite4-h-moe", make_tiny_granitemoehybrid(tmp / "granite4hmoe", experts=4, rope=True),
             ["--max-model-len", "256"]),
            ("nemotron-h", make_tiny_nemotron_h(tmp / "nemotron_h"), ["--max-model-len", "256"]),
            # (Nemotron 3 Nano / Super: E layers, non-gated ReLU^2 experts; Super's latent projection)
            ("nemotron-3-nano", make_tiny_nemotron_h_moe(tmp / "nemotron3_nano"), ["--max-model-len", "256"]),
            ("nemotron-3-super", make_tiny_nemotron_h_moe(tmp / "nemotron3_super", latent=True),
             ["--max-model-len", "256"]),
            # (their checkpoints' MTP layer drafting: the answers stay the offline LLM's without drafts)
            ("mtp-qwen3_5", _with_mtp(make_tiny_qwen3_5(tmp / "qwen3_5_mtp")), ["--max-model-len", "256", *MTP]),
            ("mtp-qwen3-next", _with_mtp(make_tiny_qwen3_next(tmp / "qwen3_next_mtp")),
             ["--max-model-len", "256", *MTP]),
            ("mtp-glm4-moe", _with_deepseek_layout_mtp(make_tiny_glm4_moe(tmp / "glm4moe_mtp", mtp_layers=0)), MTP),
            ("mtp-deepseek-v3", _with_deepseek_layout_mtp(make_tiny_deepseek(tmp / "dsv3_mtp", version=3)), MTP),
            # (Nemotron 3 Super's MTP step: an attention and a latent-MoE block beside the Mamba2 hybrid)
            ("mtp-nemotron-h", _with_nemotron_h_mtp(make_tiny_nemotron_h_moe(tmp / "nemotron3_super_mtp", latent=True)),
             ["--max-model-len", "256", *MTP]),
            ("harmony-parsers", make_tiny_harmony_llama(tmp / "harmony"),
             ["--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai"])]


def main() -> int:
    from ferrox import LLM, SamplingParams

    only = sys.argv[1:]
    dtype = os.environ.get("FERROX_LIVE_DTYPE", "float32")
    exact_only = dtype == "float32"
    prompts = [[5 + (7 * k + j) % 90 for j in range(n)] for k, n in enumerate([4, 12, 40, 150] * 6)]
    bad = 0
    tmp = Path(tempfile.mkdtemp())
    for name, folder, extra in families(tmp):
        if only and not any(name.startswith(o) for o in only):
            continue
        reference = LLM(model=folder, dtype=dtype, kv_cache_memory=128 << 20, max_model_len=256)
        expected = [o.outputs[0].text for o in reference.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, temperature=0,
                                                                       skip_special_tokens=False), use_tqdm=False)]
        del reference
        srv = ServerProcess(folder, "--served-model-name", "m", "--dtype", dtype, "--max-num-batched-tokens", "24",
                            *extra, *os.environ.get("FERROX_LIVE_ARGS", "").split(), startup_timeout=300)
        errors = mismatches = 0
        with cf.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(post, srv.base_url, "/v1/completions",
                                   {"model": "m", "prompt": p, "max_tokens": 12, "temperature": 0,
                                    "skip_special_tokens": False}) for p in prompts]
            others = [pool.submit(post, srv.base_url, "/v1/chat/completions",
                                  {"model": "m", "messages": [{"role": "user", "content": f"hi {k}"}],
                                   "max_tokens": 16, "stream": k % 2 == 1}) for k in range(8)]
            for k, f in enumerate(futures):
                status, body = f.result()
                if status != 200:
                    errors += 1
                    print(name, "error", status, body[:300])
                elif json.loads(body)["choices"][0]["text"] != expected[k]:
                    mismatches += 1
                    print(name, "mismatch", len(prompts[k]), repr(json.loads(body)["choices"][0]["text"]), "!=",
                          repr(expected[k]))
            for f in others:
                status, body = f.result()
                if status != 200 or '"error"' in body:
                    errors += 1
                    print(name, "chat error", status, body[:300])
        if name.startswith("mtp"):
            with urllib.request.urlopen(srv.base_url + "/metrics", timeout=30) as resp:
                print(name, [ln for ln in resp.read().decode().splitlines()
                             if ln.startswith(("ferrox:spec_decode_num_accepted_tokens_total", "ferrox:spec_decode_num_draft_tokens_total"))])
        code = srv.stop()
        log_errors = [ln for ln in srv.log if " ERROR " in ln or "Traceback" in ln]
        print(f"{name}: {len(prompts)} completions + 8 chats, {errors} errors, {mismatches} mismatches, exit {code}, "
              f"error log lines {len(log_errors)} {log_errors[:3]}")
        bad += errors + (mismatches if exact_only else 0) + (code != 0) + len(log_errors)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
