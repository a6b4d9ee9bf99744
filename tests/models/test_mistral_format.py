"""Mistral's native checkpoint layout (vLLM's --config-format mistral / --load-format mistral):
loader/mistral_config.py (params.json -> config.json), loader/config_file.py (which file 'auto' reads),
loader/mistral_weights.py (consolidated*.safetensors names and rotary rows).

Tiny transformers checkpoints are rewritten in Mistral's layout by test code (tests/helpers/mistral_layout.py:
params.json, Mistral's names, q/k rows in Mistral's rotary order); the engine must load them as the very model
of the Hugging Face folder -- the same tensors, tensor-parallel ranks included -- and generate transformers'
tokens. The rotary direction is checked on its own: Mistral's complex rotary over native rows and transformers'
rotate_half over the loader's rows give the same attention scores. Then the config mapping (YaRN, sliding
windows, tied embeddings, FP8, Ministral 3's llama_4_scaling, the Pixtral tower) and refusals by key name.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from ferrox.distributed.parallel_state import TPGroup, use_tp_group
from ferrox.distributed.sharding import CheckpointSlice
from ferrox.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
from ferrox.layers.quant.config import resolve_quant_config
from ferrox.loader.config_file import read_model_config
from ferrox.loader.mistral_config import hf_config_from_params
from ferrox.loader.mistral_weights import rotary_rows
from ferrox.loader.model_config import spec_from_hf_config
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model

from tests.helpers.driver import run_greedy
from tests.helpers.mistral_layout import to_mistral_rows, write_mistral_folder
from tests.helpers.tiny_models import (
    EOS_TOKEN_ID,
    load_float32,
    make_tiny_llama,
    make_tiny_mistral,
    make_tiny_mistral3,
)
from tests.models.conftest import assert_greedy_and_logits_match, cut_at_eos, hf_greedy

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 33, 7, 100, 41], list(range(40, 53)), [17]]
# Mistral-7B-Instruct-v0.3's params.json, as published.
MISTRAL_7B_V03 = {"dim": 4096, "n_layers": 32, "head_dim": 128, "hidden_dim": 14336, "n_heads": 32, "n_kv_heads": 8,
                  "norm_eps": 1e-05, "vocab_size": 32768, "rope_theta": 1000000.0}


def _load(folder: str, **kw):
    """ferrox's float32 CPU model of `folder` (kw: load_model_spec's config_format, load_model's load_format),
    quantized as its config says."""
    source = resolve_model(folder)
    spec = load_model_spec(source, config_format=kw.pop("config_format", "auto"))
    return load_model(source, spec, dtype=torch.float32, device="cpu", quant_config=resolve_quant_config(None, spec),
                      **kw)


def assert_same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, different


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(HF folder, its Mistral-layout twin with only params.json + consolidated.safetensors, ferrox's model of the
    HF folder)."""
    root = tmp_path_factory.mktemp("mistral_format")
    hf = make_tiny_mistral(root / "hf", sliding_window=None)
    return hf, write_mistral_folder(hf, root / "native"), load_float32(hf)


# ---- weights ---------------------------------------------------------------------------------------------------
def test_native_layout_loads_the_hf_folders_model(mistral):
    """config_format / load_format 'mistral', and 'auto' on a folder with only params.json and the consolidated
    file: the HF folder's tensors, every one."""
    hf, native, model = mistral
    assert not os.path.exists(os.path.join(native, "config.json"))
    explicit = _load(native, config_format="mistral", load_format="mistral")
    assert_same_weights(model, explicit)
    assert explicit.spec.architecture == "MistralForCausalLM" and explicit.spec.head_dim == 16
    assert_same_weights(model, _load(native))  # auto, auto


def test_tensor_parallel_ranks_read_the_permuted_rows(mistral):
    """Each of two ranks reads its heads' rows lazily from the consolidated file (q/k permuted per head): the
    shards the HF folder's ranks hold."""
    hf, native, _ = mistral
    for rank in range(2):
        with use_tp_group(TPGroup(rank=rank, size=2)):
            ours, theirs = _load(native, load_format="mistral"), _load(hf, load_format="safetensors")
        assert ours.model.layers[0].self_attn.qkv_proj.weight.shape[0] == 64  # (half the heads)
        assert_same_weights(theirs, ours)


