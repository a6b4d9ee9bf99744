"""Live `ferrox serve` of a tiny Llama with two PEFT adapters (`--enable-lora --lora-modules`), with n-gram
speculation and vLLM's own block hashes (`--prefix-caching-hash-algo sha256_cbor`, which hash each adapter's
name) and KV events on: 48 concurrent greedy completions spread over the base model and both adapters
(copy-heavy prompts, so drafts are proposed) must equal the offline LLM without speculation on the same device
(float32), with 0 errors, a clean exit and drafts accepted (the /metrics counter). Prints one line and exits
non-zero on any problem.

    PYTHONHASHSEED=0 python benches/live/serve_lora.py [FAMILY]

FAMILY: llama (default), or a family of tests/lora/adapters.py FAMILIES (qwen3_5, qwen3_next, glm4, glm4_moe,
llama4): its tiny checkpoint, adapters on its own targets (a hybrid's both token mixers); KV events stay off
for the hybrids (refused there by name).
"""
from __future__ import annotations

import concurrent.futures as cf
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.helpers.tiny_models import make_tiny_llama  # noqa: E402
from tests.lora.adapters import FAMILIES, load_hf_model, make_peft_adapter  # noqa: E402
from tests.server.server_proc import ServerProcess, post_json  # noqa: E402


def main() -> int:
    from ferrox import LLM, SamplingParams
    from ferrox.lora.request import LoRARequest

    family = sys.argv[1] if len(sys.argv) > 1 else "llama"
    tmp = Path(tempfile.mkdtemp())
    if family == "llama":
        base_dir = make_tiny_llama(tmp / "base", hidden_size=128, num_layers=2)
        targets = (None, ["q_proj", "v_proj", "down_proj"])
    else:
        build, *targets_of = FAMILIES[family]
        base_dir, targets = build(tmp / "base"), tuple(targets_of)
    hf = load_hf_model(base_dir)
    first = {} if targets[0] is None else {"target_modules": targets[0]}
    paths = {"a1": make_peft_adapter(hf, tmp / "a1", r=8, lora_alpha=32, seed=1, **first),
             "a2": make_peft_adapter(hf, tmp / "a2", r=4, lora_alpha=16, seed=2, target_modules=targets[1])}
    hybrid = family in ("qwen3_5", "qwen3_next")
    events = [] if hybrid else ["--kv-events-config", f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{tmp}/kv"}}']
    models = ["m", "a1", "a2"]
    prompts = [[1] + [5 + (k + j) % (3 + k % 4) for j in range(8 + k % 24)] for k in range(48)]
    model_of = [models[k % 3] for k in range(48)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    reference = LLM(model=base_dir, dtype="float32", kv_cache_memory=128 << 20, enable_lora=True, max_loras=2,
                    max_lora_rank=8, max_model_len=256)
    loras = {"a1": LoRARequest("a1", 1, paths["a1"]), "a2": LoRARequest("a2", 2, paths["a2"])}
    expected = [list(o.outputs[0].token_ids) for o in reference.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
        lora_request=[loras.get(m) for m in model_of])]
    del reference
    srv = ServerProcess(base_dir, "--served-model-name", "m", "--dtype", "float32", "--enable-lora", "--max-loras", "2",
                        "--max-lora-rank", "8", "--max-model-len", "256", "--lora-modules", *(f"{n}={p}" for n, p in paths.items()),
                        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 3}', "--prefix-caching-hash-algo", "sha256_cbor", *events,
                        startup_timeout=300)
    errors = mismatches = 0
    with cf.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(post_json, srv.base_url,
                               {"model": m, "prompt": p, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                                "return_token_ids": True}, "/v1/completions")
                   for m, p in zip(model_of, prompts, strict=True)]
        for k, f in enumerate(futures):
            status, body = f.result()
            if status != 200:
                errors += 1
                print("error", status, body)
                continue
            if body["choices"][0]["token_ids"] != expected[k]:
                mismatches += 1
                print("mismatch", model_of[k], body["choices"][0]["token_ids"], "!=", expected[k])
    with urllib.request.urlopen(srv.base_url + "/metrics", timeout=30) as resp:
        metrics = resp.read().decode()
    accepted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("ferrox:spec_decode_num_accepted_tokens_total"))
    code = srv.stop()
    log_errors = [ln for ln in srv.log if " ERROR " in ln or "Traceback" in ln]
    print(f"{family}: 48 completions over base + 2 adapters with n-gram drafts and sha256_cbor: {errors} errors, {mismatches} "
          f"mismatches, {accepted:.0f} drafts accepted, exit {code}, error log lines {len(log_errors)} {log_errors[:3]}")
    return 1 if errors or mismatches or code or log_errors or not accepted else 0


if __name__ == "__main__":
    sys.exit(main())
