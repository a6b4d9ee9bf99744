"""Live sleep mode on the GPU: `ferrox serve --enable-sleep-mode` of a dummy Llama-3.1-8B with
VLLM_SERVER_DEV_MODE=1; the device memory /sleep gives back (read from another process), the same greedy
text after /wake_up, and the server tests' checks (abort, queued requests, wait and keep modes, level 2 with
/collective_rpc reload_weights, bad arguments).

    python benches/live/serve_sleep.py [--extra "--kv-cache-dtype fp8"]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches"))
sys.path.insert(0, str(ROOT))
import bench_setup  # noqa: E402
import torch  # noqa: E402

from tests.server.server_proc import ServerProcess  # noqa: E402
from tests.server.test_sleep_server import (  # noqa: E402
    DEV,
    call,
    check_abort_then_queue_until_wake,
    check_bad_arguments,
    check_keep_mode,
    check_level_2_and_reload,
    check_wait_mode,
    is_sleeping,
)


def free_gib() -> float:
    return torch.cuda.mem_get_info()[0] / 2**30


def text(base: str) -> str:
    status, body = call(base, "POST", "/v1/completions", {"model": "m", "prompt": "The history of", "max_tokens": 32,
                                                          "temperature": 0, "ignore_eos": True})
    assert status == 200 and body is not None, body
    return body["choices"][0]["text"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--extra", default="")
    args = p.parse_args()
    folder, _ = bench_setup.dummy_model_dir(str(bench_setup.LLAMA_8B_CONFIG))
    torch.cuda.init()
    t0 = time.monotonic()
    srv = ServerProcess(folder, "--load-format", "dummy", "--served-model-name", "m", "--max-model-len", "8192",
                        "--kv-cache-memory", "20GiB", "--enable-sleep-mode", *shlex.split(args.extra), env=DEV, startup_timeout=600)
    print(f"ready in {time.monotonic() - t0:.1f} s", flush=True)
    failures = 0
    try:
        before = text(srv.base_url)
        awake = free_gib()
        t = time.monotonic()
        assert call(srv.base_url, "POST", "/sleep?level=1")[0] == 200 and is_sleeping(srv.base_url)
        sleep_s = time.monotonic() - t
        asleep = free_gib()
        t = time.monotonic()
        assert call(srv.base_url, "POST", "/wake_up")[0] == 200 and not is_sleeping(srv.base_url)
        wake_s = time.monotonic() - t
        woken = free_gib()
        after = text(srv.base_url)
        print(f"device free memory: awake {awake:.1f} GiB, asleep {asleep:.1f} GiB (+{asleep - awake:.1f}), "
              f"woken {woken:.1f} GiB; sleep {sleep_s:.2f} s, wake_up {wake_s:.2f} s", flush=True)
        print(f"greedy text equal after wake_up: {before == after}", flush=True)
        failures += before != after
        failures += asleep - awake < 30  # the weights (~15 GiB) and the KV cache (20 GiB)
        for check in (check_abort_then_queue_until_wake, check_wait_mode, check_keep_mode, check_level_2_and_reload):
            try:
                check(srv.base_url, "m")
                print(f"{check.__name__}: ok", flush=True)
            except Exception as exc:  # report every check
                failures += 1
                print(f"{check.__name__}: FAILED {exc!r}", flush=True)
        check_bad_arguments(srv.base_url)
        print("check_bad_arguments: ok", flush=True)
        again = text(srv.base_url)
        failures += again != before
        print(f"greedy text equal after the checks: {again == before}", flush=True)
    finally:
        code = srv.stop()
        errors = [ln for ln in srv.log if "Traceback" in ln or " ERROR " in ln]
        print(f"server exit code {code}; error lines in its log: {len(errors)}", flush=True)
        for ln in errors[:10]:
            print("  ", ln)
    print(f"failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
