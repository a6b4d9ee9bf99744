"""FP8 experts in the fused MoE kernels (kernels/fused_moe.py, `fused_moe(..., w13_scale, w2_scale,
block)`) against the torch reference `experts_fp8_torch` (layers/quant/fp8_moe_ref.py): per-row and
block scales, the grouped and the small-batch path, top-k 1, 2 and 8, uneven loads with an expert
left empty, bf16 and fp32 activations, the residual; and the argument checks. On CPU these run in
the Triton interpreter child (conftest.py); on a GPU natively.

Weights: random float experts whose experts, rows and columns differ in magnitude (by factors up to
16), so a scale read for the wrong expert, row or block shows, quantized per row
(`quantize_per_row`) or per block (`quantize_fp8_blocks`) expert by expert."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.fused_moe import GemmConfig, GemvConfig, fused_moe
from ferrox.layers.quant.fp8_block import quantize_fp8_blocks
from ferrox.layers.quant.fp8_linear import quantize_per_row
from ferrox.layers.quant.fp8_moe_ref import experts_fp8_torch

# Interpreter-sized tiles. The grouped GEMM's K tile is 32 per row (an FP8 MMA's least) and the
# weight block's BK with blocks; 32-wide n-blocks split H = 64 and I = 64 in two.
SMALL_GEMM = GemmConfig(16, 32, 32, 4, 1)
# Gate/up K tiles of 64 span two 32-wide groups (one group of a 64-wide BK); down K tiles of 64 are
# cut to BK = 32 with blocks. Few, wide programs keep the interpreter quick.
SMALL_GEMV = GemvConfig(gate_up_rows=32, gate_up_block_k=64, down_rows=32, down_block_k=64, num_warps=4)


def token_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Each token's largest |out - ref|, as a fraction of max |ref|."""
    return (out.float() - ref.float()).abs().amax(dim=1) / ref.float().abs().max()


def assert_close(out: torch.Tensor, ref: torch.Tensor, device: torch.device) -> None:
    """out against the reference, within what its roundings allow.

    A code of the intermediate's E4M3 can differ: the kernels and the reference take the same
    products in another order, so the intermediate differs in its last bits, and a value that lands
    a hair from a rounding tie of its code (about one in 10^6 in fp32) rounds the other way. That
    moves one term of the pair's down product by an E4M3 step (up to an eighth of it): up to a few
    1e-3 of max |ref| on that token.

    bf16: the kernels and the reference round gate, up, the intermediate and each slot's output to
    bf16 after sums taken in another order (and the grouped path weights a slot before rounding it,
    the reference after), so values differ by a bf16 ulp (2^-8) here and there, and an ulp of the
    intermediate moves its E4M3 code one time in sixteen. A few bf16 ulps of the output scale: 2e-2
    on every token (the largest seen over 60 seeds: 0.8e-2).
    fp32 in the interpreter: every product is the reference's to fp32 rounding (the quantizers
    round alike, conftest.py), ~1e-6 of max |ref|: 1e-4 on every token but one (a moved code, in
    about one case in 300), 2e-2 on that one (1.09e-2 seen: FERROX_TEST_SEED=3865934331, per-row
    grouped, where a 1e-2 bound failed CI).
    fp32 on a GPU: the FP8 MMAs sum in an accumulator of ~14 bits (fp8_block_gemm.py's docstring),
    which moves the intermediate by ~1e-4 and so about one code in a hundred: 1e-2 on every token."""
    errors = token_errors(out, ref)
    loose = 2e-2  # (a moved code's token, in every dtype; misplaced scales are off by > 0.2: run_case)
    assert float(errors.max()) < loose, f"worst token off by {float(errors.max()):.2e} of max |ref|"
    if out.dtype == torch.float32 and device.type == "cpu":
        assert int((errors > 1e-4).sum()) <= 1, f"tokens off by over 1e-4 of max |ref|: {errors.tolist()}"


def fp8_experts(num_experts: int, hidden: int, inter: int, block: tuple[int, int] | None, device):
    """(w13, w13_scale, w2, w2_scale): float experts with rows and columns of magnitudes 2^-2..2^2
    and experts of magnitudes 1/2, 1, 2 in turn (times 1/sqrt(K)), quantized per row or per block."""
    magnitude = 2.0 ** (torch.arange(num_experts, device=device) % 3 - 1.0)[:, None, None]

    def quantized(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randn(num_experts, n, k, device=device) * magnitude / k ** 0.5
        w = w * 2.0 ** torch.randint(-2, 3, (num_experts, n, 1), device=device)
        w = w * 2.0 ** torch.randint(-2, 3, (num_experts, 1, k), device=device)
        parts = [quantize_per_row(m) if block is None else quantize_fp8_blocks(m, block) for m in w]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])

    w13, w13_scale = quantized(2 * inter, hidden)
    w2, w2_scale = quantized(hidden, inter)
    return w13, w13_scale, w2, w2_scale


