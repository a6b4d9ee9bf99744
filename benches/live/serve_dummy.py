"""Live `ferrox serve` of a dummy model on the GPU: the request shapes users send (raw HTTP), concurrently;
counts errors; checks the server's log and that it exits cleanly (benches/live/README.md).

    python benches/live/serve_dummy.py [--moe qwen3-30b-a3b] [--extra "--quantization fp8"]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import shlex
import sys
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches"))
sys.path.insert(0, str(ROOT))
import bench_setup  # noqa: E402

from tests.server.server_proc import ServerProcess  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--moe", default=None)
    p.add_argument("--extra", default="")
    args = p.parse_args()
    folder, _ = bench_setup.dummy_model_dir(str(bench_setup.LLAMA_8B_CONFIG), moe=args.moe)
    t0 = time.monotonic()
    # A MoE dummy's weights (Qwen3-30B-A3B: 57 GiB) leave an 80 GB H100 too little beside a 20 GiB cache for
    # the piecewise CUDA graphs, whose capture then fails (logged; prefill runs eagerly). --extra overrides.
    kv = "8GiB" if args.moe else "20GiB"
    srv = ServerProcess(folder, "--load-format", "dummy", "--served-model-name", "m", "--max-model-len", "8192",
                        "--kv-cache-memory", kv, *shlex.split(args.extra), startup_timeout=600)
    print(f"ready in {time.monotonic() - t0:.1f} s", flush=True)

    def post(path, body, stream=False):
        req = urllib.request.Request(srv.base_url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json", "anthropic-version": "2023-06-01"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return [ln for ln in resp.read().decode().splitlines() if ln] if stream else json.loads(resp.read())

    msgs = [{"role": "user", "content": "hello there, tell me a story"}]
    # Raw HTTP throughout: the openai / anthropic packages there need httpx2, which the machine lacks.

    def chat():
        r = post("/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 32, "temperature": 0.7})
        assert r["choices"][0]["message"]["content"] is not None and r["usage"]["completion_tokens"] > 0

    def chat_stream():
        lines = post("/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 48, "stream": True,
                                              "stream_options": {"include_usage": True}}, stream=True)
        assert lines[-1] == "data: [DONE]" and len(lines) > 3, lines[-3:]

    def completions_logprobs():
        r = post("/v1/completions", {"model": "m", "prompt": "once upon a time", "max_tokens": 16, "logprobs": 3,
                                     "seed": 1, "temperature": 1.0})
        assert len(r["choices"][0]["logprobs"]["tokens"]) == 16

    def named_logprobs():
        # logprob_token_ids: exactly these ids as the alternatives, their values as the prompt path scores them
        # (greedy: the same under --logprobs-mode processed_logprobs).
        named = [5, 1000, 128000]
        r = post("/v1/completions", {"model": "m", "prompt": [1000, 2000, 3000], "max_tokens": 4, "logprobs": 2,
                                     "temperature": 0, "logprob_token_ids": named,
                                     "return_tokens_as_token_ids": True})
        lp = r["choices"][0]["logprobs"]
        for tok, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
            assert set(top) == {f"token_id:{t}" for t in named} | {tok}, top
        ref = post("/v1/completions", {"model": "m", "prompt": [1000, 2000, 3000, 128000], "max_tokens": 1,
                                       "prompt_logprobs": 0})["choices"][0]["prompt_logprobs"][-1]["128000"]["logprob"]
        # bf16, the two requests in different batches: they agree to ~0.1 nats (an H100 run, random weights).
        assert abs(lp["top_logprobs"][0]["token_id:128000"] - ref) < 0.25, (lp["top_logprobs"][0], ref)
        lines = post("/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 6, "stream": True,
                                              "logprobs": True, "top_logprobs": 1, "logprob_token_ids": named,
                                              "return_tokens_as_token_ids": True}, stream=True)
        entries = [e for ln in lines if ln.startswith("data: {") for c in json.loads(ln[6:])["choices"]
                   if c.get("logprobs") for e in c["logprobs"]["content"]]
        assert len(entries) == 6 and all([t["token"] for t in e["top_logprobs"]] == [f"token_id:{t}" for t in named]
                                         for e in entries), entries[:2]

    def bad_words():
        # The word the free output starts with (its first two tokens' text, re-encoded) is then never said.
        body = {"model": "m", "prompt": [1000, 2000, 3000], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        free = post("/v1/completions", body)["choices"][0]["token_ids"]
        word = post("/detokenize", {"model": "m", "tokens": free[:2]})["prompt"].strip() or "hello"
        seq = post("/tokenize", {"model": "m", "prompt": word, "add_special_tokens": False})["tokens"]
        got = post("/v1/completions", {**body, "bad_words": [word]})["choices"][0]["token_ids"]
        assert len(got) == 8 and all(got[i:i + len(seq)] != seq for i in range(len(got))), (word, seq, got)

    def beam():
        r = post("/v1/completions", {"model": "m", "prompt": "the quick brown fox", "max_tokens": 8, "n": 3,
                                     "use_beam_search": True, "ignore_eos": True})
        assert len(r["choices"]) == 3

    def beam_chat():
        r = post("/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 6, "n": 2,
                                          "use_beam_search": True, "length_penalty": 0.5})
        assert len(r["choices"]) == 2

    def cache_key():
        r = post("/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 8, "prompt_cache_key": "s1"})
        assert r["usage"]["completion_tokens"] > 0

    def json_schema():
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                  "additionalProperties": False}
        r = post("/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 40, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
        if r["choices"][0]["finish_reason"] == "stop":
            json.loads(r["choices"][0]["message"]["content"])

    def special_token_text():
        # Forced text that spells a special token (<|eot_id|>) is written as text (structured/guidance_vocab.py):
        # it used to be forced as the special token, refused, and the request ended after "Tag: ".
        text = "Tag: <|eot_id|> done"
        r = post("/v1/completions", {"model": "m", "prompt": "write a tag", "max_tokens": 40, "temperature": 0.8,
                                     "structured_outputs": {"regex": text.replace("|", "\\|")}})
        assert r["choices"][0]["text"] == text and r["choices"][0]["finish_reason"] == "stop", r["choices"][0]

    def messages_thinking():
        r = post("/v1/messages", {"model": "m", "max_tokens": 24, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>x</system-reminder>"}, {"type": "text", "text": "hi"}]}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
                       {"type": "text", "text": "You are helpful."}]})
        assert r["type"] == "message" and r["usage"]["output_tokens"] > 0, r

    def messages_stream():
        lines = post("/v1/messages", {"model": "m", "max_tokens": 24, "stream": True,
                                      "messages": [{"role": "user", "content": "hi"}]}, stream=True)
        assert "event: message_stop" in lines, lines[-4:]

    def responses():
        r = post("/v1/responses", {"model": "m", "input": "hello", "max_output_tokens": 16, "store": False,
                                   "prompt_cache_key": "k", "top_logprobs": 2,
                                   "include": ["reasoning.encrypted_content", "message.output_text.logprobs"]})
        assert r["status"] in ("completed", "incomplete"), r
        lps = [p["logprobs"] for item in r["output"] if item["type"] == "message" for p in item["content"]][0]
        assert len(lps) == r["usage"]["output_tokens"] and all(len(e["top_logprobs"]) == 2 for e in lps), lps[:2]

    def long_prompt():
        r = post("/v1/completions", {"model": "m", "prompt": list(range(1000, 4000)), "max_tokens": 8})
        assert r["usage"]["prompt_tokens"] == 3000

    def bad_input():
        try:
            post("/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 4, "thinking_token_budget": 5})
        except urllib.error.HTTPError as e:
            text = e.read().decode()
            assert e.code == 400 and "thinking_token_budget" in text, text
            return
        raise AssertionError("thinking_token_budget without a reasoning parser accepted")

    def invocations():
        r = post("/invocations", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]}],
                                  "max_tokens": 4})
        assert r["object"] == "chat.completion"

    kinds = [invocations, chat, chat_stream, completions_logprobs, named_logprobs, bad_words, beam, beam_chat, cache_key, json_schema, special_token_text, messages_thinking,
             messages_stream, responses, long_prompt, bad_input]
    errors: dict[str, int] = {}
    done = 0
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(48) as pool:
        futs = {pool.submit(k): k.__name__ for _ in range(8) for k in kinds}
        for f in cf.as_completed(futs):
            try:
                f.result()
                done += 1
            except Exception:
                errors[futs[f]] = errors.get(futs[f], 0) + 1
                if errors[futs[f]] == 1:
                    print(f"--- {futs[f]}\n{traceback.format_exc()[-1500:]}", flush=True)
    wall = time.monotonic() - t0
    metrics = urllib.request.urlopen(srv.base_url + "/metrics", timeout=10).read().decode()
    running = [ln for ln in metrics.splitlines() if ln.startswith(("vllm:num_requests_running", "vllm:kv_cache_usage_perc"))]
    code = srv.stop()
    tail = [ln for ln in srv.log if "Traceback" in ln or " ERROR " in ln]
    for ln in srv.log:
        if any(s in ln for s in ("CUDA graphs captured", "long prefill chunks", "FlashAttention-3", "calculate_kv_scales")):
            print("   ", ln.strip()[-160:])
    print(f"{done} ok, errors {errors}, {wall:.1f} s; metrics {running}; exit {code}; error log lines {len(tail)}")
    for ln in tail[:10]:
        print("   ", ln)
    return 0 if not errors and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
