"""The MLA kernels (kernels/mla_attention.py) against the absorbed latent attention written out in torch,
over paged caches with holes in their block tables: mixed steps (decodes, fresh prompts, chunks over cached
context), split-KV decodes and chunks, CUDA-graph pad rows, an FP8 cache, the latent write (K plane only,
slot -1 skipped); the model-level backend (models/mla_attention.py) against the torch backend over the same
cache, the profiling forward's cacheless path; and a whole tiny DeepSeek-V3 on the Triton kernel set giving
transformers' greedy tokens. On CPU in the interpreter child (conftest.py) at tiny dims (a 32 + 16 latent
row); in the parent, the kernels compiled for sm_90a at DeepSeek's shapes (no GPU needed); the `gpu` tests
at DeepSeek's 512 + 64 with 16 and 128 heads."""

from __future__ import annotations

import os

import pytest
import torch
import triton
from ferrox.attention.metadata import AttentionMetadata
from ferrox.attention.torch_backend import TorchAttentionBackend
from ferrox.kernels.mla_attention import (
    FEW_HEADS_BATCH_CONFIG,
    MANY_HEADS_BATCH_CONFIG,
    PREFILL_CONFIG,
    SMALL_DECODE_CONFIG,
    MlaLaunchConfig,
    mla_attention,
    write_latent,
)
from ferrox.models.mla_attention import MlaShape, MlaTritonBackend

from tests.helpers.driver import StepRequest, build_step
from tests.kernels.kernel_refs import relative_error

SCALE = 0.3


def _step(device, requests: list[tuple[int, int]], block_size: int, *, rank: int, rope: int, heads: int,
          dtype=torch.float32, seed: int = 0):
    """(q, latent rows of the step, cache with random context, meta) for (query_len, context_len) requests.
    Blocks are handed out in a shuffled order with unused ones between (holes), block 0 never used."""
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-(q + c) // block_size) for q, c in requests]
    total = 2 * sum(needs) + 2
    order = (torch.randperm(total - 1, generator=gen) + 1).tolist()
    reqs = []
    for (q_len, context), n in zip(requests, needs, strict=True):
        blocks, order = order[:n], order[n + 1:]  # skip one: a hole
        reqs.append(StepRequest([0] * q_len, context, blocks))
    _, _, meta = build_step(reqs, block_size, device)
    dim = rank + rope
    q = torch.randn(meta.num_actual_tokens, heads, dim, generator=gen).to(device, dtype)
    rows = torch.randn(meta.num_actual_tokens, 1, dim, generator=gen).to(device, dtype)
    cache = torch.randn(2, total, block_size, 1, dim, generator=gen).to(device, dtype)
    return q, rows, cache, meta


def _reference(q: torch.Tensor, cache_k: torch.Tensor, meta: AttentionMetadata, rank: int,
               scale: float = SCALE) -> torch.Tensor:
    """The absorbed attention written out: per request, the latent rows gathered through its block table,
    scores q . row (all D dims), causal softmax in float64, values the rows' first `rank` dims."""
    starts, lens = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()
    block_size = cache_k.shape[1]
    cache = cache_k.cpu().double()
    out = torch.zeros(q.shape[0], q.shape[1], rank, dtype=torch.float64)
    for r, seq_len in enumerate(lens):
        a, b = starts[r], starts[r + 1]
        if b == a:
            continue
        pos = torch.arange(seq_len)
        blocks = meta.block_table[r].cpu().long()[pos // block_size]
        rows = cache[blocks, pos % block_size, 0]  # [L, D]
        scores = torch.einsum("thd,ld->thl", q[a:b].cpu().double(), rows) * scale
        q_pos = seq_len - (b - a) + torch.arange(b - a)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[:, None, None], float("-inf"))
        out[a:b] = scores.softmax(-1) @ rows[:, :rank]
    return out.to(q.device)  # (compared with the kernel's output where it ran: its first GPU run compared across devices)


