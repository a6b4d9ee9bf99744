"""Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm): the Llama decoder with two switches."""

from __future__ import annotations

from ferrox.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_always = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
