"""Mistral 4 (models/mistral4.py: Mistral Small 4) against transformers on tiny random checkpoints (tests/helpers/
tiny_mistral4.py): DeepSeek's latent attention and experts with YaRN over a 16-position original context and Llama
4's query scaling, prompts of 3-70 tokens crossing several multiples of it, transformers 5's stacked experts.
Mistral4ForCausalLM's greedy tokens and last-prompt logits, chunked prefill, the real engine; the scaling and the
router's group ranking each changing the logits (the parity is not vacuous); Mistral3ForConditionalGeneration over
a mistral4 text config (a text prompt and an image); the FP8 release's layout (per-tensor `weight_scale_inv`,
static `activation_scale`, stacked per-expert scales) against transformers on the dequantized weights; two
tensor-parallel ranks (slow); on a GPU, the CUDA engine (Triton MLA kernels, CUDA graphs) against the CPU one."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.models.deepseek_v2 import DeepseekMoe

from tests.helpers import tiny_mistral4
from tests.helpers.config_edit import copy_with_config
from tests.helpers.driver import run_greedy
from tests.helpers.tiny_models import EOS_TOKEN_ID, load_float32, models_with_references
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_greedy_and_logits_match,
    assert_outputs_match_transformers,
    chunked_engine_outputs,
    hf_greedy,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

# 3 tokens (inside the first 16 positions), 40 (three scaling steps), 70 (five; with 8 new tokens, 78 of 128).
PROMPTS = [[5, 9, 11], list(range(3, 43)), [(7 * i) % 300 + 3 for i in range(70)]]
MAX_LEN = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, ferrox model, transformers model), float32 on the CPU."""
    return models_with_references(tmp_path_factory.mktemp("mistral4"), {"text": tiny_mistral4.make_tiny_mistral4},
                                  references={"text": "Mistral4ForCausalLM"})["text"]


def test_greedy_and_logits_match_transformers(tiny):
    _, model, ref = tiny
    assert type(model).__name__ == "Mistral4ForCausalLM" and model.model.query_scale.beta == 0.5
    assert [isinstance(layer.mlp, DeepseekMoe) for layer in model.model.layers] == [False, True, True]
    moe = model.model.layers[1].mlp.moe
    assert (moe.scoring_func, moe.correction_bias, moe.group_top2, moe.num_expert_group, moe.topk_group,
            moe.renormalize, moe.routed_scaling_factor) == ("softmax", False, True, 3, 1, True, 1.5)
    assert model.mla.interleaved and model.spec.rotary_dim is None  # (partial_rotary_factor 0.5: the 16 rope dims)
    assert_greedy_and_logits_match(model, ref, PROMPTS, [EOS_TOKEN_ID])


def test_chunked_prefill_and_batching_do_not_change_tokens(tiny):
    """Prefill chunks of 7 tokens over cached context across scaling steps, 8-token blocks, a prompt alone."""
    assert_chunking_and_batching_keep_tokens(tiny[1], PROMPTS, alone=slice(2, None))


def test_engine_chunked_prefill_matches_transformers(tiny):
    """The real engine (Rust scheduler, paged latent cache) with a 16-token budget: tokens and logprobs as
    transformers' over prompt + output."""
    folder, _, ref = tiny
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS, max_model_len=MAX_LEN))


@pytest.mark.slow
def test_tensor_parallel_matches_transformers(tiny):
    """Two ranks (gloo): each scales its own query heads; tokens and logprobs as transformers'."""
    folder, _, ref = tiny
    outs = chunked_engine_outputs(folder, PROMPTS, max_model_len=MAX_LEN, tensor_parallel_size=2)
    assert_outputs_match_transformers(ref, PROMPTS, outs)


def test_query_scaling_and_group_ranking_each_matter(tiny, tmp_path):
    """Without the query scaling the long prompt's logits part from the model's (the short one, inside the first
    16 positions, keeps them); ranking expert groups by their best score (DeepSeek-V2's) instead of their two
    best changes them too."""
    folder, model, _ = tiny
    _, want = run_greedy(model, PROMPTS, 1, return_prefill_logits=True)
    unscaled = load_float32(copy_with_config(folder, tmp_path / "beta0",
                                             rope_parameters={**tiny_mistral4.ROPE, "llama_4_scaling_beta": 0.0}))
    assert unscaled.model.query_scale is None
    _, logits = run_greedy(unscaled, PROMPTS, 1, return_prefill_logits=True)
    assert (logits[2] - want[2]).abs().max() > 1e-2
    torch.testing.assert_close(logits[0], want[0], atol=1e-5, rtol=1e-5)
    for layer in unscaled.model.layers[1:]:  # (reused: the scaling back on, the groups ranked by their best)
        layer.mlp.moe = dataclasses.replace(layer.mlp.moe, group_top2=False)
    unscaled.model.query_scale = model.model.query_scale
    _, logits = run_greedy(unscaled, PROMPTS, 1, return_prefill_logits=True)
    assert max((logits[i] - want[i]).abs().max() for i in range(3)) > 1e-2