MIXED = [(1, 9), (1, 40), (7, 0), (12, 5), (1, 0), (3, 70)]


@pytest.mark.parametrize("config", [None, SMALL_DECODE_CONFIG, PREFILL_CONFIG, MlaLaunchConfig(2, 16, 16, 4, 1)],
                         ids=["auto", "decode-tiles", "prefill-tiles", "2-heads"])
@pytest.mark.parametrize("heads", [16, 4])
@pytest.mark.parametrize("requests,block_size", [(MIXED, 8), ([(20, 0), (9, 33)], 16), ([(1, 50)] * 3, 4)],
                         ids=["mixed", "prefill", "decode"])
def test_mixed_steps_match_the_reference(kernel_device, heads, requests, block_size, config):
    """Every tiling on every kind of step: the bf16 engine's decode and prefill tiles (float32 picks its own
    by default), and tiles of fewer heads than the model has (several head tiles a token)."""
    rank, rope = 32, 16
    q, rows, cache, meta = _step(kernel_device, requests, block_size, rank=rank, rope=rope, heads=heads)
    write_latent(rows, cache, meta.slot_mapping)
    got = mla_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, kv_lora_rank=rank,
                        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, scale=SCALE, config=config)
    assert got.shape == (q.shape[0], heads, rank)
    assert relative_error(got, _reference(q, cache[0], meta, rank)) < 1e-5


def test_bfloat16(kernel_device):
    """bf16 q and cache (the engine's dtype; its default tiles), fp32 softmax and accumulation."""
    rank, rope = 32, 16
    q, rows, cache, meta = _step(kernel_device, MIXED, 8, rank=rank, rope=rope, heads=16, dtype=torch.bfloat16)
    write_latent(rows, cache, meta.slot_mapping)
    got = mla_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, kv_lora_rank=rank,
                        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, scale=SCALE)
    assert got.dtype == torch.bfloat16
    assert relative_error(got, _reference(q, cache[0], meta, rank)) < 1e-2


@pytest.mark.parametrize("requests,num_splits", [([(1, 700), (1, 37), (1, 300)], 4), ([(5, 300), (1, 90)], 3),
                                                 ([(1, 1100)], None)], ids=["decode", "chunks", "auto"])
def test_split_kv_matches_the_reference(kernel_device, requests, num_splits):
    """Decode-only splits (each at least min_split_len long: the short context in one live split, written
    without the merge), splits of a mixed step (every split merged, empty ones included), and the count
    the heuristic picks for one long decode (a CPU counts 1 SM: the most splits)."""
    rank, rope, heads = 32, 16, 4
    q, rows, cache, meta = _step(kernel_device, requests, 16, rank=rank, rope=rope, heads=heads, seed=1)
    write_latent(rows, cache, meta.slot_mapping)
    got = mla_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, kv_lora_rank=rank,
                        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, scale=SCALE,
                        num_splits=num_splits)
    assert relative_error(got, _reference(q, cache[0], meta, rank)) < 1e-5


