"""Phi-3 (fused qkv_proj / gate_up_proj in the checkpoint, cut by rows at load) and Granite (four
config scalars folded into the weights at load) against transformers on tiny random checkpoints:
greedy tokens and logits through the test driver with chunked prefill, once through the engine,
the sliding-window limit on max_model_len, the refusals by name, online FP8 after the split / the
folds, tensor-parallel shards, Granite's LoRA deltas and pooled hidden states; on a GPU the engine
in bfloat16 with CUDA graphs against the CPU float32 engine."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.attention.kv_cache import allocate_kv_caches
from ferrox.distributed.parallel_state import TPGroup, use_tp_group
from ferrox.errors import UnsupportedModelError
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.linear import MergedLinear, RowParallelLinear
from ferrox.layers.quant.fp8 import Fp8Config
from ferrox.layers.vocab_parallel import VocabParallelEmbedding
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.loader.weights import iter_safetensors
from ferrox.model_spec import ModelLoadError
from ferrox.models.registry import get_model_class

from tests.helpers import tiny_models
from tests.helpers.config_edit import copy_with_config as _copy_with_config
from tests.helpers.driver import StepRequest, build_step, run_greedy
from tests.models.conftest import assert_outputs_match_transformers, cut_at_eos, hf_greedy, hf_last_logits

transformers = pytest.importorskip("transformers")

WINDOW = 120  # the tiny Phi-3's sliding_window (max_position_embeddings 2048)
PROMPTS = [[5, 9, 11], [100, 7, 300, 45, 2, 9, 77, 13], list(range(3, 83))]  # 80 tokens: several blocks
BUILDERS = {
    "phi3": lambda d: tiny_models.make_tiny_phi3(d, sliding_window=WINDOW, seed=11),
    "granite": lambda d: tiny_models.make_tiny_granite(d, attention_bias=True, seed=12),  # o_proj bias folded too
    "granite_tied": lambda d: tiny_models.make_tiny_granite(d, tie_word_embeddings=True, seed=13),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, ferrox model, transformers model); built once for the module."""
    return tiny_models.models_with_references(tmp_path_factory.mktemp("phi3_granite"), BUILDERS)


def _load(folder: str, **kw):
    source = resolve_model(folder)
    return load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu", **kw)


# ---- parity with transformers ---------------------------------------------------------------------
@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_and_logits_match_transformers(tiny, name):
    """Prompts prefilled in chunks of 7 tokens over 8-token blocks (cached-context prefill), then
    batched decode: the prefill logits and the greedy tokens against transformers'."""
    folder, model, ref = tiny[name]
    ours, logits = run_greedy(model, PROMPTS, 10, block_size=8, prefill_chunk=7, return_prefill_logits=True)
    for i, ids in enumerate(PROMPTS):
        expected = hf_last_logits(ref, ids)
        torch.testing.assert_close(logits[i], expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[i].log_softmax(-1), expected.log_softmax(-1), atol=1e-4, rtol=1e-4)
        assert cut_at_eos(ours[i], [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, ids, 10), (name, i)
    assert run_greedy(model, PROMPTS[1:2], 10) == ours[1:2]  # alone, unchunked == in the chunked batch


def test_load_time_mapping(tiny):
    """Phi-3's fused tensors land in the merged layers' shards; Granite's scalars are folded (and its
    softmax scale is the config's, not head_dim ** -0.5)."""
    folder, phi3, _ = tiny["phi3"]
    tensors = dict(iter_safetensors(folder))
    qkv = tensors["model.layers.1.self_attn.qkv_proj.weight"]
    assert qkv.shape == (64 + 32 + 32, 64)
    assert torch.equal(phi3.model.layers[1].self_attn.qkv_proj.weight, qkv)  # [q; k; v] rows, in order
    assert torch.equal(phi3.model.layers[1].mlp.gate_up_proj.weight, tensors["model.layers.1.mlp.gate_up_proj.weight"])
    assert phi3.spec.sliding_window == WINDOW and phi3.spec.max_position_embeddings == 2048

    for name, tied in (("granite", False), ("granite_tied", True)):
        folder, granite, _ = tiny[name]
        tensors = dict(iter_safetensors(folder))
        attn = granite.model.layers[0].self_attn
        assert attn.scale == 0.0078125 and granite.model.layers[0].one_token_view().scale == 0.0078125
        torch.testing.assert_close(attn.o_proj.weight, 0.22 * tensors["model.layers.0.self_attn.o_proj.weight"])
        torch.testing.assert_close(granite.model.layers[1].mlp.down_proj.weight,
                                   0.22 * tensors["model.layers.1.mlp.down_proj.weight"])
        torch.testing.assert_close(granite.model.embed_tokens.weight, 12.0 * tensors["model.embed_tokens.weight"])
        norm_scale = 8.0 * (12.0 if tied else 1.0)
        assert granite.hidden_states_scale == norm_scale
        torch.testing.assert_close(granite.model.norm.weight, tensors["model.norm.weight"] / norm_scale)
        if not tied:
            torch.testing.assert_close(attn.o_proj.bias, 0.22 * tensors["model.layers.0.self_attn.o_proj.bias"])


def test_engine_chunked_prefill_matches_transformers(tiny):
    """The real engine (Rust scheduler, paged KV, sampler) with a 16-token budget and a context past
    Phi-3's sliding window (windows on: tests/models/test_sliding_window.py tests them past their edge)."""
    folder, _, ref = tiny["phi3"]
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=16, max_num_seqs=4,
              max_model_len=2 * WINDOW)
    try:
        assert llm.engine.max_model_len == 2 * WINDOW
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert_outputs_match_transformers(ref, PROMPTS, outs)


