"""Ministral 3 (models/ministral3.py) against transformers on tiny random checkpoints (tests/helpers/
tiny_ministral3.py): YaRN over a 16-position original context and Llama 4's query scaling, with prompts of 3-70
tokens that cross several multiples of it. Ministral3ForCausalLM (untied, and tied with a sliding window), its
greedy tokens and last-prompt logits, chunked prefill, the real engine; Mistral3ForConditionalGeneration over a
ministral3 text config (a text prompt and an image); the FP8 releases' layout (per-tensor scales named
`weight_scale_inv` / `activation_scale`, static activations, quantization_config at the top level) against
transformers on the dequantized weights; two tensor-parallel ranks (slow); and on a GPU, the CUDA engine against
the CPU one (float32, bfloat16) and the FP8 release against the reference."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import ModelLoadError
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.model_spec import spec_for_context
from ferrox.models.ministral3 import Llama4QueryScaling, llama4_query_scaling

from tests.helpers import tiny_ministral3
from tests.helpers.config_edit import copy_with_config
from tests.helpers.driver import run_greedy
from tests.helpers.quant_checkpoints import MERGED, assert_follows_reference, reference_greedy
from tests.helpers.tiny_models import EOS_TOKEN_ID, load_float32, models_with_references
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_cuda_engine_matches_cpu,
    assert_greedy_and_logits_match,
    assert_outputs_match_transformers,
    chunked_engine_outputs,
    hf_greedy,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

# 3 tokens (inside the first 16 positions), 40 (three scaling steps), 70 (five; with 10 new tokens, 80 of 128).
PROMPTS = [[5, 9, 11], list(range(3, 43)), [(7 * i) % 300 + 3 for i in range(70)]]
MAX_LEN = 128
BUILDERS = {
    "text": lambda d: tiny_ministral3.make_tiny_ministral3(d, seed=0),
    # The 3B's tied head, the multimodal releases' rope, and a sliding window of 24 (transformers applies it).
    "tied-window": lambda d: tiny_ministral3.make_tiny_ministral3(
        d, tie_word_embeddings=True, sliding_window=24, rope_parameters=dict(tiny_ministral3.MULTIMODAL_ROPE),
        seed=1),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, ferrox model, transformers model), float32 on the CPU; the ferrox models built for a
    context of MAX_LEN (where the sliding window is shorter than the context: spec_for_context)."""
    out = models_with_references(tmp_path_factory.mktemp("ministral3"), BUILDERS)
    folder, _, ref = out["tied-window"]
    source = resolve_model(folder)
    spec = spec_for_context(load_model_spec(source), MAX_LEN)
    assert spec.attention_windows == (24, 24)
    out["tied-window"] = (folder, load_model(source, spec, dtype=torch.float32, device="cpu"), ref)
    return out


# ---- the text model ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_and_logits_match_transformers(tiny, name):
    _, model, ref = tiny[name]
    assert type(model).__name__ == "Ministral3ForCausalLM" and model.model.query_scale is not None
    assert (model.lm_head is None) == (name == "tied-window")
    assert_greedy_and_logits_match(model, ref, PROMPTS, [EOS_TOKEN_ID], label=name)


def test_chunked_prefill_and_batching_do_not_change_tokens(tiny):
    """Prefill chunks of 7 tokens (cached context reaching across scaling steps), 8-token blocks, a prompt
    alone: the same tokens."""
    assert_chunking_and_batching_keep_tokens(tiny["text"][1], PROMPTS, alone=slice(2, None))


@pytest.mark.parametrize("name", list(BUILDERS))
def test_engine_chunked_prefill_matches_transformers(tiny, name):
    """The real engine with a 16-token budget: greedy tokens and logprobs as transformers' over prompt + output."""
    folder, _, ref = tiny[name]
    outs = chunked_engine_outputs(folder, PROMPTS, max_model_len=MAX_LEN)
    assert_outputs_match_transformers(ref, PROMPTS, outs)


@pytest.mark.slow
def test_tensor_parallel_matches_transformers(tiny):
    """Two ranks (gloo): each scales its own query heads; tokens and logprobs as transformers'."""
    folder, _, ref = tiny["text"]
    outs = chunked_engine_outputs(folder, PROMPTS, max_model_len=MAX_LEN, tensor_parallel_size=2)
    assert_outputs_match_transformers(ref, PROMPTS, outs)


@pytest.mark.parametrize("rope", [{"llama_4_scaling_beta": 0.0}, {"rope_type": "default", "type": "default"}],
                         ids=["no-query-scaling", "no-yarn"])
