"""Live `ferrox serve` of tiny Phi-3 and Granite folders on the GPU (bf16, CUDA graphs): completions, chat,
streams, concurrent; 0 errors expected."""
from __future__ import annotations

import concurrent.futures as cf
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.helpers.tiny_models import make_tiny_granite, make_tiny_phi3  # noqa: E402
from tests.server.server_proc import ServerProcess  # noqa: E402


def post(base, path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read().decode()


def main() -> int:
    bad = 0
    tmp = Path(tempfile.mkdtemp())
    for name, folder, extra in (("phi3", make_tiny_phi3(tmp / "phi3"), ["--max-model-len", "1024"]),
                                ("granite", make_tiny_granite(tmp / "granite"), ["--max-model-len", "1024"])):
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