# ---- refusals ---------------------------------------------------------------------------------------
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize("name, fields, match", [
    ("granite", {"partial_rotary_factor": 0.5}, r"config\.json: partial_rotary_factor \(8 of 16 dims rotate\) is not "
                                                r"supported for GraniteForCausalLM"),
    ("granite", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     r"config\.json: rope_scaling\.rope_type 'dynamic' is not supported"),
    ("phi3", {"quantization_config": AWQ}, r"config\.json: quantization_config \(quant_method 'awq'\).*Phi3"),
    ("granite", {"quantization_config": AWQ}, r"config\.json: quantization_config \(quant_method 'awq'\).*Granite"),
    ("granite", {"logits_scaling": 0}, r"config\.json: logits_scaling must be a positive number"),
    ("granite", {"embedding_multiplier": "12"}, r"config\.json: embedding_multiplier must be a positive number"),
])
def test_unsupported_configs_are_refused_by_name(tiny, tmp_path, name, fields, match):
    folder = _copy_with_config(tiny[name][0], tmp_path / "edited", **fields)
    with pytest.raises(UnsupportedModelError, match=match):
        LLM(model=folder, kv_cache_memory=8 << 20, max_model_len=64)


@pytest.mark.parametrize("arch", ["gemma", "falcon"])
def test_gguf_files_of_unmapped_architectures_are_refused_by_name(tmp_path, arch):
    """Families ferrox does not run are refused naming the file's architecture (phi3 and granite files
    load: test_gguf_models.py; phi2 and the others of loader/gguf_families.py: test_gguf_families.py)."""
    gguf = pytest.importorskip("gguf")
    path = str(tmp_path / f"tiny-{arch}.gguf")
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=rf"GGUF file .*architecture '{arch}' is not supported"):
        load_model_spec(resolve_model(path))


def test_dropout_fields_are_ignored_and_fused_shapes_checked(tiny):
    folder, model, _ = tiny["phi3"]
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert config["resid_pdrop"] == config["embd_pdrop"] == config["attention_dropout"] == 0.1
    tensors = dict(iter_safetensors(folder))
    bad = dict(tensors)
    bad["model.layers.0.mlp.gate_up_proj.weight"] = tensors["model.layers.0.mlp.gate_up_proj.weight"][:200]
    with pytest.raises(ModelLoadError, match=r"gate_up_proj\.weight.*\(200, 64\).*256 rows \(128 gate \+ 128 up\)"):
        model.load_weights(bad.items())
    model.load_weights(tensors.items())  # leave the shared model as it was


def test_attention_multiplier_defaults_as_transformers(tiny, tmp_path):
    """A Granite config without attention_multiplier scores with 1.0 (GraniteConfig's default), not
    head_dim ** -0.5."""
    folder = _copy_with_config(tiny["granite"][0], tmp_path / "no_attention_multiplier", attention_multiplier=None)
    assert _load(folder).model.layers[0].self_attn.scale == 1.0
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert ref.config.attention_multiplier == 1.0


