"""MTP speculation (speculative_config method "mtp": models/qwen3_5_mtp.py, models/deepseek_mtp.py,
worker/mtp_proposer.py) on tiny Qwen3.5, Qwen3-Next, GLM-4.5 and DeepSeek-V3 checkpoints carrying an MTP layer in their layouts
(tests/helpers/mtp_layer.py).

The models repeat themselves (residual branches scaled by 0.3, lm_head = the embedding) and their MTP layer leans
to the token it is given, so drafts are accepted as well as rejected. Checked: the engine's answers (tokens and
logprobs) are those of the engine without drafts; every draft the engine proposed -- across chunked prefills (a
chunk's last position paired with the next chunk's first token), verify steps (rejected positions left out) and
the chained rounds (scratch blocks) -- is what a from-scratch reference drafts (transformers' decoder layer over the
pairs (h_i, t_{i+1}) of transformers' hidden states); prefix caching with state snapshots and preemption beside;
two tensor-parallel ranks; the refusals by name; on a GPU, the CUDA engine."""

from __future__ import annotations

import shutil

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.speculative_config import parse_speculative_config

from tests.helpers import tiny_qwen3_5
from tests.helpers.mtp_layer import (
    DeepseekLayoutMtpReference,
    MtpReference,
    add_deepseek_layout_mtp,
    add_mtp_layer,
)
from tests.helpers.tiny_deepseek import make_tiny_deepseek
from tests.helpers.tiny_glm import make_tiny_glm4_moe
from tests.helpers.tiny_models import make_tiny_llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

# name -> (build the tiny model, add its MTP layer, the reference of its drafts)
FAMILIES = {
    "qwen3_5": (lambda f: tiny_qwen3_5.make_tiny_qwen3_5(f, rope_parameters=dict(tiny_qwen3_5.ROPE, rope_theta=100.0)),
                add_mtp_layer, MtpReference),
    "qwen3_next": (lambda f: tiny_qwen3_5.make_tiny_qwen3_next(f, rope_parameters=dict(tiny_qwen3_5.NEXT_ROPE,
                                                                                       rope_theta=100.0)),
                   add_mtp_layer, MtpReference),
    "glm4_moe": (lambda f: make_tiny_glm4_moe(f, mtp_layers=0), add_deepseek_layout_mtp, DeepseekLayoutMtpReference),
    "deepseek_v3": (lambda f: make_tiny_deepseek(f, version=3), add_deepseek_layout_mtp, DeepseekLayoutMtpReference),
}
PROMPTS = [[5, 9, 11, 13] * 6, [(7 * i) % 40 + 3 for i in range(37)], [21, 22] * 9, [(3 * i) % 17 + 40 for i in range(29)]]
PARAMS = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True, logprobs=0)
MTP = {"method": "mtp", "num_speculative_tokens": 3}


def _repeating_with_mtp(folder, make, add_layer) -> dict[str, torch.Tensor]:
    """The tiny model (the hybrids' rope theta 100: positions weigh in), repeating itself, with an MTP layer."""
    from safetensors.torch import load_file, save_file

    make(folder)
    path = f"{folder}/model.safetensors"
    weights = load_file(path)
    for name in weights:
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.3
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, path, metadata={"format": "pt"})
    return add_layer(str(folder), embed_gain=0.5)


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    """name -> (folder, the MTP tensors written)."""
    root = tmp_path_factory.mktemp("mtp")
    return {name: (str(root / name), _repeating_with_mtp(root / name, make, add_layer))
            for name, (make, add_layer, _) in FAMILIES.items()}


def _generate(folder: str, prompts=PROMPTS, record: bool = False, on_engine=None, **kw):
    """(outputs, engine stats, [(request id, position of its last token, drafts proposed)]). on_engine(llm): called
    before generating."""
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, **kw)
    if on_engine is not None:
        on_engine(llm)
    proposals: list[tuple[str, int, list[int]]] = []
    drafter = llm.engine.drafter
    if record and drafter is not None:
        propose = drafter.propose

        def recording():
            position = {p.slot: p.position for p in drafter._pending}
            out = propose()
            if out:
                offsets = out["draft_offsets"]
                for i, slot in enumerate(out["draft_slots"].tolist()):
                    proposals.append((llm.engine._req_of_slot[slot], position[slot],
                                      out["draft_token_ids"][offsets[i]:offsets[i + 1]].tolist()))
            return out

        drafter.propose = recording
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        return outs, llm.engine.stats(), proposals
    finally:
        llm.engine.shutdown()