def test_lazy_rows_are_the_permuted_rows(tmp_path):
    """A CheckpointSlice of permuted rows reads any row range (whole heads, or not) as the permuted tensor has it,
    and columns too; a one-value scale is left alone."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    w = torch.randn(48, 5)
    save_file({"w": w}, tmp_path / "w.safetensors")
    whole = rotary_rows(w, 4, "w")  # 4 heads of 12 rows
    assert not torch.equal(whole, w) and torch.equal(whole.sort(0).values, w.sort(0).values)
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        lazy = rotary_rows(CheckpointSlice(f.get_slice("w")), 4, "w")
        for start, length in ((0, 12), (24, 24), (5, 17), (47, 1)):
            assert torch.equal(lazy.narrow(0, start, length), whole[start:start + length])
        assert torch.equal(lazy.narrow(1, 1, 3), whole[:, 1:4])
        assert torch.equal(lazy.load(), whole)
    scale = torch.tensor(0.5)
    assert rotary_rows(scale, 4, "s") is scale


def test_permutation_turns_mistrals_rotary_into_rotate_half():
    """Mistral's rotary rotates each pair of adjacent q/k features as one complex number; transformers' (ferrox's)
    rotates feature i with feature i + d/2. Over the loader's rows the latter gives the attention scores the
    former gives over the native rows -- the direction of the permutation, checked without the test's converter."""
    heads, d, dim, positions = 2, 8, 16, torch.arange(7)
    freqs = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    angles = positions[:, None].float() * freqs  # [T, d/2]
    x = torch.randn(len(positions), dim)
    wq, wk = torch.randn(heads * d, dim), torch.randn(heads * d, dim)

    def mistral_rotary(w):
        q = (x @ w.T).view(-1, heads, d // 2, 2)
        return torch.view_as_real(torch.view_as_complex(q) * torch.polar(torch.ones_like(angles), angles)[:, None])

    def rotate_half_rotary(w):
        q = (x @ w.T).view(-1, heads, d)
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        return q * cos + torch.cat([-q[..., d // 2:], q[..., :d // 2]], -1) * sin

    native = torch.einsum("thd,shd->hts", mistral_rotary(wq).flatten(2), mistral_rotary(wk).flatten(2))
    hf = torch.einsum("thd,shd->hts", rotate_half_rotary(rotary_rows(wq, heads, "q")),
                      rotate_half_rotary(rotary_rows(wk, heads, "k")))
    torch.testing.assert_close(hf, native, atol=1e-4, rtol=1e-4)
    unpermuted = torch.einsum("thd,shd->hts", rotate_half_rotary(wq), rotate_half_rotary(wk))
    assert not torch.allclose(unpermuted, native, atol=1e-2)


def test_engine_on_native_folder_matches_transformers(mistral):
    """The real engine (config_format / load_format 'mistral') generates transformers' greedy tokens."""
    from ferrox import LLM, SamplingParams

    hf, native, _ = mistral
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    llm = LLM(model=native, config_format="mistral", load_format="mistral", dtype="float32", device="cpu",
              kv_cache_memory=8 << 20, max_model_len=256)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert cut_at_eos(list(out.outputs[0].token_ids), [EOS_TOKEN_ID]) == hf_greedy(ref, prompt, 8)


def test_tied_embeddings_and_a_folder_with_both_layouts(tmp_path):
    """A tied Llama rewritten without output.weight (tied_embeddings) loads as the HF folder; a folder holding
    both layouts reads its config.json and HF weights under 'auto' (params.json there is not even read)."""
    hf = make_tiny_llama(tmp_path / "hf", tie_word_embeddings=True)
    native = write_mistral_folder(hf, tmp_path / "native")
    model = _load(native, config_format="mistral", load_format="mistral")
    assert model.lm_head is None and model.spec.tie_word_embeddings
    assert_same_weights(load_float32(hf), model)
    both = write_mistral_folder(hf, tmp_path / "both", params={"not_a_key": 1}, keep_config=True)
    assert load_model_spec(resolve_model(both)).architecture == "LlamaForCausalLM"
    assert_same_weights(load_float32(hf), _load(both))
    with pytest.raises(UnsupportedModelError, match="'not_a_key'"):
        load_model_spec(resolve_model(both), config_format="mistral")


def test_fp8_names_map_to_the_fp8_layout(mistral, tmp_path):
    """An FP8 checkpoint (per-row weight scales, static input scales, KV-cache scales) in Mistral's names
    (qscale_weight, qscale_act, k/v_fake_quantizer) with params.json's quantization runs as the same checkpoint
    in the HF fp8 layout: equal logits and tokens, equal KV scales."""
    from safetensors.torch import load_file

    from tests.helpers.quant_checkpoints import PROJ, write_checkpoint

    hf, _, _ = mistral
    tensors = {}
    for name, w in load_file(os.path.join(hf, "model.safetensors")).items():
        module = name.rsplit(".", 1)[0]
        if not module.endswith(PROJ):
            tensors[name] = w
            continue
        scale = w.abs().amax(1).clamp(min=1e-12) / 448
        tensors[name] = (w / scale[:, None]).to(torch.float8_e4m3fn)
        tensors[f"{module}.weight_scale"] = scale
        tensors[f"{module}.input_scale"] = torch.tensor(0.02 + 0.001 * len(tensors))
    fp8_hf = write_checkpoint(hf, tmp_path / "fp8_hf", {"quant_method": "fp8", "activation_scheme": "static"},
                              {**tensors, "model.layers.1.self_attn.k_scale": torch.tensor(0.25),
                               "model.layers.1.self_attn.v_scale": torch.tensor(0.5)})
    native = write_mistral_folder(hf, tmp_path / "fp8_native", tensors=tensors,
                                  params={"quantization": {"qformat_weight": "fp8_e4m3", "qscheme_act": "TENSOR"}})
    from safetensors.torch import save_file

    extra = {"layers.1.attention.k_fake_quantizer.qscale_act": torch.tensor(0.25),
             "layers.1.attention.v_fake_quantizer.qscale_act": torch.tensor(0.5)}
    save_file(extra, os.path.join(native, "consolidated-kv.safetensors"))
    ours, theirs = _load(native), _load(fp8_hf)
    assert type(ours.model.layers[0].self_attn.qkv_proj.quant).__name__ == "Fp8Linear"
    scales = ours.model.layers[1].self_attn.kv_scales
    assert (scales.k_scale, scales.v_scale) == (0.25, 0.5)
    got, got_logits = run_greedy(ours, PROMPTS, 6, return_prefill_logits=True)
    want, want_logits = run_greedy(theirs, PROMPTS, 6, return_prefill_logits=True)
    assert got == want
    for a, b in zip(got_logits, want_logits, strict=True):
        assert torch.equal(a, b)


def test_ministral3_params_with_yarn_and_llama_4_scaling(tmp_path):
    """A Ministral 3 rewritten with params.json's yarn and llama_4_scaling (Devstral 2 / Ministral 3 text) is
    Ministral3ForCausalLM again, and matches transformers on the HF folder (YaRN and the query scaling both
    change these prompts' tokens: tests/models/test_ministral3.py)."""
    from tests.helpers import tiny_ministral3

    hf = tiny_ministral3.make_tiny_ministral3(tmp_path / "hf")
    rope = tiny_ministral3.ROPE
    native = write_mistral_folder(hf, tmp_path / "native", params={
        "yarn": {"factor": rope["factor"], "original_max_position_embeddings": rope["original_max_position_embeddings"],
                 "beta": rope["beta_fast"], "alpha": rope["beta_slow"]},
        "llama_4_scaling": {"original_max_position_embeddings": rope["original_max_position_embeddings"],
                            "beta": rope["llama_4_scaling_beta"]}})
    model = _load(native)
    assert model.spec.architecture == "Ministral3ForCausalLM" and model.spec.max_position_embeddings == 128
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    long_prompts = [[5, 9, 11], [(7 * i) % 300 + 3 for i in range(70)]]
    assert_greedy_and_logits_match(model, ref, long_prompts, [EOS_TOKEN_ID], label="ministral3")


def test_mistral3_vision_encoder_and_adapter_names(tmp_path):
    """A Mistral 3 (Pixtral tower, patch merger, adapter) rewritten with params.json's vision_encoder and Mistral's
    vision names (vision q/k rows permuted over the tower's heads) loads as the HF folder."""
    hf = make_tiny_mistral3(tmp_path / "hf")
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    v = config["vision_config"]
    vision = {"hidden_size": v["hidden_size"], "num_channels": 3, "max_image_size": v["image_size"],
              "patch_size": v["patch_size"], "rope_theta": (v.get("rope_parameters") or v)["rope_theta"],
              "intermediate_size": v["intermediate_size"], "num_hidden_layers": v["num_hidden_layers"],
              "num_attention_heads": v["num_attention_heads"], "image_token_id": config["image_token_index"],
              "spatial_merge_size": 2, "adapter_bias": False, "mm_projector_id": "patch_merge",
              "add_pre_mm_projector_layer_norm": True}
    native = write_mistral_folder(hf, tmp_path / "native", params={"vision_encoder": vision})
    model = _load(native)
    assert model.spec.architecture == "Mistral3ForConditionalGeneration"
    assert_same_weights(load_float32(hf), model)


# ---- config ----------------------------------------------------------------------------------------------------
def test_params_json_maps_to_a_mistral_config():
    config = hf_config_from_params(MISTRAL_7B_V03, "params.json")
    assert config["architectures"] == ["MistralForCausalLM"]
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                   "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta",
                                   "tie_word_embeddings", "max_position_embeddings")} == {
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 14336, "vocab_size": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 1e6, "tie_word_embeddings": False, "max_position_embeddings": 128_000}  # (vLLM's default)
    # max_seq_len caps it; else the folder's config.json says; a dtype from the consolidated files.
    assert hf_config_from_params({**MISTRAL_7B_V03, "max_seq_len": 32768}, "p")["max_position_embeddings"] == 32768
    fallback = {"max_position_embeddings": 32768, "torch_dtype": "bfloat16"}
    assert hf_config_from_params(MISTRAL_7B_V03, "p", fallback=fallback)["max_position_embeddings"] == 32768
    assert hf_config_from_params(MISTRAL_7B_V03, "p", checkpoint_dtype="bfloat16")["torch_dtype"] == "bfloat16"
    transformers.MistralConfig(**config)  # (a config transformers takes)


def test_sliding_window_int_and_per_layer_pattern():
    config = hf_config_from_params({**MISTRAL_7B_V03, "sliding_window": 4096}, "p")
    spec = spec_from_hf_config(config, "p")
    assert spec.sliding_window == 4096 and spec.sliding_layers == (True,) * 32
    pattern = {**MISTRAL_7B_V03, "n_layers": 6, "sliding_window": [1024, 1024, None]}
    spec = spec_from_hf_config(hf_config_from_params(pattern, "p"), "p")
    assert spec.sliding_window == 1024 and spec.sliding_layers == (True, True, False) * 2
    with pytest.raises(UnsupportedModelError, match="several windows"):
        hf_config_from_params({**pattern, "sliding_window": [1024, 2048, None]}, "p")
    with pytest.raises(ModelLoadError, match="does not tile"):
        hf_config_from_params({**pattern, "sliding_window": [1024, None, None, None]}, "p")


def test_yarn_maps_to_rope_parameters():
    params = {**MISTRAL_7B_V03, "max_position_embeddings": 131072,
              "yarn": {"factor": 4.0, "original_max_position_embeddings": 32768, "beta": 32, "alpha": 1,
                       "apply_scale": False}}
    config = hf_config_from_params(params, "p")
    assert config["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 1e6, "mscale_all_dim": 1, "factor": 4.0,
                                         "original_max_position_embeddings": 32768, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "attention_factor": 1.0}
    spec = spec_from_hf_config(config, "p")
    assert spec.rope_scaling["rope_type"] == "yarn" and spec.max_position_embeddings == 131072
    with pytest.raises(UnsupportedModelError, match="'temperature'"):
        hf_config_from_params({**params, "yarn": {**params["yarn"], "temperature": 1}}, "p")


def test_llama_4_scaling_is_a_ministral3_config():
    """params.json with llama_4_scaling: Ministral3ForCausalLM, its fields as transformers 5's Ministral3Config
    names them (rope_parameters with llama_4_scaling_beta and one original_max_position_embeddings)."""
    params = {"dim": 4096, "n_layers": 34, "head_dim": 128, "hidden_dim": 14336, "n_heads": 32, "n_kv_heads": 8,
              "rope_theta": 1e6, "norm_eps": 1e-5, "vocab_size": 131072, "tied_embeddings": False,
              "max_position_embeddings": 262144, "q_lora_rank": None, "kv_lora_rank": None,
              "yarn": {"original_max_position_embeddings": 16384, "factor": 16, "apply_scale": False, "beta": 32,
                       "alpha": 1},
              "llama_4_scaling": {"original_max_position_embeddings": 16384, "beta": 0.1}}
    config = hf_config_from_params(params, "p")
    assert config["architectures"] == ["Ministral3ForCausalLM"] and config["model_type"] == "ministral3"
    ours = transformers.Ministral3Config(**{k: v for k, v in config.items() if k not in ("architectures",
                                                                                         "model_type")})
    assert ours.rope_parameters["llama_4_scaling_beta"] == 0.1
    assert ours.rope_parameters["original_max_position_embeddings"] == 16384
    assert ours.rope_parameters["rope_type"] == "yarn" and ours.rope_parameters["factor"] == 16
    with pytest.raises(UnsupportedModelError, match="differs from yarn"):
        hf_config_from_params({**params, "llama_4_scaling": {"original_max_position_embeddings": 8192,
                                                             "beta": 0.1}}, "p")


def test_quantization_maps_to_fp8_config():
    def quant(q):
        return hf_config_from_params({**MISTRAL_7B_V03, "quantization": q}, "p")["quantization_config"]

    assert quant({"qformat_weight": "fp8_e4m3", "qscheme_act": "TENSOR"}) == {
        "quant_method": "fp8", "activation_scheme": "static"}
    assert quant({"qformat_weight": "fp8_e4m3"})["activation_scheme"] == "static"
    assert quant({"qformat_weight": "fp8_e4m3", "qscheme_act": "NO_SCALES"})["activation_scheme"] == "dynamic"
    with pytest.raises(UnsupportedModelError, match="qformat_weight 'int4'"):
        quant({"qformat_weight": "int4"})


def test_vision_encoder_is_a_mistral3_or_pixtral_llava_config():
    small31 = {"hidden_size": 1024, "num_channels": 3, "max_image_size": 1540, "patch_size": 14, "rope_theta": 1e4,
               "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16, "image_token_id": 10,
               "image_break_token_id": 12, "image_end_token_id": 13, "spatial_merge_size": 2, "adapter_bias": False,
               "mm_projector_id": "patch_merge", "add_pre_mm_projector_layer_norm": True}
    config = hf_config_from_params({**MISTRAL_7B_V03, "vision_encoder": small31}, "p")
    assert config["architectures"] == ["Mistral3ForConditionalGeneration"] and config["spatial_merge_size"] == 2
    assert config["vision_config"]["image_size"] == 1540 and config["vision_config"]["head_dim"] == 64
    assert config["text_config"]["architectures"] == ["MistralForCausalLM"]
    assert spec_from_hf_config(config, "p").architecture == "Mistral3ForConditionalGeneration"
    pixtral = {k: v for k, v in small31.items() if k not in ("spatial_merge_size", "mm_projector_id",
                                                             "add_pre_mm_projector_layer_norm", "max_image_size")}
    config = hf_config_from_params({**MISTRAL_7B_V03, "vision_encoder": {**pixtral, "image_size": 1024,
                                                                         "adapter_bias": True}}, "p")
    assert config["architectures"] == ["LlavaForConditionalGeneration"] and config["multimodal_projector_bias"]
    assert config["vision_feature_select_strategy"] == "full"


@pytest.mark.parametrize("extra, match", [
    ({"n_experts": 8}, "'n_experts'"),
    ({"moe": {"num_experts": 8, "num_experts_per_tok": 2}}, "'moe' is set"),
    ({"qk_nope_head_dim": 128}, "'qk_nope_head_dim' is set"),
    ({"model_type": "mamba"}, "model_type 'mamba'"),
    ({"quantization": {"qformat_weight": "fp8_e4m3", "qformat_act": "fp8"}}, "'qformat_act'"),
    ({"multimodal": {"whisper_model_args": {}}}, "'whisper_model_args'"),
    ({"vision_encoder": {"hidden_size": 8, "num_attention_heads": 2, "mystery": 1}}, "'mystery'"),
], ids=["unknown-key", "moe", "mla", "mamba", "quant-key", "audio", "vision-key"])
def test_what_params_json_cannot_say_is_refused_by_name(extra, match):
    with pytest.raises(UnsupportedModelError, match=match):
        hf_config_from_params({**MISTRAL_7B_V03, **extra}, "params.json")


def test_missing_files_are_named(mistral, tmp_path):
    hf, native, _ = mistral
    with pytest.raises(ModelNotFoundError, match="params.json"):
        load_model_spec(resolve_model(hf), config_format="mistral")
    with pytest.raises(ModelNotFoundError, match="consolidated"):
        _load(hf, load_format="mistral")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model_spec(resolve_model(native), config_format="hf")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match=r"no config.json \(nor Mistral's params.json\)"):
        read_model_config(str(empty))
    with pytest.raises(ModelLoadError, match="required key 'norm_eps'"):
        hf_config_from_params({k: v for k, v in MISTRAL_7B_V03.items() if k != "norm_eps"}, "params.json")


def test_config_formats_mirror_the_loaders():
    from ferrox.config import CONFIG_FORMATS
    from ferrox.loader.config_file import CONFIG_FORMATS as LOADER_FORMATS

    assert CONFIG_FORMATS == LOADER_FORMATS


def test_to_mistral_rows_inverts_the_loader():
    w = torch.randn(32, 3)
    assert torch.equal(rotary_rows(to_mistral_rows(w, 2), 2, "w"), w)
