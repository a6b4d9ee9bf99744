"""Nemotron-H's non-gated ReLU^2 experts in the fused MoE kernels (kernels/fused_moe.py, activation RELU2: w13 holds
the up rows alone, GATED off) against a float64 per-expert formula and the torch loop (layers/fused_moe.experts_torch
with Relu2): the grouped path and the small-batch path, top-k 1, 2 and 6 over uneven expert loads with an expert
left empty, the one-token step (with a residual, and with the RMSNorm prologue), bf16, and the FusedMoE layer on the
Triton set against the torch set, routed as Nemotron-H routes (sigmoid, correction bias, grouped top-k), and a tiny
Nemotron 3 model on the Triton set against transformers. On CPU in the Triton interpreter child (conftest.py), at
tiny shapes; at Nemotron 3 Nano's real shapes on the GPU (`gpu`)."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.fused_moe import Activation, fused_moe
from ferrox.layers.fused_moe import FusedMoE, Relu2, experts_torch
from ferrox.layers.grouped_topk import grouped_topk
from ferrox.layers.ops import for_device

from tests.kernels.kernel_refs import relative_error
from tests.kernels.test_fused_moe_gelu import SMALL_GEMM, SMALL_GEMV, skewed_routing

RELU2 = Activation.RELU2
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def ref64(x, w1, w2, weights, ids, *, square: bool = True) -> torch.Tensor:
    """Expert by expert in float64: each expert's tokens gathered, relu(x up^T)^2 (relu alone without `square`)
    down^T, weighted, added back."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=x.device)
    for e in range(w1.shape[0]):
        tokens, slots = torch.nonzero(ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        h = torch.relu(x[tokens].double() @ w1[e].double().t())
        h = h * h if square else h
        out.index_add_(0, tokens, (h @ w2[e].double().t()) * weights[tokens, slots, None].double())
    return out


def experts_case(device, dtype, *, tokens, experts, top_k, hidden, inter):
    """x, w1 [E, I, H] (up rows only), w2 [E, H, I], weights, ids; expert experts - 2 gets no token."""
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w1 = torch.randn(experts, inter, hidden, device=device) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, device=device) / inter ** 0.5
    weights, ids = skewed_routing(tokens, experts, top_k, empty=experts - 2, device=device)
    return x, w1.to(dtype), w2.to(dtype), weights, ids


def check(out, x, w1, w2, weights, ids, *, residual=None) -> None:
    """out against the float64 formula and the torch loop, and away from plain ReLU's answer (a kernel that
    skipped the square fails)."""
    dtype = x.dtype
    extra = residual.double() if residual is not None else 0.0
    want = ref64(x, w1, w2, weights, ids) + extra
    assert out.shape == x.shape and out.dtype == dtype and not out.isnan().any()
    assert relative_error(out, want) < TOLERANCE[dtype]
    loop = experts_torch(x, w1, w2, weights, ids, activation=Relu2())
    assert relative_error(loop.double() + extra, want) < TOLERANCE[dtype]
    assert relative_error(out.double() - extra, ref64(x, w1, w2, weights, ids, square=False)) > 0.1


@pytest.mark.parametrize("small_batch", [False, True], ids=["grouped", "small-batch"])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(21, 5, 1), (13, 6, 2), (5, 10, 6)])
def test_relu2_experts_match_the_reference(kernel_device, seed, small_batch, tokens, experts, top_k):
    # hidden 40 / inter 24: neither a multiple of the 16-wide tiles, so every mask is exercised.
    x, w1, w2, weights, ids = experts_case(kernel_device, torch.float32, tokens=tokens, experts=experts,
                                           top_k=top_k, hidden=40, inter=24)
    assert not (ids == experts - 2).any()  # an expert with no tokens
    out = fused_moe(x, w1, w2, weights, ids, small_batch=small_batch, config=SMALL_GEMM, gemv_config=SMALL_GEMV,
                    activation=RELU2)
    check(out, x, w1, w2, weights, ids)


@pytest.mark.parametrize("top_k", [1, 6])
def test_relu2_one_token_step(kernel_device, seed, top_k):
    """A batch-1 decode step's experts (the path chosen for it by default: matrix-vector products per pair), with
    the decoder's residual added as an unfused add would."""
    x, w1, w2, weights, ids = experts_case(kernel_device, torch.float32, tokens=1, experts=10, top_k=top_k,
                                           hidden=40, inter=24)
    res = torch.randn_like(x)
    out = fused_moe(x, w1, w2, weights, ids, gemv_config=SMALL_GEMV, residual=res, activation=RELU2)
    check(out, x, w1, w2, weights, ids, residual=res)