# ---- online FP8 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["phi3", "granite_tied"])
def test_online_fp8_quantizes_the_split_and_folded_weights(tiny, name):
    folder, model, _ = tiny[name]
    fp8 = _load(folder, quant_config=Fp8Config.online())
    for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        runner = fp8.model.layers[1].get_submodule(path).quant
        dequantized = runner.weight.float() * runner.weight_scale.reshape(-1, 1)
        want = model.model.layers[1].get_submodule(path).weight  # the float model's (split / folded) weight
        assert (dequantized - want).norm() / want.norm() < 0.05, path
    # Activations are rounded to fp8 too (per token): a few percent per layer on random weights.
    _, logits = run_greedy(fp8, PROMPTS, 1, return_prefill_logits=True)
    _, ref_logits = run_greedy(model, PROMPTS, 1, return_prefill_logits=True)
    assert (logits - ref_logits).norm() / ref_logits.norm() < 0.25


# ---- tensor parallelism ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(BUILDERS))
def test_tensor_parallel_ranks_load_their_part(tiny, name):
    """Two ranks built in this process and loaded through lazy safetensors slices (as a sharded
    engine reads them: Phi-3's fused rows cut without being read, Granite's folds applied on read)
    hold exactly their part of the one-rank model's weights. The engine itself runs Phi-3 on two
    gloo ranks in tests/engine/test_tensor_parallel.py."""
    folder, whole, _ = tiny[name]
    spec = whole.spec
    cls = get_model_class([spec.architecture])
    full = dict(whole.named_modules())
    for rank in range(2):
        with use_tp_group(TPGroup(rank=rank, size=2)), torch.no_grad():
            part = cls(spec, torch.float32, "cpu")
            part.load_weights(iter_safetensors(folder, lazy=True))
        compared = 0
        for module_name, module in part.named_modules():
            other = full[module_name]
            if isinstance(module, MergedLinear):
                for shard, (start, size, _) in module.checkpoint_rows.items():
                    mine = module.weight[module.shard_offsets[shard]:module.shard_offsets[shard] + size]
                    theirs = other.weight[other.shard_offsets[shard] + start:other.shard_offsets[shard] + start + size]
                    assert torch.equal(mine, theirs), (module_name, shard)
            elif isinstance(module, RowParallelLinear):
                assert torch.equal(module.weight, other.weight[:, module.in_start:module.in_start + module.in_features])
                assert module.bias is None or torch.equal(module.bias, other.bias)
            elif isinstance(module, VocabParallelEmbedding):
                rows = slice(module.vocab_start, module.vocab_start + module.num_rows)
                assert torch.equal(module.weight[:module.num_rows], other.weight[rows]), module_name
            elif isinstance(module, RMSNorm):
                assert torch.equal(module.weight, other.weight), module_name
            else:
                continue
            compared += 1
        assert compared == 2 * 6 + 2 + (whole.lm_head is not None)  # 6 per layer, embedding + final norm, head


# ---- Granite: LoRA deltas and pooled hidden states ---------------------------------------------------
@torch.inference_mode()
def test_granite_lora_deltas_get_the_residual_multiplier(tiny, tmp_path):
    """o_proj and down_proj carry residual_multiplier in their weights; an adapter on them must get
    it too (transformers scales the adapted layer's output): against peft merged into the weights."""
    pytest.importorskip("peft")
    from tests.lora.adapters import make_peft_adapter, merged_reference

    folder, _, ref = tiny["granite"]
    adapter = make_peft_adapter(ref, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=("o_proj", "down_proj"),
                                seed=3)
    merged = merged_reference(ref, adapter)
    model = _load(folder)
    _assert_adapter_matches(model, adapter, ref, merged)


@pytest.mark.parametrize("partial", [False, True])
@torch.inference_mode()
def test_lora_on_phi3_fused_modules_matches_peft(tiny, tmp_path, partial):
    """A PEFT adapter of Phi-3 names its fused qkv_proj / gate_up_proj, which ferrox splits at load: the adapter's
    B rows are cut the same way (Phi3ForCausalLM.lora_rewrite), and with partial rotary (Phi-4-mini) its q / k
    rows reordered too: logits against peft merged into the weights."""
    pytest.importorskip("peft")
    from tests.lora.adapters import (
        assert_lora_rows_follow_the_loader,
        load_hf_model,
        make_peft_adapter,
        merged_reference,
    )

    if partial:
        folder = tiny_models.make_tiny_phi3(tmp_path / "phi4_mini", partial_rotary_factor=0.75, seed=14)
        ref = load_hf_model(folder)
    else:
        folder, _, ref = tiny["phi3"]
    model = _load(folder)
    assert (model.spec.rotary_dim is not None) == partial
    assert_lora_rows_follow_the_loader(folder, _load(folder))
    adapter = make_peft_adapter(ref, tmp_path / "adapter", r=4, lora_alpha=8,
                                target_modules=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), seed=4)
    merged = merged_reference(ref, adapter)
    _assert_adapter_matches(model, adapter, ref, merged)