def test_rope_fields_and_stacked_scales():
    """partial_rotary_factor must name the qk_rope_head_dim dims (of qk_nope + qk_rope); a stacked gate_up scale
    per expert is one for both halves ([1, 1]), one each ([2, 1]) or rows / blocks halved."""
    from ferrox.loader.model_config import spec_from_hf_config
    from ferrox.model_spec import ModelLoadError
    from ferrox.models.mistral4 import _halves

    config = {"architectures": ["Mistral4ForCausalLM"], "model_type": "mistral4", "vocab_size": 32, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
              **{k: v for k, v in tiny_mistral4.text_fields().items() if k != "model_type"}}
    assert spec_from_hf_config(config, "config.json").rotary_dim is None
    with pytest.raises(ModelLoadError, match="gives 8 rotary dims of a 32-dim query head"):
        spec_from_hf_config({**config, "rope_parameters": {**tiny_mistral4.ROPE, "partial_rotary_factor": 0.25}},
                            "config.json")
    one, pair, rows = torch.tensor([[2.0]]), torch.tensor([[2.0], [3.0]]), torch.arange(8.0).reshape(4, 2)
    assert [float(x) for x in _halves(one, 2, "_scale_inv")] == [2.0, 2.0]
    assert [float(x) for x in _halves(pair, 2, "_scale_inv")] == [2.0, 3.0]
    assert [x.tolist() for x in _halves(rows, 2, "")] == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0, 7.0]]]
    assert [float(x) for x in _halves(torch.tensor(0.5), 2, "_activation_scale")] == [0.5, 0.5]


# ---- Mistral 3 over a mistral4 text config --------------------------------------------------------------
def test_mistral3_with_a_mistral4_text_config_matches_transformers(tmp_path):
    """The releases' layout (Pixtral tower, projector, `model.language_model.*`): a text prompt's and an image's (a
    7x8 rows layout: 63 positions) greedy tokens as transformers'."""
    from tests.models.test_mistral3 import GREEDY, _hf_greedy, _images, _processed

    folder = tiny_mistral4.make_tiny_mistral4_multimodal(tmp_path / "mm")
    hf = transformers.Mistral3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", device="cpu", kv_cache_memory=8 << 20, max_model_len=MAX_LEN,
              max_num_batched_tokens=16)
    try:
        model = llm.engine.runner.model
        assert type(model).__name__ == "Mistral3Mistral4ForConditionalGeneration"
        assert type(model.model).__name__ == "Mistral4Model" and model.model.query_scale.beta == 0.5
        text, prompt, image = PROMPTS[2], "Hello [IMG] What is this?", _images()[1]
        outs = llm.generate([{"prompt_token_ids": text}, {"prompt": prompt, "multi_modal_data": {"image": [image]}}],
                            GREEDY, use_tqdm=False)
        processed = _processed(llm, prompt, [image])
    finally:
        llm.engine.shutdown()
    assert list(outs[0].outputs[0].token_ids) == hf_greedy(hf, text, 8)
    assert [item.grid for item in processed.mm_items] == [[7, 8]]
    assert list(outs[1].outputs[0].token_ids) == _hf_greedy(hf, processed)


# ---- the FP8 release's layout -------------------------------------------------------------------------------
_PROJ = re.compile(r"layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
                   r"|mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj))$")
FP8 = torch.float8_e4m3fn


