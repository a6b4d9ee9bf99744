"""Fuzzing the loaders that read files from outside: GGUF, safetensors, config.json, tokenizer.json,
tokenizer_config.json and chat templates.

A truncated or corrupted file must give a clear error (a ferrox.FerroxError whose message names the
file), never another exception, a crash, a hang or a huge allocation. The files are small ones made
here (a two-layer GGUF written with the `gguf` package, a tiny safetensors), so each case is fast.
Each bug the fuzzers found has a regression test of its own below.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from ferrox.errors import FerroxError  # noqa: E402
from ferrox.loader.chat_template import render_chat_template  # noqa: E402
from ferrox.loader.errors import ChatTemplateError  # noqa: E402
from ferrox.loader.gguf_file import GGUFFile  # noqa: E402
from ferrox.loader.gguf_tokenizer import build_gguf_tokenizer  # noqa: E402
from ferrox.loader.model_config import hf_config_from_gguf, load_model_spec, spec_from_hf_config  # noqa: E402
from ferrox.loader.source import ModelSource  # noqa: E402
from ferrox.loader.tokenizer import load_tokenizer  # noqa: E402
from ferrox.loader.weights import iter_safetensors  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.fuzz.fuzzing import fuzz_settings  # noqa: E402
from tests.helpers.tiny_models import CHATML_TEMPLATE, build_tokenizer  # noqa: E402

TOKENS = ["<|endoftext|>", "a", "b", "ab", "Ġ", "Ġa", "c", "<|im_end|>"]
MERGES = ["a b", "Ġ a"]


def write_gguf(path: str, heads: int = 2, merges: list[str] = MERGES) -> None:
    """A two-layer llama GGUF (F32 and F16 tensors) with a byte-level BPE tokenizer and a chat template."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 1, 1, 1, 1, 1, 1, 3])
    w.add_token_merges(merges)
    w.add_eos_token_id(7)
    w.add_chat_template(CHATML_TEMPLATE)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((len(TOKENS), 8), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_q.weight", rng.standard_normal((8, 8)).astype(np.float16))
        w.add_tensor(f"blk.{i}.attn_k.weight", rng.standard_normal((4, 8)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rng.standard_normal((8, 16)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def load_everything_from_gguf(path: str) -> None:
    """What `ferrox serve model.gguf` reads: header, metadata, spec, tokenizer, every tensor."""
    g = GGUFFile(path)
    spec = spec_from_hf_config(hf_config_from_gguf(g), g.path)
    build_gguf_tokenizer(g)
    for _name, arr in g.iter_hf_tensors(spec.num_heads, spec.num_kv_heads):
        assert arr.dtype == np.float32


def expect_clean(path: str, load) -> None:
    """`load()` succeeds, or fails with a FerroxError naming `path`."""
    try:
        load()
    except FerroxError as exc:
        assert os.path.basename(path) in str(exc), f"error does not name the file: {exc}"
    except Exception as exc:
        raise AssertionError(f"{type(exc).__name__} instead of a FerroxError naming {path}: {exc}") from exc


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_gguf(path)
    load_everything_from_gguf(path)  # the pristine file loads
    with open(path, "rb") as f:
        return f.read()


def _mutations(data: bytes) -> st.SearchStrategy[bytes]:
    """Cut short, bytes overwritten (mostly in the header and metadata, where lengths and counts
    live), or a 64-bit count / length set to a huge value."""
    cut = st.integers(0, len(data) - 1).map(lambda n: data[:n])
    header = min(len(data), 1024)
    flips = st.lists(st.tuples(st.integers(0, header - 1), st.integers(0, 255)), min_size=1, max_size=4).map(
        lambda edits: _apply(data, edits))
    big = st.tuples(st.integers(0, header - 8), st.sampled_from([2**31, 2**32 - 1, 2**40, 2**63 - 1])).map(
        lambda t: data[:t[0]] + struct.pack("<Q", t[1]) + data[t[0] + 8:])
    return st.one_of(cut, flips, big)


def _apply(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for at, value in edits:
        out[at] = value
    return bytes(out)


def test_corrupted_gguf_is_a_clear_error(gguf_bytes, tmp_path):
    path = str(tmp_path / "fuzzed.gguf")

    @fuzz_settings(120)
    @given(data=_mutations(gguf_bytes))
    def check(data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
        expect_clean(path, lambda: load_everything_from_gguf(path))

    check()


def test_gguf_merge_of_unknown_tokens_names_the_file(tmp_path):
    path = str(tmp_path / "merges.gguf")
    write_gguf(path, merges=["a b", "x y"])
    with pytest.raises(FerroxError, match="merges.gguf"):
        load_everything_from_gguf(path)


@pytest.mark.parametrize("heads", [0, 258, 3])  # 3: a head dim of 8 // 3 = 2, but 8 rows are not 3 heads
def test_gguf_with_impossible_head_count_names_the_file(tmp_path, heads):
    path = str(tmp_path / "heads.gguf")
    write_gguf(path, heads=heads)
    with pytest.raises(FerroxError, match=r"heads\.gguf.*llama\.attention\.head_count"):
        load_everything_from_gguf(path)


# ---- safetensors -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def safetensors_bytes(tmp_path_factory) -> bytes:
    import torch
    from safetensors.torch import save_file

    path = str(tmp_path_factory.mktemp("st") / "model.safetensors")
    save_file({"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}, path)
    with open(path, "rb") as f:
        return f.read()


def test_corrupted_safetensors_is_a_clear_error(safetensors_bytes, tmp_path):
    path = str(tmp_path / "model.safetensors")

    @fuzz_settings(120)
    @given(data=st.one_of(_mutations(safetensors_bytes),
                          st.binary(max_size=64).map(lambda b: struct.pack("<Q", len(b)) + b)))
    def check(data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
        expect_clean(path, lambda: [t.sum() for _, t in iter_safetensors(str(tmp_path))])

    check()


# ---- config.json ---------------------------------------------------------------------------------------

VALID_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384,
                "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False)
                           | st.text(max_size=6), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def test_config_json_fields_of_any_value_are_a_clear_error(tmp_path):
    folder = str(tmp_path)

    @fuzz_settings(150)
    @given(changes=st.dictionaries(st.sampled_from(sorted(VALID_CONFIG) + ["head_dim", "rope_scaling",
                                                                         "rope_parameters", "num_experts"]),
                                   JSON_VALUES, max_size=3),
           drop=st.sets(st.sampled_from(sorted(VALID_CONFIG)), max_size=2),
           raw_cut=st.none() | st.integers(0, 200))
    def check(changes: dict, drop: set, raw_cut: int | None) -> None:
        config = {k: v for k, v in {**VALID_CONFIG, **changes}.items() if k not in drop}
        text = json.dumps(config)
        path = os.path.join(folder, "config.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text if raw_cut is None else text[:raw_cut])
        expect_clean(path, lambda: load_model_spec(ModelSource(folder, "hf", "fuzz")))

    check()


@pytest.mark.parametrize("change", [{"hidden_size": "sixty-four"}, {"num_attention_heads": 0},
                                    {"rope_scaling": 5}, {"num_hidden_layers": [2]}])
def test_config_field_of_the_wrong_type_names_the_file(tmp_path, change):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**VALID_CONFIG, **change}))
    with pytest.raises(FerroxError, match=rf"config\.json.*{next(iter(change))}"):
        load_model_spec(ModelSource(str(tmp_path), "hf", "fuzz"))


# ---- tokenizer.json, tokenizer_config.json, chat templates ------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return build_tokenizer().to_str()


def test_tokenizer_files_of_any_content_are_a_clear_error(tokenizer_json, tmp_path):
    folder = str(tmp_path)
    config_keys = ["chat_template", "bos_token", "eos_token", "add_bos_token", "add_eos_token", "pad_token"]

    @fuzz_settings(120)
    @given(cut=st.none() | st.integers(0, len(tokenizer_json) - 1),
           config=st.dictionaries(st.sampled_from(config_keys), JSON_VALUES, max_size=3),
           generation=st.dictionaries(st.just("eos_token_id"), JSON_VALUES, max_size=1))
    def check(cut: int | None, config: dict, generation: dict) -> None:
        files = {"tokenizer.json": tokenizer_json if cut is None else tokenizer_json[:cut],
                 "tokenizer_config.json": json.dumps(config), "generation_config.json": json.dumps(generation)}
        for name, text in files.items():
            with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                f.write(text)
        try:
            tok = load_tokenizer(ModelSource(folder, "hf", "fuzz"))
        except FerroxError as exc:
            assert any(name in str(exc) for name in files), f"error names no file: {exc}"
            return
        tok.encode("hello world")
        try:
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
        except FerroxError:
            pass  # a template that does not render (or none at all) is refused with ChatTemplateError

    check()


@pytest.mark.parametrize("files", [{"tokenizer_config.json": {"chat_template": [{"name": "default"}]}},
                                   {"tokenizer_config.json": {"chat_template": 5}},
                                   {"chat_template.json": {"chat_template": {"default": "x"}}},
                                   {"generation_config.json": {"eos_token_id": 2.5}},
                                   {"generation_config.json": {"eos_token_id": [2, "</s>"]}}])
def test_tokenizer_config_of_the_wrong_shape_names_the_file(tokenizer_json, tmp_path, files):
    (tmp_path / "tokenizer.json").write_text(tokenizer_json)
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    field = next(iter(next(iter(files.values()))))
    with pytest.raises(FerroxError, match=rf"{next(iter(files))}.*{field}"):
        load_tokenizer(ModelSource(str(tmp_path), "hf", "fuzz"))


def test_an_integral_float_eos_token_id_is_accepted(tokenizer_json, tmp_path):
    """Some JSON writers emit 2.0 for 2; transformers keeps such ids, so ferrox reads them as ints."""
    (tmp_path / "tokenizer.json").write_text(tokenizer_json)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2.0, 3]}))
    tok = load_tokenizer(ModelSource(str(tmp_path), "hf", "fuzz"))
    assert tok.eos_token_ids[-2:] == [2, 3] and all(type(i) is int for i in tok.eos_token_ids)


TEMPLATE_PIECES = ["{{ ", " }}", "{% ", " %}", "for m in messages", "endfor", "if", "endif", "m['content']",
                   "messages[0]", "raise_exception('no')", "add_generation_prompt", "|tojson", "loop.index",
                   "x.__class__", "range(10**9)|list", "'a' * 10", "{#", "#}", "else", "tools", "\n", "abc"]


def test_arbitrary_chat_templates_render_or_raise_chat_template_error():
    @fuzz_settings(200)
    @given(pieces=st.lists(st.sampled_from(TEMPLATE_PIECES), max_size=12), noise=st.text(max_size=10))
    def check(pieces: list[str], noise: str) -> None:
        template = "".join(pieces) + noise
        try:
            text = render_chat_template(template, [{"role": "user", "content": "hi"}], template_name="fuzz")
        except ChatTemplateError as exc:
            assert "fuzz" in str(exc) or "message" in str(exc)
            return
        assert isinstance(text, str)

    check()
