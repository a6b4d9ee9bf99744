"""Live `ferrox serve` of tiny checkpoints in Mistral's own layout with the flags Mistral's model cards and vLLM's
recipes give: `--tokenizer_mode mistral --config_format mistral --load_format mistral --enable-auto-tool-choice
--tool-call-parser mistral`. Three models: a Mistral (Mistral-7B-v0.3 / Small's
shape), a Ministral 3 (params.json with yarn and llama_4_scaling) and a Mistral 3 with a Pixtral tower (params.json's
vision_encoder, tekken.json's image settings), each a random tiny model written by transformers, rewritten as
params.json + consolidated.safetensors + tekken.json (cut from mistral_common's).

Each serves 16 concurrent chats (answers compared with the offline LLM's under the same flags on the same device),
a streamed chat (its deltas joined equal the answer), tools with tool_choice "auto" and "required" (the required
call is guided by llguidance over the tekken-built tokenizer: its arguments must parse), and a json_schema
response_format; and a chat with a data-URL image (the Mistral 3's answer is the offline LLM's; the text models
refuse it with a 400 naming messages). 0 errors and 0 mismatches expected; exit code 0."""
from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import json
import os
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.helpers.mistral_layout import write_mistral_folder  # noqa: E402
from tests.helpers.tiny_mistral_vision import make_tekken_mistral3, write_native  # noqa: E402
from tests.helpers.tiny_tekken import NUM_SPECIAL, write_tekken  # noqa: E402
from tests.server.server_proc import ServerProcess  # noqa: E402

VOCAB = 1040
FLAGS = ["--tokenizer_mode", "mistral", "--config_format", "mistral", "--load_format", "mistral"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]


def post(base: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream(base: str, body: dict) -> str:
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text.append(delta.get("content") or "")
    return "".join(text)


def build(kind: str, dst: Path) -> str:
    """A random tiny model of `kind` in Mistral's layout at dst (its HF folder beside it)."""
    import torch
    import transformers

    if kind == "mistral3":
        return write_native(make_tekken_mistral3(dst.with_name(dst.name + "-hf")), dst)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    params = None
    if kind == "mistral":
        config = transformers.MistralConfig(max_position_embeddings=2048, rope_theta=10000.0, **common)
        model = transformers.MistralForCausalLM(config)
    else:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "original_max_position_embeddings": 64,
                "beta_fast": 4.0, "beta_slow": 0.5, "mscale": 1.0, "mscale_all_dim": 0.0,
                "llama_4_scaling_beta": 0.5}
        config = transformers.Ministral3Config(max_position_embeddings=2048, rope_parameters=rope, **common)
        model = transformers.Ministral3ForCausalLM(config)
        params = {"yarn": {"factor": 32.0, "original_max_position_embeddings": 64, "beta": 4.0, "alpha": 0.5},
                  "llama_4_scaling": {"original_max_position_embeddings": 64, "beta": 0.5}}
    torch.manual_seed(0)
    model = model.to(torch.float32)
    hf = dst.with_name(dst.name + "-hf")
    model.save_pretrained(hf)
    folder = write_mistral_folder(str(hf), dst, params=params)
    write_tekken(folder, vocab=VOCAB - NUM_SPECIAL)
    return folder