def _per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes, the bf16 0-dim scale) of one matrix, as the release stores them."""
    scale = (w.float().abs().amax() / 448.0).to(torch.bfloat16)
    return (w.float() / scale.float()).clamp(-448, 448).to(FP8), scale


def _fp8_release(folder: str, dst, hf) -> str:
    """The folder in the FP8 release's layout, quantized from `hf` (its float model): each projection per tensor
    with a static input scale calibrated on PROMPTS, the stacked experts per expert (`gate_up_proj_scale_inv`
    [E, 1, 1] for both halves, their `*_activation_scale` [E]). `hf` becomes the reference: weights dequantized,
    projection inputs rounded through fp8 with their static scales (a merged gate/up's largest), kv_b_proj's
    not (ferrox absorbs it), the experts' per token (fp8_moe_checkpoints: what the experts run)."""
    from tests.helpers.fp8_moe_checkpoints import _experts_forward
    from tests.helpers.tiny_ministral3 import write_fp8_release

    modules = {name: m for name, m in hf.named_modules() if _PROJ.search(name)}
    amax: dict[str, float] = {}

    def record(name, module, args):
        amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))

    hooks = [m.register_forward_pre_hook(functools.partial(record, name)) for name, m in modules.items()]
    with torch.inference_mode():
        for prompt in PROMPTS:
            hf(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    tensors = dict(hf.state_dict())
    static: dict[str, float] = {}
    for name, module in modules.items():
        codes, scale = _per_tensor(module.weight.detach())
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = codes, scale
        tensors[f"{name}.activation_scale"] = torch.tensor(amax[name] / 448.0 * (1.5 if "up_proj" in name else 1.0))
        module.weight.data = codes.float() * scale.float()
        group = name.replace("up_proj", "gate_proj")  # (ferrox's merged gate/up takes the larger scale)
        static[group] = max(static.get(group, 0.0), float(tensors[f"{name}.activation_scale"]))
    for name, module in modules.items():
        if not name.endswith("kv_b_proj"):
            module.register_forward_pre_hook(functools.partial(_fake_quantized,
                                                               static[name.replace("up_proj", "gate_proj")]))
    for name, experts in hf.named_modules():
        if not name.endswith("mlp.experts"):
            continue
        for proj in ("gate_up_proj", "down_proj"):
            w = getattr(experts, proj).detach()
            pairs = [_per_tensor(w[e]) for e in range(w.shape[0])]
            tensors[f"{name}.{proj}"] = torch.stack([codes for codes, _ in pairs])
            tensors[f"{name}.{proj}_scale_inv"] = torch.stack([scale for _, scale in pairs]).reshape(-1, 1, 1)
            tensors[f"{name}.{proj}_activation_scale"] = torch.full((w.shape[0],), 0.05)  # (read, not used)
            getattr(experts, proj).data = torch.stack([codes.float() * scale.float() for codes, scale in pairs])
        experts.fp8_block = None
        experts.forward = _experts_forward.__get__(experts)
    return write_fp8_release(folder, dst, tensors)


def _fake_quantized(scale: float, module, args):
    return ((args[0].float() / scale).clamp(-448, 448).to(FP8).float() * scale,)


def test_fp8_release_layout_matches_the_dequantized_model(tiny, tmp_path):
    """Greedy tokens equal to transformers' on the dequantized weights with fp8-rounded inputs, logprobs within
    float32 rounding; the projections run FP8 with static scales, the experts FP8 per token, the LM head float."""
    from ferrox.layers.quant.fp8_linear import Fp8Linear

    from tests.helpers.quant_checkpoints import reference_greedy

    folder = tiny[0]
    hf = transformers.Mistral4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    release = _fp8_release(folder, tmp_path / "fp8", hf)
    llm = LLM(model=release, device="cpu", kv_cache_memory=8 << 20, max_model_len=MAX_LEN)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    try:
        model = llm.engine.runner.model
        attn = model.model.layers[1].self_attn
        assert isinstance(attn.q_b_proj.quant, Fp8Linear) and attn.q_b_proj.quant.activations == "static"
        assert model.model.layers[1].mlp.experts.w13.dtype == FP8 and model.lm_head_weight.dtype == torch.float32
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for prompt, out in zip(PROMPTS[1:], outs, strict=True):
        tokens, logprobs = reference_greedy(hf, prompt, 6)
        assert list(out.outputs[0].token_ids) == tokens, prompt
        got = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(logprobs), atol=1e-3, rtol=1e-3)


# ---- GPU ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_matches_cpu(tiny):
    """The CUDA engine (the Triton MLA kernels with the scaled queries, decode and piecewise CUDA graphs, the fused
    MoE kernels) against the CPU float32 engine: float32 tokens equal, bfloat16 close; a 112-token prompt too
    (seven scaling steps)."""
    from tests.models.conftest import assert_cuda_engine_matches_cpu

    prompts = [*PROMPTS, [(13 * i + 4) % 300 + 3 for i in range(112)]]
    assert_cuda_engine_matches_cpu(tiny[0], prompts, max_tokens=8, max_model_len=MAX_LEN)
