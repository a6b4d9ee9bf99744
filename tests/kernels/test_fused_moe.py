"""Fused MoE kernels (kernels/fused_moe.py) against a per-expert torch reference: the grouped path
and the small-batch path, uneven expert loads with an expert left empty, top-k 1, 2 and 8; the
device-side sort; the small-batch path with the RMSNorm and the routing in its gate/up prologue
(`fused_moe_from_logits`) against the unfused sequence, ties included, and the one-token decode
path's `_moe` both ways; and tiny MoE models on the Triton kernel set against the torch set. On
CPU these run in the Triton interpreter child (conftest.py); at real shapes on the GPU."""

from __future__ import annotations

import pytest
import torch
from ferrox.attention.fused_decode import FusedOneTokenDecode
from ferrox.attention.kv_cache import allocate_kv_caches
from ferrox.kernels.fused_moe import (
    GemmConfig,
    GemvConfig,
    align_by_expert,
    fused_moe,
    fused_moe_from_logits,
    route_top_k,
    use_small_batch_path,
)
from ferrox.layers.fused_moe import FusedMoE, experts_torch, select_experts
from ferrox.layers.ops import for_device
from ferrox.loader.model_config import spec_from_hf_config
from ferrox.loader.model_loader import init_dummy_weights
from ferrox.models.registry import get_model_class

from tests.helpers.driver import StepRequest, build_step
from tests.helpers.interpreter import native_only
from tests.kernels.kernel_refs import align_by_expert_ref, relative_error

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
SMALL_GEMM = GemmConfig(16, 16, 16, 4, 1)  # interpreter-sized tiles (tl.dot needs 16)
# Few, wide programs keep the interpreter quick (each gate/up program routes its token again):
# one gate/up n-block of inter 24 (SPLIT_GEMV: three, all routing alike), two masked K steps in
# both kernels at hidden 40.
SMALL_GEMV = GemvConfig(gate_up_rows=32, gate_up_block_k=32, down_rows=64, down_block_k=16, num_warps=4)
SPLIT_GEMV = GemvConfig(gate_up_rows=8, gate_up_block_k=32, down_rows=16, down_block_k=16, num_warps=4)


def moe_ref(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Expert by expert in float64: each expert's tokens gathered, SwiGLU, weighted, added back."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=x.device)
    for e in range(w13.shape[0]):
        tokens, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = x[tokens].double() @ w13[e].double().t()
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tokens, (h @ w2[e].double().t()) * topk_weights[tokens, slots, None].double())
    return out


def skewed_routing(num_tokens: int, num_experts: int, top_k: int, *, empty: int, device):
    """k distinct experts per token, drawn with weights 1/(e+1) (expert 0 busiest), never `empty`;
    weights positive, not normalised."""
    prior = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64)
    prior[empty] = 0.0
    ids = torch.multinomial(prior.expand(num_tokens, -1), top_k, replacement=False)
    weights = torch.rand(num_tokens, top_k, dtype=torch.float64) + 0.1
    return weights.to(device=device, dtype=torch.float32), ids.to(device)


def _case(device, dtype, *, tokens, experts, top_k, hidden, inter, small_batch, config=None):
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device) / inter ** 0.5).to(dtype)
    weights, ids = skewed_routing(tokens, experts, top_k, empty=experts - 2, device=device)
    out = fused_moe(x, w13, w2, weights, ids, small_batch=small_batch, config=config)
    ref = moe_ref(x, w13, w2, weights, ids)
    assert out.shape == (tokens, hidden) and out.dtype == dtype and not out.isnan().any()
    assert relative_error(out, ref) < TOLERANCE[dtype]
    return out, ref


@pytest.mark.parametrize("small_batch", [False, True])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(21, 5, 1), (13, 6, 2), (5, 10, 8)])
def test_fused_moe_matches_per_expert_reference(kernel_device, seed, small_batch, tokens, experts, top_k):
    # hidden 40 / inter 24: neither a multiple of the 16-wide tiles, so every mask is exercised.
    # The small-batch path runs a program per pair and 4 rows: fewer tokens keep the interpreter quick.
    tokens = min(tokens, 3) if small_batch else tokens
    _case(kernel_device, torch.float32, tokens=tokens, experts=experts, top_k=top_k, hidden=40, inter=24,
          small_batch=small_batch, config=SMALL_GEMM)


