"""GGUF files of the families ferrox reads back as their Hugging Face checkpoints (loader/gguf_families.py): OLMo 2,
Command R (with R+'s q/k norms), Command R7B, StarCoder2, Phi-2, GPT-2, GPT-NeoX, GLM-4-0414, EXAONE 4, Arcee and
ERNIE 4.5. Each tiny random folder is written as llama.cpp's converter writes it (tests/helpers/llama_cpp_export.py:
the gguf package's own tensor names, the converter's keys and tensor edits), and the engine on the .gguf file must
generate what transformers generates on the folder: greedy tokens and their logprobs, long prompts prefilled in
chunks. A Q8_0 file matches transformers on the weights it round-trips to. Mapping a tensor wrongly (two biases
swapped, a converter edit not undone) must move the logits, so the equalities above pin the mapping; keys and
tensors a family cannot honour are refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ferrox.errors import UnsupportedModelError
from ferrox.loader.gguf_families import GGUF_FAMILIES, rotary_factor
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.model_spec import spec_for_context

from tests.helpers.driver import run_greedy
from tests.helpers.llama_cpp_export import export_llama_cpp, quantize_q8
from tests.helpers.tiny_cohere import make_tiny_cohere, make_tiny_cohere2
from tests.helpers.tiny_ernie4_5 import make_tiny_ernie4_5
from tests.helpers.tiny_exaone4 import make_tiny_exaone4
from tests.helpers.tiny_glm import make_tiny_glm4
from tests.helpers.tiny_gpt_neox import (
    make_tiny_gpt2,
    make_tiny_gpt_neox,
    make_tiny_phi,
    make_tiny_starcoder2,
)
from tests.helpers.tiny_olmo_smollm3 import make_tiny_olmo2
from tests.helpers.tiny_ungated import make_tiny_arcee
from tests.models.conftest import assert_outputs_match_transformers, chunked_engine_outputs

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

PROMPTS = [[5, 9, 11], [100, 7, 300, 45, 2, 9, 77, 13], list(range(3, 70))]
CONTEXT = 256  # (the windowed families' 8-token windows are served: spec_for_context)
# llama.cpp architecture -> the tiny folder (biases and norms random, so each one decides something).
FAMILIES = {
    "olmo2": lambda d: make_tiny_olmo2(d, seed=61),
    "command-r": lambda d: make_tiny_cohere(d, use_qk_norm=True, seed=62),
    "cohere2": lambda d: make_tiny_cohere2(d, seed=63),
    # (llama.cpp's converter writes no sliding window for StarCoder2: the windowed folder is a variant below)
    "starcoder2": lambda d: make_tiny_starcoder2(d, sliding_window=None, seed=64),
    # (Phi-2's converter writes 4 x hidden as the MLP width and no rope base: the tiny one has both as Phi-2's)
    "phi2": lambda d: make_tiny_phi(d, intermediate_size=256, rope_theta=10_000.0, seed=65),
    "gpt2": lambda d: make_tiny_gpt2(d, seed=66),
    "gptneox": lambda d: make_tiny_gpt_neox(d, seed=67),
    "glm4": lambda d: make_tiny_glm4(d, seed=68),
    "exaone4": lambda d: make_tiny_exaone4(d, seed=69),
    "arcee": lambda d: make_tiny_arcee(d, seed=70),
    "ernie4_5": lambda d: make_tiny_ernie4_5(d, seed=71),
}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """arch -> (folder, F32 .gguf), each family built once."""
    root = tmp_path_factory.mktemp("gguf_families")
    out = {}
    for arch, build in FAMILIES.items():
        folder = build(root / arch)
        out[arch] = folder, export_llama_cpp(folder, root / f"{arch}.gguf")
    return out


def _reference(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _served_spec(path: str):
    return spec_for_context(load_model_spec(resolve_model(str(path))), CONTEXT)


def _prefill_logits(path: str) -> torch.Tensor:
    source = resolve_model(str(path))
    model = load_model(source, _served_spec(path), dtype=torch.float32, device="cpu")
    return run_greedy(model, PROMPTS, 1, return_prefill_logits=True)[1]


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_gguf_file_generates_what_transformers_does_on_the_folder(families, arch):
    folder, path = families[arch]
    want, got = _served_spec(folder), _served_spec(path)
    assert got.architecture == GGUF_FAMILIES[arch].architecture == want.architecture
    assert (got.head_dim, got.rotary_dim, got.attention_windows, got.tie_word_embeddings, got.num_kv_heads) == (
        want.head_dim, want.rotary_dim, want.attention_windows, want.tie_word_embeddings, want.num_kv_heads)
    assert_outputs_match_transformers(_reference(folder), PROMPTS,
                                      chunked_engine_outputs(path, PROMPTS, max_model_len=CONTEXT))


def test_the_files_tokenizer_and_template_are_the_folders(families):
    """The vocabulary, merges, special ids and chat template travel in the metadata (as for every GGUF file)."""
    from ferrox.loader.tokenizer import load_tokenizer

    folder, path = families["gptneox"]
    ours, theirs = load_tokenizer(resolve_model(path)), load_tokenizer(resolve_model(folder))
    text = "The quick brown fox 123 café"
    assert ours.encode(text) == theirs.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat)


@pytest.mark.parametrize("arch", ["gptneox", "gpt2"])
def test_q8_0_gguf_generates_what_transformers_does_on_its_dequantized_weights(families, arch, tmp_path):
    """Quantized files are dequantized at load: the engine equals transformers holding the Q8_0 round trip of each
    quantized weight (GPT-2's in the file's transposed layout), and that round trip moves the logits."""
    folder, _ = families[arch]
    path = export_llama_cpp(folder, tmp_path / "q8.gguf", tensor_type="Q8_0")
    kinds = {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(path).tensors}
    assert kinds == {"Q8_0", "F32"}
    ref = _reference(folder)
    quantize_q8(ref, ref.config.architectures[0])
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(path, PROMPTS, max_model_len=CONTEXT))
    with torch.inference_mode():
        moved = ref(torch.tensor([PROMPTS[2]])).logits - _reference(folder)(torch.tensor([PROMPTS[2]])).logits
    assert moved.abs().max() > 1e-3


def _swapped(a: str, b: str):
    def mutate(family):
        names = dict(family.layer_names)
        names[a], names[b] = names[b], names[a]
        return dataclasses.replace(family, layer_names=names)
    return mutate


MUTATIONS = {
    "starcoder2 norm biases swapped": ("starcoder2", _swapped("attn_norm.bias", "ffn_norm.bias")),
    "gpt2 norm biases swapped": ("gpt2", _swapped("attn_norm.bias", "ffn_norm.bias")),
    "phi2 q/k biases swapped": ("phi2", _swapped("attn_q.bias", "attn_k.bias")),
    "glm4 k/v biases swapped": ("glm4", _swapped("attn_k.bias", "attn_v.bias")),
    "gptneox qkv rows left regrouped": ("gptneox", lambda f: dataclasses.replace(f, per_head_qkv=frozenset())),
    "olmo2 post-norms swapped": ("olmo2", _swapped("post_attention_norm.weight", "post_ffw_norm.weight")),
    "exaone4 post-norms swapped": ("exaone4", _swapped("post_attention_norm.weight", "post_ffw_norm.weight")),
    "ernie4_5 mlp biases swapped": ("ernie4_5", _swapped("ffn_gate.bias", "ffn_up.bias")),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_wrong_mapping_moves_the_logits(families, monkeypatch, mutation):
    """Guard for the equality above: each of these mistakes, which still loads, changes what the model computes
    (the tiny models' biases and norms are random, not transformers' zeros and ones)."""
    arch, mutate = MUTATIONS[mutation]
    _, path = families[arch]
    right = _prefill_logits(path)
    monkeypatch.setitem(GGUF_FAMILIES, arch, mutate(GGUF_FAMILIES[arch]))
    assert (_prefill_logits(path) - right).abs().max() > 1e-3


def test_other_converters_layouts_give_the_same_model(families, tmp_path):
    """Files the current converter does not write but older ones (or other tools) do: Phi-2's and GLM-4's q, k, v
    fused into attn_qkv; GPT-2 with the embedding written again as output.weight (an untied head holding the same
    rows); StarCoder2 with its sliding window in the metadata, which then is served as transformers applies it."""
    for arch in ("phi2", "glm4"):
        folder, _ = families[arch]
        path = export_llama_cpp(folder, tmp_path / f"{arch}-fused.gguf", fuse_qkv=True)
        assert any(".attn_qkv." in t.name for t in gguf.GGUFReader(path).tensors)
        assert_outputs_match_transformers(_reference(folder), PROMPTS,
                                          chunked_engine_outputs(path, PROMPTS, max_model_len=CONTEXT))
    folder, _ = families["gpt2"]
    from safetensors.numpy import load_file

    embedding = load_file(f"{folder}/model.safetensors")["transformer.wte.weight"]
    path = export_llama_cpp(folder, tmp_path / "gpt2-head.gguf", extra_tensors={"output.weight": embedding})
    assert not load_model_spec(resolve_model(path)).tie_word_embeddings
    assert_outputs_match_transformers(_reference(folder), PROMPTS,
                                      chunked_engine_outputs(path, PROMPTS, max_model_len=CONTEXT))
    folder = make_tiny_starcoder2(tmp_path / "windowed", sliding_window=8, seed=64)
    path = export_llama_cpp(folder, tmp_path / "windowed.gguf", metadata=lambda w: w.add_sliding_window(8))
    assert _served_spec(path).attention_windows == (8, 8)
    assert_outputs_match_transformers(_reference(folder), PROMPTS,
                                      chunked_engine_outputs(path, PROMPTS, max_model_len=CONTEXT))


REFUSALS = {
    "a key the family has no use for": ("gptneox", {"metadata": lambda w: w.add_clamp_kqv(8.0)},
                                        r"metadata gptneox\.attention\.clamp_kqv is not supported"),
    "rope keys of a model without rotary": ("gpt2", {"metadata": lambda w: w.add_rope_freq_base(1e4)},
                                            r"metadata gpt2\.rope\.freq_base is not supported"),
    "OLMo 3's windows": ("olmo2", {"metadata": lambda w: w.add_sliding_window(8)},
                         r"metadata olmo2\.attention\.sliding_window is not supported \(an OLMo 3 file"),
    "part of a Cohere head rotating": ("command-r", {"metadata": lambda w: w.add_rope_dimension_count(8)},
                                       r"metadata command-r\.rope\.dimension_count 8 is not supported"),
    "a tensor the family has no place for": (
        "gpt2", {"extra_tensors": {"blk.0.attn_q_norm.weight": torch.ones(64).numpy()}},
        r"tensor 'blk\.0\.attn_q_norm\.weight' is not supported for gpt2 files"),
    "GLM's multi-token-prediction layer": (
        "glm4", {"extra_tensors": {"blk.2.nextn.eh_proj.weight": torch.ones(64, 128).numpy()}},
        r"tensor 'blk\.2\.nextn\.eh_proj\.weight' is not supported for glm4 files"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_a_family_cannot_honour_is_refused_by_name(families, tmp_path, case):
    arch, kwargs, match = REFUSALS[case]
    folder, _ = families[arch]
    path = export_llama_cpp(folder, tmp_path / "edited.gguf", **kwargs)
    with pytest.raises(UnsupportedModelError, match=rf"GGUF file .*edited\.gguf: {match}"):
        load_model_spec(resolve_model(path))


def test_rotary_factor_gives_the_rotary_dims_back():
    """rope.dimension_count as partial_rotary_factor: int(head_dim * factor) must be the count again, where
    count / head_dim can fall a hair short (30 / 176)."""
    for head_dim in (64, 80, 96, 128, 176, 208, 256):
        for rotary in range(2, head_dim + 1, 2):
            assert int(head_dim * rotary_factor(rotary, head_dim)) == rotary
