"""Gemma 4's GELU-tanh-gated experts in the fused MoE kernels (kernels/fused_moe.py, activation GELU_TANH)
against a float64 per-expert formula and the torch loop (layers/fused_moe.experts_torch with GeluTanh): the
grouped path and the small-batch path, top-k 1, 2 and 8 over uneven expert loads with an expert left empty,
the one-token step (with a residual), bf16, FP8 experts through the same epilogue, the FusedMoE layer on the
Triton set against the torch set with Gemma 4's router, and a tiny Gemma 4 MoE model both ways. On CPU in the
Triton interpreter child (conftest.py), at tiny shapes; at 26B-A4B's real shapes on the GPU (`gpu`)."""

from __future__ import annotations

import math

import pytest
import torch
from ferrox.kernels.fused_moe import Activation, GemmConfig, GemvConfig, fused_moe
from ferrox.layers.expert_loop import per_expert
from ferrox.layers.fused_moe import FusedMoE, GeluTanh, SwigluOai, experts_torch
from ferrox.layers.ops import for_device
from ferrox.layers.quant.fp8_block import quantize_fp8_blocks
from ferrox.layers.quant.fp8_linear import quantize_per_row
from ferrox.layers.quant.fp8_moe_ref import dequantize_expert, fake_quantize

from tests.kernels.kernel_refs import relative_error

GELU = Activation.GELU_TANH
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SMALL_GEMM = GemmConfig(16, 16, 16, 4, 1)  # interpreter-sized tiles (tl.dot needs 16)
# Few, wide programs keep the interpreter quick; two masked K steps in both kernels at hidden 40.
SMALL_GEMV = GemvConfig(gate_up_rows=32, gate_up_block_k=32, down_rows=64, down_block_k=16, num_warps=4)


def gelu_tanh64(g: torch.Tensor) -> torch.Tensor:
    """transformers' gelu_pytorch_tanh written out, in float64 (not torch's F.gelu: an independent formula)."""
    return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))


def ref64(x, w13, w2, weights, ids) -> torch.Tensor:
    """Expert by expert in float64: each expert's tokens gathered, gelu_tanh(gate) * up, weighted, added back."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=x.device)
    for e in range(w13.shape[0]):
        tokens, slots = torch.nonzero(ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = x[tokens].double() @ w13[e].double().t()
        h = gelu_tanh64(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tokens, (h @ w2[e].double().t()) * weights[tokens, slots, None].double())
    return out


def skewed_routing(tokens: int, experts: int, top_k: int, *, empty: int, device):
    """k distinct experts per token drawn with weights 1/(e+1) (expert 0 busiest: uneven loads), never `empty`;
    weights positive, not normalised."""
    prior = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
    prior[empty] = 0.0
    ids = torch.multinomial(prior.expand(tokens, -1), top_k, replacement=False)
    weights = torch.rand(tokens, top_k, dtype=torch.float64) + 0.1
    return weights.to(device=device, dtype=torch.float32), ids.to(device)


def experts_case(device, dtype, *, tokens, experts, top_k, hidden, inter):
    """x, w13, w2, weights, ids: gate pre-activations of about unit size, where GELU-tanh and SiLU part most
    (their products with up differ by ~15%)."""
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w13 = torch.randn(experts, 2 * inter, hidden, device=device) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, device=device) / inter ** 0.5
    weights, ids = skewed_routing(tokens, experts, top_k, empty=experts - 2, device=device)
    return x, w13.to(dtype), w2.to(dtype), weights, ids


def check(out, x, w13, w2, weights, ids, *, residual=None) -> None:
    """out against the float64 formula and the torch loop, and away from SiLU-and-mul's answer (so a kernel
    that ignored the activation fails)."""
    dtype = x.dtype
    extra = residual.double() if residual is not None else 0.0
    want = ref64(x, w13, w2, weights, ids) + extra
    assert out.shape == x.shape and out.dtype == dtype and not out.isnan().any()
    assert relative_error(out, want) < TOLERANCE[dtype]
    loop = experts_torch(x, w13, w2, weights, ids, activation=GeluTanh())
    assert relative_error(loop.double() + extra, want) < TOLERANCE[dtype]
    # (SiLU's answer is 15% off in the median, 4.7% at the least over 2000 seeds of the smallest case here)
    silu = experts_torch(x, w13, w2, weights, ids)
    assert relative_error(silu.double(), want - extra) > 0.03


@pytest.mark.parametrize("small_batch", [False, True], ids=["grouped", "small-batch"])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(21, 5, 1), (13, 6, 2), (5, 10, 8)])
def test_gelu_tanh_experts_match_the_reference(kernel_device, seed, small_batch, tokens, experts, top_k):
    # hidden 40 / inter 24: neither a multiple of the 16-wide tiles, so every mask is exercised.
    x, w13, w2, weights, ids = experts_case(kernel_device, torch.float32, tokens=tokens, experts=experts,
                                            top_k=top_k, hidden=40, inter=24)
    assert not (ids == experts - 2).any()  # an expert with no tokens
    out = fused_moe(x, w13, w2, weights, ids, small_batch=small_batch, config=SMALL_GEMM, gemv_config=SMALL_GEMV,
                    activation=GELU)
    check(out, x, w13, w2, weights, ids)


@pytest.mark.parametrize("top_k", [2, 8])
def test_gelu_tanh_one_token_step(kernel_device, seed, top_k):
    """A batch-1 decode step's experts (the path chosen for it by default: matrix-vector products per pair),
    with the decoder's residual added as an unfused add would."""
    x, w13, w2, weights, ids = experts_case(kernel_device, torch.float32, tokens=1, experts=10, top_k=top_k,
                                            hidden=40, inter=24)
    res = torch.randn_like(x)
    out = fused_moe(x, w13, w2, weights, ids, gemv_config=SMALL_GEMV, residual=res, activation=GELU)
    check(out, x, w13, w2, weights, ids, residual=res)