def test_fused_moe_half_precision_and_one_token(kernel_device, seed):
    _case(kernel_device, torch.float16, tokens=9, experts=4, top_k=2, hidden=32, inter=16, small_batch=False,
          config=SMALL_GEMM)
    # One token, default path choice (the small-batch one) and the torch loop agree.
    out, _ = _case(kernel_device, torch.float32, tokens=1, experts=8, top_k=2, hidden=32, inter=16,
                   small_batch=None)
    assert use_small_batch_path(1, 2, 8)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"), [(19, 7, 3, 4), (350, 128, 8, 16), (1, 5, 1, 16)])
def test_align_by_expert_matches_a_stable_sort(kernel_device, seed, tokens, experts, top_k, block_m):
    """The three-launch sort (moe_align.py) against torch's stable one, bit for bit: 2,800 pairs
    span 11 chunks (an expert's pairs continue across chunk edges), 128 experts fill 256 bins."""
    _, ids = skewed_routing(tokens, experts, top_k, empty=experts - 1, device=kernel_device)
    blocks = align_by_expert(ids, experts, block_m)
    pair_ids, block_expert, num_rows = align_by_expert_ref(ids, experts, block_m)
    assert int(blocks.num_rows) == num_rows and blocks.num_rows.dtype == torch.int64
    assert torch.equal(blocks.pair_ids.cpu(), pair_ids) and blocks.pair_ids.dtype == torch.int32
    assert torch.equal(blocks.block_expert.cpu(), block_expert)


