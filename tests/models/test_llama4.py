"""Llama 4 (Llama4ForCausalLM, and Llama4ForConditionalGeneration served text-only) against transformers on tiny
random checkpoints: chunked local attention of 16 tokens on the RoPE layers (prompts of 40-90 tokens cross
chunks), NoPE layers with attention temperature tuning, MoE every layer (Scout) or every other (Maverick), the
interleaved RoPE with llama3 scaling. Greedy tokens and last-prompt logits, chunked prefill, the real engine with
a 16-token budget and prefix-cache hits, the layer kinds each config builds, and the refusals by name."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.models.llama4 import interleaved_to_halves

from tests.helpers import tiny_llama4
from tests.helpers.config_edit import copy_with_config
from tests.helpers.driver import run_greedy
from tests.helpers.tiny_models import EOS_TOKEN_ID, load_float32, models_with_references
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_greedy_and_logits_match,
    assert_outputs_match_transformers,
    hf_last_logits,
)

transformers = pytest.importorskip("transformers")

# 3 tokens (one chunk), 47 (three chunks), 85 (six chunks, past floor_scale 8 many times).
PROMPTS = [[5, 9, 11], list(range(3, 50)), [(7 * i) % 300 + 3 for i in range(85)]]
BUILDERS = {
    # Scout's layout: MoE in every layer, q/k norms on the RoPE layers, layer 2 NoPE.
    "scout": lambda d: tiny_llama4.make_tiny_llama4(d, seed=41),
    # Maverick's: MoE every other layer (dense MLPs between), no q/k norm; tied embeddings, no rope scaling.
    "maverick": lambda d: tiny_llama4.make_tiny_llama4(d, interleave_moe_layer_step=2, use_qk_norm=False,
                                                       no_rope_layers=[0, 1, 1, 0], tie_word_embeddings=True,
                                                       rope={"rope_type": "default", "rope_theta": 500000.0},
                                                       seed=42),
    "multimodal": lambda d: tiny_llama4.make_tiny_llama4_multimodal(d, interleave_moe_layer_step=2, seed=43),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, ferrox model, transformers model), float32 on the CPU; built once for the module."""
    references = {name: "Llama4ForConditionalGeneration" if name == "multimodal" else "Llama4ForCausalLM"
                  for name in BUILDERS}
    return models_with_references(tmp_path_factory.mktemp("llama4"), BUILDERS, references)


# ---- parity with transformers ---------------------------------------------------------------------
@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_and_logits_match_transformers(tiny, name):
    _, model, ref = tiny[name]
    assert_greedy_and_logits_match(model, ref, PROMPTS, [EOS_TOKEN_ID], label=name)


@pytest.mark.parametrize("name", ["scout", "maverick"])
def test_chunked_prefill_and_batching_do_not_change_tokens(tiny, name):
    """Prefill chunks of 7 tokens (cached context that starts mid attention-chunk), 8-token blocks, and one
    prompt alone: the same tokens."""
    _, model, _ = tiny[name]
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, alone=slice(2, None))


@pytest.mark.parametrize("name", ["scout", "multimodal"])
def test_engine_chunked_prefill_and_prefix_cache_match_transformers(tiny, name):
    """The real engine with a 16-token budget (prompts prefilled in chunks), then the same prompts again (their
    full blocks from the prefix cache): greedy tokens and logprobs against transformers both times."""
    folder, _, ref = tiny[name]
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=16, max_num_seqs=4,
              max_model_len=256)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert again[2].num_cached_tokens >= 80  # five of the 85-token prompt's 16-token blocks were reused
    _check_engine_against_transformers(ref, first)
    _check_engine_against_transformers(ref, again)


def _check_engine_against_transformers(ref, outs) -> None:
    assert_outputs_match_transformers(ref, PROMPTS, outs)


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_matches_transformers(tiny, expert_parallel):
    """Two ranks (gloo): heads, dense MLPs and the shared expert sharded as Llama's and the MoE stack's, the
    experts sharded by their intermediate rows or split 2 + 2 over the ranks (expert parallelism)."""
    folder, _, ref = tiny["maverick"]
    llm = LLM(model=folder, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              kv_cache_memory=8 << 20, max_num_batched_tokens=16, max_model_len=256)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    _check_engine_against_transformers(ref, outs)