def test_query_scaling_and_yarn_each_matter(tiny, tmp_path, rope):
    """Without the query scaling, or without YaRN, the long prompt's logits part from transformers' (the parity
    above is not vacuous); the short one, inside the first 16 positions, keeps them without the scaling."""
    folder, _, ref = tiny["text"]
    edited = copy_with_config(folder, tmp_path / "edited",
                              rope_parameters={**tiny_ministral3.ROPE, **rope})
    model = load_float32(edited)
    _, logits = run_greedy(model, PROMPTS, 1, return_prefill_logits=True)
    _, want = run_greedy(tiny["text"][1], PROMPTS, 1, return_prefill_logits=True)
    assert (logits[2] - want[2]).abs().max() > 1e-2
    if "llama_4_scaling_beta" in rope:
        assert model.model.query_scale is None
        torch.testing.assert_close(logits[0], want[0], atol=1e-5, rtol=1e-5)


def test_query_scaling_reads_the_config():
    scale = llama4_query_scaling({"rope_parameters": {"llama_4_scaling_beta": 0.1,
                                                      "original_max_position_embeddings": 16384}})
    assert scale == Llama4QueryScaling(0.1, 16384)
    got = scale(torch.tensor([0, 16383, 16384, 32767, 32768, 262143]))
    want = 1 + 0.1 * torch.log(torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 16.0]))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert llama4_query_scaling({"rope_parameters": {"rope_type": "yarn", "llama_4_scaling_beta": 0}}) is None
    assert llama4_query_scaling({"rope_parameters": {"rope_type": "default"}}) is None
    with pytest.raises(ModelLoadError, match="original_max_position_embeddings"):
        llama4_query_scaling({"rope_parameters": {"llama_4_scaling_beta": 0.1}})


# ---- Mistral 3 over a ministral3 text config ----------------------------------------------------------
@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    folder = tiny_ministral3.make_tiny_ministral3_multimodal(tmp_path_factory.mktemp("ministral3") / "mm")
    hf = transformers.Mistral3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


def test_mistral3_with_a_ministral3_text_config_matches_transformers(multimodal):
    """A text prompt and an image's (a 7x8 rows layout: 63 positions) greedy tokens as transformers'."""
    from tests.models.test_mistral3 import GREEDY, _hf_greedy, _images, _processed

    folder, hf = multimodal
    llm = LLM(model=folder, dtype="float32", device="cpu", kv_cache_memory=8 << 20, max_model_len=MAX_LEN,
              max_num_batched_tokens=16)
    try:
        model = llm.engine.runner.model
        assert type(model.model).__name__ == "Ministral3Model" and model.model.query_scale.beta == 0.3
        assert model.lm_head is None  # tied
        text = PROMPTS[2]
        prompt = "Hello [IMG] What is this?"
        image = _images()[1]
        outs = llm.generate([{"prompt_token_ids": text}, {"prompt": prompt, "multi_modal_data": {"image": [image]}}],
                            GREEDY, use_tqdm=False)
        processed = _processed(llm, prompt, [image])
    finally:
        llm.engine.shutdown()
    assert list(outs[0].outputs[0].token_ids) == hf_greedy(hf, text, 8)
    assert [item.grid for item in processed.mm_items] == [[7, 8]]
    assert list(outs[1].outputs[0].token_ids) == _hf_greedy(hf, processed)


# ---- the FP8 releases' layout -------------------------------------------------------------------------
_PROJ = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj$")
FP8 = torch.float8_e4m3fn