def main() -> int:
    from ferrox import LLM, SamplingParams

    dtype = os.environ.get("FERROX_LIVE_DTYPE", "float32")
    tmp = Path(tempfile.mkdtemp())
    bad = 0
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (40, 24), (200, 30, 90)).save(png, format="PNG")
    image_chat = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url",
                   "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}}]}]
    kinds = ["mistral", "ministral3"]
    try:
        import cv2  # noqa: F401  (mistral_common's image encoder resizes with OpenCV: mistral-common[image])
        kinds.append("mistral3")
    except ImportError:
        print("serve_mistral_native: no OpenCV here (mistral-common[image]): the image model is skipped")
    for kind in kinds:
        folder = build(kind, tmp / kind)
        chats = [[{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"Count to {k}."}]
                 for k in range(12)]
        chats += [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                   {"role": "user", "content": f"Say {w} in French, é ü 漢字."}] for w in ("yes", "no", "cat", "dog")]
        reference = LLM(model=folder, dtype=dtype, kv_cache_memory=128 << 20, tokenizer_mode="mistral",
                        config_format="mistral", load_format="mistral")
        expected = [o.outputs[0].text for o in reference.chat(chats, SamplingParams(max_tokens=16, temperature=0),
                                                              use_tqdm=False)]
        expected_image = reference.chat(image_chat, SamplingParams(max_tokens=16, temperature=0),
                                        use_tqdm=False)[0].outputs[0].text if kind == "mistral3" else None
        del reference
        srv = ServerProcess(folder, "--served-model-name", "m", "--dtype", dtype, *FLAGS,
                            "--enable-auto-tool-choice", "--tool-call-parser", "mistral", startup_timeout=300)
        errors = mismatches = 0
        with cf.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(post, srv.base_url, "/v1/chat/completions",
                                   {"model": "m", "messages": c, "max_tokens": 16, "temperature": 0}) for c in chats]
            streamed = pool.submit(stream, srv.base_url, {"model": "m", "messages": chats[0], "max_tokens": 16,
                                                          "temperature": 0})
            auto = pool.submit(post, srv.base_url, "/v1/chat/completions", {
                "model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
                "tool_choice": "auto", "max_tokens": 16})
            required = pool.submit(post, srv.base_url, "/v1/chat/completions", {
                "model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
                "tool_choice": "required", "max_tokens": 60, "temperature": 0})
            schema = pool.submit(post, srv.base_url, "/v1/chat/completions", {
                "model": "m", "messages": [{"role": "user", "content": "A number"}], "max_tokens": 40,
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                    # (bounded: a random model may write digits until max_tokens)
                    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
                    "required": ["n"]}}}})
            image = pool.submit(post, srv.base_url, "/v1/chat/completions", {
                "model": "m", "messages": image_chat, "max_tokens": 16, "temperature": 0})
            results = [f.result() for f in futures]
            streamed_text = streamed.result()
            extras = {"auto": auto.result(), "required": required.result(), "schema": schema.result(),
                      "image": image.result()}
        for k, (status, body) in enumerate(results):
            if status != 200:
                errors += 1
                print(kind, "error", status, body)
            elif body["choices"][0]["message"]["content"] != expected[k]:
                mismatches += 1
                print(kind, "mismatch", k, repr(body["choices"][0]["message"]["content"]), "!=", repr(expected[k]))
        checks = {"stream": streamed_text == expected[0]}
        checks["auto"] = extras["auto"][0] == 200
        status, body = extras["required"]
        calls = body.get("choices", [{}])[0].get("message", {}).get("tool_calls") if status == 200 else None
        checks["required"] = bool(calls) and calls[0]["function"]["name"] == "get_weather" and "city" in json.loads(
            calls[0]["function"]["arguments"])
        status, body = extras["schema"]
        try:
            checks["schema"] = status == 200 and isinstance(json.loads(body["choices"][0]["message"]["content"])["n"],
                                                            int)
        except (ValueError, KeyError, TypeError):
            checks["schema"] = False
        status, body = extras["image"]
        checks["image"] = (status == 200 and body["choices"][0]["message"]["content"] == expected_image) if \
            expected_image is not None else (status == 400 and body["error"]["param"] == "messages")
        code = srv.stop()
        log_errors = [ln for ln in srv.log if " ERROR " in ln or "Traceback" in ln]
        print(f"{kind}: {len(chats)} chats, {errors} errors, {mismatches} mismatches, checks {checks}, exit {code}, "
              f"error log lines {len(log_errors)} {log_errors[:3]}")
        for name in ("required", "schema", "image"):
            if not checks[name]:
                print(kind, name, extras[name])
        bad += errors + mismatches + sum(not v for v in checks.values()) + (code != 0) + len(log_errors)
    print("serve_mistral_native:", "OK" if not bad else f"{bad} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