# ---- the config's layer kinds ---------------------------------------------------------------------
def test_layers_follow_the_config(tiny):
    scout, maverick = tiny["scout"][1].model, tiny["maverick"][1].model
    assert scout.layout.rotary == (True, True, False, True)
    assert scout.layout.chunk == (16, 16, 0, 16)  # the RoPE layers attend in chunks, the NoPE layer globally
    assert scout.layout.moe == (True,) * 4
    assert [layer.self_attn.qk_norm for layer in scout.layers] == [True, True, False, True]
    assert maverick.layout.moe == (False, True, False, True)
    assert maverick.layout.chunk == (0, 16, 16, 0)
    assert not any(layer.self_attn.qk_norm for layer in maverick.layers)
    assert tiny["maverick"][1].lm_head is None  # tied


@pytest.mark.parametrize("edit", [dict(attention_chunk_size=None, layer_types=None),
                                  dict(attn_temperature_tuning=False), dict(use_qk_norm=False)])
def test_each_semantic_changes_the_output(tiny, tmp_path, edit):
    """Chunked attention, the temperature tuning and the q/k norm each decide something here: turned off in
    config.json, the logits part from transformers' (so the parity above is not vacuous)."""
    folder, _, ref = tiny["scout"]
    model = load_float32(copy_with_config(folder, tmp_path / "edited", **edit))
    _, logits = run_greedy(model, PROMPTS[2:], 1, return_prefill_logits=True)
    assert not torch.allclose(logits[0], hf_last_logits(ref, PROMPTS[2]), atol=1e-3)


def test_interleaved_rows_become_halves():
    head_dim = 6
    w = torch.arange(2 * head_dim, dtype=torch.float32)[:, None]  # two heads
    assert interleaved_to_halves(w, head_dim)[:, 0].tolist() == [0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11]


# ---- refusals ---------------------------------------------------------------------------------------
def test_top_k_above_one_is_refused_by_name(tiny, tmp_path):
    folder = copy_with_config(tiny["scout"][0], tmp_path / "top2", num_experts_per_tok=2)
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok 2"):
        load_float32(folder)


@pytest.mark.parametrize("name", ["maverick", "multimodal"])
def test_lora_rows_follow_the_loader(tiny, name):
    """An adapter's q_proj / k_proj lora_B rows are reordered as the weights' (interleaved pairs to halves), the
    multimodal checkpoint's `language_model.` prefix dropped; the dense layers' MLPs are adapted too."""
    from tests.lora.adapters import assert_lora_rows_follow_the_loader

    assert_lora_rows_follow_the_loader(tiny[name][0])


def test_images_are_refused_by_name(tiny):
    """The multimodal checkpoint's vision tower is not built: an image in a request is refused, never dropped."""
    from PIL import Image

    llm = LLM(model=tiny["multimodal"][0], dtype="float32", kv_cache_memory=4 << 20, max_model_len=256)
    try:
        img = Image.new("RGB", (28, 28), (200, 10, 10))
        with pytest.raises(InvalidArgumentError, match="takes no images"):
            llm.generate({"prompt": "hi", "multi_modal_data": {"image": img}}, SamplingParams(max_tokens=2))
    finally:
        llm.engine.shutdown()


# ---- GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["scout", "maverick"])
def test_cuda_engine_matches_cpu_engine(tiny, name):
    """On CUDA: the Triton attention kernels with chunks (the unified kernel for decodes and short chunks, the
    prefill kernel for the 200-token prompt; cuDNN and the CUDA decode kernel step aside), the decode CUDA graphs,
    the fused MoE kernels; float32 tokens equal the CPU engine's, bfloat16 close."""
    from tests.models.conftest import assert_cuda_engine_matches_cpu

    prompts = [*PROMPTS, [(13 * i + 4) % 300 + 3 for i in range(200)]]
    assert_cuda_engine_matches_cpu(tiny[name][0], prompts, max_tokens=12, max_model_len=512)