def routing(num_tokens: int, num_experts: int, top_k: int, device, empty: int | None = None):
    """k distinct experts per token, drawn with weights 1/(e+1) (expert 0 busiest), never `empty`;
    weights positive, not normalised."""
    prior = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64)
    if empty is not None:
        prior[empty] = 0.0
    ids = torch.multinomial(prior.expand(num_tokens, -1), top_k, replacement=False)
    weights = torch.rand(num_tokens, top_k, dtype=torch.float64) + 0.1
    return weights.to(device=device, dtype=torch.float32), ids.to(device)


def run_case(device, dtype, block, *, small_batch, tokens, experts, top_k, hidden=64, inter=64,
             residual=False) -> None:
    w13, w13_scale, w2, w2_scale = fp8_experts(experts, hidden, inter, block, device)
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    weights, ids = routing(tokens, experts, top_k, device, empty=experts - 2 if top_k < experts - 1 else None)
    res = torch.randn(tokens, hidden, device=device).to(dtype) if residual else None
    out = fused_moe(x, w13, w2, weights, ids, small_batch=small_batch, config=SMALL_GEMM, gemv_config=SMALL_GEMV,
                    residual=res, w13_scale=w13_scale, w2_scale=w2_scale, block=block)
    ref = experts_fp8_torch(x, w13, w13_scale, w2, w2_scale, weights, ids, block)
    assert out.shape == (tokens, hidden) and out.dtype == dtype and not out.isnan().any()
    if res is not None:
        plain = fused_moe(x, w13, w2, weights, ids, small_batch=small_batch, config=SMALL_GEMM,
                          gemv_config=SMALL_GEMV, w13_scale=w13_scale, w2_scale=w2_scale, block=block)
        # The experts' sum rounded to the dtype, then the add rounded once: as an unfused add.
        assert torch.equal(out, plain + res)
        ref = ref + res
    assert_close(out, ref, device)
    # The check can fail: against misplaced scales (each expert's w13 scales given to the next
    # expert, whose weights are twice or half as large) the same output is far off.
    wrong = experts_fp8_torch(x, w13, w13_scale.roll(1, 0), w2, w2_scale, weights, ids, block)
    assert float(token_errors(out, wrong + (res if res is not None else 0)).max()) > 0.2