def _assert_same_answers(expected, got, tol: float = 1e-4) -> None:
    for a, b in zip(expected, got, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        assert list(a.token_ids) == list(b.token_ids)
        for la, lb, t in zip(a.logprobs, b.logprobs, a.token_ids, strict=True):
            assert abs(la[t].logprob - lb[t].logprob) < tol


@pytest.mark.parametrize("name", list(FAMILIES))
def test_mtp_drafts_are_the_layers_and_keep_the_answers(mtp_models, name):
    """Chunked prefill under a 16-token budget, 3 drafts a step, no prefix caching (a hit's block would keep another
    request's pair: an approximation the reference does not share)."""
    folder, mtp = mtp_models[name]
    plain, _, _ = _generate(folder, enable_prefix_caching=False)
    spec, stats, proposals = _generate(folder, record=True, enable_prefix_caching=False, max_num_batched_tokens=16,
                                       speculative_config=MTP)
    _assert_same_answers(plain, spec)
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    _assert_drafts_are_the_layers(mtp_models[name], name, spec, proposals)


def _assert_drafts_are_the_layers(model, name, outs, proposals, tol: float = 1e-4, device: str = "cpu") -> None:
    """Every recorded proposal is what the from-scratch reference drafts from the request's tokens up to it (the
    reference on `device`)."""
    folder, mtp = model
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    reference = FAMILIES[name][2](ref, mtp)
    sequences = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}
    assert len(proposals) > 20
    for rid, position, drafts in proposals:
        expected, logits = reference.drafts(sequences[rid][:position + 1], len(drafts))
        for j, (got, want) in enumerate(zip(drafts, expected, strict=True)):
            if got != want:  # (a near tie between the two is float noise, not a wrong draft)
                assert logits[j][want] - logits[j][got] < tol, (rid, position, drafts, expected)
                break


def test_mtp_with_prefix_caching_snapshots_and_preemption(mtp_models):
    """State snapshots on a 16-token grid and prefix-cache hits (a prompt repeated, a conversation's second turn),
    then a KV cache so tight that requests are preempted: the answers are those without drafts, no block leaks."""
    folder, _ = mtp_models["qwen3_5"]
    prompts = PROMPTS + [PROMPTS[1], PROMPTS[0] + [7, 8, 9]]
    plain, _, _ = _generate(folder, prompts, enable_prefix_caching=False)
    spec, stats, _ = _generate(folder, prompts, mamba_block_size=16, speculative_config=MTP)
    _assert_same_answers(plain, spec)
    assert stats["spec_num_accepted_tokens"] > 0
    llm = LLM(model=folder, dtype="float32", num_gpu_blocks_override=9, max_num_seqs=6, max_model_len=96,
              max_num_batched_tokens=32, mamba_block_size=16, speculative_config=MTP)
    try:
        tight = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        stats = llm.engine.stats()
        assert stats["num_preemptions"] > 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"] - 1
    finally:
        llm.engine.shutdown()
    _assert_same_answers(plain, tight)


def test_mtp_under_tensor_parallelism(mtp_models):
    """Two gloo ranks: each holds half of the MTP layer's heads (and of its twin cache's) and runs the driver's pass and
    round arrays on its shard, so the collectives line up; the answers are the one-rank engine's without drafts."""
    folder, _ = mtp_models["qwen3_5"]
    plain, _, _ = _generate(folder, enable_prefix_caching=False)
    spec, stats, _ = _generate(folder, tensor_parallel_size=2, max_num_batched_tokens=16, mamba_block_size=16,
                               speculative_config=MTP)
    _assert_same_answers(plain, spec, 1e-3)
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]


def test_mtp_layer_quantized_at_load_with_the_model(mtp_models):
    """quantization="fp8" on float weights quantizes the MTP layer too (its fc included), and the answers are those
    of the FP8 engine without drafts."""
    folder, _ = mtp_models["qwen3_5"]
    prompts = PROMPTS[:2]
    plain, _, _ = _generate(folder, prompts, quantization="fp8")
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, quantization="fp8", speculative_config=MTP)
    try:
        assert llm.engine.drafter.predictor.fc.quant is not None
        spec = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    _assert_same_answers(plain, spec)