def test_graph_padding_and_out_view(kernel_device):
    """A CUDA graph's decode batch: pad rows with seq_len 0 get zeros, their slot -1 writes nothing; with a
    fixed max_seq_len larger than any context (splits mostly not live). The output goes into the first
    `rank` columns of a q-shaped buffer (the piecewise graphs' one), the rest untouched. Only the K plane
    is written."""
    rank, rope, heads = 32, 16, 16
    q, rows, cache, meta = _step(kernel_device, [(1, 20), (1, 400), (1, 3)], 8, rank=rank, rope=rope, heads=heads,
                                 seed=2)
    v_plane = cache[1].clone()
    pad = 2
    q = torch.cat([q, torch.randn(pad, heads, rank + rope).to(q)])
    rows = torch.cat([rows, torch.randn(pad, 1, rank + rope).to(rows)])
    slots = torch.cat([meta.slot_mapping, torch.full((pad,), -1, dtype=torch.int64, device=kernel_device)])
    seq_lens = torch.cat([meta.seq_lens, torch.zeros(pad, dtype=torch.int32, device=kernel_device)])
    starts = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=kernel_device)
    table = torch.cat([meta.block_table, torch.zeros(pad, meta.block_table.shape[1], dtype=torch.int32,
                                                     device=kernel_device)])
    before = cache[0].clone()
    write_latent(rows, cache, slots)
    written = (before != cache[0]).any(-1).any(-1).nonzero()  # (block, offset) pairs written
    assert written.shape[0] == 3 and torch.equal(cache[1], v_plane)
    out = torch.full((q.shape[0], heads, rank + rope), 7.0, device=kernel_device)
    got = mla_attention(q, cache, starts, seq_lens, table, kv_lora_rank=rank, max_query_len=1, max_seq_len=2048,
                        scale=SCALE, out=out, num_splits=6)
    assert got.data_ptr() == out.data_ptr()
    assert relative_error(out[:3, :, :rank], _reference(q[:3], cache[0], meta, rank)) < 1e-5
    assert torch.equal(out[3:, :, :rank], torch.zeros_like(out[3:, :, :rank]))
    assert torch.equal(out[..., rank:], torch.full_like(out[..., rank:], 7.0))


def test_fp8_cache(kernel_device):
    """An FP8 latent cache: rows stored as row / k_scale; attention equals the reference over the dequantized
    rows (k_scale folded into the scores' scale and the output)."""
    rank, rope, heads = 32, 16, 4
    q, rows, cache, meta = _step(kernel_device, MIXED, 8, rank=rank, rope=rope, heads=heads, seed=3)
    fp8 = (cache / 2).to(torch.float8_e4m3fn)
    scales = torch.tensor([0.5, 3.0], device=kernel_device)
    write_latent(rows, fp8, meta.slot_mapping, scales)
    slots = meta.slot_mapping.cpu()
    stored = fp8[0].flatten(0, 1)[slots.to(kernel_device)].float().cpu()
    torch.testing.assert_close(stored, (rows.cpu() / 0.5).to(torch.float8_e4m3fn).float())
    got = mla_attention(q, fp8, meta.query_start_loc, meta.seq_lens, meta.block_table, kv_lora_rank=rank,
                        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, scale=SCALE, kv_scale=scales)
    want = _reference(q, fp8[0].float() * 0.5, meta, rank)
    assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("requests,cached", [(MIXED, True), ([(1, 30), (1, 9), (130, 5), (4, 3)], True),
                                             ([(7, 0), (12, 0), (1, 0)], False)],
                         ids=["cache", "separate-decodes", "profiling"])
def test_backend_matches_the_torch_backend(kernel_device, requests, cached):
    """MlaTritonBackend.forward (write + attend) against the torch backend over a copy of the same cache: the
    first kv_lora_rank columns agree; with a 130-token chunk the leading decodes take their own launch; without
    a cache (the profiling forward), fresh prompts only."""
    rank, rope, heads = 32, 16, 4
    q, rows, cache, meta = _step(kernel_device, requests, 8, rank=rank, rope=rope, heads=heads, seed=4)
    cache[1].copy_(cache[0])  # (the torch backend's cache: the latent written as K and as V)
    if not cached:
        cache = cache[:, :0]
    ref = TorchAttentionBackend()
    ref.begin_forward(meta)
    want = ref.forward(q, rows, rows, cache.clone(), meta, SCALE)[..., :rank]
    backend = MlaTritonBackend(MlaShape(rank, None, 16, rope, 16, False, SCALE))
    backend.begin_forward(meta)
    assert backend._plan[0] == (2 if meta.max_query_len >= 128 else 0)
    mine = cache.clone()
    got = backend.forward(q, rows, rows, mine, meta, SCALE)
    assert relative_error(got, want) < 1e-5
    if cached:
        slots = meta.slot_mapping
        torch.testing.assert_close(mine[0].flatten(0, 1)[slots], rows)