def test_relu2_one_token_step_with_the_norm_prologue(kernel_device, seed):
    """norm_weight: the up rows read rms_norm(x) * weight, normed in the kernel's prologue."""
    h, w1, w2, weights, ids = experts_case(kernel_device, torch.float32, tokens=2, experts=6, top_k=2, hidden=40,
                                           inter=24)
    norm = torch.rand(40, device=kernel_device) + 0.5
    out = fused_moe(h, w1, w2, weights, ids, small_batch=True, gemv_config=SMALL_GEMV, norm_weight=norm, eps=1e-6,
                    activation=RELU2)
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
    assert relative_error(out, ref64(x, w1, w2, weights, ids)) < 1e-5


@pytest.mark.parametrize("small_batch", [False, True], ids=["grouped", "small-batch"])
def test_relu2_experts_bf16(kernel_device, seed, small_batch):
    x, w1, w2, weights, ids = experts_case(kernel_device, torch.bfloat16, tokens=6 if small_batch else 17,
                                           experts=6, top_k=2, hidden=48, inter=32)
    out = fused_moe(x, w1, w2, weights, ids, small_batch=small_batch, config=SMALL_GEMM, gemv_config=SMALL_GEMV,
                    activation=RELU2)
    check(out, x, w1, w2, weights, ids)


def relu2_layers(device, experts: int, hidden: int, inter: int) -> tuple[dict[str, FusedMoE], torch.Tensor,
                                                                          torch.Tensor]:
    """The FusedMoE layer as models/nemotron_h_moe.py builds it on the Triton and torch sets, every expert loaded
    from its own up_proj / down_proj tensors (the releases' names); and the stacked weights."""
    layers = {kind: FusedMoE(experts, hidden, inter, dtype=torch.float32, device=device,
                             ops=for_device(device, kind), activation=Relu2()) for kind in ("triton", "torch")}
    assert layers["triton"].triton and not layers["torch"].triton
    w1 = torch.randn(experts, inter, hidden, device=device) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, device=device) / inter ** 0.5
    for layer in layers.values():
        assert layer.expected_weights() == {(e, s, "weight") for e in range(experts) for s in ("up", "down")}
        for e in range(experts):
            layer.load_expert_weight("weight", e, "up", w1[e])
            layer.load_expert_weight("weight", e, "down", w2[e])
    return layers, w1, w2


@pytest.mark.parametrize("tokens", [3, 20])
def test_fused_moe_layer_relu2_triton_matches_torch(kernel_device, seed, tokens):
    """Routed as Nemotron-H routes (sigmoid scores, a correction bias, 8 experts in 4 groups of which 2 are kept,
    top 3, scaled by 2.5), the Triton set's layer against the torch set's: 3 tokens take the small-batch path, 20
    the grouped GEMMs."""
    experts, hidden, inter = 8, 40, 24
    layers, w1, w2 = relu2_layers(kernel_device, experts, hidden, inter)
    x = torch.randn(tokens, hidden, device=kernel_device)
    logits = torch.randn(tokens, experts, device=kernel_device) * 2
    weights, ids = grouped_topk(logits, 3, scoring_func="sigmoid", renormalize=True, num_expert_group=4,
                                topk_group=2, e_score_correction_bias=torch.randn(experts, device=kernel_device) * 0.2,
                                routed_scaling_factor=2.5, group_top2=True)
    out = {kind: layer(x, weights, ids) for kind, layer in layers.items()}
    assert relative_error(out["triton"], out["torch"]) < 1e-5
    check(out["triton"], x, w1, w2, weights, ids)


def test_nemotron_3_model_on_the_triton_kernel_set(kernel_device, tmp_path):
    """A tiny Nemotron 3 with the latent projection (tests/helpers/tiny_nemotron_h_moe.py) on the GPU's op set
    (kernels="triton": the prompt's experts through the grouped GEMMs, the decode steps' through the matrix-vector
    path, the Mamba2 and norm kernels beside them) in the interpreter: last-prompt logits and greedy tokens as
    transformers'. (On a GPU the engine test runs these kernels: tests/models/test_nemotron_h_moe.py.)"""
    if kernel_device.type == "cuda":
        pytest.skip("the CUDA engine test covers this on a GPU")
    transformers = pytest.importorskip("transformers")
    from tests.helpers.tiny_nemotron_h_moe import make_tiny_nemotron_h_moe
    from tests.models.conftest import assert_triton_kernel_set_matches

    folder = make_tiny_nemotron_h_moe(tmp_path / "nemotron3", latent=True, seed=1)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert_triton_kernel_set_matches(folder, ref, [(7 * i) % 300 + 3 for i in range(20)])


