"""Tensor parallelism on Nemotron-H (models/nemotron_h.py) with Nemotron 3's E layers (models/nemotron_h_moe.py),
over two gloo rank processes on the CPU.

The tiny checkpoints of tests/helpers/tiny_nemotron_h_moe.py hold every layer kind (M E * E - M: Mamba2 4 heads in 2
groups, NoPE attention 4 / 2 heads, a 96-wide ReLU^2 MLP, 8 experts of 32 and a 48-wide shared expert): "plain" (the
shared expert's partial summed with the routed one in one all-reduce) and "latent" (the experts behind replicated
fc1 / fc2_latent_proj with biases: fc2 maps each rank's partial sum, its bias added once). A rank's slices are checked
against the whole model's; then the real engine at tensor_parallel_size 2 (once with whole experts per rank,
--enable-expert-parallel), prompts prefilled in chunks under a 16-token budget, gets the one-rank engine's greedy
tokens and logprobs. Counts that do not split are refused before the ranks start, naming the config field."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from ferrox import LLM
from ferrox.model_spec import UnsupportedModelError

from tests.helpers.tiny_nemotron_h_moe import EXPERTS, NEMOTRON_MOE_PATTERN, make_tiny_nemotron_h_moe
from tests.models.conftest import chunked_engine_outputs

pytest.importorskip("transformers")

# 3 tokens, 40 (three chunks of 16), 30.
PROMPTS = [[5, 9, 11], list(range(3, 43)), [(7 * i) % 300 + 3 for i in range(30)]]
MOE_LAYER = NEMOTRON_MOE_PATTERN.index("E")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> folder: "plain" and "latent" (moe_latent_size, mlp_bias)."""
    root = tmp_path_factory.mktemp("nemotron_h_tp")
    return {name: make_tiny_nemotron_h_moe(root / name, latent=name == "latent", seed=5)
            for name in ("plain", "latent")}


def _load_rank(folder: str, rank: int, size: int, expert_parallel: bool = False):
    """Rank `rank` of `size` loaded as its engine process loads it (lazy safetensors slices), in this process."""
    from ferrox.distributed.parallel_state import TPGroup, use_tp_group
    from ferrox.loader.model_loader import load_model, load_model_spec
    from ferrox.loader.source import resolve_model

    source = resolve_model(folder)
    with use_tp_group(TPGroup(rank=rank, size=size, expert_parallel=expert_parallel)):
        return load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu")


