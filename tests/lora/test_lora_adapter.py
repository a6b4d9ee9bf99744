"""PEFT adapter folders (written by peft itself) read back by ferrox, and every adapter ferrox
cannot run refused with the file and the field named, leaving the manager as it was. Also the
manager's bookkeeping: the CPU cache (LRU), GPU slots (LRU swaps) and the per-token slot buffer."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from ferrox.distributed.parallel_state import TPGroup, use_tp_group
from ferrox.errors import InvalidArgumentError, RequestError, UnsupportedModelError
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.lora.adapter import LoRAAdapterError, read_peft_adapter
from ferrox.lora.manager import LoRAManager
from ferrox.lora.request import LoRARequest
from ferrox.models.registry import get_model_class
from torch import nn

from tests.helpers.tiny_models import make_tiny_llama
from tests.lora.adapters import load_hf_model, make_peft_adapter, peft_modules

pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(root, base folder, transformers base model, {name: adapter folder})."""
    root = tmp_path_factory.mktemp("lora_adapter")
    folder = make_tiny_llama(root / "base", seed=5)
    base = load_hf_model(folder)
    narrow = load_hf_model(make_tiny_llama(root / "narrow", hidden_size=48, seed=6))
    adapters = {
        "good": make_peft_adapter(base, root / "good", r=8, lora_alpha=16, seed=1),
        "patterns": make_peft_adapter(base, root / "patterns", r=4, lora_alpha=8, use_rslora=True, seed=2,
                                      rank_pattern={"o_proj": 2, "layers.1.self_attn.q_proj": 6},
                                      alpha_pattern={"down_proj": 3.0}),
        "qv": make_peft_adapter(base, root / "qv", r=4, lora_alpha=4, target_modules=("q_proj", "v_proj"), seed=3),
        "r16": make_peft_adapter(base, root / "r16", r=16, seed=4),
        "lm_head": make_peft_adapter(base, root / "lm_head", target_modules=("q_proj", "lm_head"), seed=5),
        "narrow": make_peft_adapter(narrow, root / "narrow_adapter", seed=6),
        "dora": make_peft_adapter(base, root / "dora", use_dora=True, seed=7),
    }
    return root, folder, base, adapters


def _model(folder):
    source = resolve_model(folder)
    return load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu")


def _manager(folder, **kwargs) -> LoRAManager:
    args = dict(max_loras=2, max_lora_rank=8, max_cpu_loras=3, device="cpu", dtype=torch.float32,
                max_num_tokens=16)
    return LoRAManager(_model(folder), **{**args, **kwargs})


def _state(manager: LoRAManager):
    """Everything a refused add or step must leave as it was."""
    stacks = [(layer.a_stack.clone(), layer.b_stack.clone()) for layer in manager.layers]
    slots = {r.lora_int_id: manager.slot_of(r.lora_int_id) for r in manager.list_adapters()}
    return manager.list_adapters(), slots, manager.token_slots.clone(), stacks


def _same(a, b) -> bool:
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2]) and all(
        torch.equal(x, y) for pa, pb in zip(a[3], b[3], strict=True) for x, y in zip(pa, pb, strict=True))


# ---- LoRARequest ------------------------------------------------------------------------------------
def test_request_spelling():
    req = LoRARequest("sql", 3, "/adapters/sql")
    assert (req.name, req.adapter_id, req.path) == ("sql", 3, "/adapters/sql")
    assert req == LoRARequest(lora_name="sql", lora_int_id=3, lora_path="/adapters/sql")
    assert len({req, LoRARequest("sql", 3, "/adapters/sql"), LoRARequest("sql", 4)}) == 2
    assert LoRARequest("n", np.int64(2)).lora_int_id == 2 and type(LoRARequest("n", np.int64(2)).lora_int_id) is int
    for bad in (0, -1, True, "1", 1.0):
        with pytest.raises(InvalidArgumentError, match="lora_int_id") as e:
            LoRARequest("x", bad)
        assert e.value.param == "lora_int_id"
    with pytest.raises(InvalidArgumentError, match="lora_name"):
        LoRARequest("", 1)