def test_tiny_deepseek_on_triton_kernels_matches_transformers(kernel_device, tmp_path):
    """A tiny DeepSeek-V3 (latent 32 + 16, 4 heads) built with kernels="triton": the MLA kernels (and the
    Triton norms, rotary and fused MoE) in the path; greedy tokens equal transformers', with a prompt
    prefilled in chunks over its cached context."""
    import transformers
    from ferrox.loader.source import resolve_model
    from ferrox.loader.tokenizer import load_tokenizer
    from ferrox.models.deepseek_v2 import DeepseekV3ForCausalLM

    from tests.helpers.driver import run_greedy
    from tests.helpers.tiny_deepseek import load_on_triton_kernels, make_tiny_deepseek
    from tests.models.conftest import cut_at_eos, hf_greedy

    folder = make_tiny_deepseek(tmp_path / "v3", version=3, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                seed=5, num_layers=2)
    model = load_on_triton_kernels(folder, DeepseekV3ForCausalLM, kernel_device)
    assert isinstance(model.backend, MlaTritonBackend) and model.supports_cuda_graphs
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [[5, 17, 33, 2, 9], list(range(3, 40))]
    got = run_greedy(model, prompts, 5, block_size=8, prefill_chunk=16)
    eos = load_tokenizer(resolve_model(folder)).eos_token_ids
    for ids, tokens in zip(prompts, got, strict=True):
        assert cut_at_eos(tokens, eos) == hf_greedy(ref, ids, 5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles the kernels, which the interpreter runs")
@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
def test_kernels_compile_for_hopper(cache):
    """Without a GPU: the attention kernel at DeepSeek's shapes (the decode split-KV and prefill tiles, 16 and
    128 heads), the merge and the latent write compile for sm_90a, within Hopper's 227 KB of shared memory."""
    from ferrox.kernels import mla_attention as mla
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_(fn, pointers: dict[str, str], constexprs: dict, **options) -> int:
        signature = {}
        for name in fn.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = pointers.get(name, "*fp32")
            else:
                signature[name] = "fp32" if name == "scale_log2" else "i32"
        source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        return int(kernel.metadata.shared)

    ints = {"block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32"}
    for config, decode, heads in [(mla.SMALL_DECODE_CONFIG, True, 16), (mla.SMALL_DECODE_CONFIG, True, 128),
                                  (mla.FEW_HEADS_BATCH_CONFIG, True, 16), (mla.MANY_HEADS_BATCH_CONFIG, True, 128),
                                  (mla.PREFILL_CONFIG, False, 128)]:
        head_tile, block_m, block_q = mla._fit(config, heads, decode)
        shared = compile_(mla._mla_attention_kernel, {"out_ptr": "*bf16", "q_ptr": "*bf16", "cache_ptr": f"*{cache}",
                                                     **ints},
                          dict(DIM_LATENT=512, DIM_ROPE=64, LATENT_PAD=512, ROPE_PAD=64, HEAD_TILE=head_tile,
                               BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=config.tile_n, SPLIT_KV=decode,
                               DECODE_ONLY=decode, MIN_SPLIT=1024, DOT_PRECISION="tf32", USE_PDL=True),
                          num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=True)
        assert shared <= 227 * 1024, (config, heads, shared)
    compile_(mla._mla_merge_kernel, {"out_ptr": "*bf16", **ints},
             dict(DIM_LATENT=512, LATENT_PAD=512, SPLIT_CHUNK=16, DECODE_ONLY=True, TILE_N=32, MIN_SPLIT=1024,
                  USE_PDL=True), num_warps=4, launch_pdl=True)
    compile_(mla._write_latent_kernel, {"rows_ptr": "*bf16", "cache_ptr": f"*{cache}", "slot_mapping_ptr": "*i64"},
             dict(DIM_PAD=1024))


# ---- GPU: DeepSeek's shapes ----------------------------------------------------------------------------
def _gpu_case(device, heads: int, requests: list[tuple[int, int]], dtype=torch.bfloat16, **kwargs):
    rank, rope = 512, 64
    q, rows, cache, meta = _step(device, requests, 64, rank=rank, rope=rope, heads=heads, dtype=dtype)
    write_latent(rows, cache, meta.slot_mapping)
    got = mla_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, kv_lora_rank=rank,
                        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, scale=576 ** -0.5, **kwargs)
    return got, _reference(q, cache[0], meta, rank, 576 ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("requests", [[(1, 1000), (1, 31), (1, 32767)], [(1, 8191)] * 4, [(1, 32767)],
                                      [(1, 3000 + 97 * k) for k in range(32)],
                                      [(1, 17), (1, 4000), (300, 0), (200, 2000)], [(1024, 0)]],
                         ids=["decode", "decode-8k", "decode-32k", "decode-batch-32", "mixed", "prefill"])
def test_gpu_real_shapes(cuda_device, heads, requests):
    got, want = _gpu_case(cuda_device, heads, requests)
    assert relative_error(got, want) < 1e-2  # bf16 inputs, fp32 accumulation


@pytest.mark.gpu
@pytest.mark.parametrize("config", [SMALL_DECODE_CONFIG, MANY_HEADS_BATCH_CONFIG, FEW_HEADS_BATCH_CONFIG,
                                    PREFILL_CONFIG, MlaLaunchConfig(16, 16, 64, 4, 2), MlaLaunchConfig(8, 64, 16, 4, 3)])
def test_gpu_launch_configs(cuda_device, config):
    """The configurations benches/bench_mla.py --sweep tries give the same attention."""
    got, want = _gpu_case(cuda_device, 128, [(1, 5000), (40, 900)], config=config)
    assert relative_error(got, want) < 1e-2


@pytest.mark.gpu
def test_gpu_float32_decode_graph(cuda_device):
    """float32 (IEEE dots) at V3's shape, replayed from a CUDA graph captured with a larger max_seq_len:
    the same result as eager."""
    rank, rope, heads = 512, 64, 128
    q, rows, cache, meta = _step(cuda_device, [(1, 3000), (1, 70)], 64, rank=rank, rope=rope, heads=heads)
    write_latent(rows, cache, meta.slot_mapping)
    out = torch.empty(2, heads, rank, device=cuda_device)

    def run():
        mla_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, kv_lora_rank=rank,
                      max_query_len=1, max_seq_len=32768, scale=0.05, out=out)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, _reference(q, cache[0], meta, rank, 0.05)) < 1e-5


