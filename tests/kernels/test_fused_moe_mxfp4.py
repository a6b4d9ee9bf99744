"""MXFP4 experts in the fused MoE kernels (kernels/fused_moe.py: packed E2M1 codes and E8M0 scales
dequantized in the K loop) against the torch loop over the dequantized weights (layers/quant/mxfp4.py
dequantize_mxfp4, layers/fused_moe.experts_torch): the grouped GEMM and the one-token / small-batch
gate/up and down kernels, top-k 1, 2 and 4, uneven expert loads with an expert that gets no token,
gpt-oss's biases and clamped SwiGLU and plain SiLU-and-mul. The packed bytes are drawn uniformly, so
every code (negative zero and the subnormal 0.5 included) is in play. On CPU in the Triton
interpreter child (conftest.py); the gpu-marked case runs gpt-oss-20b's shapes on the device."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.fused_moe import GemmConfig, GemvConfig, fused_moe
from ferrox.layers.fused_moe import SwigluOai, experts_torch
from ferrox.layers.quant.mxfp4 import dequantize_mxfp4

from tests.helpers.interpreter import INTERPRETED, wide_row_tiles
from tests.kernels.kernel_refs import relative_error

# K tiles of 64 over hidden 96 (a masked last tile) and intermediate 64; one-token tiles of two groups
# for gate/up and one for down (several K steps each).
SMALL_GEMM = GemmConfig(16, 16, 64, 4, 1)
SMALL_GEMV = GemvConfig(gate_up_rows=16, gate_up_block_k=64, down_rows=16, down_block_k=32, num_warps=4)
ACT = SwigluOai(alpha=1.702, limit=1.5)
EMPTY = 3  # the expert no token is routed to


def _packed(gen: torch.Generator, experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 weights [E, rows, cols]: (blocks [E, rows, cols / 32, 16], scales [E, rows, cols / 32]),
    every byte value equally likely and scales spread over 2**-8 .. 2**-1."""
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(119, 127, (experts, rows, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def _case(device, tokens: int, top_k: int, dtype=torch.float32, experts: int = 6, hidden: int = 96, inter: int = 64):
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    b13, s13 = _packed(gen, experts, 2 * inter, hidden)
    b2, s2 = _packed(gen, experts, hidden, inter)
    bias13 = (torch.randn(experts, 2 * inter, generator=gen) * 0.5).to(dtype)
    bias2 = (torch.randn(experts, hidden, generator=gen) * 0.5).to(dtype)
    # Uneven loads: experts 0 and 1 favoured, EMPTY never chosen.
    logits = torch.randn(tokens, experts, generator=gen) + torch.tensor([2.0, 1.0] + [0.0] * (experts - 2))
    logits[:, EMPTY] = -1e9
    values, ids = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(values, dim=-1)
    packed = dict(w13=b13.flatten(-2), w2=b2.flatten(-2), w13_scale=s13, w2_scale=s2)  # [E, N, K / 2], [E, N, K / 32]
    dense = dict(w13=dequantize_mxfp4(b13, s13, dtype), w2=dequantize_mxfp4(b2, s2, dtype))
    return x.to(device), {k: v.to(device) for k, v in packed.items()}, {k: v.to(device) for k, v in dense.items()}, \
        bias13.to(device), bias2.to(device), weights.to(device), ids.to(device)


@pytest.mark.parametrize(("tokens", "top_k", "small_batch"), [
    (9, 4, False), (6, 2, False), (7, 1, False),  # grouped GEMM
    (1, 4, True), (3, 2, True), (1, 1, True),  # one-token / small-batch kernels
])
def test_mxfp4_experts_match_the_dequantized_torch_loop(kernel_device, tokens, top_k, small_batch):
    x, packed, dense, bias13, bias2, weights, ids = _case(kernel_device, tokens, top_k)
    assert not (ids == EMPTY).any() and (ids.numel() == 1 or len(ids.unique()) > 1)
    got = fused_moe(x, packed["w13"], packed["w2"], weights, ids, w13_scale=packed["w13_scale"],
                    w2_scale=packed["w2_scale"], small_batch=small_batch, config=SMALL_GEMM, gemv_config=SMALL_GEMV,
                    w13_bias=bias13, w2_bias=bias2, swiglu_oai=(ACT.alpha, ACT.limit))
    want = experts_torch(x, dense["w13"], dense["w2"], weights, ids, w13_bias=bias13, w2_bias=bias2, activation=ACT)
    assert relative_error(got, want) < 1e-5
    # Without the gpt-oss options: SiLU-and-mul, no biases (the same kernels, as another family would run them).
    got = fused_moe(x, packed["w13"], packed["w2"], weights, ids, w13_scale=packed["w13_scale"],
                    w2_scale=packed["w2_scale"], small_batch=small_batch, config=SMALL_GEMM, gemv_config=SMALL_GEMV)
    want = experts_torch(x, dense["w13"], dense["w2"], weights, ids)
    assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize(("small_batch", "dtype"), [(False, torch.bfloat16), (True, torch.bfloat16),
                                                   (False, torch.float16)])
def test_mxfp4_experts_in_half_precision_and_default_tiles(kernel_device, small_batch, dtype):
    """bf16 / fp16 activations (the grouped path's tl.dot_scaled upcasts the codes: exact for MXFP4
    values) and the tiles fused_moe picks itself (one-token K tiles wider than the experts: masked)."""
    x, packed, dense, bias13, bias2, weights, ids = _case(kernel_device, 5 if not small_batch else 1, 4,
                                                          dtype=dtype)
    got = fused_moe(x, packed["w13"], packed["w2"], weights, ids, w13_scale=packed["w13_scale"],
                    w2_scale=packed["w2_scale"], small_batch=small_batch, w13_bias=bias13, w2_bias=bias2,
                    swiglu_oai=(ACT.alpha, ACT.limit))
    want = experts_torch(x.float(), dense["w13"].float(), dense["w2"].float(), weights, ids,
                         w13_bias=bias13.float(), w2_bias=bias2.float(), activation=ACT)
    assert got.dtype == dtype
    assert relative_error(got, want) < 2e-2


def test_mxfp4_experts_refuse_mismatched_scales(kernel_device):
    x, packed, dense, bias13, bias2, weights, ids = _case(kernel_device, 2, 2)
    with pytest.raises(ValueError, match="w2_scale"):
        fused_moe(x, packed["w13"], packed["w2"], weights, ids, w13_scale=packed["w13_scale"],
                  w2_scale=packed["w2_scale"][:, :, :1])
    with pytest.raises(ValueError, match="w13_scale"):
        fused_moe(x, packed["w13"], packed["w2"], weights, ids, w13_scale=packed["w13_scale"].float(),
                  w2_scale=packed["w2_scale"])
    with pytest.raises(ValueError, match="norm_weight"):
        fused_moe(x, packed["w13"], packed["w2"], weights, ids, w13_scale=packed["w13_scale"],
                  w2_scale=packed["w2_scale"], small_batch=True, norm_weight=torch.ones_like(x[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 64, 300, 2048])
def test_mxfp4_experts_at_gpt_oss_20b_shapes(cuda_device, tokens):
    """gpt-oss-20b's layer (hidden 2880, experts of 2880, 32 experts, top 4) in bf16 with the tiles
    fused_moe picks (each of the grouped GEMM's MXFP4 load classes), against the dequantized weights
    in the same kernels."""
    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 32, 2880, 2880, 4
    b13, s13 = _packed(gen, experts, 2 * inter, hidden)
    b2, s2 = _packed(gen, experts, hidden, inter)
    x = torch.randn(tokens, hidden, generator=gen).to(cuda_device, torch.bfloat16)
    values, ids = torch.topk(torch.randn(tokens, experts, generator=gen), top_k, dim=-1)
    weights, ids = torch.softmax(values, dim=-1).to(cuda_device), ids.to(cuda_device)
    b13, s13, b2, s2 = (t.to(cuda_device) for t in (b13, s13, b2, s2))
    bias13 = torch.randn(experts, 2 * inter, device=cuda_device, dtype=torch.bfloat16) * 0.1
    bias2 = torch.randn(experts, hidden, device=cuda_device, dtype=torch.bfloat16) * 0.1
    opts = dict(w13_bias=bias13, w2_bias=bias2, swiglu_oai=(1.702, 7.0))
    got = fused_moe(x, b13.flatten(-2), b2.flatten(-2), weights, ids, w13_scale=s13, w2_scale=s2, **opts)
    want = fused_moe(x, dequantize_mxfp4(b13, s13, torch.bfloat16), dequantize_mxfp4(b2, s2, torch.bfloat16),
                     weights, ids, **opts)
    assert relative_error(got, want) < 1e-2


@pytest.fixture(scope="module")
def tiny_gpt_oss_folders(tmp_path_factory):
    """(bf16-layout folder, the same weights in MXFP4): tests/helpers/tiny_gpt_oss.py."""
    pytest.importorskip("transformers")
    from tests.helpers import tiny_gpt_oss

    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    folder = tiny_gpt_oss.make_tiny_gpt_oss(root / "fused", seed=3, hidden_size=64, intermediate_size=64)
    return folder, tiny_gpt_oss.write_mxfp4_copy(folder, str(root / "mxfp4"))


def _gpt_oss(folder: str, kernels: str, device):
    from ferrox.loader.model_loader import load_model_spec
    from ferrox.loader.source import resolve_model
    from ferrox.loader.weights import iter_safetensors
    from ferrox.model_spec import spec_for_context
    from ferrox.models.gpt_oss import GptOssForCausalLM

    spec = spec_for_context(load_model_spec(resolve_model(folder)), 64)
    with torch.no_grad():
        model = GptOssForCausalLM(spec, torch.float32, device, kernels=kernels)
        model.load_weights(iter_safetensors(folder))
    return model


def test_gpt_oss_layer_keeps_mxfp4_experts_on_the_triton_kernels(kernel_device, tiny_gpt_oss_folders, monkeypatch):
    """The model on the Triton kernel set holds the checkpoint's packed experts (gate/up rows
    de-interleaved as whole rows) and its sparse MLPs match the float model's torch loop on the
    same weights (the bf16-layout folder), one token and many; the dummy experts as well. Interpreted,
    the one-token expert kernels take wide row tiles (tests/helpers/interpreter.py; the tiles fused_moe
    picks keep test_mxfp4_experts_in_half_precision_and_default_tiles)."""
    from ferrox.layers.quant.mxfp4_moe import Mxfp4MoeMethod

    if INTERPRETED:
        wide_row_tiles(monkeypatch)

    folder, mxfp4 = tiny_gpt_oss_folders
    packed, dense = _gpt_oss(mxfp4, "triton", kernel_device), _gpt_oss(folder, "torch", kernel_device)
    gen = torch.Generator().manual_seed(1)
    for layer, want_layer in zip(packed.model.layers, dense.model.layers, strict=True):
        experts = layer.mlp.experts
        assert isinstance(experts.weight_method, Mxfp4MoeMethod) and experts.triton
        e, hidden, inter = experts.num_experts, experts.hidden_size, experts.intermediate_size
        assert experts.w13.shape == (e, 2 * inter, hidden // 2) and experts.w13.dtype == torch.uint8
        assert experts.w2_scale is not None and experts.w2_scale.shape == (e, hidden, inter // 32)
        w13, w2 = experts.weight_method.dequantized(experts, torch.float32)
        assert torch.equal(w13, want_layer.mlp.experts.w13) and torch.equal(w2, want_layer.mlp.experts.w2)
        for tokens in (1, 7):
            x = torch.randn(tokens, hidden, generator=gen).to(kernel_device)
            with torch.no_grad():
                assert relative_error(layer.mlp(x), want_layer.mlp(x)) < 1e-5
    experts = packed.model.layers[0].mlp.experts
    experts.weight_method.dummy(experts, seed=0)
    w13, w2 = experts.weight_method.dequantized(experts, torch.float32)
    assert 0.01 < float(w13.std()) < 0.03
    x = torch.randn(4, experts.hidden_size, generator=gen).to(kernel_device)
    weights = torch.softmax(torch.randn(4, 2, generator=gen), -1).to(kernel_device)
    ids = torch.tensor([[0, 1], [2, 0], [5, 6], [1, 7]], device=kernel_device)
    with torch.no_grad():
        want = experts_torch(x, w13, w2, weights, ids, w13_bias=experts.w13_bias, w2_bias=experts.w2_bias,
                             activation=experts.activation)
        assert relative_error(experts.run_experts(x, weights, ids), want) < 1e-5


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_mxfp4_experts_shard_over_two_ranks(kernel_device, expert_parallel):
    """Each of two ranks keeps its share of the stacked checkpoint tensors (intermediate rows of gate/up
    and 32-column groups of down, or whole experts) and the ranks' partial sums add up to the whole layer;
    a share that would cut a 32-column group is dequantized at load instead."""
    from ferrox.distributed.parallel_state import TPGroup, use_tp_group
    from ferrox.layers.fused_moe import FusedMoE
    from ferrox.layers.ops import for_device
    from ferrox.layers.quant.mxfp4_moe import Mxfp4MoeMethod

    experts, hidden, inter, top_k = 6, 64, 64, 2
    gen = torch.Generator().manual_seed(7)
    b13, s13 = _packed(gen, experts, 2 * inter, hidden)
    b2, s2 = _packed(gen, experts, hidden, inter)
    bias13, bias2 = torch.randn(experts, 2 * inter, generator=gen), torch.randn(experts, hidden, generator=gen)
    x = torch.randn(5, hidden, generator=gen)
    values, ids = torch.topk(torch.randn(5, experts, generator=gen), top_k, dim=-1)
    weights = torch.softmax(values, dim=-1)
    b13, s13, b2, s2, bias13, bias2, x, ids, weights = (t.to(kernel_device) for t in (b13, s13, b2, s2, bias13, bias2,
                                                                                      x, ids, weights))
    w13, w2 = dequantize_mxfp4(b13, s13, torch.float32), dequantize_mxfp4(b2, s2, torch.float32)
    want = experts_torch(x, w13, w2, weights, ids, w13_bias=bias13, w2_bias=bias2, activation=ACT)
    ops = for_device(kernel_device, "triton")
    total = torch.zeros_like(want)
    for rank in range(2):
        with use_tp_group(TPGroup(rank=rank, size=2, expert_parallel=expert_parallel)):
            layer = FusedMoE(experts, hidden, inter, dtype=torch.float32, device=kernel_device, ops=ops, bias=True,
                             activation=ACT, mxfp4=True)
        method = layer.weight_method
        assert isinstance(method, Mxfp4MoeMethod)
        method.load_stacked(layer, "w13", b13, s13)
        method.load_stacked(layer, "w2", b2, s2)
        layer.load_stacked("w13_bias", bias13)
        layer.load_stacked("w2_bias", bias2)
        mine_w13, mine_w2 = method.dequantized(layer, torch.float32)
        if expert_parallel:
            local = slice(3 * rank, 3 * rank + 3)
            assert torch.equal(mine_w13, w13[local]) and torch.equal(mine_w2, w2[local])
            mine = (ids >= 3 * rank) & (ids < 3 * rank + 3)
            local_ids = torch.where(mine, ids - 3 * rank, torch.zeros_like(ids))
            total += layer.run_experts(x, torch.where(mine, weights, torch.zeros_like(weights)), local_ids)
        else:
            rows = slice(32 * rank, 32 * rank + 32)
            assert torch.equal(mine_w13, torch.cat([w13[:, rows], w13[:, inter:][:, rows]], dim=1))
            assert torch.equal(mine_w2, w2[:, :, rows])
            total += layer.run_experts(x, weights, ids)
    assert relative_error(total, want) < 1e-5
    with use_tp_group(TPGroup(rank=1, size=2)):  # 48 columns a rank: not whole groups
        layer = FusedMoE(experts, hidden, 96, dtype=torch.float32, device=kernel_device, ops=ops, bias=True,
                         activation=ACT, mxfp4=True)
    assert layer.weight_method is None and layer.w13.dtype == torch.float32