def test_align_by_expert_groups_pairs_in_padded_blocks(kernel_device, seed):
    tokens, experts, top_k, block_m = 19, 7, 3, 4
    _, ids = skewed_routing(tokens, experts, top_k, empty=2, device=kernel_device)
    blocks = align_by_expert(ids, experts, block_m)
    pairs, block_expert = blocks.pair_ids.cpu(), blocks.block_expert.cpu()
    num_rows, num_pairs = int(blocks.num_rows), tokens * top_k
    flat = ids.reshape(-1).cpu()
    counts = torch.bincount(flat, minlength=experts)
    assert num_rows == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted(pairs[pairs < num_pairs].tolist()) == list(range(num_pairs))  # each pair exactly once
    assert (pairs[num_rows:] == num_pairs).all()  # the tail is padding
    assert (block_expert[num_rows // block_m:] == -1).all() and (block_expert[:num_rows // block_m] >= 0).all()
    assert 2 not in block_expert.tolist()  # the empty expert owns no block
    for b in range(num_rows // block_m):
        rows = pairs[b * block_m:(b + 1) * block_m]
        real = rows[rows < num_pairs]
        assert len(real) > 0 and (flat[real] == block_expert[b]).all()
        assert torch.equal(real, real.sort().values)  # token order kept inside an expert


@pytest.mark.parametrize("small_batch", [False, True])
def test_fused_moe_adds_the_residual(kernel_device, seed, small_batch):
    """The one-token decode path's h + moe(x): the sum rounded to the dtype, then the add."""
    x = torch.randn(3, 32, device=kernel_device).to(torch.float16)
    w13 = (torch.randn(4, 32, 32, device=kernel_device) / 32 ** 0.5).to(torch.float16)
    w2 = (torch.randn(4, 32, 16, device=kernel_device) / 16 ** 0.5).to(torch.float16)
    weights, ids = skewed_routing(3, 4, 2, empty=3, device=kernel_device)
    residual = torch.randn(3, 32, device=kernel_device).to(torch.float16)
    config = None if small_batch else SMALL_GEMM
    plain = fused_moe(x, w13, w2, weights, ids, small_batch=small_batch, config=config)
    out = fused_moe(x, w13, w2, weights, ids, small_batch=small_batch, config=config, residual=residual)
    assert torch.equal(out, plain + residual)  # fp16 + fp16 rounds as the kernel's fp32 add then round
    with pytest.raises(ValueError, match="residual"):
        fused_moe(x, w13, w2, weights, ids, residual=residual[:2])


@pytest.mark.parametrize(("experts", "top_k"), [(4, 1), (10, 3), (6, 2), (16, 8), (5, 5)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_top_k_matches_select_experts(kernel_device, seed, experts, top_k, renormalize):
    logits = 3 * torch.randn(7, experts, device=kernel_device)
    weights, ids = route_top_k(logits, top_k, renormalize)
    ref_weights, ref_ids = select_experts(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)  # both in descending probability (no ties among random logits)
    assert relative_error(weights, ref_weights) < 1e-6
    with pytest.raises(ValueError, match="top_k"):
        route_top_k(logits, experts + 1, renormalize)


def rms_norm_ref(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = h.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def _routed_case(device, dtype, *, tokens, experts, top_k, renormalize, norm, hidden=40, inter=24, logits=None,
                 config=SMALL_GEMV):
    """fused_moe_from_logits against route_top_k (the same picks) and the float64 reference of
    rms_norm -> experts -> + residual."""
    h = torch.randn(tokens, hidden, device=device).to(dtype)
    norm_weight = (1 + 0.3 * torch.randn(hidden, device=device)).to(dtype) if norm else None
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device) / inter ** 0.5).to(dtype)
    if logits is None:
        logits = 3 * torch.randn(tokens, experts, device=device)
    residual = torch.randn(tokens, hidden, device=device).to(dtype)
    out, weights, ids = fused_moe_from_logits(h, logits, w13, w2, top_k=top_k, renormalize=renormalize,
                                              norm_weight=norm_weight, eps=1e-5, residual=residual,
                                              gemv_config=config)
    ref_weights, ref_ids = route_top_k(logits, top_k, renormalize)
    assert torch.equal(ids, ref_ids) and ids.dtype == torch.int64
    assert relative_error(weights, ref_weights) < 1e-6
    x = rms_norm_ref(h, norm_weight, 1e-5) if norm_weight is not None else h.double()
    ref = moe_ref(x, w13, w2, ref_weights, ref_ids) + residual.double()
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    assert relative_error(out, ref) < TOLERANCE[dtype]
    return ids


# E not a power of two (6, 10, 12); k 1, 2, 8; two tokens in one launch, split over n-blocks.
@pytest.mark.parametrize(("tokens", "experts", "top_k", "renormalize", "config"),
                         [(1, 6, 1, False, SMALL_GEMV), (2, 10, 2, True, SPLIT_GEMV), (1, 12, 8, False, SMALL_GEMV)])
def test_fused_moe_from_logits_routes_and_norms_in_the_gate_up_prologue(kernel_device, seed, tokens, experts,
                                                                       top_k, renormalize, config):
    _routed_case(kernel_device, torch.float32, tokens=tokens, experts=experts, top_k=top_k,
                 renormalize=renormalize, norm=True, config=config)


def test_fused_moe_from_logits_half_precision_and_no_norm(kernel_device, seed):
    _routed_case(kernel_device, torch.bfloat16, tokens=1, experts=12, top_k=8, renormalize=True, norm=True)
    _routed_case(kernel_device, torch.float32, tokens=1, experts=5, top_k=2, renormalize=False, norm=False)


def test_fused_moe_from_logits_breaks_ties_as_route_top_k(kernel_device, seed):
    """Equal logits: route_top_k takes the lower expert id first, and the experts run are those."""
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, 1.0, 2.0]], device=kernel_device)
    ids = _routed_case(kernel_device, torch.float32, tokens=1, experts=7, top_k=3, renormalize=True, norm=True,
                       logits=logits)
    assert ids.tolist() == [[1, 2, 4]]
    ids = _routed_case(kernel_device, torch.float32, tokens=1, experts=7, top_k=5, renormalize=False, norm=True,
                       logits=torch.zeros(1, 7, device=kernel_device))
    assert ids.tolist() == [[0, 1, 2, 3, 4]]


def test_fused_moe_from_logits_checks_its_inputs(kernel_device):
    h = torch.randn(1, 16, device=kernel_device)
    w13, w2 = torch.randn(4, 8, 16, device=kernel_device), torch.randn(4, 16, 4, device=kernel_device)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe_from_logits(h, torch.randn(1, 4, device=kernel_device), w13, w2, top_k=5, renormalize=True)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe_from_logits(h, torch.randn(1, 5, device=kernel_device), w13, w2, top_k=2, renormalize=True)
    with pytest.raises(ValueError, match="norm weight"):
        fused_moe_from_logits(h, torch.randn(1, 4, device=kernel_device), w13, w2, top_k=2, renormalize=True,
                              norm_weight=torch.ones(8, device=kernel_device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_moe_fused_routing_matches_the_explicit_sequence(kernel_device, seed, dtype):
    """The decode path's _moe on a Qwen3-MoE layer: router GEMV with the norm prologue, then
    route_top_k, gate/up (norm prologue) and down, against rms_norm -> router GEMV -> route_top_k ->
    small-batch experts. (Qwen2-MoE's shared expert keeps the explicit sequence: the model test
    below runs it.)"""
    arch = "Qwen3MoeForCausalLM"
    spec = spec_from_hf_config(_tiny_moe_config(arch), "test config")
    model = get_model_class([arch])(spec, dtype, kernel_device, kernels="triton")
    init_dummy_weights(model, seed=5)
    view = model.model.layers[0].one_token_view()
    assert view.moe is not None
    with torch.no_grad():
        view.moe.block.gate.weight.normal_(0, 0.5)  # routing far from ties
        view.moe.block.experts.w13.normal_(0, 0.2)
        view.moe.block.experts.w2.normal_(0, 0.2)
        view.post_norm.weight.copy_(1 + 0.3 * torch.randn_like(view.post_norm.weight))
    h = torch.randn(1, spec.hidden_size, device=kernel_device).to(dtype)
    with torch.inference_mode():
        fused = FusedOneTokenDecode._moe(view, view.moe, h)
        explicit = FusedOneTokenDecode._moe(view, view.moe, h, fuse_routing=False)
    assert fused.shape == h.shape and fused.dtype == dtype
    assert relative_error(fused, explicit) < TOLERANCE[dtype]


def test_layer_uses_the_kernels_of_its_op_set(kernel_device, seed):
    layer = FusedMoE(6, 32, 16, dtype=torch.float32, device=kernel_device, ops=for_device(kernel_device, "triton"))
    assert layer.triton
    assert not FusedMoE(6, 32, 16, dtype=torch.float32, device="cpu", ops=for_device("cpu", "torch")).triton
    layer.w13.data.normal_(0, 0.2)
    layer.w2.data.normal_(0, 0.2)
    x = torch.randn(11, 32, device=kernel_device)
    weights, ids = skewed_routing(11, 6, 2, empty=0, device=kernel_device)
    ref = moe_ref(x, layer.w13, layer.w2, weights, ids)
    assert relative_error(layer(x, weights, ids), ref) < 1e-5
    assert relative_error(experts_torch(x, layer.w13, layer.w2, weights, ids), ref) < 1e-5


def _tiny_moe_config(arch: str) -> dict:
    config = {
        "architectures": [arch], "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 48, "num_hidden_layers": 2, "vocab_size": 61,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
        "tie_word_embeddings": False, "num_experts_per_tok": 2,
    }
    if arch == "MixtralForCausalLM":
        return {**config, "num_local_experts": 4, "intermediate_size": 16}
    return {**config, "num_experts": 4, "moe_intermediate_size": 16, "norm_topk_prob": arch == "Qwen3MoeForCausalLM",
            "shared_expert_intermediate_size": 24 if arch == "Qwen2MoeForCausalLM" else 0}


# Interpreted, Qwen3-MoE alone: test_fused_decode.py runs Qwen2-MoE and Mixtral of these shapes through the
# same prompt and more decode steps, fused and unfused. (A GPU runs all three here.)
@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM",
                                  *(native_only(arch, reason="test_fused_decode.py runs this MoE model")
                                    for arch in ("Qwen2MoeForCausalLM", "MixtralForCausalLM"))])
def test_moe_model_on_triton_kernels_matches_torch_kernels(kernel_device, arch):
    """A prefill (grouped path: 12 pairs over 4 experts) then decode steps (small-batch path)."""
    spec = spec_from_hf_config(_tiny_moe_config(arch), "test config")
    cls = get_model_class([arch])
    ref = cls(spec, torch.float32, kernel_device, kernels="torch")
    init_dummy_weights(ref, seed=3)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(10.0)  # std 0.2: routing and logits far from ties
    fused = cls(spec, torch.float32, kernel_device, kernels="triton")
    fused.load_state_dict(ref.state_dict())
    logits = []
    for model in (ref, fused):
        model.finalize_weights()
        caches = allocate_kv_caches(spec, 6, 4, torch.float32, kernel_device)
        rows = []
        with torch.inference_mode():
            prompt, blocks = [3, 9, 27, 41, 50, 20], [1, 2, 3]
            ids, pos, meta = build_step([StepRequest(prompt, 0, blocks)], 4, kernel_device)
            rows.append(model.compute_logits(model(ids, pos, caches, meta)[-1:]))
            for i, token in enumerate([11, 42]):
                ids, pos, meta = build_step([StepRequest([token], len(prompt) + i, blocks)], 4, kernel_device)
                rows.append(model.compute_logits(model(ids, pos, caches, meta)))
        logits.append(torch.cat(rows))
    assert relative_error(logits[1], logits[0]) < 1e-4
    assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))


