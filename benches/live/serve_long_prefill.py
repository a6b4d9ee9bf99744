"""Live `ferrox serve` of long prompts through the library prefill paths on Hopper: a tiny DeepSeek-V2-Lite with
the real latent-attention head dims (nope 128, rope 64, v 128), so its long chunks take the expanded
FlashAttention-3 path (kernels/mla_prefill.py), in bf16, eager (a CUDA-graph step replays the absorbed
kernels), 1,024-token chunks. 16 concurrent greedy completions (prompts of 40 to 1,900 token ids: fresh chunks,
chunks after cached context, short ones beside them) against the offline LLM on the same device with
FERROX_FA3_PREFILL=0 (the absorbed kernels), plus chats. Errors and a wrong log line fail; token
mismatches are counted (bf16 near-ties of random weights), as is the first token's agreement.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.helpers.tiny_deepseek import make_tiny_deepseek  # noqa: E402
from tests.server.server_proc import ServerProcess, post_json  # noqa: E402

PROMPT_LENS = [40, 600, 1100, 1900] * 4


def offline_texts(folder: str, prompts: list[list[int]]) -> list[str]:
    """The absorbed kernels' answers (FERROX_FA3_PREFILL=0), in a child so the setting is its own."""
    code = ("import json, sys; from ferrox import LLM, SamplingParams; "
            f"llm = LLM(model={folder!r}, dtype='bfloat16', kv_cache_memory=1 << 30, max_model_len=2048, "
            "max_num_batched_tokens=1024, enforce_eager=True); "
            "prompts = json.load(sys.stdin); "
            "outs = llm.generate([{'prompt_token_ids': p} for p in prompts], "
            "SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False); "
            "print(json.dumps([o.outputs[0].text for o in outs]))")
    env = dict(os.environ, FERROX_FA3_PREFILL="0")
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(prompts), capture_output=True, text=True,
                          env=env, check=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    folder = make_tiny_deepseek(Path(tempfile.mkdtemp()) / "dsv2", version=2, q_lora_rank=None, topk_method="greedy",
                                seed=8, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=64)
    prompts = [[3 + (11 * k + 7 * j) % 200 for j in range(n)] for k, n in enumerate(PROMPT_LENS)]
    expected = offline_texts(folder, prompts)
    srv = ServerProcess(folder, "--served-model-name", "m", "--dtype", "bfloat16", "--enforce-eager",
                        "--max-num-batched-tokens", "1024", "--max-model-len", "2048", startup_timeout=300)
    errors = mismatches = first_token_mismatches = 0
    with cf.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(post_json, srv.base_url, {"model": "m", "prompt": p, "max_tokens": 12, "temperature": 0,
                                                         "ignore_eos": True}, "/v1/completions") for p in prompts]
        # (non-streamed: post_json reads one JSON answer)
        others = [pool.submit(post_json, srv.base_url, {"model": "m", "messages": [{"role": "user", "content": f"hi {k}"}],
                                                        "max_tokens": 8}) for k in range(4)]
        for k, f in enumerate(futures):
            status, body = f.result()
            if status != 200:
                errors += 1
                print("error", status, str(body)[:300])
                continue
            text = body["choices"][0]["text"]
            if text != expected[k]:
                mismatches += 1
                first_token_mismatches += text[:1] != expected[k][:1]
        for f in others:
            status, body = f.result()
            errors += status != 200 or "error" in body
    code = srv.stop()
    log_errors = [ln for ln in srv.log if " ERROR " in ln or "Traceback" in ln]
    path = [ln.strip()[-90:] for ln in srv.log if "long MLA prefill chunks" in ln]
    print("   ", *path)
    print(f"{len(prompts)} completions (prompts {min(PROMPT_LENS)}-{max(PROMPT_LENS)} tokens) + 4 chats: {errors} errors, "
          f"{mismatches} texts differ from the absorbed kernels' ({first_token_mismatches} from the first character), "
          f"exit {code}, error log lines {len(log_errors)} {log_errors[:3]}")
    expanded = bool(path) and "expanded" in path[0]
    return 0 if not errors and code == 0 and not log_errors and expanded else 1


if __name__ == "__main__":
    sys.exit(main())