def _assert_adapter_matches(model, adapter: str, ref, merged) -> None:
    """One prompt's last logits through `model` with `adapter` in a slot: those of peft's merged model, and
    not the base model's (the adapter matters)."""
    from ferrox.lora.manager import LoRAManager
    from ferrox.lora.request import LoRARequest

    manager = LoRAManager(model, max_loras=1, max_lora_rank=4, max_cpu_loras=None, device="cpu",
                          dtype=torch.float32, max_num_tokens=64)
    manager.add_adapter(LoRARequest("a", 1, adapter))
    prompt = PROMPTS[1]
    caches = allocate_kv_caches(model.spec, 2, 16, torch.float32, "cpu")
    ids, pos, meta = build_step([StepRequest(prompt, 0, [1])], 16, "cpu")
    manager.prepare_step(np.ones(len(prompt), dtype=np.int64))
    logits = model.compute_logits(model(ids, pos, caches, meta)[-1:])[0]
    torch.testing.assert_close(logits, hf_last_logits(merged, prompt), atol=1e-4, rtol=1e-4)
    assert (hf_last_logits(merged, prompt) - hf_last_logits(ref, prompt)).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["granite", "granite_tied"])
def test_granite_pooled_hidden_states_match_transformers(tiny, name):
    """The final norm carries 1 / logits_scaling (and 1 / embedding_multiplier when tied): unnormalized
    embeddings are scaled back to transformers' last hidden state."""
    from ferrox.pooling.params import PoolingParams

    folder, _, ref = tiny[name]
    llm = LLM(model=folder, runner="pooling", kv_cache_memory=8 << 20, max_model_len=128)
    try:
        out = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], pooling_params=PoolingParams(normalize=False),
                        use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for prompt, emb in zip(PROMPTS, out, strict=True):
        with torch.inference_mode():
            hidden = ref.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(emb.outputs.embedding), hidden, atol=1e-4, rtol=1e-4)


# ---- CUDA ------------------------------------------------------------------------------------------
LONG_PROMPT = list(range(3, 380)) * 3  # 1131 tokens: a prefill chunk long enough for the cuDNN path (sm90)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(BUILDERS))
def test_cuda_graphs_bf16_engine_matches_cpu_float32(tiny, name, monkeypatch):
    """The engine on CUDA with CUDA graphs: in float32 every greedy token equals the CPU float32
    engine's (one prompt at a time, so decode steps take the fused one-token kernels, and all in a
    batch); in bfloat16 the first tokens do, and the first token's logprob is close. Granite also
    prefills a 1131-token prompt, which takes FlashAttention-3 (or cuDNN's attention without its
    wheel) on an H200: it too must read the layer's softmax scale (Granite's attention_multiplier)."""
    from ferrox.kernels import cudnn_prefill, fa3_prefill

    folder, _, _ = tiny[name]
    long = name != "phi3"  # Phi-3's context is capped at its sliding window
    prompts = PROMPTS + [LONG_PROMPT] if long else PROMPTS
    max_model_len = 1200 if long else WINDOW
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)

    def generate(llm, batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].logprobs[0] for o in outs]

    cpu = LLM(model=folder, device="cpu", dtype="float32", kv_cache_memory=32 << 20, max_model_len=max_model_len)
    try:
        want, want_lp = generate(cpu, prompts)
    finally:
        cpu.engine.shutdown()
    library_calls: list[str] = []
    for module, name in ((cudnn_prefill, "cudnn_prefill_request"), (fa3_prefill, "fa3_prefill_request")):
        def counted(*args, _original=getattr(module, name), _name=name, **kwargs):
            library_calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model=folder, device="cuda", dtype=dtype, kv_cache_memory=256 << 20, max_model_len=max_model_len,
                  enforce_eager=False)
        try:
            batched, lps = generate(llm, prompts)
            alone = [generate(llm, [p])[0][0] for p in prompts]
        finally:
            llm.engine.shutdown()
        n = 8 if dtype == "float32" else 3
        for i in range(len(prompts)):
            assert batched[i][:n] == want[i][:n] and alone[i][:n] == want[i][:n], (dtype, i, batched[i], alone[i],
                                                                                   want[i])
            token = want[i][0]
            assert abs(lps[i][token].logprob - want_lp[i][token].logprob) < (1e-3 if dtype == "float32" else 0.1)
    if long and cudnn_prefill.cudnn_prefill_supported(torch.device("cuda"), torch.bfloat16, 16):
        assert library_calls, "the long bf16 prefill took neither FlashAttention-3 nor cuDNN"
