"""Nemotron-H's MTP layers drafting (speculative_config method "mtp": models/nemotron_h_mtp.py, worker/mtp_proposer.py)
on a tiny Nemotron 3 Super (tests/helpers/tiny_nemotron_h_moe.py: Mamba2, NoPE attention, latent MoE layers) carrying
the releases' MTP step (an attention block and an MoE block, `mtp.layers.{0,1}.*`).

transformers has no Nemotron-H MTP module (it drops mtp.* at load), so the reference here is the definition written
out in torch -- eh_proj over [enorm(embedding) | hnorm(h_i)], the blocks (transformers' own NemotronHBlock of each kind,
loaded with the MTP tensors), final_layernorm, the target's lm_head -- over the pairs (h_i, t_{i+1}) of transformers'
hidden states, chained as vLLM chains MTP drafts. The model repeats itself (residual branches scaled by 0.3, lm_head
= the embedding) and its eh_proj leans to the token it is given, so drafts are accepted as well as rejected.

Checked: greedy answers (tokens and logprobs) equal the engine's without drafts across chunked prefill and verify
steps of the Mamba2 hybrid; every draft and each first draft's logits are the reference's; an FP8 (ModelOpt) export
whose exclude list keeps the MTP attention in BF16; the refusals by name; on a GPU, the CUDA engine."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.model_spec import UnsupportedModelError
from ferrox.models.nemotron_h_mtp import check_mtp_config, mtp_block_kinds
from ferrox.speculative_config import parse_speculative_config
from safetensors.torch import load_file, save_file

from tests.helpers.quant_checkpoints import write_checkpoint
from tests.helpers.tiny_nemotron_h_moe import (
    MTP_BLOCKS,
    MTP_SOURCES,
    add_nemotron_h_mtp,
    make_tiny_nemotron_h_moe,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

PROMPTS = [[5, 9, 11, 13] * 6, [(7 * i) % 40 + 3 for i in range(37)], [21, 22] * 9, [(3 * i) % 17 + 40 for i in range(29)]]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
MTP = {"method": "mtp", "num_speculative_tokens": 3}
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """(folder, the MTP tensors): the tiny Super, repeating itself, with its MTP layers."""
    folder = str(tmp_path_factory.mktemp("nemotron_h_mtp") / "super")
    make_tiny_nemotron_h_moe(folder, latent=True)
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    for name in weights:
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.3
    weights["lm_head.weight"] = weights["backbone.embeddings.weight"].clone()
    save_file(weights, path, metadata={"format": "pt"})
    return folder, add_nemotron_h_mtp(folder, embed_gain=0.5)


def _generate(folder: str, prompts=PROMPTS, record: bool = False, on_engine=None, **kw):
    """(outputs, engine stats, [(request id, position of its last token, drafts, the first draft's logits)]).
    on_engine(llm): called before generating."""
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, enable_prefix_caching=False, **kw)
    if on_engine is not None:
        on_engine(llm)
    proposals: list[tuple[str, int, list[int], torch.Tensor]] = []
    drafter = llm.engine.drafter
    if record:
        propose = drafter.propose

        def recording():
            pending = {p.slot: (i, p.position) for i, p in enumerate(drafter._pending)}
            first = None
            if drafter._first is not None:
                with torch.inference_mode():
                    first = drafter.predictor.compute_logits(drafter._first[1]).cpu()
            out = propose()
            if out:
                offsets = out["draft_offsets"]
                for j, slot in enumerate(out["draft_slots"].tolist()):
                    row, position = pending[slot]
                    proposals.append((llm.engine._req_of_slot[slot], position,
                                      out["draft_token_ids"][offsets[j]:offsets[j + 1]].tolist(), first[row]))
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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class NemotronHMtpReference:
    """What the MTP layers draft after a token sequence, from scratch (module docstring)."""

    def __init__(self, ref, mtp: dict[str, torch.Tensor]) -> None:
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock

        self.ref, config = ref, ref.config
        self.eps = config.layer_norm_epsilon
        self.blocks = []
        for i, letter in enumerate(MTP_BLOCKS):
            # (a block of the kind of the target's layer MTP_SOURCES names, holding the MTP tensors: the experts
            # stacked as transformers keeps them)
            block = NemotronHBlock(config, layer_idx=MTP_SOURCES[letter]).eval()
            prefix = f"mtp.layers.{i}."
            ours = {name[len(prefix):]: t for name, t in mtp.items() if name.startswith(prefix)}
            state = {}
            for key in block.state_dict():
                if key in ("mixer.experts.up_proj", "mixer.experts.down_proj"):
                    proj = key.rpartition(".")[2]
                    state[key] = torch.stack([ours[f"mixer.experts.{e}.{proj}.weight"]
                                              for e in range(config.n_routed_experts)])
                else:
                    state[key] = ours[key]
            block.load_state_dict(state)
            self.blocks.append(block)
        self.mtp = mtp

    @torch.no_grad()
    def hidden(self, seq: list[int]) -> torch.Tensor:
        """The target's last hidden states (after its final norm) over `seq`: causal, so a prefix's are a slice."""
        return self.ref.model(input_ids=torch.tensor([seq])).last_hidden_state[0]

    @torch.no_grad()
    def _layers(self, hidden: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        m, eps = self.mtp, self.eps
        e = _rms_norm(self.ref.model.embeddings(torch.tensor(tokens)), m["mtp.layers.0.enorm.weight"], eps)
        x = torch.cat([e, _rms_norm(hidden, m["mtp.layers.0.hnorm.weight"], eps)], dim=-1)
        x = (x @ m["mtp.layers.0.eh_proj.weight"].t())[None]
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        for block in self.blocks:  # (each x + mixer(norm(x)); NoPE attention)
            x = block(x, attention_mask=mask, position_ids=torch.arange(n)[None])
        return _rms_norm(x[0], m[f"mtp.layers.{len(self.blocks) - 1}.final_layernorm.weight"], eps)

    @torch.no_grad()
    def drafts(self, seq: list[int], hidden: torch.Tensor, k: int) -> tuple[list[int], list[torch.Tensor]]:
        """The k drafts after `seq` (its last token just sampled; `hidden`: the target's over at least seq[:-1]),
        and the logits each came from."""
        hidden, tokens = hidden[:len(seq) - 1], list(seq[1:])
        drafts, logits = [], []
        for _ in range(k):
            o = self._layers(hidden, tokens)
            row = self.ref.lm_head(o[-1])
            drafts.append(int(row.argmax()))
            logits.append(row)
            hidden = torch.cat([hidden, o[-1:]])
            tokens.append(drafts[-1])
        return drafts, logits


def _assert_drafts_are_the_layers(model, outs, proposals, tol: float = 1e-4) -> None:
    """Every recorded proposal is what the reference drafts from the request's tokens up to it, and its first draft's
    logits are the reference's."""
    folder, mtp = model
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = NemotronHMtpReference(ref, mtp)
    sequences = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}
    hidden = {rid: reference.hidden(seq[:-1]) for rid, seq in sequences.items()}
    assert len(proposals) > 20
    for rid, position, drafts, first_logits in proposals:
        expected, logits = reference.drafts(sequences[rid][:position + 1], hidden[rid], len(drafts))
        torch.testing.assert_close(first_logits, logits[0], atol=tol * 10, rtol=tol)
        for j, (got, want) in enumerate(zip(drafts, expected, strict=True)):
            if got != want:  # (a near tie between the two is float noise, not a wrong draft)
                assert logits[j][want] - logits[j][got] < tol, (rid, position, drafts, expected)
                break


def test_nemotron_h_mtp_drafts_are_the_layers_and_keep_the_answers(mtp_model):
    """Four requests at once, chunked prefill under a 16-token budget, 3 drafts a step: the answers are those without
    drafts, drafts are accepted and rejected, and each is the reference's."""
    folder, _ = mtp_model
    plain, _, _ = _generate(folder)
    spec, stats, proposals = _generate(folder, record=True, max_num_batched_tokens=16, speculative_config=MTP)
    _assert_same_answers(plain, spec)
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    _assert_drafts_are_the_layers(mtp_model, spec, proposals)


def test_nemotron_h_mtp_with_state_snapshots_and_preemption(mtp_model):
    """Prefix caching's Mamba state snapshots on a 16-token grid (a prompt repeated, one extended), then a KV cache so
    tight that requests are preempted: the answers are those without drafts, and no block leaks."""
    folder, _ = mtp_model
    prompts = PROMPTS + [PROMPTS[1], PROMPTS[0] + [7, 8, 9]]
    plain, _, _ = _generate(folder, prompts)
    for kw in ({"kv_cache_memory": 8 << 20}, {"num_gpu_blocks_override": 9, "max_model_len": 96}):
        llm = LLM(model=folder, dtype="float32", max_num_seqs=6, max_num_batched_tokens=32, mamba_block_size=16,
                  speculative_config=MTP, **kw)
        try:
            spec = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
            stats = llm.engine.stats()
        finally:
            llm.engine.shutdown()
        _assert_same_answers(plain, spec)
        assert stats["spec_num_accepted_tokens"] > 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"] - 1
    assert stats["num_preemptions"] > 0


def test_nemotron_h_mtp_under_tensor_parallelism(mtp_model):
    """Two gloo ranks, each with half of the MTP attention's heads and of the experts' rows (and of the twin cache):
    the answers are the one-rank engine's without drafts, with the same drafts accepted."""
    folder, _ = mtp_model
    plain, _, _ = _generate(folder)
    _, one, _ = _generate(folder, max_num_batched_tokens=16, speculative_config=MTP)
    spec, two, _ = _generate(folder, tensor_parallel_size=2, max_num_batched_tokens=16, speculative_config=MTP)
    _assert_same_answers(plain, spec, 1e-3)
    assert 0 < two["spec_num_accepted_tokens"] == one["spec_num_accepted_tokens"]


# ---- FP8 (ModelOpt, as NVIDIA's Nemotron 3 FP8 releases) -----------------------------------------------------------
_QUANTIZED = ("experts", "shared_experts", "fc1_latent_proj", "fc2_latent_proj", "eh_proj")
# The attention (the MTP step's too), the Mamba mixers and every router kept in BF16, as the releases' recipe keeps
# them; a trailing `*`: the module and everything under it (ModelOpt's syntax).
EXCLUDE = ["lm_head", "backbone.layers.2*", "backbone.layers.*.mixer.in_proj", "backbone.layers.*.mixer.out_proj",
           "backbone.layers.*.mixer.conv1d", "*.mixer.gate", "mtp.layers.0.mixer*"]


def _modelopt(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """E4M3 codes with a per-tensor weight_scale and a static input_scale for the projections of _QUANTIZED (the
    decoder's "-" MLP too); the rest as it is."""
    out = {}
    for name, w in weights.items():
        module, _, leaf = name.rpartition(".")
        parts = module.split(".")
        quantized = leaf == "weight" and (parts[-1] in ("up_proj", "down_proj", "eh_proj") or
                                          any(p in _QUANTIZED for p in parts))
        if not quantized or module.endswith("mixer.gate"):
            out[name] = w
            continue
        scale = w.float().abs().amax().clamp(min=1e-12) / 448.0
        out[name] = (w.float() / scale).clamp(-448, 448).to(FP8)
        out[f"{module}.weight_scale"] = scale
        out[f"{module}.input_scale"] = torch.tensor(4.0 / 448.0)
    return out


@pytest.fixture(scope="module")
def fp8_model(mtp_model, tmp_path_factory):
    float_folder, _ = mtp_model
    tensors = _modelopt(load_file(os.path.join(float_folder, "model.safetensors")))
    config = {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": EXCLUDE,
              "producer": {"name": "modelopt", "version": "0.35.0"}}
    return write_checkpoint(float_folder, tmp_path_factory.mktemp("nemotron_h_mtp_fp8") / "fp8", config, tensors)


def test_nemotron_h_mtp_fp8_checkpoint(fp8_model):
    """The MTP layers quantized as the model is: eh_proj, the routed and shared experts and the latent projections
    FP8, the attention block kept BF16 by the exclude list (`mtp.layers.0.mixer*`); the answers are the FP8 engine's
    without drafts."""
    from ferrox.layers.quant.fp8_linear import Fp8Linear

    prompts = PROMPTS[:2]
    plain, _, _ = _generate(fp8_model, prompts)
    llm = LLM(model=fp8_model, dtype="float32", kv_cache_memory=8 << 20, enable_prefix_caching=False,
              speculative_config=MTP)
    try:
        predictor = llm.engine.drafter.predictor
        attention, moe = predictor.layers[0].mixer, predictor.layers[1].mixer
        assert isinstance(predictor.eh_proj.quant, Fp8Linear)
        assert moe.experts.weight_method is not None and isinstance(moe.fc1_latent_proj.quant, Fp8Linear)
        assert attention.qkv_proj.weight_method is None and attention.o_proj.weight_method is None
        spec = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
    finally:
        llm.engine.shutdown()
    _assert_same_answers(plain, spec)


# ---- refusals ------------------------------------------------------------------------------------------------------
def test_mtp_config_spellings_and_aliases():
    assert parse_speculative_config({"method": "nemotron_h_mtp", "num_speculative_tokens": 2}).method == "mtp"
    assert mtp_block_kinds({"mtp_layers_block_type": ["attention", "moe"]}) == ["full_attention", "moe"]
    assert mtp_block_kinds({"mtp_hybrid_override_pattern": "*E"}) == ["full_attention", "moe"]
    assert mtp_block_kinds({}) == ["full_attention", "moe"]  # (transformers' default)
    with pytest.raises(Exception, match="disagree"):
        mtp_block_kinds({"mtp_layers_block_type": ["attention", "moe"], "mtp_hybrid_override_pattern": "*-"})
    for config, match in [({"num_nextn_predict_layers": 0}, "num_nextn_predict_layers declares no"),
                          ({"num_nextn_predict_layers": 2}, "declares 2 multi-token-prediction steps"),
                          ({"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*M"}, "Mamba block"),
                          ({"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E*E"},
                           "exactly one attention block")]:
        with pytest.raises(UnsupportedModelError, match=match):
            check_mtp_config(config)


@pytest.mark.parametrize("case", ["no_tensors", "no_layers_declared", "fp8_exclude_list_unclear", "too_many_drafts"])
def test_what_nemotron_h_mtp_cannot_do_is_refused_by_name(mtp_model, fp8_model, tmp_path, case):
    folder = str(shutil.copytree(mtp_model[0], tmp_path / "copy"))
    spec = dict(MTP)
    if case == "no_tensors":  # (Nemotron 3 Nano, and releases cut of their MTP layers)
        path = os.path.join(folder, "model.safetensors")
        save_file({k: v for k, v in load_file(path).items() if not k.startswith("mtp.")}, path)
        match = "has no mtp.\\* tensors"
    elif case == "no_layers_declared":
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["num_nextn_predict_layers"] = 0
        with open(path, "w") as f:
            json.dump(config, f)
        match = "num_nextn_predict_layers declares no multi-token-prediction layers"
    elif case == "fp8_exclude_list_unclear":  # (the list leaves the shared expert BF16, its tensors are FP8)
        folder = str(shutil.copytree(fp8_model, tmp_path / "fp8"))
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["quantization_config"]["exclude_modules"].append("mtp.layers.1.mixer.shared_experts*")
        with open(path, "w") as f:
            json.dump(config, f)
        match = "mtp.layers.1.mixer.shared_experts.up_proj is stored FP8 while"
    else:
        spec["num_speculative_tokens"], match = 16, "num_speculative_tokens: at most 15 on a hybrid"
    with pytest.raises(Exception, match=match):
        LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, speculative_config=spec)


@pytest.mark.gpu
def test_cuda_nemotron_h_mtp_matches_cpu(mtp_model):
    """The CUDA engine (the Mamba2 kernels and their verify steps, the fused ReLU^2 MoE kernels, CUDA graphs for the
    target's decode steps and the MTP layers' pass and rounds: worker/mtp_graphs.py) drafting with the MTP layers
    gives the CPU engine's answers (float32), and its drafts are the reference's (on the CPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    folder, _ = mtp_model
    cpu, _, _ = _generate(folder)
    replays: list[bool] = []

    def count_replays(llm) -> None:
        graphs = llm.engine.drafter.graphs
        assert graphs is not None
        run = graphs.run

        def counted(*args):
            replays.append(bool(args[-1].decode_only))
            return run(*args)

        graphs.run = counted

    cuda, stats, proposals = _generate(folder, device="cuda", record=True, on_engine=count_replays,
                                       speculative_config=MTP)
    _assert_same_answers(cpu, cuda, 1e-3)
    assert stats["spec_num_accepted_tokens"] > 0
    assert any(replays), "the MTP rounds never replayed a decode graph"
    _assert_drafts_are_the_layers(mtp_model, cuda, proposals, tol=1e-3)