# ---- reading ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["good", "patterns", "qv"])
def test_read_back_matches_peft(tiny, name):
    """A, B and the scaling of every module as peft itself loads them (rsLoRA, rank_pattern and
    alpha_pattern resolved by peft's rules)."""
    _, _, base, adapters = tiny
    adapter = read_peft_adapter(adapters[name])
    reference = peft_modules(base, adapters[name])
    assert set(adapter.modules) == set(reference)
    for module_name, (a, b, scaling) in reference.items():
        module = adapter.modules[module_name]
        assert module.lora_a.dtype == torch.float32 and module.lora_a.device.type == "cpu"
        assert torch.equal(module.lora_a, a) and torch.equal(module.lora_b, b)
        assert module.scaling == pytest.approx(scaling, rel=1e-12), module_name
    if name == "patterns":
        assert adapter.modules["model.layers.0.self_attn.o_proj"].rank == 2
        assert adapter.modules["model.layers.1.self_attn.q_proj"].rank == 6
        assert adapter.modules["model.layers.0.self_attn.q_proj"].rank == 4


# ---- refusals ---------------------------------------------------------------------------------------
def _copy(tiny, name: str, dest: str) -> str:
    root, _, _, adapters = tiny
    out = os.path.join(root, "bad", dest)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(adapters[name], out)
    return out