def test_relu2_arguments_are_checked():
    """(Refused before any launch: runs natively.)"""
    x, w1, w2, weights, ids = experts_case("cpu", torch.float32, tokens=2, experts=4, top_k=2, hidden=16, inter=16)
    gated_w13 = torch.cat([w1, w1], dim=1)
    with pytest.raises(ValueError, match="do not describe non-gated experts"):
        fused_moe(x, gated_w13, w2, weights, ids, activation=RELU2)
    with pytest.raises(ValueError, match="RELU2 .non-gated. experts are taken float or FP8, without biases"):
        fused_moe(x, w1, w2, weights, ids, activation=RELU2, w13_bias=torch.zeros(4, 16), w2_bias=torch.zeros(4, 16))
    ops = for_device("cpu", "torch")
    with pytest.raises(ValueError, match="Relu2 experts are supported unquantized, not MXFP4"):
        FusedMoE(4, 64, 64, dtype=torch.float32, device="cpu", ops=ops, activation=Relu2(), mxfp4=True)
    with pytest.raises(ValueError, match="take no biases"):
        FusedMoE(4, 16, 16, dtype=torch.float32, device="cpu", ops=ops, activation=Relu2(), bias=True)
    layer = FusedMoE(4, 16, 16, dtype=torch.float32, device="cpu", ops=ops, activation=Relu2())
    assert layer.w13.shape == (4, 16, 16) and not layer.gated
    with pytest.raises(ValueError, match="not gated"):
        layer.load_expert_weight("weight", 0, "gate", w1[0])
    with pytest.raises(ValueError, match=r"checkpoint shape \(4, 32, 16\), model expects \(4, 16, 16\)"):
        layer.load_stacked("w13", gated_w13)
    layer.load_stacked("w13", w1)
    assert torch.equal(layer.w13, w1)


# ---- GPU: one E layer of NVIDIA-Nemotron-3-Nano-30B-A3B (128 experts, num_experts_per_tok 6, hidden_size 2688,
# moe_intermediate_size 1856) in bf16.
NANO = dict(experts=128, top_k=6, hidden=2688, inter=1856)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 64, 700])
def test_relu2_experts_real_shapes(cuda_device, seed, tokens):
    """The default path for each size (matrix-vector up to 10 tokens, the grouped GEMMs past that), and at decode
    sizes the grouped path too."""
    cfg = NANO
    x, w1, w2, weights, ids = experts_case(cuda_device, torch.bfloat16, tokens=tokens, experts=cfg["experts"],
                                           top_k=cfg["top_k"], hidden=cfg["hidden"], inter=cfg["inter"])
    for small_batch in (None, False) if tokens <= 3 else (None,):
        out = fused_moe(x, w1, w2, weights, ids, small_batch=small_batch, activation=RELU2)
        assert relative_error(out, ref64(x, w1, w2, weights, ids)) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 48])
def test_relu2_experts_replay_in_a_cuda_graph(cuda_device, seed, tokens):
    """Captured once at Nano's shapes, replayed with new inputs and routing: nothing read on the host."""
    cfg = NANO
    x, w1, w2, weights, ids = experts_case(cuda_device, torch.bfloat16, tokens=tokens, experts=cfg["experts"],
                                           top_k=cfg["top_k"], hidden=cfg["hidden"], inter=cfg["inter"])
    fused_moe(x, w1, w2, weights, ids, activation=RELU2)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w1, w2, weights, ids, activation=RELU2)
    for empty in (3, 5):
        x.copy_(torch.randn_like(x))
        new_weights, new_ids = skewed_routing(tokens, cfg["experts"], cfg["top_k"], empty=empty, device=cuda_device)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        assert relative_error(out, ref64(x, w1, w2, weights, ids)) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 200])
def test_nano_layer_triton_matches_torch(cuda_device, seed, tokens):
    """A whole Nano E layer's routed experts (the FusedMoE layer, loaded per expert) on the Triton set against the
    torch loop, in float32 on the GPU, routed by grouped_topk as the model routes (n_group 1)."""
    cfg = NANO
    layers, w1, w2 = relu2_layers(cuda_device, cfg["experts"], cfg["hidden"], cfg["inter"])
    x = torch.randn(tokens, cfg["hidden"], device=cuda_device)
    logits = torch.randn(tokens, cfg["experts"], device=cuda_device) * 2
    weights, ids = grouped_topk(logits, cfg["top_k"], scoring_func="sigmoid", renormalize=True,
                                e_score_correction_bias=torch.randn(cfg["experts"], device=cuda_device) * 0.2,
                                routed_scaling_factor=2.5, group_top2=True)
    out = {kind: layer(x, weights, ids) for kind, layer in layers.items()}
    assert relative_error(out["triton"], out["torch"]) < 1e-5