@pytest.mark.parametrize("small_batch", [False, True], ids=["grouped", "small-batch"])
def test_gelu_tanh_experts_bf16(kernel_device, seed, small_batch):
    x, w13, w2, weights, ids = experts_case(kernel_device, torch.bfloat16, tokens=6 if small_batch else 17,
                                            experts=6, top_k=2, hidden=48, inter=32)
    out = fused_moe(x, w13, w2, weights, ids, small_batch=small_batch, config=SMALL_GEMM, gemv_config=SMALL_GEMV,
                    activation=GELU)
    check(out, x, w13, w2, weights, ids)


def fp8_gelu_ref(x, w13, w13_scale, w2, w2_scale, weights, ids, block, *, silu=False) -> torch.Tensor:
    """layers/quant/fp8_moe_ref.experts_fp8_torch's arithmetic with GELU-tanh (SiLU with `silu`)."""
    xd = fake_quantize(x, block)

    def expert_fn(e: int, tokens: torch.Tensor) -> torch.Tensor:
        gate_up = torch.nn.functional.linear(xd[tokens], dequantize_expert(w13[e], w13_scale[e], block)).to(x.dtype)
        gate, up = gate_up.float().chunk(2, dim=-1)
        act = (torch.nn.functional.silu(gate) if silu else torch.nn.functional.gelu(gate, approximate="tanh")) * up
        w2_e = dequantize_expert(w2[e], w2_scale[e], block)
        return torch.nn.functional.linear(fake_quantize(act.to(x.dtype), block), w2_e).to(x.dtype)

    return per_expert(x, weights, ids, w13.shape[0], expert_fn)


@pytest.mark.parametrize(("small_batch", "block"), [(False, None), (True, (32, 32))],
                         ids=["grouped-per-row", "small-batch-block"])
def test_gelu_tanh_fp8_experts(kernel_device, seed, small_batch, block):
    """FP8 experts share the epilogue: the activation reads the scaled sums."""
    experts, hidden, inter, top_k = 6, 64, 64, 2
    tokens = 3 if small_batch else 20
    w = {}
    for name, (n, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
        dense = torch.randn(experts, n, k, device=kernel_device) / k ** 0.5
        parts = [quantize_per_row(m) if block is None else quantize_fp8_blocks(m, block) for m in dense]
        w[name], w[name + "_scale"] = torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
    x = torch.randn(tokens, hidden, device=kernel_device)
    weights, ids = skewed_routing(tokens, experts, top_k, empty=experts - 2, device=kernel_device)
    out = fused_moe(x, w["w13"], w["w2"], weights, ids, small_batch=small_batch, config=GemmConfig(16, 32, 32, 4, 1),
                    gemv_config=GemvConfig(32, 64, 32, 64, 4), w13_scale=w["w13_scale"], w2_scale=w["w2_scale"],
                    block=block, activation=GELU)
    args = (x, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], weights, ids, block)
    want = fp8_gelu_ref(*args)
    scale = float(want.abs().max())
    # (a code of the intermediate may round the other way: tests/kernels/test_fused_moe_fp8.py assert_close)
    assert float((out - want).abs().max()) / scale < 2e-2
    assert relative_error(out, want) < 5e-3
    assert relative_error(out, fp8_gelu_ref(*args, silu=True)) > 0.03


@pytest.mark.parametrize("tokens", [3, 20])
def test_fused_moe_layer_gelu_tanh_triton_matches_torch(kernel_device, seed, tokens):
    """The FusedMoE layer as models/gemma4.py builds it (activation GeluTanh), routed by Gemma 4's router, on
    the Triton set against the torch set (the CPU path) with the same weights."""
    from ferrox.models.gemma4 import Gemma4Router

    experts, hidden, inter, top_k = 6, 40, 24, 2
    layers = {kind: FusedMoE(experts, hidden, inter, dtype=torch.float32, device=kernel_device,
                             ops=for_device(kernel_device, kind), activation=GeluTanh())
              for kind in ("triton", "torch")}
    assert layers["triton"].triton and not layers["torch"].triton
    w13 = torch.randn(experts, 2 * inter, hidden, device=kernel_device) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, device=kernel_device) / inter ** 0.5
    for layer in layers.values():
        layer.load_stacked("w13", w13)
        layer.load_stacked("w2", w2)
    router = Gemma4Router(hidden, experts, top_k, 1e-6, torch.float32, kernel_device)
    with torch.no_grad():
        router.proj.weight.normal_()
        router.scale.uniform_(0.5, 1.5)
        router.per_expert_scale.uniform_(0.5, 1.5)
    x = torch.randn(tokens, hidden, device=kernel_device)
    routed = {kind: router(x, layer) for kind, layer in layers.items()}
    torch.testing.assert_close(routed["triton"][0], routed["torch"][0], rtol=1e-5, atol=1e-6)
    assert torch.equal(routed["triton"][1], routed["torch"][1])
    weights, ids = routed["torch"]
    out = {kind: layer(x, weights, ids) for kind, layer in layers.items()}
    assert relative_error(out["triton"], out["torch"]) < 1e-5
    check(out["triton"], x, w13, w2, weights, ids)


