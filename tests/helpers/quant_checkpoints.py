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
