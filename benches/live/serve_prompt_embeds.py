"""Live `ferrox serve --enable-prompt-embeds` of a tiny Llama on the device: 24 concurrent completions whose
prompts are base64 torch.save bytes of transformers' input embeddings (cut across chunked-prefill steps by
--max-num-batched-tokens 16), each answered as the same prompt's token ids are answered on that server, beside
token-id requests and CUDA-graph decode steps; the same embeddings twice hit the prefix cache; a bad tensor is a
400 naming prompt_embeds while the rest complete. 0 errors, 0 mismatches expected (float32; FERROX_LIVE_DTYPE
picks another dtype, where bf16 embeddings of the bf16 lookup should still give the same tokens). FAMILY (argv)
picks the tiny model: llama (default), qwen3_moe (the MoE stack) or deepseek_v3 (latent attention)."""
from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.helpers.tiny_deepseek import make_tiny_deepseek  # noqa: E402
from tests.helpers.tiny_models import make_tiny_llama, make_tiny_qwen3_moe  # noqa: E402
from tests.server.server_proc import ServerProcess, post_json  # noqa: E402


def post(base: str, body: dict) -> tuple[int, dict]:
    return post_json(base, body, "/v1/completions")


def b64(tensor: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


FAMILIES = {"llama": make_tiny_llama, "qwen3_moe": make_tiny_qwen3_moe, "deepseek_v3": make_tiny_deepseek}


def main() -> int:
    from transformers import AutoModelForCausalLM

    dtype = os.environ.get("FERROX_LIVE_DTYPE", "float32")
    family = sys.argv[1] if len(sys.argv) > 1 else "llama"
    folder = FAMILIES[family](Path(tempfile.mkdtemp()) / family)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    prompts = [[5 + (11 * k + j) % 200 for j in range(n)] for k, n in enumerate([5, 23, 40, 90] * 6)]
    with torch.no_grad():
        embeds = [b64(hf.get_input_embeddings()(torch.tensor(p))) for p in prompts]
    srv = ServerProcess(folder, "--served-model-name", "m", "--dtype", dtype, "--enable-prompt-embeds",
                        "--max-num-batched-tokens", "16", startup_timeout=300)
    base = {"model": "m", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    errors = mismatches = 0
    with cf.ThreadPoolExecutor(16) as pool:
        by_ids = [pool.submit(post, srv.base_url, {**base, "prompt": p}) for p in prompts]
        by_embeds = [pool.submit(post, srv.base_url, {**base, "prompt_embeds": e}) for e in embeds]
        bad = pool.submit(post, srv.base_url, {**base, "prompt_embeds": b64(torch.ones(4, 3))})
        for k, (a, b) in enumerate(zip(by_ids, by_embeds, strict=True)):
            (sa, ra), (sb, rb) = a.result(), b.result()
            if sa != 200 or sb != 200:
                errors += 1
                print("error", sa, sb, str(ra)[:200], str(rb)[:200])
            elif ra["choices"][0]["token_ids"] != rb["choices"][0]["token_ids"]:
                mismatches += 1
                print("mismatch", len(prompts[k]), ra["choices"][0]["token_ids"], rb["choices"][0]["token_ids"])
        bad_status, bad_body = bad.result()
    again_status, again = post(srv.base_url, {**base, "prompt_embeds": embeds[3]})
    metrics = urllib.request.urlopen(srv.base_url + "/metrics", timeout=30).read().decode()
    hits = [ln for ln in metrics.splitlines() if "prefix_cache_hits" in ln and not ln.startswith("#")]
    code = srv.stop()
    log_errors = [ln for ln in srv.log if " ERROR " in ln or "Traceback" in ln]
    bad_ok = bad_status == 400 and bad_body.get("error", {}).get("param") == "prompt_embeds"
    print(f"prompt_embeds {family} ({dtype}): {len(prompts)} embeds + {len(prompts)} id requests, {errors} errors, "
          f"{mismatches} mismatches, bad tensor a 400 naming prompt_embeds {bad_ok}, repeat 200 {again_status == 200}, "
          f"prefix-cache hit lines {hits[:2]}, exit {code}, error log lines {len(log_errors)} {log_errors[:3]}")
    return 1 if errors or mismatches or not bad_ok or again_status != 200 or code or log_errors else 0


if __name__ == "__main__":
    sys.exit(main())