def test_a_rank_holds_its_share_of_each_layer(tiny):
    """Rank 1 of 2 through Nemotron-H's load path (the releases' `backbone.*` names): Mamba2 heads 2-3 with their
    group (in_proj's rows of z, x, B, C and dt, A_log, D, dt_bias, the gated norm's channels 32-63, out_proj's
    columns); the MLP's up rows 48-95 and
    down columns; each expert's intermediate rows 16-31 (or, expert parallel, experts 4-7 whole); the shared expert's
    rows 24-47; the router, its correction bias and the latent projections whole on both ranks."""
    folder = tiny["latent"]
    whole, part, ep = _load_rank(folder, 0, 1), _load_rank(folder, 1, 2), _load_rank(folder, 1, 2, True)
    a, b = whole.model.layers[0].mixer, part.model.layers[0].mixer
    # in_proj rows: z [0, 64) | x [64, 128) | B [128, 160) | C [160, 192) | dt [192, 196): rank 1's of each
    rows = [*range(32, 64), *range(96, 128), *range(144, 160), *range(176, 192), 194, 195]
    torch.testing.assert_close(b.in_proj.weight, a.in_proj.weight[rows], rtol=0, atol=0)
    torch.testing.assert_close(b.in_proj.bias, a.in_proj.bias[rows], rtol=0, atol=0)
    for param in ("A_log", "dt_bias", "D"):
        torch.testing.assert_close(getattr(b, param), getattr(a, param)[2:], rtol=0, atol=0)
    torch.testing.assert_close(b.norm.weight, a.norm.weight[32:], rtol=0, atol=0)
    assert not b.norm.spans_ranks  # (2 groups over 2 ranks: each norms its own)
    torch.testing.assert_close(b.out_proj.weight, a.out_proj.weight[:, 32:], rtol=0, atol=0)
    mlp_a, mlp_b = (m.model.layers[NEMOTRON_MOE_PATTERN.index("-")].mixer for m in (whole, part))
    torch.testing.assert_close(mlp_b.gate_up_proj.weight, mlp_a.gate_up_proj.weight[48:], rtol=0, atol=0)
    torch.testing.assert_close(mlp_b.down_proj.weight, mlp_a.down_proj.weight[:, 48:], rtol=0, atol=0)
    moe_a, moe_b, moe_ep = (m.model.layers[MOE_LAYER].mixer for m in (whole, part, ep))
    torch.testing.assert_close(moe_b.experts.w13, moe_a.experts.w13[:, 16:], rtol=0, atol=0)
    torch.testing.assert_close(moe_b.experts.w2, moe_a.experts.w2[:, :, 16:], rtol=0, atol=0)
    torch.testing.assert_close(moe_ep.experts.w13, moe_a.experts.w13[EXPERTS // 2:], rtol=0, atol=0)
    torch.testing.assert_close(moe_ep.experts.w2, moe_a.experts.w2[EXPERTS // 2:], rtol=0, atol=0)
    for moe in (moe_b, moe_ep):
        torch.testing.assert_close(moe.shared_experts.gate_up_proj.weight,
                                   moe_a.shared_experts.gate_up_proj.weight[24:], rtol=0, atol=0)
        torch.testing.assert_close(moe.shared_experts.gate_up_proj.bias, moe_a.shared_experts.gate_up_proj.bias[24:],
                                   rtol=0, atol=0)
        for name in ("gate.weight", "gate.e_score_correction_bias", "fc1_latent_proj.weight", "fc1_latent_proj.bias",
                     "fc2_latent_proj.weight", "fc2_latent_proj.bias"):
            torch.testing.assert_close(moe.get_parameter(name), moe_a.get_parameter(name), rtol=0, atol=0)


def _answers(folder: str, tp: int, device: str = "cpu", **kw) -> list[tuple[list[int], list[float]]]:
    """(greedy tokens, their logprobs) of each of PROMPTS, chunked under a 16-token budget."""
    outs = chunked_engine_outputs(folder, PROMPTS, tensor_parallel_size=tp, device=device, **kw)
    return [(list(s.token_ids), [lp[t].logprob for lp, t in zip(s.logprobs, s.token_ids, strict=True)])
            for o in outs for s in [o.outputs[0]]]


def _assert_same(reference, sharded, atol: float) -> None:
    for (tokens, logprobs), (tp_tokens, tp_logprobs) in zip(reference, sharded, strict=True):
        assert tp_tokens == tokens
        torch.testing.assert_close(torch.tensor(tp_logprobs), torch.tensor(logprobs), atol=atol, rtol=0)


@pytest.fixture(scope="module")
def one_rank(tiny):
    """name -> the one-rank engine's answers (computed once per model)."""
    cache: dict[str, list[tuple[list[int], list[float]]]] = {}

    def answers(name: str) -> list[tuple[list[int], list[float]]]:
        if name not in cache:
            cache[name] = _answers(tiny[name], 1)
        return cache[name]

    return answers


@pytest.mark.parametrize(("name", "expert_parallel"), [("plain", False), ("latent", False), ("latent", True)])
def test_tp2_matches_one_rank(tiny, one_rank, name, expert_parallel):
    """Two ranks (gloo) against one, float32: the same greedy tokens, logprobs within 1e-4. The latent model's
    fc2_latent_proj bias would show if every rank added it to its partial sum."""
    sharded = _answers(tiny[name], 2, enable_expert_parallel=expert_parallel)
    _assert_same(one_rank(name), sharded, 1e-4)


@pytest.mark.parametrize(("override", "size", "expert_parallel", "match"), [
    ({"moe_shared_expert_intermediate_size": 45}, 2, False, r"moe_shared_expert_intermediate_size \(45\)"),
    ({"moe_intermediate_size": 33}, 2, False, r"moe_intermediate_size \(33\)"),
    ({"n_routed_experts": 6}, 4, True, r"n_routed_experts \(6\)"),
])
def test_counts_that_do_not_split_are_refused_by_name(tiny, override, size, expert_parallel, match):
    """Checked before any rank starts (executor/launch.py), the E layers' config field named."""
    with pytest.raises(UnsupportedModelError, match=match + r" is not divisible by tensor_parallel_size"):
        LLM(model=tiny["plain"], dtype="float32", tensor_parallel_size=size, enable_expert_parallel=expert_parallel,
            hf_overrides=override, kv_cache_memory=1 << 20)


# ---- GPU ------------------------------------------------------------------------------------------
GPU_CASES = [("plain", False), ("latent", False), ("latent", True)]


def cuda_answers(folder: str, tp: int, expert_parallel: bool) -> list[tuple[list[int], list[float]]]:
    return _answers(folder, tp, "cuda", enable_expert_parallel=expert_parallel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize(("name", "expert_parallel"), GPU_CASES)
def test_cuda_tp2_matches_one_gpu(tiny, name, expert_parallel):
    """Two GPUs over NCCL (the fused non-gated expert kernels on each rank's rows or experts, the Mamba2 kernels on
    its heads, decode CUDA graphs with the all-reduces inside them) against one, float32: the same tokens, logprobs
    within 1e-3. The sharded engine runs in a child process (its NCCL group lives until the process exits)."""
    folder = tiny[name]
    code = ("import json; from tests.models.test_nemotron_h_tp import cuda_answers; "
            f"print('RESULT', json.dumps(cuda_answers({folder!r}, 2, {expert_parallel!r})))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    sharded = [(tokens, logprobs) for tokens, logprobs in json.loads(lines[-1].removeprefix("RESULT "))]
    _assert_same(cuda_answers(folder, 1, False), sharded, 1e-3)