def test_mtp_aliases_parse():
    assert parse_speculative_config({"method": "qwen3_next_mtp", "num_speculative_tokens": 2}).method == "mtp"
    for alias in ("qwen3_5_mtp", "deepseek_mtp", "glm4_moe_mtp"):
        assert parse_speculative_config({"method": alias, "num_speculative_tokens": 1}).method == "mtp"


@pytest.mark.parametrize("case", ["no_layer_class", "no_tensors", "async", "ngram_keys", "other_model",
                                  "glm_head_copy_differs", "sleep_mode"])
def test_what_mtp_cannot_do_is_refused_by_name(mtp_models, tmp_path, case):
    folder, _ = mtp_models["qwen3_5"]
    spec: dict = dict(MTP)
    kw: dict = {}
    if case == "no_layer_class":
        folder, match = make_tiny_llama(tmp_path / "llama"), "has no multi-token-prediction layer"
    elif case == "no_tensors":
        folder = str(tmp_path / "bare")
        tiny_qwen3_5.make_tiny_qwen3_5(folder)
        match = "has no mtp.\\* tensors"
    elif case == "async":
        kw, match = {"async_scheduling": True}, "async_scheduling: not supported with speculative_config method 'mtp'"
    elif case == "sleep_mode":
        kw, match = {"enable_sleep_mode": True}, "enable_sleep_mode: not supported with speculative_config method 'mtp'"
    elif case == "ngram_keys":
        spec["prompt_lookup_max"], match = 2, "prompt_lookup_min / prompt_lookup_max"
    elif case == "glm_head_copy_differs":
        from safetensors.torch import load_file, save_file

        folder = str(shutil.copytree(mtp_models["glm4_moe"][0], tmp_path / "glm"))
        weights = load_file(f"{folder}/model.safetensors")
        weights["model.layers.3.shared_head.head.weight"] += 1.0
        save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
        match = "the MTP layer's lm_head differs from the model's"
    else:
        other = shutil.copytree(folder, tmp_path / "copy")
        spec["model"], match = str(other), "speculative_config.model: method 'mtp' drafts with the served model's"
    with pytest.raises(Exception, match=match):
        LLM(model=str(folder), dtype="float32", kv_cache_memory=8 << 20, speculative_config=spec, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_5", "glm4_moe", "deepseek_v3"])
def test_cuda_mtp_matches_cpu(mtp_models, name):
    """The CUDA engine (fla's kernels, the fused MoE kernels, the Triton MLA kernels; CUDA graphs for the target's
    decode and verify steps -- the hybrid's through the one-launch verify recurrence --, and for the MTP layer's
    pass and rounds, worker/mtp_graphs.py) drafting with the MTP layer gives the CPU engine's answers (float32), and
    its drafts are the reference layer's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    folder, _ = mtp_models[name]
    cpu, _, _ = _generate(folder, enable_prefix_caching=False)
    extra = {"mamba_block_size": 16} if name == "qwen3_5" else {}
    replays: dict[str, list[int]] = {"target verify": [], "mtp decode": [], "mtp verify": []}

    def counting(run, kind):
        def run_counted(*args):
            meta = args[-1]
            if kind == "mtp":
                replays["mtp decode" if meta.decode_only else "mtp verify"].append(meta.num_reqs)
            elif not meta.decode_only:
                replays["target verify"].append(meta.num_reqs)
            return run(*args)
        return run_counted

    def count_replays(llm) -> None:
        graphs, mtp = llm.engine.runner.graph_runner, llm.engine.drafter.graphs
        assert graphs is not None and graphs.verify_graphs and mtp is not None
        graphs.run = counting(graphs.run, "target")
        mtp.run = counting(mtp.run, "mtp")

    cuda, stats, proposals = _generate(folder, device="cuda", record=True, speculative_config=MTP,
                                       on_engine=count_replays, **extra)
    _assert_same_answers(cpu, cuda, 1e-3)
    assert stats["spec_num_accepted_tokens"] > 0
    # (the target's: steps whose queries are all 1 + k tokens; the layer's: the rounds, and passes of <= 1 + k pairs)
    assert replays["target verify"] and replays["mtp decode"] and replays["mtp verify"], replays
    # (the reference on CUDA too: the device image's transformers runs the hybrid layers through fla's Triton kernels)
    _assert_drafts_are_the_layers(mtp_models[name], name, cuda, proposals, 1e-3, device="cuda")