def _fp8_release(folder: str, dst, hf, prompts: list[list[int]]) -> str:
    """The folder in the FP8 releases' layout, quantized from `hf` (its float model, loaded from the folder):
    every language-model projection per tensor (absmax -> 448), its static input scale calibrated on `prompts`
    (the largest input / 448, times 1.5 on k/v/up so a merged layer's shards differ). `hf` becomes the
    reference: weights dequantized, each projection's input rounded through fp8 with its merged layer's largest
    input scale, as the engine takes it."""
    modules = {name: m for name, m in hf.named_modules() if _PROJ.search(name) and "vision" not in name}
    amax: dict[str, float] = {}

    def record(name, module, args):
        amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))

    hooks = [m.register_forward_pre_hook(functools.partial(record, name)) for name, m in modules.items()]
    with torch.inference_mode():
        for prompt in prompts:
            hf(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    tensors = dict(hf.state_dict())
    static: dict[str, float] = {}
    for name, module in modules.items():
        w = module.weight.detach().float()
        scale = w.abs().amax() / 448.0
        codes = (w / scale).clamp(-448, 448).to(FP8)
        input_scale = amax[name] / 448.0 * (1.5 if name.endswith(("k_proj", "v_proj", "up_proj")) else 1.0)
        tensors[f"{name}.weight"] = codes
        tensors[f"{name}.weight_scale_inv"] = scale.reshape(())  # (0-dim, as transformers saves them)
        tensors[f"{name}.activation_scale"] = torch.tensor(input_scale, dtype=torch.float32)
        module.weight.data = codes.float() * scale
        layer, proj = name.rsplit(".", 1)
        group = f"{layer}.{MERGED.get(proj, proj)}"
        static[group] = max(static.get(group, 0.0), input_scale)
    for name, module in modules.items():
        layer, proj = name.rsplit(".", 1)
        module.register_forward_pre_hook(functools.partial(_fake_quantized, static[f"{layer}.{MERGED.get(proj, proj)}"]))
    return tiny_ministral3.write_fp8_release(folder, dst, tensors)


def _fake_quantized(scale: float, module, args):
    return ((args[0].float() / scale).clamp(-448, 448).to(FP8).float() * scale,)


@pytest.mark.parametrize("kind", ["text", "multimodal"])
def test_fp8_release_layout_matches_the_dequantized_model(tiny, multimodal, tmp_path, kind):
    """Greedy tokens equal to transformers' on the dequantized weights with fp8-rounded inputs, logprobs within
    float32 rounding; the language model's projections run FP8 with static scales, the LM head and (multimodal)
    the tower stay float."""
    from ferrox.layers.quant.fp8_linear import Fp8Linear

    if kind == "text":
        folder = tiny["text"][0]
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    else:
        folder = multimodal[0]
        hf = transformers.Mistral3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    release = _fp8_release(folder, tmp_path / "fp8", hf, PROMPTS)
    llm = LLM(model=release, device="cpu", kv_cache_memory=8 << 20, max_model_len=MAX_LEN)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    try:
        model = llm.engine.runner.model
        runner = model.model.layers[1].self_attn.qkv_proj.quant
        assert isinstance(runner, Fp8Linear) and runner.activations == "static"
        assert model.lm_head_weight.dtype == torch.float32
        if kind == "multimodal":
            assert model.vision_tower.transformer.layers[0].attention.q_proj.weight.dtype == torch.float32
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0] for p in PROMPTS]
    finally:
        llm.engine.shutdown()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens, logprobs = reference_greedy(hf, prompt, 8)
        assert list(out.token_ids) == tokens, prompt
        got = [step[t].logprob for step, t in zip(out.logprobs, out.token_ids, strict=True)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)


# ---- GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_matches_cpu(tiny):
    """The CUDA engine (Triton attention, CUDA graphs, the fused one-token path scaling its queries) against the
    CPU float32 engine: float32 tokens equal, bfloat16 close (conftest.assert_cuda_engine_matches_cpu)."""
    from ferrox.attention.fused_decode import FusedOneTokenDecode

    folder = tiny["text"][0]
    source = resolve_model(folder)
    cuda = load_model(source, load_model_spec(source), dtype=torch.float32, device="cuda")
    path = cuda.model.decode_path
    assert isinstance(path, FusedOneTokenDecode) and path.q_scale is cuda.model.query_scale is not None
    del cuda
    assert_cuda_engine_matches_cpu(folder, PROMPTS, max_tokens=8, max_model_len=MAX_LEN)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_release_on_cuda(tiny, tmp_path):
    """The FP8 release layout on the GPU (static W8A8 prefill, the fused fp8 one-token kernels with the query
    scale) against the CPU reference fed the engine's tokens (quant_checkpoints.assert_follows_reference: a
    W8A8 rounding difference can flip a near-tie, so tokens are not compared one for one)."""
    folder = tiny["text"][0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    release = _fp8_release(folder, tmp_path / "fp8", hf, PROMPTS)
    llm = LLM(model=release, dtype="float32", max_model_len=MAX_LEN, kv_cache_memory=64 << 20)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    try:
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0] for p in PROMPTS]
    finally:
        llm.engine.shutdown()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens = list(out.token_ids)
        assert_follows_reference(hf, prompt, tokens, [step[t].logprob for step, t in zip(out.logprobs, tokens,
                                                                                          strict=True)])
