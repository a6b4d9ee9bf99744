"""Live `ferrox serve` of tiny folders of the families added without a GPU on the GPU (bf16, CUDA graphs):
Phi-3, Granite, Mistral with a sliding window shorter than the prompts, Gemma 2 (soft caps, every other
layer windowed), Gemma 3 text (q/k norms, local/global RoPE, windows), a Phi-4-mini-shaped Phi-3
(LongRoPE over partial rotary) and Qwen2 with YaRN turned on by --hf-overrides. Completions, chat, streams,
a 297-token prompt, concurrent; 0 errors expected."""
from __future__ import annotations

import concurrent.futures as cf
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.helpers.tiny_models import (  # noqa: E402
    make_tiny_gemma2,
    make_tiny_gemma3,
    make_tiny_gemma3_multimodal,
    make_tiny_granite,
    make_tiny_mistral,
    make_tiny_phi3,
    make_tiny_qwen2,
)
from tests.server.server_proc import ServerProcess  # noqa: E402


def post(base, path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read().decode()


def phi4_mini_like(folder: str) -> str:
    """A tiny Phi-3 with Phi-4-mini's LongRoPE over half of each head (16-dim heads: 4 rotary pairs)."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    config.update(max_position_embeddings=2048, original_max_position_embeddings=256, partial_rotary_factor=0.5,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0, 1.2, 1.5, 2.0],
                                   "long_factor": [1.0, 3.0, 7.0, 15.0]})
    path.write_text(json.dumps(config))
    return folder


YARN = json.dumps({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}})


def families(tmp: Path) -> list[tuple[str, str, list[str]]]:
    return [("phi3", make_tiny_phi3(tmp / "phi3"), ["--max-model-len", "1024"]),
            ("granite", make_tiny_granite(tmp / "granite"), ["--max-model-len", "1024"]),
            ("mistral-window-64", make_tiny_mistral(tmp / "mistral", sliding_window=64), ["--max-model-len", "1024"]),
            ("gemma2", make_tiny_gemma2(tmp / "gemma2", sliding_window=64, max_position_embeddings=1024), []),
            ("gemma2-head-dim-256", make_tiny_gemma2(tmp / "gemma2-256", head_dim=256, sliding_window=64,
                                                     max_position_embeddings=1024), []),
            ("gemma3", make_tiny_gemma3(tmp / "gemma3", sliding_window=64, max_position_embeddings=1024), []),
            ("gemma3-multimodal-text", make_tiny_gemma3_multimodal(tmp / "gemma3mm", sliding_window=64),
             ["--max-model-len", "512"]),
            ("phi4-mini-like", phi4_mini_like(make_tiny_phi3(tmp / "phi4")), ["--max-model-len", "1024"]),
            ("qwen2-yarn", make_tiny_qwen2(tmp / "qwen2"), ["--hf-overrides", YARN, "--max-model-len", "2048"])]


def main() -> int:
    bad = 0
    tmp = Path(tempfile.mkdtemp())
    for name, folder, extra in families(tmp):
        srv = ServerProcess(folder, "--served-model-name", "m", *extra, startup_timeout=300)
        bodies = [("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 16, "temperature": 0}),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}),
                  ("/v1/completions", {"prompt": "a b c", "max_tokens": 8, "stream": True}),
                  ("/v1/completions", {"prompt": list(range(3, 300)), "max_tokens": 4})] * 8
        errors = 0
        with cf.ThreadPoolExecutor(16) as pool:
            for f in [pool.submit(post, srv.base_url, p, {"model": "m", **b}) for p, b in bodies]:
                try:
                    f.result()
                except Exception as e:  # noqa: BLE001
                    errors += 1
                    print(name, "error", e)
        greedy = [json.loads(post(srv.base_url, "/v1/completions", {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 16,
                                                                      "temperature": 0}))["choices"][0]["text"] for _ in range(2)]
        code = srv.stop()
        log_errors = [ln for ln in srv.log if " ERROR " in ln or "Traceback" in ln]
        print(f"{name}: {len(bodies)} requests, {errors} errors, greedy repeat equal {greedy[0] == greedy[1]}, exit {code}, "
              f"error log lines {len(log_errors)} {log_errors[:3]}")
        bad += errors + (code != 0) + len(log_errors) + (greedy[0] != greedy[1])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