def test_gemma4_moe_model_on_triton_kernels_matches_torch(kernel_device):
    """A tiny Gemma 4 MoE (tests/kernels/test_gemma4_triton.py's model with the expert block) on the Triton set
    against the same weights on the torch set: the prompt's step through the grouped GEMMs, the decode steps
    through the matrix-vector path, routed by route_top_k."""
    from ferrox.kernels.fused_moe import use_small_batch_path

    from tests.kernels.test_gemma2_triton import _pair, _run
    from tests.kernels.test_gemma4_triton import CONFIG

    config = CONFIG | {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16}
    ref, triton_model = _pair(config, kernel_device, 512)
    layer = triton_model.model.layers[0]
    assert isinstance(layer.experts, FusedMoE) and layer.experts.triton and triton_model.supports_cuda_graphs
    assert isinstance(layer.experts.activation, GeluTanh)
    prompt = [(7 * i + 3) % 61 for i in range(20)]
    assert not use_small_batch_path(len(prompt), 2, 4) and use_small_batch_path(1, 2, 4)
    expected = _run(ref, kernel_device, prompt, [11, 42])
    got = _run(triton_model, kernel_device, prompt, [11, 42])
    assert relative_error(got, expected) < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_activation_arguments_are_checked():
    """(Refused before any launch: runs natively.)"""
    x, w13, w2, weights, ids = experts_case("cpu", torch.float32, tokens=2, experts=4, top_k=2, hidden=16,
                                            inter=16)
    with pytest.raises(ValueError, match="swiglu_oai is gpt-oss's activation"):
        fused_moe(x, w13, w2, weights, ids, swiglu_oai=(1.702, 7.0), activation=GELU)
    with pytest.raises(ValueError, match="needs swiglu_oai"):
        fused_moe(x, w13, w2, weights, ids, activation=Activation.SWIGLU_OAI)
    with pytest.raises(ValueError, match="not MXFP4"):
        FusedMoE(4, 64, 64, dtype=torch.float32, device="cpu", ops=for_device("cpu", "torch"), activation=GeluTanh(),
                 mxfp4=True)
    # (gpt-oss's activation is untouched: still taken by the layer)
    assert FusedMoE(4, 16, 16, dtype=torch.float32, device="cpu", ops=for_device("cpu", "torch"),
                    activation=SwigluOai()).activation == SwigluOai()


# ---- GPU: one layer of google/gemma-4-26B-A4B (text_config: 128 experts, top_k_experts 8, hidden_size 2816,
# moe_intermediate_size 704) in bf16.
GEMMA4_26B = dict(experts=128, top_k=8, hidden=2816, inter=704)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 64, 700])
def test_gelu_tanh_experts_real_shapes(cuda_device, seed, tokens):
    """The default path for each size (matrix-vector up to 8 tokens, the grouped GEMMs past that), and at
    decode sizes the grouped path too."""
    cfg = GEMMA4_26B
    x, w13, w2, weights, ids = experts_case(cuda_device, torch.bfloat16, tokens=tokens, experts=cfg["experts"],
                                            top_k=cfg["top_k"], hidden=cfg["hidden"], inter=cfg["inter"])
    for small_batch in (None, False) if tokens <= 3 else (None,):
        out = fused_moe(x, w13, w2, weights, ids, small_batch=small_batch, activation=GELU)
        assert relative_error(out, ref64(x, w13, w2, weights, ids)) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 48])
def test_gelu_tanh_experts_replay_in_a_cuda_graph(cuda_device, seed, tokens):
    """Captured once at 26B-A4B's shapes, replayed with new inputs and routing: nothing read on the host."""
    cfg = GEMMA4_26B
    x, w13, w2, weights, ids = experts_case(cuda_device, torch.bfloat16, tokens=tokens, experts=cfg["experts"],
                                            top_k=cfg["top_k"], hidden=cfg["hidden"], inter=cfg["inter"])
    fused_moe(x, w13, w2, weights, ids, activation=GELU)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids, activation=GELU)
    for empty in (3, 5):
        x.copy_(torch.randn_like(x))
        new_weights, new_ids = skewed_routing(tokens, cfg["experts"], cfg["top_k"], empty=empty, device=cuda_device)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        assert relative_error(out, ref64(x, w13, w2, weights, ids)) < TOLERANCE[torch.bfloat16]