LAYOUTS = {"per-row": None, "block-32x32": (32, 32), "block-64x32": (64, 32)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("small_batch", [False, True], ids=["grouped", "small-batch"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_experts_match_the_reference(kernel_device, seed, layout, small_batch, dtype):
    """Top-2 of 6 experts with one left empty. Grouped: 20 tokens, uneven loads over 16-row blocks;
    small-batch: 3 tokens. Per row at H = 72 and I = 80 (no tile divides them: every mask); blocks
    at I = 64 (32-row blocks: two a half) and I = 128 (64-row blocks)."""
    block = LAYOUTS[layout]
    hidden, inter = (72, 80) if block is None else (64, 2 * block[0])
    run_case(kernel_device, dtype, block, small_batch=small_batch, tokens=3 if small_batch else 20, experts=6,
             top_k=2, hidden=hidden, inter=inter)


@pytest.mark.parametrize("small_batch", [False, True], ids=["grouped", "small-batch"])
@pytest.mark.parametrize(("layout", "top_k", "experts"), [("per-row", 1, 4), ("block-32x32", 8, 8),
                                                          ("block-64x32", 1, 5)])
def test_fp8_experts_top_k(kernel_device, seed, layout, top_k, experts, small_batch):
    """Top-1 (a grouped block per expert, one slot in the down tile) and top-8 of 8 (every expert
    in every token, the down tile's eight slots)."""
    run_case(kernel_device, torch.float32, LAYOUTS[layout], small_batch=small_batch,
             tokens=2 if small_batch else 13, experts=experts, top_k=top_k)


@pytest.mark.parametrize("small_batch", [False, True], ids=["grouped", "small-batch"])
def test_fp8_experts_with_residual_and_a_partial_group(kernel_device, seed, small_batch):
    """The residual added as an unfused add would; H = 80 with 32-wide groups (a partial last group
    of the input and of the weight blocks), and with one 128-wide group (gate/up K tiles widened to
    BK, two down K tiles in each group of I = 128)."""
    run_case(kernel_device, torch.bfloat16, (32, 32), small_batch=small_batch, tokens=2 if small_batch else 9,
             experts=4, top_k=2, hidden=80, residual=True)
    run_case(kernel_device, torch.float32, (32, 128), small_batch=small_batch, tokens=2 if small_batch else 9,
             experts=4, top_k=2, hidden=80, inter=128, residual=True)


def test_fp8_experts_refusals(kernel_device):
    experts, hidden, inter = 4, 64, 64
    w13, w13_scale, w2, w2_scale = fp8_experts(experts, hidden, inter, None, kernel_device)
    _, b13_scale, _, b2_scale = fp8_experts(experts, hidden, inter, (32, 32), kernel_device)
    x = torch.randn(2, hidden, device=kernel_device)
    weights, ids = routing(2, experts, 2, kernel_device)

    def call(**kw):
        args = dict(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale) | kw
        return fused_moe(x, args.pop("w13"), args.pop("w2"), weights, ids, **args)

    with pytest.raises(ValueError, match="w2_scale"):
        call(w2_scale=None)
    with pytest.raises(ValueError, match="w13_scale"):
        call(w13_scale=None)
    with pytest.raises(ValueError, match="w13_scale"):
        call(w13_scale=w13_scale[:, :-1])
    with pytest.raises(ValueError, match="w2_scale"):
        call(w2_scale=w2_scale.double())
    with pytest.raises(ValueError, match="w13_scale"):  # per-row scales with a block
        call(block=(32, 32))
    with pytest.raises(ValueError, match="w13 must be float8_e4m3fn"):
        call(w13=w13.to(torch.bfloat16))
    with pytest.raises(ValueError, match="w2 must be float8_e4m3fn"):
        call(w2=w2.float())
    with pytest.raises(ValueError, match="need w13_scale and w2_scale"):
        call(w13_scale=None, w2_scale=None)
    with pytest.raises(ValueError, match="norm_weight"):
        call(norm_weight=torch.ones(hidden, device=kernel_device), small_batch=True)
    with pytest.raises(ValueError, match="multiple of BN"):  # I = 64 is not a multiple of 128
        call(w13_scale=b13_scale[:, :1], w2_scale=b2_scale, block=(128, 32))
    with pytest.raises(ValueError, match="BK"):
        call(w13_scale=b13_scale, w2_scale=b2_scale, block=(32, 16))
    with pytest.raises(ValueError, match="powers of two"):
        call(w13_scale=b13_scale, w2_scale=b2_scale, block=(32, 48))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 4, 64, 300])
@pytest.mark.parametrize("layout", ["per-row", "block-128x128"])
def test_fp8_experts_at_qwen3_30b_a3b_shapes_on_the_gpu(seed, layout, tokens):
    """Qwen3-30B-A3B's experts (128 of hidden 2048, intermediate 768, top 8) in bf16 with the
    configs the engine chooses (matrix-vector up to 8 tokens, grouped above), against the reference."""
    device = torch.device("cuda")
    block = None if layout == "per-row" else (128, 128)
    w13, w13_scale, w2, w2_scale = fp8_experts(128, 2048, 768, block, device)
    x = torch.randn(tokens, 2048, device=device).to(torch.bfloat16)
    weights, ids = routing(tokens, 128, 8, device)
    out = fused_moe(x, w13, w2, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale, block=block)
    ref = experts_fp8_torch(x, w13, w13_scale, w2, w2_scale, weights, ids, block)
    assert_close(out, ref, device)


def test_fp8_experts_take_their_own_matrix_vector_configs():
    """One byte a weight: more rows a program (the H200 sweep in choose_gemv_config's docstring);
    float experts keep theirs: Qwen3-MoE's (k = 8) K tiles of 1024, 4 rows for one token and 1 for
    more; Mixtral's (k = 2) 2 x 512."""
    from ferrox.kernels.fused_moe import choose_gemv_config

    plain = choose_gemv_config(2048, 768, 8)
    batch = choose_gemv_config(2048, 768, 8, num_tokens=4)
    mixtral = choose_gemv_config(4096, 14336, 2)
    per_row = choose_gemv_config(2048, 768, 8, fp8=True)
    blocks = choose_gemv_config(2048, 768, 8, fp8=True, block=(128, 128))
    assert (plain.gate_up_rows, plain.gate_up_block_k, plain.down_rows) == (4, 1024, 1)
    assert (batch.gate_up_rows, batch.gate_up_block_k, batch.down_rows) == (1, 1024, 1)
    assert (mixtral.gate_up_rows, mixtral.gate_up_block_k, mixtral.down_rows) == (2, 512, 2)
    assert (per_row.gate_up_rows, per_row.gate_up_block_k, per_row.down_rows) == (4, 512, 1)
    assert (blocks.gate_up_rows, blocks.down_rows) == (2, 2)


@pytest.mark.parametrize("layout", ["per-row", "block-32x32"])
def test_fp8_experts_with_the_default_matrix_vector_configs(kernel_device, seed, layout):
    """The small-batch path with the configs fused_moe chooses for FP8 experts (not SMALL_GEMV)."""
    block = LAYOUTS[layout]
    w13, w13_scale, w2, w2_scale = fp8_experts(8, 64, 64, block, kernel_device)
    x = torch.randn(2, 64, device=kernel_device).to(torch.bfloat16)
    weights, ids = routing(2, 8, 2, kernel_device)
    out = fused_moe(x, w13, w2, weights, ids, small_batch=True, w13_scale=w13_scale, w2_scale=w2_scale, block=block)
    assert_close(out, experts_fp8_torch(x, w13, w13_scale, w2, w2_scale, weights, ids, block), kernel_device)
