"""What the quantized-checkpoint tests (tests/models/test_fp8_quant.py, test_int8_checkpoints.py) share:
writing a checkpoint folder beside a tiny float one, calibrating static input scales on the float
model, and stepping a transformers reference (dequantized weights, fake-quantized inputs) the way the
engine steps one request, with a KV cache."""

from __future__ import annotations

import functools
import json
import os
import shutil

import torch

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MERGED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def write_checkpoint(float_folder: str, folder, quantization_config: dict, tensors: dict[str, torch.Tensor]) -> str:
    """The float folder's tokenizer and config, with `quantization_config` and `tensors` as weights."""
    from safetensors.torch import save_file

    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(float_folder):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(float_folder, name), folder)
    with open(os.path.join(float_folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    return folder


def with_float_modules(tensors: dict[str, torch.Tensor], float_weights: dict[str, torch.Tensor],
                       modules) -> dict[str, torch.Tensor]:
    """A quantized checkpoint's tensors with the projections `modules(name)` picks left in float, as an export
    that ignores them writes them: the float `weight`, no scales, input scales or zero points."""
    out = {}
    for name, value in tensors.items():
        module = name.rsplit(".", 1)[0]
        if not (module.endswith(PROJ) and modules(module)):
            out[name] = value
        elif name.endswith((".weight", ".bias")):
            out[name] = float_weights[name]
    return out


def edited_copy(folder: str, dst, edit) -> str:
    """A copy of checkpoint `folder` at `dst` (a new pathlib folder) whose tensors `edit(tensors)`
    changed in place (the refusal tests: a tensor dropped, retyped, reshaped)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    edit(tensors)
    os.makedirs(dst)
    for name in os.listdir(folder):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(folder, name), dst)
    save_file(tensors, os.path.join(str(dst), "model.safetensors"))
    return str(dst)


def load_checkpoint(folder: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The model of `folder` loaded as the engine loads it, with its own quantization_config."""
    from ferrox.layers.quant.config import resolve_quant_config
    from ferrox.loader.model_loader import load_model, load_model_spec
    from ferrox.loader.source import resolve_model

    source = resolve_model(folder)
    spec = load_model_spec(source)
    return load_model(source, spec, dtype=dtype, device=device, quant_config=resolve_quant_config(None, spec))


def make_llm(folder: str, **kw):
    """An `LLM` on a tiny checkpoint: a small KV cache, on the CPU unless `device` says otherwise."""
    from ferrox import LLM

    kw.setdefault("device", "cpu")
    return LLM(model=folder, kv_cache_memory=8 << 20, max_model_len=256, **kw)


def engine_greedy(llm, prompts: list[list[int]], new_tokens: int = 8) -> list[tuple[list[int], list[float]]]:
    """Each prompt alone (a dynamic per-tensor scale then spans one request's tokens): its greedy
    tokens and their logprobs. Shuts the engine down."""
    from ferrox import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    try:
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    finally:
        llm.engine.shutdown()
    return [(list(o.token_ids), [step[t].logprob for step, t in zip(o.logprobs, o.token_ids, strict=True)])
            for o in outs]


def calibrate_input_amax(float_folder: str, prompts: list[list[int]]) -> dict[str, float]:
    """Each projection's largest input over `prompts` in the float model (module name -> amax)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    amax: dict[str, float] = {}

    def record(name, module, args):
        amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))

    for name, module in model.named_modules():
        if name.endswith(PROJ):
            module.register_forward_pre_hook(functools.partial(record, name))
    with torch.inference_mode():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    return amax


def dequantized_reference(float_folder: str, tensors: dict[str, torch.Tensor], quantize_input=None):
    """transformers (float32) with every quantized projection's weight = `weight` * `weight_scale` of `tensors`
    and, given quantize_input(x, static_scale), each projection's input rounded by it. static_scale
    is the checkpoint's `input_scale` for that projection -- a merged layer (q/k/v, gate/up) reads one
    input, so the largest of its shards', as the engines take it -- or None where none is stored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    static: dict[str, float] = {}
    for name, value in tensors.items():
        if name.endswith(".input_scale"):
            layer, proj = name.rsplit(".", 1)[0].rsplit(".", 1)
            key = f"{layer}.{MERGED.get(proj, proj)}"
            static[key] = max(static.get(key, 0.0), float(value))
    for name, module in model.named_modules():
        if not name.endswith(PROJ) or f"{name}.weight_scale" not in tensors:
            continue  # (a projection the checkpoint leaves in float runs as it is)
        scale = tensors[f"{name}.weight_scale"].float()
        codes = tensors[f"{name}.weight"].float()
        module.weight.data = codes * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))
        if quantize_input is not None:
            layer, proj = name.rsplit(".", 1)
            s = static.get(f"{layer}.{MERGED.get(proj, proj)}")
            module.register_forward_pre_hook(functools.partial(_rounded_input, quantize_input, s))
    return model


def _rounded_input(quantize_input, static_scale: float | None, module, args):
    return (quantize_input(args[0], static_scale),)


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, one token per step after the prompt (a KV cache), as the
    engine steps a request that runs alone."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, logprobs = [], []
    for _ in range(new_tokens):
        lp = out.logits[0, -1].float().log_softmax(-1)
        token = int(lp.argmax())
        tokens.append(token)
        logprobs.append(float(lp[token]))
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs


@torch.inference_mode()
def reference_forced(model, prompt: list[int], tokens: list[int]) -> tuple[list[float], list[float]]:
    """The reference fed the engine's tokens: per step, its logprob of that token and its best logprob."""
    out = model(torch.tensor([prompt]), use_cache=True)
    chosen, best = [], []
    for token in tokens:
        lp = out.logits[0, -1].float().log_softmax(-1)
        chosen.append(float(lp[token]))
        best.append(float(lp.max()))
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return chosen, best


def assert_follows_reference(reference, prompt: list[int], tokens: list[int], logprobs: list[float],
                             nats: float = 0.1) -> None:
    """The GPU tests' check: the reference fed the engine's tokens finds each its best up to `nats`,
    and the engine's logprobs within `nats` of its own. (The GPU's float32 attention and norms differ
    from the CPU reference's by ~1e-6, which moves a quantized input code now and then, and such a
    difference can flip a near-tie, so greedy tokens are not compared.)"""
    ref_logprobs, ref_best = reference_forced(reference, prompt, tokens)
    gaps = [round(b - c, 4) for b, c in zip(ref_best, ref_logprobs, strict=True)]
    diffs = [round(a - b, 4) for a, b in zip(logprobs, ref_logprobs, strict=True)]
    assert max(gaps) < nats and max(map(abs, diffs)) < nats, (prompt, gaps, diffs)