def _edit_config(path: str, **fields) -> str:
    config_file = os.path.join(path, "adapter_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config.update(fields)
    with open(config_file, "w") as f:
        json.dump(config, f)
    return path


def _remove(path: str, file: str) -> str:
    os.remove(os.path.join(path, file))
    return path


def _pickled(tiny) -> str:
    path = _copy(tiny, "good", "pickled")
    from safetensors.torch import load_file

    torch.save(load_file(os.path.join(path, "adapter_model.safetensors")), os.path.join(path, "adapter_model.bin"))
    return _remove(path, "adapter_model.safetensors")


def _corrupt(tiny) -> str:
    path = _copy(tiny, "good", "corrupt")
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    return path


# case -> (build the folder, substrings the message must contain: the file, then the field)
BAD = {
    "missing folder": (lambda t: os.path.join(t[0], "no-such-adapter"), ["no-such-adapter", "no such folder"]),
    "missing config": (lambda t: _remove(_copy(t, "good", "noconfig"), "adapter_config.json"),
                       ["adapter_config.json", "missing"]),
    "missing weights": (lambda t: _remove(_copy(t, "good", "noweights"), "adapter_model.safetensors"),
                        ["adapter_model.safetensors", "missing"]),
    "pickled weights": (_pickled, ["adapter_model.bin", "adapter_model.safetensors"]),
    "corrupt weights": (_corrupt, ["adapter_model.safetensors", "unreadable"]),
    "rank above max": (lambda t: t[3]["r16"], ["adapter_config.json", "r=16 exceeds max_lora_rank=8"]),
    "lm_head target": (lambda t: t[3]["lm_head"], ["adapter_config.json", "target_modules 'lm_head'", "LM head"]),
    "made-up target": (lambda t: _edit_config(_copy(t, "good", "madeup"), target_modules=["q_proj", "foo_proj"]),
                       ["adapter_config.json", "target_modules 'foo_proj'", "not a projection"]),
    "other hidden size": (lambda t: t[3]["narrow"],
                          ["adapter_model.safetensors", "layers.0.mlp.down_proj.lora_B.weight' shape (48, 8), "
                           "model expects (64, 8)"]),
    "use_dora": (lambda t: t[3]["dora"], ["adapter_config.json", "use_dora=True"]),
    "bias": (lambda t: _edit_config(_copy(t, "good", "bias"), bias="all"), ["adapter_config.json", "bias='all'"]),
    "modules_to_save": (lambda t: _edit_config(_copy(t, "good", "mts"), modules_to_save=["lm_head"]),
                        ["adapter_config.json", "modules_to_save"]),
    "fan_in_fan_out": (lambda t: _edit_config(_copy(t, "good", "fifo"), fan_in_fan_out=True),
                       ["adapter_config.json", "fan_in_fan_out=True"]),
    "not lora": (lambda t: _edit_config(_copy(t, "good", "ia3"), peft_type="IA3"),
                 ["adapter_config.json", "peft_type='IA3'"]),
    "r disagrees with tensors": (lambda t: _edit_config(_copy(t, "good", "rdiff"), r=4),
                                 ["adapter_model.safetensors", "rank 8", "adapter_config.json r says 4"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapter_refused_and_nothing_changes(tiny, case):
    _, folder, _, adapters = tiny
    manager = _manager(folder)
    manager.add_adapter(LoRARequest("good", 1, adapters["good"]))
    manager.prepare_step(np.array([1, 1, 0]))
    before = _state(manager)
    build, expected = BAD[case]
    with pytest.raises(LoRAAdapterError) as e:
        manager.add_adapter(LoRARequest("bad", 2, build(tiny)))
    assert isinstance(e.value, RequestError) and e.value.param == "lora_path"
    message = str(e.value)
    for part in expected:
        assert part in message, (case, message)
    # The file named is in the message before the field, e.g. "<path>/adapter_config.json: r=16 ..."
    assert message.index(expected[0]) < message.index(expected[-1])
    assert _same(_state(manager), before)


def test_different_hidden_size_refused_on_a_tensor_of_a(tiny):
    """(Every tensor is checked: an adapter whose A is wrong is named by its A tensor.)"""
    root, folder, _, adapters = tiny
    path = _copy(tiny, "good", "bad_a")
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"
    tensors[key] = tensors[key][:, :63].contiguous()
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match=r"adapter_model.safetensors: tensor '.*k_proj.lora_A.weight' "
                                               r"shape \(8, 63\), model expects \(8, 64\)"):
        _manager(folder).add_adapter(LoRARequest("bad", 1, path))


# ---- manager bookkeeping ----------------------------------------------------------------------------
def test_cpu_cache_is_lru_and_readding_is_a_noop(tiny):
    _, folder, _, adapters = tiny
    manager = _manager(folder)  # max_cpu_loras=3
    for i in (1, 2, 3):
        manager.add_adapter(LoRARequest(f"a{i}", i, adapters["good"]))
    manager.add_adapter(LoRARequest("a1", 1, adapters["good"]))  # a no-op that marks 1 recently used
    manager.add_adapter(LoRARequest("a4", 4, adapters["qv"]))  # evicts 2, the least recently used
    assert [r.lora_int_id for r in manager.list_adapters()] == [3, 1, 4]
    assert manager.list_adapters()[1] == LoRARequest("a1", 1, adapters["good"])
    assert manager.remove_adapter(3) and not manager.remove_adapter(3) and not manager.remove_adapter(2)
    assert [r.lora_int_id for r in manager.list_adapters()] == [1, 4]


def test_steps_fill_slots_and_token_slots(tiny):
    _, folder, _, adapters = tiny
    manager = _manager(folder)  # two slots
    manager.add_adapter(LoRARequest("good", 1, adapters["good"]))
    manager.add_adapter(LoRARequest("patterns", 2, adapters["patterns"]))
    manager.add_adapter(LoRARequest("qv", 3, adapters["qv"]))
    manager.prepare_step(np.array([2, 2, 0, 1, 2]))
    s1, s2 = manager.slot_of(1), manager.slot_of(2)
    assert {s1, s2} == {0, 1}
    assert manager.token_slots.tolist() == [s2, s2, -1, s1, s2] + [-1] * 11
    # The Triton kernels' view of the same step: rows grouped by slot (base rows first), then -1.
    step = manager.layers[0].token_slots
    order = [2, 3, 0, 1, 4] if s1 < s2 else [2, 0, 1, 4, 3]
    assert step.order[:5].tolist() == order
    assert step.sorted_slots.tolist() == sorted([s2, s2, -1, s1, s2]) + [-1] * 11

    # Slot contents: adapter 1's k slice of layer 0 (A at rows [R, R + 8), B scaled by alpha / r = 2).
    qkv = manager.layers[0]
    good = read_peft_adapter(adapters["good"]).modules["model.layers.0.self_attn.k_proj"]
    q_rows = qkv.slice_widths[0]
    assert torch.equal(qkv.a_stack[s1, 8:16], good.lora_a)
    assert torch.equal(qkv.b_stack[s1, q_rows:q_rows + qkv.slice_widths[1]], good.lora_b * 2.0)

    # A step of adapter 3 (rank 4, q/v only) takes adapter 1's slot (2 was used later): the rest of
    # the slot is zeroed, so nothing of adapter 1 is left in it.
    manager.prepare_step(np.array([3]))
    assert manager.slot_of(1) is None and manager.slot_of(3) == s1 and manager.slot_of(2) == s2
    assert manager.token_slots.tolist() == [s1] + [-1] * 15
    assert not qkv.a_stack[s1, 4:8].any() and not qkv.a_stack[s1, 8:16].any()  # k rows and past rank 4
    assert not qkv.b_stack[s1, :, 4:].any()
    assert not manager.layers[1].a_stack[s1].any()  # o_proj: not adapted by this adapter

    manager.prepare_step(np.zeros(3, dtype=np.int64))
    assert manager.token_slots.tolist() == [-1] * 16


def test_bad_steps_refused_and_nothing_changes(tiny):
    _, folder, _, adapters = tiny
    manager = _manager(folder)
    for i in (1, 2, 3):
        manager.add_adapter(LoRARequest(f"a{i}", i, adapters["qv"]))
    manager.prepare_step(np.array([1, 0, 2]))
    before = _state(manager)
    with pytest.raises(ValueError, match="3 adapters, max_loras is 2"):
        manager.prepare_step(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"\[9\] not loaded"):
        manager.prepare_step(np.array([9, 0]))
    with pytest.raises(ValueError, match="max_num_tokens is 16"):
        manager.prepare_step(np.ones(17, dtype=np.int64))
    with pytest.raises(ValueError, match="1-D integer"):
        manager.prepare_step(np.ones((2, 2), dtype=np.int64))
    assert _same(_state(manager), before)


def test_a_tensor_parallel_rank_packs_its_share(tiny):
    """Each of 2 ranks packs its share of an adapter, cut as its layers are (lora/layers.py): column-parallel
    q/k/v and gate/up keep all of A and their output rows of B, row-parallel o/down their input columns of A
    and all of B; the two ranks' shares put together are the one-rank packing. (The engine under tensor
    parallelism against PEFT: tests/lora/test_lora_tp.py.)"""
    _, folder, _, adapters = tiny
    request = LoRARequest("patterns", 1, adapters["patterns"])
    whole = _manager(folder)
    whole.add_adapter(request)
    spec = load_model_spec(resolve_model(folder))
    shares = []
    for rank in range(2):
        with use_tp_group(TPGroup(rank=rank, size=2)):  # built sharded (no collective runs here)
            sharded = get_model_class([spec.architecture])(spec, torch.float32, "cpu")
            manager = LoRAManager(sharded, max_loras=1, max_lora_rank=8, max_cpu_loras=None, device="cpu",
                                  dtype=torch.float32, max_num_tokens=8)
        manager.add_adapter(request)
        shares.append(manager)
    full_weights = whole._cache[1].weights
    for i, layer in enumerate(whole.layers):
        if full_weights[i] is None:
            assert all(m._cache[1].weights[i] is None for m in shares)
            continue
        a, b = full_weights[i]
        (a0, b0), (a1, b1) = (m._cache[1].weights[i] for m in shares)
        if shares[0].layers[i].row_parallel:  # o_proj, down_proj
            assert torch.equal(torch.cat([a0, a1], dim=1), a) and torch.equal(b0, b) and torch.equal(b1, b)
        else:  # each output slice's rows, rank 0's then rank 1's
            assert torch.equal(a0, a) and torch.equal(a1, a)
            parts = [torch.cat([b0[lo0:hi0], b1[lo1:hi1]]) for (lo0, hi0), (lo1, hi1) in zip(
                zip(shares[0].layers[i].slice_bounds, shares[0].layers[i].slice_bounds[1:], strict=False),
                zip(shares[1].layers[i].slice_bounds, shares[1].layers[i].slice_bounds[1:], strict=False),
                strict=True)]
            assert torch.equal(torch.cat(parts), b), layer


def test_models_lora_cannot_serve_are_refused(tiny):
    _, folder, _, _ = tiny
    with pytest.raises(UnsupportedModelError, match="no decoder layers"):
        LoRAManager(nn.Linear(2, 2), max_loras=1, max_lora_rank=8, max_cpu_loras=None, device="cpu",
                    dtype=torch.float32, max_num_tokens=8)
    with pytest.raises(InvalidArgumentError, match="max_cpu_loras") as e:
        _manager(folder, max_loras=4, max_cpu_loras=2)
    assert e.value.param == "max_cpu_loras"
    model = _model(folder)
    LoRAManager(model, max_loras=1, max_lora_rank=8, max_cpu_loras=None, device="cpu", dtype=torch.float32,
                max_num_tokens=8)
    with pytest.raises(InvalidArgumentError, match="already has a LoRAManager"):
        LoRAManager(model, max_loras=1, max_lora_rank=8, max_cpu_loras=None, device="cpu", dtype=torch.float32,
                    max_num_tokens=8)