def test_tiny_mistral4_on_triton_kernels_matches_transformers(kernel_device, tmp_path):
    """Llama 4's query scaling on the Triton path (models/mistral4.py): a one-layer dense Mistral 4 whose 20-token
    prompt crosses five multiples of a 4-position original context, built with kernels="triton" (the MLA kernels
    over the scaled queries, Triton rotary in place); greedy tokens equal transformers'."""
    import transformers
    from ferrox.models.mistral4 import Mistral4ForCausalLM

    from tests.helpers.driver import run_greedy
    from tests.helpers.tiny_deepseek import load_on_triton_kernels
    from tests.helpers.tiny_mistral4 import ROPE, make_tiny_mistral4
    from tests.models.conftest import hf_greedy

    folder = make_tiny_mistral4(tmp_path / "m4", num_hidden_layers=1, max_position_embeddings=32,
                                rope_parameters={**ROPE, "original_max_position_embeddings": 4})
    model = load_on_triton_kernels(folder, Mistral4ForCausalLM, kernel_device)
    assert isinstance(model.backend, MlaTritonBackend) and model.model.query_scale is not None
    ref = transformers.Mistral4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = [(7 * i) % 300 + 3 for i in range(20)]
    assert run_greedy(model, [prompt], 3, block_size=8, prefill_chunk=12)[0] == hf_greedy(ref, prompt, 3)