# Real shapes: one layer of Qwen3-30B-A3B (128 experts, 8 active) and of Mixtral-8x7B (8 experts, 2 active).
REAL = {"qwen3-30b-a3b": dict(experts=128, top_k=8, hidden=2048, inter=768),
        "mixtral-8x7b": dict(experts=8, top_k=2, hidden=4096, inter=14336)}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(REAL))
@pytest.mark.parametrize("tokens", [1, 3, 64, 700])
def test_fused_moe_real_shapes(cuda_device, seed, shape, tokens):
    cfg = REAL[shape]
    if shape == "mixtral-8x7b" and tokens == 700:
        tokens = 300  # keeps the float64 reference quick
    _case(cuda_device, torch.bfloat16, tokens=tokens, experts=cfg["experts"], top_k=cfg["top_k"],
          hidden=cfg["hidden"], inter=cfg["inter"], small_batch=None)
    if tokens <= 3:  # both paths at decode sizes
        _case(cuda_device, torch.bfloat16, tokens=tokens, experts=cfg["experts"], top_k=cfg["top_k"],
              hidden=cfg["hidden"], inter=cfg["inter"], small_batch=False)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(REAL))
def test_fused_moe_from_logits_real_shapes(cuda_device, seed, shape):
    """The one-token decode path's routed experts (the norm in the gate/up prologue) at the
    default launch config: the thousands of gate/up programs read route_top_k's k experts."""
    cfg = REAL[shape]
    _routed_case(cuda_device, torch.bfloat16, tokens=1, experts=cfg["experts"], top_k=cfg["top_k"],
                 renormalize=True, norm=True, hidden=cfg["hidden"], inter=cfg["inter"], config=None)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 48])
def test_fused_moe_replays_in_a_cuda_graph(cuda_device, seed, tokens):
    """Both paths read no device data on the host: captured once, replayed with new routing."""
    cfg = REAL["qwen3-30b-a3b"]
    experts, top_k, hidden, inter = cfg["experts"], cfg["top_k"], cfg["hidden"], cfg["inter"]
    w13 = (torch.randn(experts, 2 * inter, hidden, device=cuda_device) / hidden ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, device=cuda_device) / inter ** 0.5).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, device=cuda_device).to(torch.bfloat16)
    weights, ids = skewed_routing(tokens, experts, top_k, empty=3, device=cuda_device)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        new_weights, new_ids = skewed_routing(tokens, experts, top_k, empty=5, device=cuda_device)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        assert relative_error(out, moe_ref(x, w13, w2, weights, ids)) < TOLERANCE[torch.bfloat16]
